"""Does masking attention at document edges help? Validation loss with and without, 3 seeds.

A corpus of many short documents is built at run time from the embedded Shakespeare: each
sonnet and each scene of each play is one document (742 of them). The default model
then trains on it for the same number of steps, hence on the same tokens, with and without
--data.windows.document_mask, with 3 seeds each (the seed sets the initial weights, dropout and the
data order); windows of 256 tokens, so that many hold a document's edge. Each run prints
its validation loss (each model validated as it was trained), and the end the mean and the
spread of the difference. nanochat measured no gain from document masks; modded-nanogpt
keeps them in its record recipe: this measures gptmini's case honestly, whatever it says.

    python bench/ab_document_mask.py [--steps 300] [--seeds 1 2 3]
"""

import argparse
import csv
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gptmini.data import EMBEDDED_CORPUS

SCENE = re.compile(r"^(Scene|SCENE) [IVXLC]+\.", re.MULTILINE)
SONNET = re.compile(r"^[IVXLC]+$", re.MULTILINE)


def short_documents() -> list[str]:
    """Every sonnet and every scene of the embedded corpus, one document each."""
    docs = []
    for path in sorted(EMBEDDED_CORPUS.glob("*.txt.gz")):
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
        pattern = SONNET if "sonnets" in path.name else SCENE
        starts = [m.start() for m in pattern.finditer(text)]
        if not starts:
            continue  # the long poems: no scenes, no numbered sonnets
        docs += [text[a:b].strip() for a, b in zip(starts, starts[1:] + [len(text)],
                                                    strict=True)]
    return [d for d in docs if d]


def run(root: Path, corpus: Path, seed: int, masked: bool, steps: int) -> float:
    name = f"{'masked' if masked else 'plain'}-{seed}"
    args = ["--data.corpus.source", str(corpus),
            "--data.windows.document_mask", str(masked).lower(),
            "--seed_everything", str(seed), "--data.loader.seed", str(seed),
            "--trainer.default_root_dir", str(root), "--run_name", name,
            "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
            "--trainer.limit_val_batches", "1.0", "--model.context_length", "256",
            "--data.corpus.val_fraction", "0.05", "--checkpoint_every", str(steps),
            "--sample_every", "0", "--trainer.enable_progress_bar", "false",
            "--data.corpus.cache_dir", str(root / "cache")]
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "train.py"), *args], cwd=root,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    with open(next((root / name / "logs").glob("version_*/metrics.csv"))) as f:
        losses = [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]
    return losses[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    docs = short_documents()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = root / "short_documents.jsonl"
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        sizes = sorted(len(d) for d in docs)
        print(f"corpus: {len(docs)} documents (sonnets and scenes), median "
              f"{sizes[len(sizes) // 2]:,} characters; {os.cpu_count()} cores; "
              f"{args.steps} steps of 8 x 256 tokens per run")
        results = {}
        for seed in args.seeds:
            for masked in (False, True):
                start = time.perf_counter()
                loss = run(root, corpus, seed, masked, args.steps)
                results[seed, masked] = loss
                print(f"seed {seed}, document mask {'on ' if masked else 'off'}: validation "
                      f"loss {loss:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    differences = [results[s, True] - results[s, False] for s in args.seeds]
    mean = statistics.mean(differences)
    spread = statistics.stdev(differences) if len(differences) > 1 else float("nan")
    print(f"\nmasked minus plain: {', '.join(f'{d:+.4f}' for d in differences)}; mean "
          f"{mean:+.4f}, standard deviation {spread:.4f} over {len(differences)} seeds "
          "(negative: the mask helps)")


if __name__ == "__main__":
    main()
