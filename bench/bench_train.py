"""Training throughput: the full train.py path against a plain PyTorch loop, one run.

Same GPTModel (4 layers, 4 heads, emb 256, context 256, batch 8, fp32), same AdamW and
schedule, same data windows. Prints tokens/s of both, the overhead of Lightning, and MFU
against the fp32 matmul peak measured here.

    python bench/bench_train.py [--steps 40] [--warmup 8]
"""

import argparse
import os
import platform
import tempfile
import time

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback

from gptmini.lit_module import lr_factor, measure_matmul_flops
from gptmini.model import GPTConfig, GPTModel, flops_per_token
from gptmini.training import build_cli, fit, keep_freed_memory

SHAPE = {"n_layers": 4, "n_heads": 4, "emb_dim": 256, "context_length": 256}
BATCH = 8


class StepTimer(Callback):
    def __init__(self, warmup: int):
        self.warmup, self.start, self.steps = warmup, None, 0

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, *args):
        self.seconds = time.perf_counter() - self.start
        self.steps = trainer.global_step - self.warmup


def lightning_tokens_per_sec(steps: int, warmup: int, root: str) -> float:
    args = ["--trainer.default_root_dir", root, "--run_name", "bench",
            "--trainer.accelerator", "cpu", "--trainer.max_steps", str(steps + warmup),
            "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "true",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_model_summary", "false",
            "--checkpoint_every", str(10**9), "--sample_every", "0",
            "--model.drop_rate", "0.0", "--model.warmup_steps", "10",
            "--data.batch_size", str(BATCH)]
    args += [f"--model.{key}={value}" for key, value in SHAPE.items()]
    cli = build_cli(args)
    timer = StepTimer(warmup)
    cli.trainer.callbacks.append(timer)
    fit(cli)
    return timer.steps * BATCH * SHAPE["context_length"] / timer.seconds, cli


def plain_tokens_per_sec(steps: int, warmup: int, loader) -> float:
    torch.manual_seed(1234)
    cfg = GPTConfig(vocab_size=50257, drop_rate=0.0, tie_weights=True, **SHAPE)
    model = GPTModel(cfg).train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95),
    )
    total = steps + warmup
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, 10, total, 0.1)
    )
    batches = iter(loader)
    for step in range(total):
        if step == warmup:
            start = time.perf_counter()
        inputs, targets = next(batches)
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
    return steps * BATCH * SHAPE["context_length"] / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    args = parser.parse_args()

    # Both paths run in this process, so both get what train.py does: freed memory is kept
    # for reuse (without it, on this 2-core machine: plain 933, Lightning 867 tok/s).
    kept = keep_freed_memory()
    peak = measure_matmul_flops(size=1024, seconds=2.0)
    cfg = GPTConfig(vocab_size=50257, tie_weights=True, **SHAPE)
    flops = flops_per_token(cfg)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"glibc keeps freed memory: {kept}")
    print(f"fp32 matmul peak measured here: {peak / 1e9:.1f} GFLOP/s (1024x1024 matmuls)")
    print(f"model: {SHAPE}, batch {BATCH}, {flops / 1e6:.1f} MFLOP per trained token")

    with tempfile.TemporaryDirectory() as root:
        lit, cli = lightning_tokens_per_sec(args.steps, args.warmup, root)
        plain = plain_tokens_per_sec(args.steps, args.warmup, cli.datamodule.train_dataloader())

    print(f"\n{'path':<28}{'tokens/s':>10}{'MFU vs peak':>14}")
    for name, rate in (("plain PyTorch loop", plain), ("train.py (Lightning)", lit)):
        print(f"{name:<28}{rate:>10.0f}{flops * rate / peak:>13.1%}")
    print(f"\nLightning overhead: {(plain - lit) / plain:+.1%} of the plain loop's throughput "
          "(goal: within 3%)")


if __name__ == "__main__":
    main()
