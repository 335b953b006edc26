"""Training throughput on CPU: train.py against a plain PyTorch loop, fp32 and bf16, one run.

Same GPTModel (4 layers, 4 heads, emb 256, batch 8; context 256 by default, 128 is the
default run's), same AdamW and schedule, same data windows. Prints the CPU and its bf16
flags, the matmul peak measured here for each precision, and for each precision the
tokens/s and MFU of both paths, the overhead of Lightning, and bf16's speed-up.

With --options, the plain loop also trains the default run's shape (context 128, its
4,096-token vocabulary, random tokens) with each modern option alone and all together, in
alternating rounds, and prints tokens/s against the book's blocks and the parameter count.

    python bench/bench_train.py [--steps 40] [--warmup 8] [--context 256] [--precision both]
                                [--options] [--rounds 3]
"""

import argparse
import os
import tempfile
import time

import torch
from lightning.pytorch import Callback
from machine import cpu_description  # bench/machine.py (the script's own folder)

from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights, lm_loss
from gptmini.model.flops import flops_per_token
from gptmini.runtime import cpu_has_bf16, measure_matmul_flops
from gptmini.train.command import build_cli, fit, keep_freed_memory
from gptmini.train.optim import lr_factor

SHAPE = {"n_layers": 4, "n_heads": 4, "emb_dim": 256}
BATCH = 8


class StepTimer(Callback):
    def __init__(self, warmup: int):
        self.warmup, self.start, self.steps = warmup, None, 0

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.warmup and self.start is None:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, *args):
        self.seconds = time.perf_counter() - self.start
        self.steps = trainer.global_step - self.warmup


def lightning_tokens_per_sec(steps: int, warmup: int, root: str, context: int, precision: str):
    args = ["--trainer.default_root_dir", root, "--run_name", precision,
            "--trainer.accelerator", "cpu", "--trainer.max_steps", str(steps + warmup),
            "--trainer.precision", precision,
            "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "true",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_model_summary", "false",
            "--checkpoint_every", str(10**9), "--sample_every", "0",
            "--model.drop_rate", "0.0", "--model.warmup_steps", "10",
            "--data.loader.batch_size", str(BATCH), f"--model.context_length={context}"]
    args += [f"--model.{key}={value}" for key, value in SHAPE.items()]
    cli = build_cli(args)
    timer = StepTimer(warmup)
    cli.trainer.callbacks.append(timer)
    fit(cli)
    return timer.steps * BATCH * context / timer.seconds, cli


OPTIONS = {  # name: GPTConfig fields over the book's blocks
    "book (learned, LayerNorm, GELU)": {},
    "position rope": {"position": "rope"},
    "position alibi": {"position": "alibi"},
    "position none": {"position": "none"},
    "norm rmsnorm": {"norm": "rmsnorm"},
    "mlp swiglu": {"mlp": "swiglu"},
    "mlp relu2": {"mlp": "relu2"},
    "qk_norm": {"qk_norm": True},
    "attn_softcap 50": {"attn_softcap": 50.0},
    "modern-cpu.yaml (all but softcap)": {"position": "rope", "norm": "rmsnorm",
                                          "mlp": "swiglu", "qk_norm": True, "bias": False,
                                          "tie_weights": False},
}


def random_batches(vocab: int, context: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (BATCH, context + 1), generator=gen)
        yield ids[:, :-1], ids[:, 1:]


def option_rates(steps: int, warmup: int, rounds: int, precision: str) -> None:
    """The modern options at the default run's shape, alternating rounds, medians."""
    from statistics import median

    context, vocab = 128, 4096
    rates: dict[str, list[float]] = {name: [] for name in OPTIONS}
    for _ in range(rounds):
        for name, fields in OPTIONS.items():
            rates[name].append(plain_tokens_per_sec(steps, warmup, random_batches(vocab, context),
                                                    context, precision, vocab_size=vocab,
                                                    **fields))
    base = median(rates[next(iter(OPTIONS))])
    print(f"\noptions at the default run's shape ({SHAPE}, context {context}, vocab {vocab}, "
          f"batch {BATCH}), {precision}, plain loop, median of {rounds} alternating rounds")
    print(f"{'option':<36}{'params':>10}{'tokens/s':>10}{'vs book':>9}{'spread':>9}")
    for name, fields in OPTIONS.items():
        cfg = GPTConfig(vocab_size=vocab, context_length=context, **SHAPE,
                        **{"tie_weights": True, **fields})
        params = sum(p.numel() for p in GPTModel(cfg).parameters())
        mid = median(rates[name])
        spread = (max(rates[name]) - min(rates[name])) / mid
        print(f"{name:<36}{params:>10,}{mid:>10.0f}{mid / base - 1:>+9.1%}{spread:>9.1%}")


def plain_tokens_per_sec(steps: int, warmup: int, loader, context: int, precision: str,
                         vocab_size: int = 50257, **fields) -> float:
    torch.manual_seed(1234)
    cfg = GPTConfig(vocab_size=vocab_size, drop_rate=0.0, context_length=context,
                    **SHAPE, **{"tie_weights": True, **fields})
    model = init_gpt2_weights(GPTModel(cfg)).train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), fused=True,
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
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = lm_loss(model, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
    return steps * BATCH * context / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--precision", choices=["both", "32-true", "bf16-mixed"],
                        default="both", help="both: bf16-mixed too where the CPU has bf16 units")
    parser.add_argument("--options", action="store_true",
                        help="also time each modern option at the default run's shape")
    parser.add_argument("--only_options", action="store_true",
                        help="time only the options (not train.py against the plain loop)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    # Both paths run in this process, so both get what train.py does: freed memory is kept
    # for reuse (see gptmini.train.command.keep_freed_memory).
    kept = keep_freed_memory()
    precisions = ["32-true"] + (["bf16-mixed"] if cpu_has_bf16() else [])
    if args.precision != "both":
        precisions = [args.precision]
    peaks = {p: measure_matmul_flops(seconds=2.0, dtype=torch.bfloat16 if "bf16" in p
                                     else torch.float32) for p in precisions}
    print(f"machine: {cpu_description()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, glibc keeps freed memory: {kept}")
    print("matmul peak measured here (1024x1024): " + ", ".join(
        f"{p} {peaks[p] / 1e9:.0f} GFLOP/s" for p in precisions))
    if not cpu_has_bf16():
        print("this CPU has no bf16 units (avx512_bf16 or amx_bf16): bf16-mixed not measured")

    if args.options or args.only_options:
        for precision in precisions:
            option_rates(args.steps, args.warmup, args.rounds, precision)
    if args.only_options:
        return
    rates = {}
    with tempfile.TemporaryDirectory() as root:
        for precision in precisions:
            lit, cli = lightning_tokens_per_sec(args.steps, args.warmup, root, args.context,
                                                precision)
            # the plain loop trains train.py's model: the default run's vocabulary
            vocab = cli.model.cfg.vocab_size
            plain = plain_tokens_per_sec(args.steps, args.warmup,
                                         cli.datamodule.train_dataloader(), args.context,
                                         precision, vocab_size=vocab)
            rates[precision] = (plain, lit)

    flops = flops_per_token(cli.model.cfg)
    print(f"model: {SHAPE}, context {args.context}, batch {BATCH}, vocabulary {vocab} (the "
          f"default run's), {flops / 1e6:.1f} MFLOP per trained token (6N + 12*L*T*d)")
    print(f"\n{'precision':<12}{'path':<24}{'tokens/s':>10}{'MFU vs peak':>13}")
    for precision, (plain, lit) in rates.items():
        for name, rate in (("plain PyTorch loop", plain), ("train.py (Lightning)", lit)):
            print(f"{precision:<12}{name:<24}{rate:>10.0f}{flops * rate / peaks[precision]:>12.1%}")
        print(f"{'':<12}Lightning overhead: {(plain - lit) / plain:+.1%} of the plain loop "
              "(goal: within 3%)")
    if "bf16-mixed" in rates:
        speedup = rates["bf16-mixed"][1] / rates["32-true"][1]
        print(f"\nbf16-mixed vs 32-true through train.py: {speedup:.2f}x (goal: >= 1.8x)")


if __name__ == "__main__":
    main()
