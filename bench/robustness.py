"""Try to break gptmini as a new user would, and count what happens.

Each case runs train.py, generate.py, serve.py (one shared server, called over HTTP) or the
conformance kit (or a few lines of Python against the training command) in a fresh process,
and is classed as:
    ok            did what was asked (or refused it on purpose, where that is the answer)
    clear error   exited non-zero with one line naming the input, and no traceback
    traceback     a raw Python traceback reached the user
    silent        exited 0, but the result is wrong (data dropped, a setting ignored, ...)
    data lost     a checkpoint that existed before is gone or damaged, or steps are in none
    hang          no answer within the case's time limit

    python bench/robustness.py                    # this checkout
    python bench/robustness.py --tree /path/to/another/checkout   # e.g. an older commit
    python bench/robustness.py --only serve kit   # some groups (-k: names containing text)

The cases live in bench/robustness_cases/, one module per group: train (train.py's corpora
and flags), runs (checkpoints through resumes, signals and kills), generate, evaluate,
serve (with the page's endpoints), kit (with the device parity check),
convert (Hugging Face directories in, exports out), settings (float flags, seeds, and
checkpoints whose tokenizer or weights are wrong), chat (chat data and templates, through
train.py, generate.py --chat and the chat API), finetune (LoRA, fine-tune sources and
classification).
Offline throughout (HF_HUB_OFFLINE=1). Takes a few minutes on 2 cores.
"""

import argparse
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from robustness_cases import (
    chat,
    convert,
    evaluate,
    finetune,
    generate,
    kit,
    runs,
    serve,
    settings,
    train,
)
from robustness_cases.lab import Lab

GROUPS = {"train": train.CASES, "runs": runs.CASES, "generate": generate.CASES,
          "evaluate": evaluate.CASES,
          "serve": serve.CASES, "kit": kit.CASES, "convert": convert.CASES,
          "settings": settings.CASES, "chat": chat.CASES, "finetune": finetune.CASES}


def run_cases(lab: Lab, cases: dict) -> Counter:
    """Run each case, print its line, and count the outcomes."""
    counts = Counter()
    print(f"{'case':<50} {'outcome':<12} detail")
    for name, case in cases.items():
        start = time.perf_counter()
        try:
            result, detail = case(lab)
        except subprocess.TimeoutExpired as err:
            result, detail = "hang", f"no answer in {err.timeout:g} s"
        except Exception as err:  # the harness itself: say so, keep going
            result, detail = "harness", f"{type(err).__name__}: {err}"
        counts[result] += 1
        print(f"{name:<50} {result:<12} {detail} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout whose train.py and generate.py are run")
    parser.add_argument("--only", nargs="+", choices=list(GROUPS), default=list(GROUPS),
                        help="run only these groups of cases")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    args = parser.parse_args()
    cases = {name: case for group, group_cases in GROUPS.items() if group in args.only
             for name, case in group_cases.items() if args.k in name}
    with tempfile.TemporaryDirectory() as root:
        lab = Lab(args.tree.resolve(), Path(root))
        print(f"tree: {lab.tree}\n")
        try:
            counts = run_cases(lab, cases)
        finally:
            lab.close()
    total = sum(counts.values())
    print(f"\n{total} cases: " + ", ".join(f"{n} {k}" for k, n in counts.most_common()))


if __name__ == "__main__":
    main()
