"""`generate.py --batch_file`: many prompts through the engine at once, one JSON result per
prompt, in order. Every record and its fields are checked before anything is generated, so
a wrong value names its file, line and field instead of failing halfway."""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import IO

from tiktoken import Encoding
from torch import nn

from gptmini.api import SEED_RANGE, json_type
from gptmini.engine import Engine

BATCH_SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")


def read_batch_file(path: Path) -> list[dict]:
    """The prompts of a --batch_file: one per line, or one JSON record per line (.jsonl)."""
    if not path.is_file():
        raise ValueError(f"--batch_file {path} "
                         + ("is a directory" if path.is_dir() else "does not exist"))
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--batch_file {path} is not UTF-8 text (byte {err.start} is "
            f"{err.object[err.start]:#04x}); give a text file with one prompt per line, or "
            ".jsonl records with a \"prompt\" string (convert other encodings first, e.g. "
            "iconv -t utf-8)") from None
    if path.suffix != ".jsonl":
        return [{"prompt": line} for line in lines if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} is not JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{path}:{number} needs a "prompt" string')
        unknown = set(record) - {"prompt", *BATCH_SETTINGS}
        if unknown:
            raise ValueError(f"{path}:{number}: unknown field(s) {sorted(unknown)}; known: "
                             f"prompt, {', '.join(BATCH_SETTINGS)}")
        for name in BATCH_SETTINGS:
            if name in record:
                problem = _field_problem(name, record[name])
                if problem:
                    raise ValueError(f"{path}:{number}: \"{name}\" {problem}, got "
                                     f"{record[name]!r} ({json_type(record[name])})")
        records.append(record)
    return records


def _field_problem(name: str, value) -> str | None:
    """What is wrong with a record's setting (its JSON type or range), or None."""
    integer = isinstance(value, int) and not isinstance(value, bool)
    number = (integer or isinstance(value, float)) and math.isfinite(value)
    if name == "max_new_tokens" and not (integer and value >= 0):
        return "must be an integer >= 0"
    if name == "temperature" and not (number and value >= 0):
        return "must be a number >= 0 (0: greedy)"
    if name == "top_k" and value is not None and not (integer and value >= 1):
        return "must be an integer >= 1 or null"
    if name == "top_p" and value is not None and not (number and 0 < value <= 1):
        return "must be a number in (0, 1] or null"
    if name == "seed" and value is not None and not (
            integer and SEED_RANGE[0] <= value < SEED_RANGE[1]):
        return "must be an integer of 64 bits or null"
    if name == "stop" and value is not None and not (
            (isinstance(value, str) and value) or (isinstance(value, list) and all(
                isinstance(s, str) and s for s in value))):
        return "must be a non-empty string or a list of them"
    return None


def open_output(path: Path | None) -> IO[str]:
    """--output opened before anything is generated (stdout when None): a directory, a
    missing folder or a read-only place is said at once, not after the work."""
    if path is None:
        return sys.stdout
    if path.is_dir():
        raise ValueError(f"--output {path} is a directory; name a file, e.g. "
                         f"{path / 'results.jsonl'}")
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as err:
        raise ValueError(f"--output {path}: cannot write there ({err.strerror}); name a file "
                         "in a folder that exists and is writable") from None


def generate_batch(model: nn.Module, tokenizer: Encoding, args: argparse.Namespace,
                   top_k: int | None) -> int:
    """--batch_file: every prompt through the engine at once; results in prompt order.

    With --seed S, prompt i is seeded S + i: its text does not depend on the batch in
    float64 (--dtype float64); in float32/bfloat16 a rare draw near a tie can.
    """
    from tqdm import tqdm

    records = read_batch_file(args.batch_file)
    engine = Engine(model, tokenizer, max_batch=args.max_batch)
    requests = []
    for i, record in enumerate(records):
        settings = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                    "top_k": top_k, "top_p": args.top_p,
                    "seed": None if args.seed is None else args.seed + i,
                    **{k: v for k, v in record.items() if k != "prompt"}}
        settings["stop"] = tuple([settings["stop"]] if isinstance(settings.get("stop"), str)
                                 else settings.get("stop") or ())
        ids = tokenizer.encode(record["prompt"], allowed_special={"<|endoftext|>"})
        try:
            requests.append(engine.add_request(ids or [tokenizer.eot_token],
                                               stop_ids=(tokenizer.eot_token,), **settings))
        except (ValueError, TypeError) as err:
            raise ValueError(f"prompt {i + 1} of {args.batch_file}: {err}") from None
    out = open_output(args.output)
    try:
        with tqdm(total=len(requests), desc="prompts", unit="prompt", file=sys.stderr,
                  disable=len(requests) < 2) as bar:
            while engine.has_work:
                engine.step()
                bar.update(sum(r.done for r in requests) - bar.n)
        for i, (record, request) in enumerate(zip(records, requests, strict=True)):
            out.write(json.dumps({"index": i, "prompt": record["prompt"], "text": request.text,
                                  "tokens": len(request.tokens),
                                  "finish_reason": request.finish_reason}) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0
