"""Score a checkpoint: loss, perplexity and bits per byte on the run's whole validation split
or any text, and accuracy on multiple-choice tasks in HellaSwag's layout.

    python evaluate.py --checkpoint runs/shakespeare-cpu/checkpoints/best.ckpt
    python evaluate.py --checkpoint runs/.../best.ckpt --choices hellaswag_val.jsonl

All the logic is in `gptmini.analysis.evaluate`; `python evaluate.py -h` lists the options.
"""

from gptmini.threads import sleep_when_idle

sleep_when_idle()  # before torch loads OpenMP: a shared CPU keeps its fair share

from gptmini.analysis.evaluate import evaluate_main as main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
