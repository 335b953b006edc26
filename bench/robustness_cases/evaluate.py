"""evaluate.py: multiple-choice records of every wrong JSON type, texts that are binary or
missing, settings out of range, a model whose scores are not finite, and faults around the
scoring (Ctrl-C, a token cache that cannot be written, a full stdout)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from robustness_cases.lab import Lab, last_line, outcome

BYTE_CHECKPOINT = (
    "import sys, torch\nfrom gptmini.model import GPTConfig, GPTModel\n"
    "torch.manual_seed(0)\n"
    "m = GPTModel(GPTConfig(vocab_size=257, context_length=32, emb_dim=16, n_heads=2, "
    "n_layers=2, drop_rate=0.0))\n"
    "SCALE\n"
    "torch.save({'state_dict': {'model.' + k: v for k, v in m.state_dict().items()},"
    " 'hyper_parameters': {**m.cfg.to_dict(), 'tokenizer': 'byte'}}, sys.argv[1])\n")
"""Python writing a random tiny byte-level model's checkpoint to sys.argv[1]."""
OVERFLOWING = ("m.out_head.weight.data.mul_(1e38)\n"
               "m.trf_blocks[0].att.W_query.weight.data[0, 0] = 1e38\n"
               "m.trf_blocks[0].att.W_key.weight.data[0, 0] = 1e38")
"""Finite weights whose scores overflow float32 (NaN weights are refused when loaded)."""


def checkpoint(lab: Lab, where: Path, scale: str = "") -> Path:
    path = where / "m.ckpt"
    if not path.is_file():
        lab.python(BYTE_CHECKPOINT.replace("SCALE", scale), str(path), cwd=where)
    return path


def evaluate_case(files: dict, *flags: str, said: str = "", expect_error: bool = True,
                  scale: str = "", stdout: str | None = None):
    """evaluate.py on files written first ({d} in a flag: the case's folder). An error is
    wanted (exit 1, one line saying `said`); exit 0 then is silent, unless `expect_error`
    is False: then a result is wanted, and `said` in it."""

    def case(lab: Lab):
        where = lab.folder()
        for name, content in files.items():
            (where / name).write_bytes(content if isinstance(content, bytes)
                                       else content.encode())
        args = ["--checkpoint", str(checkpoint(lab, where, scale)), "--cache_dir",
                str(where / "cache"), *(f.replace("{d}", str(where)) for f in flags)]
        command = [sys.executable, str(lab.tree / "evaluate.py"), *args]
        if stdout is None:
            proc = lab.run("evaluate.py", *args, cwd=where, timeout=300)
        else:  # stdout to a device of its own (/dev/full)
            with open(stdout, "w") as out:
                proc = subprocess.run(command, cwd=where, env=lab.env, stdout=out,
                                      stderr=subprocess.PIPE, text=True, timeout=300)
        result, line = outcome(proc), last_line(proc)
        if result == "traceback":
            return result, line
        if expect_error and result == "ok":
            return "silent", f"exit 0: {line}"
        if said and said not in (proc.stdout or "") + proc.stderr:
            return "silent", f"no {said!r}: {line}"
        return result, line

    return case


def record(value) -> dict:
    return {"mc.jsonl": json.dumps(value) + "\n"}


GOOD = {"ctx": "Romeo said", "endings": ["hello", "farewell"], "label": 0}
CHOICES = {
    f"evaluate.py --choices: {name}": evaluate_case(record(value), "--choices", "{d}/mc.jsonl",
                                                    said="mc.jsonl, line 1")
    for name, value in {
        "endings a string": {**GOOD, "endings": "hello"},
        "endings null": {**GOOD, "endings": None},
        "endings numbers": {**GOOD, "endings": [1, 2]},
        "endings one": {**GOOD, "endings": ["hello"]},
        "endings with an empty string": {**GOOD, "endings": ["hello", ""]},
        "label a float": {**GOOD, "label": 1.0},
        "label a boolean": {**GOOD, "label": True},
        "label null": {**GOOD, "label": None},
        "label negative": {**GOOD, "label": -1},
        "label 2**70": {**GOOD, "label": 2**70},
        "ctx an object": {**GOOD, "ctx": {"text": "Romeo"}},
        "ctx null": {**GOOD, "ctx": None},
        "a record that is a number": 5,
        "a record that is a list": [GOOD],
    }.items()
}


def ctrl_c(lab: Lab):
    """SIGINT while scoring a long text: one line, exit 130."""
    where = lab.folder()
    (where / "long.txt").write_text("Romeo said hello to the moon. " * 40000)
    proc = subprocess.Popen([sys.executable, str(lab.tree / "evaluate.py"), "--checkpoint",
                             str(checkpoint(lab, where)), "--data", str(where / "long.txt"),
                             "--cache_dir", str(where / "cache"), "--batch_size", "1"],
                            cwd=where, env=lab.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            # a shell's background job ignores SIGINT, and so would its child
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen, deadline = "", time.monotonic() + 120
    while "scoring" not in seen and proc.poll() is None and time.monotonic() < deadline:
        seen += proc.stderr.read(1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = seen + err
    if "Traceback (most recent call last)" in err:
        return "traceback", err.strip().splitlines()[-1][:150]
    line = err.strip().splitlines()[-1][:150] if err.strip() else ""
    return ("ok" if proc.returncode == 130 else "silent"), f"exit {proc.returncode}: {line}"


TEXT = {"t.txt": "Romeo said hello to the moon. " * 40}
CASES = {
    **CHOICES,
    "evaluate.py --choices: a binary file": evaluate_case(
        {"mc.jsonl": b"\x89PNG\r\n\x1a\n\x00\xff"}, "--choices", "{d}/mc.jsonl",
        said="not UTF-8"),
    "evaluate.py --choices: an empty file": evaluate_case({"mc.jsonl": "\n"}, "--choices",
                                                          "{d}/mc.jsonl", said="no records"),
    "evaluate.py --data: a binary file": evaluate_case(
        {"b.txt": bytes(range(256)) * 20}, "--data", "{d}/b.txt",
        said="is not text: it is a binary file"),
    "evaluate.py --data: a missing file": evaluate_case({}, "--data", "{d}/nope.txt",
                                                        said="--data"),
    "evaluate.py --data: a single token": evaluate_case({"one.txt": "a"}, "--data",
                                                        "{d}/one.txt", said="at least 2"),
    "evaluate.py --batch_size 0": evaluate_case(TEXT, "--data", "{d}/t.txt", "--batch_size",
                                                "0", said="--batch_size"),
    "evaluate.py --limit -1": evaluate_case(record(GOOD), "--choices", "{d}/mc.jsonl",
                                            "--limit", "-1", said="--limit"),
    "evaluate.py --encoding_errors nope": evaluate_case(TEXT, "--data", "{d}/t.txt",
                                                        "--encoding_errors", "nope",
                                                        said="nope"),
    "evaluate.py: scores that overflow (loss NaN)": evaluate_case(
        TEXT, "--data", "{d}/t.txt", said="not finite", scale=OVERFLOWING),
    "evaluate.py --choices: scores that overflow": evaluate_case(
        record(GOOD), "--choices", "{d}/mc.jsonl", said="not all finite", scale=OVERFLOWING),
    "evaluate.py: a token cache that cannot be written": evaluate_case(
        {**TEXT, "file": ""}, "--data", "{d}/t.txt", "--cache_dir", "{d}/file/cache",
        said="cannot be written", expect_error=False),
    "evaluate.py: stdout on a full device": evaluate_case(
        TEXT, "--data", "{d}/t.txt", said="could not write the score", stdout="/dev/full"),
    "evaluate.py: Ctrl-C while scoring": ctrl_c,
}
