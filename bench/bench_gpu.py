"""GPT-2 124M on one GPU: training and decoding throughput, one run, side by side.

Training: context 1024, random tokens, bf16-mixed, compiled, flash attention; tokens/s and
MFU (6N + 12*L*T*d FLOPs per token, gptmini.model.flops, over the GPU's dense bf16 peak,
gptmini.runtime) through the LightningModule and through a plain PyTorch loop of the same
model, the peak memory, and the largest micro-batch that fits (powers of two, at most 4
tries) with each one's tokens/s. Decoding: new tokens/s with the KV cache at batch 1 and
batch 64, compiled and not. bench/gpu_proof.py calls `training_figures` and
`decoding_figures` and writes what they return to its figures file.

    python bench/bench_gpu.py                       # on a CUDA machine
    python bench/bench_gpu.py --device cpu --tiny   # the same code on a tiny model (smoke test)
"""

import argparse
import time

import lightning as L
import torch
from machine import cpu_name  # bench/machine.py (the script's own folder)
from torch.utils.data import DataLoader, Dataset

from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights, lm_loss
from gptmini.model.flops import flops_per_token, num_parameters
from gptmini.runtime import peak_flops_of
from gptmini.train.module import GPTLitModule
from gptmini.train.optim import lr_factor

GPT2 = dict(vocab_size=50257, padded_vocab_size=50304, context_length=1024, emb_dim=768,
            n_heads=12, n_layers=12, drop_rate=0.0, qkv_bias=True, tie_weights=True)
TINY = dict(vocab_size=257, context_length=32, emb_dim=32, n_heads=2, n_layers=2,
            drop_rate=0.0, qkv_bias=True, tie_weights=True)
TOKENIZER = {50257: "gpt2", 257: "byte"}
"""The tokenizer GPTLitModule needs for a shape's vocab_size (it takes its size from one)."""


class RandomTokens(Dataset):
    def __init__(self, n: int, context: int, vocab: int):
        self.n, self.context, self.vocab = n, context, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        window = torch.randint(0, self.vocab, (self.context + 1,),
                               generator=torch.Generator().manual_seed(i))
        return window[:-1], window[1:]


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def loader(shape: dict, batch: int, steps: int, device: torch.device) -> DataLoader:
    return DataLoader(RandomTokens(steps * batch, shape["context_length"], shape["vocab_size"]),
                      batch_size=batch, pin_memory=device.type == "cuda",
                      num_workers=2 if device.type == "cuda" else 0)


def plain_loop(shape: dict, batch: int, steps: int, warmup: int, device, compile: bool):
    """Tokens/s and peak bytes of a plain loop: bf16 autocast, fused AdamW, clipping."""
    torch.manual_seed(0)
    model = init_gpt2_weights(GPTModel(GPTConfig(**shape))).to(device).train()
    loss_fn = torch.compile(lm_loss) if compile else lm_loss  # the pass, head and loss fused
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=6e-4, betas=(0.9, 0.95), fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, 10, steps + warmup, 0.1))
    data = iter(loader(shape, batch, steps + warmup, device))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps + warmup):
        if step == warmup:
            sync(device)
            start = time.perf_counter()
        inputs, targets = (t.to(device, non_blocking=True) for t in next(data))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model, inputs, targets)
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
    module = GPTLitModule(tokenizer=TOKENIZER[shape["vocab_size"]], learning_rate=6e-4,
                          warmup_steps=10, compile=compile,
                          **{k: v for k, v in shape.items() if k != "vocab_size"})
    timer = Timer(warmup)
    trainer = L.Trainer(
        accelerator=device.type, devices=1, precision="bf16-mixed", max_steps=steps + warmup,
        gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50,
        callbacks=[timer], limit_val_batches=0,
    )
    trainer.fit(module, loader(shape, batch, steps + warmup, device))
    return timer.steps * batch * shape["context_length"] / timer.seconds


def largest_batch(shape: dict, device, compile: bool, tries=(16, 32, 64, 128),
                  deadline: float = float("inf")) -> tuple[int | None, dict[int, float]]:
    """The largest power-of-two micro-batch whose training step fits, and the plain loop's
    tokens/s at each batch that fit (3 timed steps after 2; stops at `deadline`, a
    time.monotonic() value)."""
    fits, rates = None, {}
    for batch in tries:
        if time.monotonic() > deadline:
            break
        try:
            rates[batch], _ = plain_loop(shape, batch, 3, 2, device, compile)
            fits = batch
        except (torch.OutOfMemoryError, RuntimeError) as err:  # compiled code may wrap it
            if "out of memory" not in str(err).lower():
                raise
            break
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return fits, rates


def decode(shape: dict, batch: int, new_tokens: int, device, compile: bool) -> float:
    """New tokens/s of greedy generation with the KV cache (a prompt of half the context,
    at most 128 tokens)."""
    torch.manual_seed(0)
    model = init_gpt2_weights(GPTModel(GPTConfig(**shape))).to(device, torch.bfloat16).eval()
    if compile:
        model = torch.compile(model, dynamic=True)
    prompt = torch.randint(0, shape["vocab_size"], (batch, min(128, shape["context_length"] // 2)),
                           device=device)
    generate(model, prompt, 4, use_cache=True)  # warm-up (and compilation)
    sync(device)
    start = time.perf_counter()
    generate(model, prompt, new_tokens, use_cache=True)
    sync(device)
    return batch * new_tokens / (time.perf_counter() - start)


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
    return cpu_name()


def model_figures(shape: dict, device: torch.device) -> dict:
    """Parameters, FLOPs per trained token (6N + 12*L*T*d) and the device's bf16 peak."""
    cfg = GPTConfig(**shape)
    return {"parameters": num_parameters(GPTModel(cfg)), "context": cfg.context_length,
            "flops_per_token": flops_per_token(cfg),
            "peak_bf16_flops": peak_flops_of(device, torch.bfloat16)}


def training_figures(shape: dict, device: torch.device, *, batch: int = 16, steps: int = 30,
                     warmup: int = 10, tries=(16, 32, 64, 128),
                     deadline: float = float("inf")) -> dict:
    """Tokens/s and MFU of the plain loop and the LightningModule at `batch`, the plain
    loop's peak memory, and the largest micro-batch of `tries` (compiled on a GPU)."""
    compile, tf32 = device.type == "cuda", torch.backends.cuda.matmul.allow_tf32
    model = model_figures(shape, device)
    torch.backends.cuda.matmul.allow_tf32 = True  # what float32 matmuls remain (bf16-mixed)
    try:
        plain, memory = plain_loop(shape, batch, steps, warmup, device, compile)
        lit = lightning_loop(shape, batch, steps, warmup, device, compile)
        largest, rates = largest_batch(shape, device, compile, tries, deadline)
    finally:  # the parity check's float32 must not inherit TF32
        torch.backends.cuda.matmul.allow_tf32 = tf32
    peak = model["peak_bf16_flops"]

    def mfu(rate: float) -> float | None:
        return model["flops_per_token"] * rate / peak if peak else None

    return {**model, "compiled": compile, "precision": "bf16-mixed", "micro_batch": batch,
            "plain_tokens_per_s": plain, "plain_mfu": mfu(plain),
            "lightning_tokens_per_s": lit, "lightning_mfu": mfu(lit),
            "lightning_vs_plain": (lit - plain) / plain, "peak_memory_bytes": memory,
            "largest_micro_batch": largest,
            "tokens_per_s_by_micro_batch": {str(b): r for b, r in rates.items()},
            "mfu_by_micro_batch": {str(b): mfu(r) for b, r in rates.items()}}


def decoding_figures(shape: dict, device: torch.device, *, batches=(1, 64),
                     new_tokens: int = 128, deadline: float = float("inf"),
                     modes: tuple[bool, ...] = (False, True)) -> dict:
    """New tokens/s of greedy KV-cache decoding at each batch, eager, then compiled on a GPU
    (`modes`: compiled or not, in order; each skipped once past `deadline`, a
    time.monotonic() value)."""
    figures = {"new_tokens": new_tokens, "dtype": "bfloat16"}
    for compiled in modes if device.type == "cuda" else (False,):
        if time.monotonic() > deadline:
            break
        label = "compiled" if compiled else "eager"
        rates = {str(b): decode(shape, b, new_tokens, device, compiled) for b in batches}
        figures[f"{label}_tokens_per_s"] = rates
        figures[f"{label}_{batches[-1]}_vs_{batches[0]}"] = (rates[str(batches[-1])]
                                                            / rates[str(batches[0])])
    return figures


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
    print(f"device: {describe(device)}; torch {torch.__version__}; compiled: "
          f"{device.type == 'cuda'}")
    train = training_figures(shape, device, batch=args.batch, steps=args.steps,
                             warmup=args.warmup)
    peak = train["peak_bf16_flops"]
    print(f"model: {train['parameters'] / 1e6:.1f}M parameters, context {train['context']}, "
          f"{train['flops_per_token'] / 1e9:.2f} GFLOP per trained token (6N + 12*L*T*d); "
          f"bf16 peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s")
    print(f"\ntraining, micro-batch {args.batch}, bf16-mixed:")
    print(f"  {'path':<26}{'tokens/s':>12}{'MFU':>8}")
    for path, key in (("plain PyTorch loop", "plain"), ("LightningModule (train.py)",
                                                        "lightning")):
        mfu = train[f"{key}_mfu"]
        print(f"  {path:<26}{train[f'{key}_tokens_per_s']:>12,.0f}"
              f"{f'{mfu:.1%}' if mfu else '-':>8}")
    print(f"  Lightning vs plain: {train['lightning_vs_plain']:+.1%} (goal: within 3%)")
    print(f"  peak memory (plain loop): {train['peak_memory_bytes'] / 2**30:.1f} GiB")
    rates = ", ".join(f"{b}: {r:,.0f}" for b, r in train["tokens_per_s_by_micro_batch"].items())
    print(f"  largest micro-batch that fits: {train['largest_micro_batch']} (tokens/s by "
          f"micro-batch: {rates})")
    print("  goal: MFU >= 45% through the LightningModule")

    decoding = decoding_figures(shape, device, new_tokens=args.new_tokens)
    print(f"\ndecoding (greedy, KV cache, bf16, {args.new_tokens} new tokens):")
    print(f"  {'':<12}{'batch 1':>12}{'batch 64':>12}{'64 vs 1':>10}")
    for label in ("eager", "compiled"):
        if f"{label}_tokens_per_s" in decoding:
            rates = decoding[f"{label}_tokens_per_s"]
            print(f"  {label:<12}{rates['1']:>12,.0f}{rates['64']:>12,.0f}"
                  f"{decoding[f'{label}_64_vs_1']:>9.1f}x")
    print("  goals: batch 1 >= 1,000 tokens/s; batch 64 >= 30x batch 1")


if __name__ == "__main__":
    main()
