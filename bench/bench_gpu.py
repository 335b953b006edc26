"""GPT-2 124M on one GPU: training and decoding throughput, one run, side by side.

Training: context 1024, random tokens, bf16-mixed, compiled, flash attention; tokens/s and
MFU (6N + 12*L*T*d over the GPU's bf16 peak from Lightning's table) through the
LightningModule and through a plain PyTorch loop of the same model, the peak memory, and the
largest micro-batch that fits (powers of two, at most 4 tries). Decoding: new tokens/s with
the KV cache at batch 1 and batch 64, compiled and not.

    python bench/bench_gpu.py                       # on a CUDA machine
    python bench/bench_gpu.py --device cpu --tiny   # the same code on a tiny model (smoke test)
"""

import argparse
import time

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from machine import cpu_name  # bench/machine.py (the script's own folder)
from torch.utils.data import DataLoader, Dataset

from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel
from gptmini.model.flops import flops_per_token, num_parameters
from gptmini.train.module import GPTLitModule
from gptmini.train.optim import lr_factor

GPT2 = dict(vocab_size=50257, padded_vocab_size=50304, context_length=1024, emb_dim=768,
            n_heads=12, n_layers=12, drop_rate=0.0, qkv_bias=True, tie_weights=True)
TINY = dict(vocab_size=50257, context_length=64, emb_dim=64, n_heads=2, n_layers=2,
            drop_rate=0.0, qkv_bias=True, tie_weights=True)


class RandomTokens(Dataset):
    def __init__(self, n: int, context: int):
        self.n, self.context = n, context

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        window = torch.randint(0, 50257, (self.context + 1,),
                               generator=torch.Generator().manual_seed(i))
        return window[:-1], window[1:]


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def plain_loop(shape: dict, batch: int, steps: int, warmup: int, device, compile: bool):
    """Tokens/s and peak bytes of a plain loop: bf16 autocast, fused AdamW, clipping."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**shape)).to(device).train()
    if compile:
        model = torch.compile(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=6e-4, betas=(0.9, 0.95), fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, 10, steps + warmup, 0.1))
    data = iter(DataLoader(RandomTokens((steps + warmup) * batch, shape["context_length"]),
                           batch_size=batch, pin_memory=device.type == "cuda", num_workers=2))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps + warmup):
        if step == warmup:
            sync(device)
            start = time.perf_counter()
        inputs, targets = (t.to(device, non_blocking=True) for t in next(data))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(inputs, targets=targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return steps * batch * shape["context_length"] / seconds, peak


class Timer(L.Callback):
    def __init__(self, warmup: int):
        self.warmup, self.start, self.seconds, self.steps = warmup, None, 0.0, 0

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.warmup and self.start is None:
            sync(trainer.strategy.root_device)
            self.start = time.perf_counter()

    def on_train_end(self, trainer, *args):
        sync(trainer.strategy.root_device)
        self.seconds = time.perf_counter() - self.start
        self.steps = trainer.global_step - self.warmup


def lightning_loop(shape: dict, batch: int, steps: int, warmup: int, device, compile: bool):
    """Tokens/s through GPTLitModule and Lightning's Trainer, as train.py trains."""
    torch.manual_seed(0)
    module = GPTLitModule(learning_rate=6e-4, warmup_steps=10, compile=compile,
                          **{k: v for k, v in shape.items() if k != "vocab_size"})
    data = DataLoader(RandomTokens((steps + warmup) * batch, shape["context_length"]),
                      batch_size=batch, pin_memory=device.type == "cuda", num_workers=2)
    timer = Timer(warmup)
    trainer = L.Trainer(
        accelerator=device.type, devices=1, precision="bf16-mixed", max_steps=steps + warmup,
        gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50,
        callbacks=[timer], limit_val_batches=0,
    )
    trainer.fit(module, data)
    return timer.steps * batch * shape["context_length"] / timer.seconds


def largest_batch(shape: dict, device, compile: bool, tries=(16, 32, 64, 128)) -> int | None:
    """The largest power-of-two micro-batch whose training step fits (4 tries at most)."""
    fits = None
    for batch in tries:
        try:
            plain_loop(shape, batch, 1, 1, device, compile)
            fits = batch
        except torch.OutOfMemoryError:
            break
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return fits


def decode(shape: dict, batch: int, new_tokens: int, device, compile: bool) -> float:
    """New tokens/s of greedy generation with the KV cache (a 128-token prompt)."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**shape)).to(device, torch.bfloat16).eval()
    if compile:
        model = torch.compile(model, dynamic=True)
    prompt = torch.randint(0, 50257, (batch, min(128, shape["context_length"] // 2)),
                           device=device)
    generate(model, prompt, 4, use_cache=True)  # warm-up (and compilation)
    sync(device)
    start = time.perf_counter()
    generate(model, prompt, new_tokens, use_cache=True)
    sync(device)
    return batch * new_tokens / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model: smoke-test the code")
    parser.add_argument("--batch", type=int, default=16, help="training micro-batch")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--new_tokens", type=int, default=128)
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = TINY if args.tiny else GPT2
    compile = device.type == "cuda"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        name = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    else:
        name = cpu_name()
    print(f"device: {name}; torch {torch.__version__}; compiled: {compile}")
    cfg = GPTConfig(**shape)
    flops = flops_per_token(cfg)
    peak = get_available_flops(device, torch.bfloat16) if device.type == "cuda" else None
    print(f"model: {num_parameters(GPTModel(cfg)) / 1e6:.1f}M parameters, context "
          f"{cfg.context_length}, {flops / 1e9:.2f} GFLOP per trained token (6N + 12*L*T*d); "
          f"bf16 peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s")

    plain, memory = plain_loop(shape, args.batch, args.steps, args.warmup, device, compile)
    lit = lightning_loop(shape, args.batch, args.steps, args.warmup, device, compile)
    print(f"\ntraining, micro-batch {args.batch}, bf16-mixed:")
    print(f"  {'path':<26}{'tokens/s':>12}{'MFU':>8}")
    for path, rate in (("plain PyTorch loop", plain), ("LightningModule (train.py)", lit)):
        mfu = f"{flops * rate / peak:.1%}" if peak else "-"
        print(f"  {path:<26}{rate:>12,.0f}{mfu:>8}")
    print(f"  Lightning vs plain: {(lit - plain) / plain:+.1%} (goal: within 3%)")
    print(f"  peak memory (plain loop): {memory / 2**30:.1f} GiB")
    print(f"  largest micro-batch that fits: {largest_batch(shape, device, compile)}")
    if peak:
        print(f"  goal >= 500,000 tokens/s: {plain:,.0f} plain, {lit:,.0f} Lightning")

    print(f"\ndecoding (greedy, KV cache, bf16, {args.new_tokens} new tokens):")
    print(f"  {'':<12}{'batch 1':>12}{'batch 64':>12}{'64 vs 1':>10}")
    for compiled in (False, True):
        if compiled and not compile:
            continue
        one, many = (decode(shape, b, args.new_tokens, device, compiled) for b in (1, 64))
        label = "compiled" if compiled else "eager"
        print(f"  {label:<12}{one:>12,.0f}{many:>12,.0f}{many / one:>9.1f}x")
    print("  goals: batch 1 >= 1,000 tokens/s; batch 64 >= 30x batch 1")


if __name__ == "__main__":
    main()
