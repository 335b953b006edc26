"""Fine-tunes: LoRA settings (ignored, empty, too wide, changed on resume), the source a run
starts from (--model.init_from empty, a classifier, a relative base seen from elsewhere),
and classification (labels one number written two ways, the text as the label field, texts
past the context, validation labels the training lacks, a classifier asked for text).

A refusal must name what it refuses (`said`): refused for another reason, or sending the
user the wrong way, it counts as silent. A refused resume must leave the run's checkpoint
as it was."""

import hashlib
import json
import subprocess
from pathlib import Path

from robustness_cases.lab import Lab, last_line, outcome

BASE = (
    "import sys, torch\nfrom gptmini.model import GPTConfig, GPTModel\n"
    "from gptmini.finetune import add_class_head\ntorch.manual_seed(0)\n"
    "m = GPTModel(GPTConfig(vocab_size=50257, context_length=16, emb_dim=32, n_heads=2, "
    "n_layers=2, drop_rate=0.0))\nclasses = sys.argv[2:]\n"
    "if classes: add_class_head(m, len(classes))\n"
    "torch.save({'state_dict': {'model.' + k: v for k, v in m.state_dict().items()},"
    " 'hyper_parameters': {**m.cfg.to_dict(), 'tokenizer': 'gpt2', "
    "**({'classes': classes} if classes else {})}}, sys.argv[1])\n")
"""Python writing a model of the lab's tiny shape to sys.argv[1] (a classifier of the
classes after it, if any): a source for --model.init_from."""
EAGER = ("--model.compile", "false")  # what is tried here is no compiled kernel


def base(lab: Lab, where: Path, *classes: str) -> Path:
    path = where / ("classifier.ckpt" if classes else "base.ckpt")
    lab.python(BASE, str(path), *classes, cwd=where)
    return path


def judged(proc, said: str, refused: bool = True) -> tuple[str, str]:
    """ok/clear error when it refused (or ran, `refused` False) saying `said`; else silent."""
    result, line = outcome(proc), last_line(proc)
    if result == "traceback":
        return result, line
    if refused != (result == "clear error") or said not in proc.stderr + proc.stdout:
        return "silent", f"(wanted {said!r}) {line}"
    return result, line


def train_case(*extra: str, said: str, classes: tuple[str, ...] = ()):
    """train.py from a tiny base (or a classifier of `classes`) with `extra` flags."""

    def case(lab: Lab):
        where = lab.folder()
        source = base(lab, where, *classes)
        proc = lab.run("train.py", *lab.args(where, "--model.init_from", str(source), *EAGER,
                                             *extra), cwd=where)
        return judged(proc, said)

    return case


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"


def lora_resume(*changed: str, said: str):
    """A 2-step LoRA run, resumed with `changed` settings: refused, last.ckpt untouched."""

    def case(lab: Lab):
        where = lab.folder()
        args = lab.args(where, "--model.init_from", str(base(lab, where)), *EAGER,
                        "--model.lora_rank", "2", "--trainer.max_steps", "2",
                        "--checkpoint_every", "2")
        first = lab.run("train.py", *args, cwd=where)
        last = where / "runs" / "r" / "checkpoints" / "last.ckpt"
        if first.returncode:
            return "harness", last_line(first)
        before = digest(last)
        proc = lab.run("train.py", *args, "--trainer.max_steps", "4", *changed, "--ckpt_path",
                       "last", cwd=where)
        if proc.returncode and digest(last) != before:
            return "data lost", f"refused, and last.ckpt changed: {last_line(proc)}"
        return judged(proc, said)  # (trained on: silent)

    return case


def relative_base(lab: Lab):
    """Adapters trained with a relative --model.init_from, generated from elsewhere."""
    where = lab.folder()
    base(lab, where)
    args = lab.args(where, "--model.init_from", "base.ckpt", *EAGER, "--model.lora_rank", "2",
                    "--trainer.max_steps", "2", "--checkpoint_every", "2")
    first = lab.run("train.py", *args, cwd=where)
    if first.returncode:
        return "harness", last_line(first)
    elsewhere = lab.folder()
    proc = lab.run("generate.py", "--checkpoint", str(where / "runs/r/checkpoints/last.ckpt"),
                   "--max_new_tokens", "3", cwd=elsewhere, timeout=120)
    result = outcome(proc)  # the base never moved: a refusal sends the user the wrong way
    return ("silent" if result == "clear error" else result), last_line(proc)


def labelled(rows: list[dict], val_rows: list[dict] | None = None, *extra: str, said: str,
             refused: bool = True, context: int = 16):
    """A classification run on `rows` (and a validation file of `val_rows`)."""

    def case(lab: Lab):
        where = lab.folder()
        (where / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        flags = ["--data.labels.label_field", "label", "--trainer.max_steps", "2",
                 "--model.context_length", str(context)]
        if val_rows is not None:
            (where / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val_rows))
            flags += ["--data.corpus.val_source", str(where / "val.jsonl")]
        proc = lab.run("train.py", *lab.args(where, "--model.init_from", str(base(lab, where)),
                                             *EAGER, *flags, *extra,
                                             source=where / "train.jsonl"), cwd=where)
        return judged(proc, said, refused)

    return case


def words(i: int) -> str:
    return f"{'spam offer win' if i % 2 else 'hello friend lunch'} number {i}"


ROWS = [{"text": words(i), "label": "ab"[i % 2]} for i in range(40)]


def classifier_command(script: str, *flags: str, said: str):
    """generate.py or serve.py (or evaluate.py) on a classifier's checkpoint."""

    def case(lab: Lab):
        where = lab.folder()
        path = base(lab, where, "ham", "spam")
        if script == "evaluate.py":
            (where / "t.jsonl").write_text(json.dumps({"text": "hi", "label": "eggs"}) + "\n")
            flags_ = ["--data", str(where / "t.jsonl"), "--label_field", "label"]
        else:
            flags_ = list(flags)
        try:
            proc = lab.run(script, "--checkpoint", str(path), *flags_, cwd=where, timeout=90)
        except subprocess.TimeoutExpired:  # serve.py started serving it
            return "silent", "serve.py served a classifier (no refusal in 90 s)"
        if script == "evaluate.py" and "--model.classes" in proc.stderr:
            return "silent", f"a train.py flag offered: {last_line(proc)}"
        return judged(proc, said)

    return case


LORA = {
    "LoRA rank 0 with an unknown target and alpha 0": train_case(
        "--model.lora_rank", "0", "--model.lora_targets", "[nope]", "--model.lora_alpha", "0",
        said="--model.lora_alpha"),
    "LoRA rank 0 with targets nothing reads": train_case(
        "--model.lora_targets", "[W_query]", said="--model.lora_rank is 0"),
    "LoRA with an empty target list": train_case(
        "--model.lora_rank", "2", "--model.lora_targets", "[]", said="lora_targets=[]"),
    "LoRA rank wider than the layer": train_case(
        "--model.lora_rank", "1000", said="lora_rank=1000 is wider than"),
    "resume LoRA with another rank": lora_resume("--model.lora_rank", "4",
                                                 said="--model.lora_rank 4"),
    "resume LoRA with another alpha": lora_resume("--model.lora_alpha", "64",
                                                  said="rescaled x4"),
    "resume LoRA with other targets": lora_resume("--model.lora_targets", "[W_query]",
                                                  said="--model.lora_targets"),
    "resume LoRA without LoRA": lora_resume("--model.lora_rank", "0",
                                            said="holds LoRA adapters"),
    "LoRA adapters with a relative base, from elsewhere": relative_base,
}

SOURCES = {
    "init_from ''": train_case("--model.init_from", "", said="names no model"),
    "init_from a classifier for a language model": train_case(
        said="is a classifier", classes=("ham", "spam")),
}

CLASSIFICATION = {
    "labels 1 and 1.0": labelled([{"text": words(i), "label": [1, 1.0, 0][i % 3]}
                                  for i in range(40)], said="one number written 2 ways"),
    "the text column as the label field": labelled(
        ROWS, None, "--data.labels.label_field", "text", said="Is 'text' the text?"),
    "texts past the context, said": labelled(
        [{"text": words(i) * 5, "label": "ab"[i % 2]} for i in range(40)], said="are longer "
        "than the context (16 tokens)", refused=False),
    "a validation label the training lacks": labelled(
        ROWS, [*ROWS[:6], {"text": "x", "label": "c"}], said="val.jsonl has labels ['c']"),
    "evaluate.py on labels the classifier lacks": classifier_command(
        "evaluate.py", said="score records of them"),
    "generate.py on a classifier": classifier_command("generate.py", "--max_new_tokens", "2",
                                                      said="is a classifier"),
    "serve.py on a classifier": classifier_command("serve.py", "--port", "0",
                                                   said="is a classifier"),
}

CASES = {**LORA, **SOURCES, **CLASSIFICATION}
