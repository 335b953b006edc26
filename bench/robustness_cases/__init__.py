"""The cases of bench/robustness.py, by what they try to break: train.py's inputs
(`train`), a run's checkpoints through resumes, signals and kills (`runs`), generate.py
(`generate`), evaluate.py (`evaluate`), serve.py, its HTTP API and the page's endpoints
(`serve`), the conformance kit and device parity check (`kit`), Hugging Face directories
in and exports out (`convert`), float settings, seeds and checkpoints whose tokenizer
or weights are wrong (`settings`), chat data and templates (`chat`), and LoRA, fine-tune
sources and classification (`finetune`). Each
module's CASES maps a case's name to a function of the shared `lab.Lab` that returns
(outcome, detail)."""
