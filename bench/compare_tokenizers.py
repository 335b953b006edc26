"""The default run with each tokenizer, at equal wall-clock: which vocabulary learns most?

Loss per token cannot compare tokenizers; bits per byte can. Each tokenizer trains the
default config (`python train.py`: the embedded Shakespeare, 4 layers, 256 wide, context
128, the default precision) for the same wall-clock budget on this machine, alone on it.
A short calibration run first measures each one's step time, so that its step count (and
with it the cosine schedule) ends at the budget; `--trainer.max_time` guards it. After
training, the last checkpoint is scored on the whole validation split as `evaluate.py`
scores it (every token, not the run's 20 batches): bits per byte = summed nats / summed
bytes of the target tokens / ln 2. Printed per tokenizer: vocabulary, bytes per token,
steps, time, train tok/s, validation bpb, and a sample from the same prompt and seed.

    python bench/compare_tokenizers.py [--minutes 4] [--tokenizers gpt2 bpe:2048 ...]
"""

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from machine import cpu_description

from gptmini.analysis.evaluate import score_text, text_tokens
from gptmini.checkpoint import load_checkpoint, run_data_settings
from gptmini.generate.loop import generate
from gptmini.runtime import auto_precision

REPO = Path(__file__).resolve().parents[1]
PROMPT = "ROMEO:"


def train(root: Path, name: str, tokenizer: str, steps: int, seconds: float | None,
          *extra: str) -> tuple[Path, list[dict], float]:
    """Run train.py; (run directory, metrics rows, wall-clock seconds)."""
    args = ["--model.tokenizer", tokenizer, "--trainer.default_root_dir", str(root),
            "--run_name", name, "--trainer.max_steps", str(steps),
            "--trainer.enable_progress_bar", "false",
            "--data.corpus.cache_dir", str(root / "cache"), *extra]
    if seconds is not None:
        args += ["--trainer.max_time", f"00:00:{int(seconds // 60):02d}:{int(seconds % 60):02d}"]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=root,
                          capture_output=True, text=True, timeout=7200)
    took = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    with open(next((root / name / "logs").glob("version_*/metrics.csv"))) as f:
        return root / name, list(csv.DictReader(f)), took


def last(rows: list[dict], key: str) -> float:
    return [float(r[key]) for r in rows if r.get(key)][-1]


def score(run: Path) -> tuple[float, float]:
    """(bits per byte, bytes per token) of the last checkpoint over the whole validation
    split, as `evaluate.py --checkpoint` scores it."""
    path = run / "checkpoints" / "last.ckpt"
    model, enc, _ = load_checkpoint(path)
    tokens, _ = text_tokens(None, enc, run_data_settings(path))
    scored = score_text(model, enc, tokens, batch_size=16, progress=False)
    return scored.bpb, scored.bytes / scored.tokens


def sample(run: Path) -> str:
    loaded = load_checkpoint(run / "checkpoints" / "last.ckpt")
    ids = torch.tensor([loaded.tokenizer.encode(PROMPT)])
    torch.manual_seed(1)
    out = generate(loaded.model, ids, 60, temperature=0.8, top_k=50, use_cache=True)
    return loaded.tokenizer.decode(out[0].tolist())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--tokenizers", nargs="+",
                        default=["gpt2", "bpe:2048", "bpe:4096", "bpe:8192", "byte"])
    parser.add_argument("--calibration_steps", type=int, default=40)
    parser.add_argument("--train_args", default="",
                        help='more train.py options for every run, e.g. "--model.drop_rate 0"')
    args = parser.parse_args()
    extra = args.train_args.split()
    budget = args.minutes * 60
    precision, why = auto_precision(None)
    print(f"CPU: {cpu_description()}; {os.cpu_count()} cores; torch {torch.__version__}; "
          f"precision {precision} ({why}); budget {args.minutes:g} min of wall clock per "
          f"tokenizer, the default config otherwise {' '.join(extra)}\n", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for tokenizer in args.tokenizers:
            name = tokenizer.replace(":", "")
            # Calibration: step time without validation, after the first logging window.
            _, rows, _ = train(root, f"{name}-calibrate", tokenizer, args.calibration_steps,
                               None, "--trainer.limit_val_batches", "0", "--sample_every",
                               "0", "--checkpoint_every", "1000", *extra)
            step_seconds = 8 * 128 / last(rows, "train/tokens_per_sec")
            steps = int(budget * 0.97 / step_seconds)  # 3%: validations, checkpoints, samples
            run, rows, took = train(root, name, tokenizer, steps, budget + 60, *extra)
            bpb, bytes_per_token = score(run)
            results.append((tokenizer, load_checkpoint(run / "checkpoints" / "last.ckpt")
                            .tokenizer.n_vocab, bytes_per_token, last(rows, "step"), took,
                            last(rows, "train/tokens_per_sec"), last(rows, "val/loss"), bpb))
            print(f"{tokenizer}: {results[-1][3]:.0f} steps in {took:.0f} s, val bpb "
                  f"{bpb:.3f}\n  sample: {sample(run)!r}", flush=True)
    print(f"\n{'tokenizer':>10} {'vocab':>6} {'bytes/tok':>9} {'steps':>6} {'wall s':>7} "
          f"{'tok/s':>6} {'val loss':>8} {'val bpb':>8}")
    for tok, vocab, bpt, steps, took, tps, loss, bpb in results:
        print(f"{tok:>10} {vocab:>6} {bpt:>9.2f} {steps:>6.0f} {took:>7.0f} {tps:>6.0f} "
              f"{loss:>8.3f} {bpb:>8.3f}")


if __name__ == "__main__":
    main()
