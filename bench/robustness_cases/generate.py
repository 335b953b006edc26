"""generate.py: broken, malicious and odd checkpoints, Hugging Face directories, flags,
and batch files with wrong fields."""

import json
from pathlib import Path

from robustness_cases.lab import Lab, last_line, outcome, trained


def generate_case(prepare, *extra: str):
    def case(lab: Lab):
        where = lab.folder()
        target = prepare(lab, where)
        proc = lab.run("generate.py", *extra, *(str(t) for t in target), cwd=where)
        return outcome(proc), last_line(proc)

    return case


def padded_vocab(lab: Lab, where: Path) -> list:
    code = ("import torch, sys\nfrom gptmini.model import GPTConfig, GPTModel\n"
            "m = GPTModel(GPTConfig(vocab_size=50304, context_length=32, emb_dim=16, n_heads=2,"
            " n_layers=2, drop_rate=0.0))\n"
            "with torch.no_grad(): m.out_head.weight[50257:] *= 300\n"
            "torch.save({'state_dict': {'model.' + k: v for k, v in m.state_dict().items()},"
            " 'hyper_parameters': {**m.cfg.to_dict(), 'tokenizer': 'gpt2'}}, sys.argv[1])\n")
    lab.python(code, str(where / "wide.ckpt"), cwd=where)
    return ["--checkpoint", where / "wide.ckpt", "--temperature", "5", "--num_samples", "16",
            "--max_new_tokens", "8"]


def malicious(lab: Lab, where: Path) -> list:
    code = ("import os, torch, sys\nclass X:\n    def __reduce__(self):\n"
            "        return (os.system, ('echo pwned',))\n"
            "torch.save({'state_dict': {}, 'hyper_parameters': {'x': X()}}, sys.argv[1])\n")
    lab.python(code, str(where / "evil.ckpt"), cwd=where)
    return ["--checkpoint", where / "evil.ckpt"]


def malicious_case(lab: Lab):
    result, line = generate_case(malicious)(lab)
    if result == "clear error" and "arbitrary code" not in line:
        result = "silent"  # refused, but said to be corrupt: the wrong reason
    return result, line


def truncated_hf(lab: Lab, where: Path) -> list:
    code = ("import sys\nfrom gptmini.convert import export_hf\n"
            "from gptmini.model import GPTConfig, GPTModel\n"
            "d = export_hf(GPTModel(GPTConfig(vocab_size=50257, context_length=32, emb_dim=16,"
            " n_heads=2, n_layers=2, qkv_bias=True, tie_weights=True)), sys.argv[1])\n"
            "w = d / 'model.safetensors'; w.write_bytes(w.read_bytes()[:5000])\n")
    lab.python(code, str(where / "hf"), cwd=where)
    return ["--hf", where / "hf"]


def corrupt_checkpoint(data: bytes):
    def prepare(lab, where):
        path = trained(lab, where)
        path.write_bytes(data if data else path.read_bytes()[:3000])
        return ["--checkpoint", path]

    return prepare


def batch_case(content: str | bytes, *extra: str):
    def case(lab: Lab):
        where = lab.folder()
        path = where / "b.jsonl"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        extra_args = [e.replace("{d}", str(where)) for e in extra]
        proc = lab.run("generate.py", "--checkpoint", str(trained(lab, where)), "--batch_file",
                       str(path), *extra_args, cwd=where, timeout=120)
        result = outcome(proc)
        return ("silent" if result == "ok" else result), last_line(proc)

    return case


GOOD_BATCH = '{"prompt": "a", "max_new_tokens": 2}\n'


CASES = {
    "generate.py: a missing checkpoint": generate_case(lambda lab, w: ["--checkpoint",
                                                                      w / "nope.ckpt"]),
    "generate.py: a text file as checkpoint": generate_case(corrupt_checkpoint(b"my notes")),
    "generate.py: a truncated checkpoint": generate_case(corrupt_checkpoint(b"")),
    "generate.py: a malicious pickle": malicious_case,
    "generate.py: truncated safetensors": generate_case(truncated_hf),
    "generate.py: a padded vocabulary, hot sampling": generate_case(padded_vocab),
    "generate.py: --device cuda without a GPU": generate_case(
        lambda lab, w: ["--checkpoint", trained(lab, w), "--device", "cuda"]),
    "generate.py: a missing --prompt_file": generate_case(
        lambda lab, w: ["--checkpoint", trained(lab, w), "--prompt_file", "nope.txt"]),
    "generate.py --seed 2**70": batch_case(GOOD_BATCH, "--seed", str(2**70)),
    "batch file: stop 5": batch_case('{"prompt": "a", "stop": 5}\n'),
    "batch file: temperature true": batch_case('{"prompt": "a", "temperature": true}\n'),
    "batch file: max_new_tokens -1": batch_case('{"prompt": "a", "max_new_tokens": -1}\n'),
    "batch file: seed 2**70": batch_case(json.dumps({"prompt": "a", "seed": 2**70}) + "\n"),
    "batch file: binary": batch_case(b"\x89PNG\r\n\x1a\n\x00\x00binary"),
    "batch file: --output a directory": batch_case(GOOD_BATCH, "--output", "{d}"),
    "batch file: --max_batch 0": batch_case(GOOD_BATCH, "--max_batch", "0"),
}
