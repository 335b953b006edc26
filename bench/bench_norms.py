"""RMSNorm's cost on a CPU: torch's against gptmini's against LayerNorm, side by side.

Forward and backward of one norm (median ms over --reps calls, alternating rounds) at
1,024 x 256 and at the default run's shapes (the blocks' norms: 8 x 128 x 256; QK-norm:
8 x 128 x 4 heads x 64), in float32 and under bf16 autocast, for:

    LayerNorm         nn.LayerNorm (no bias): the fused kernel to match
    torch RMSNorm     nn.RMSNorm (F.rms_norm): a fused forward, a composite backward
    gptmini RMSNorm   gptmini.attention.norm.RMSNorm: torch's result, LayerNorm's backward

Then the default run's model (the shipped config's shape, batch 8) timed a training step
(forward, backward, no optimizer) with each norm, and with no norms at all (nn.Identity,
wrong numbers but the time without them): the norms' share of a step is (with - without) /
with.

    python bench/bench_norms.py [--reps 50] [--rounds 3] [--threads N]
"""

import argparse
import os
import statistics
import time
import warnings

from gptmini.threads import sleep_when_idle

sleep_when_idle()  # before torch loads OpenMP: a shared CPU keeps its fair share

import torch  # noqa: E402
from machine import cpu_description  # noqa: E402  (bench/machine.py, this folder's)
from torch import nn  # noqa: E402

from gptmini.attention.norm import RMSNorm  # noqa: E402
from gptmini.model import (  # noqa: E402
    GPTConfig,
    GPTModel,
    init_gpt2_weights,
    lm_loss,  # noqa: E402
)
from gptmini.runtime import auto_precision  # noqa: E402

NORMS = {
    "LayerNorm": lambda dim: nn.LayerNorm(dim, eps=1e-6, bias=False),
    "torch RMSNorm": lambda dim: nn.RMSNorm(dim, eps=1e-6),
    "gptmini RMSNorm": lambda dim: RMSNorm(dim, eps=1e-6),
}
SHAPES = {"1,024 x 256": (1024, 256), "block norm 8x128x256": (8, 128, 256),
          "QK-norm 8x128x4x64": (8, 128, 4, 64)}
DEFAULT_MODEL = {"context_length": 128, "emb_dim": 256, "n_heads": 4, "n_layers": 4,
                 "drop_rate": 0.0, "tie_weights": True, "position": "rope", "norm": "rmsnorm",
                 "norm_eps": 1e-6, "mlp": "swiglu", "qk_norm": True, "bias": False}


def median_ms(fn, reps: int, warmup: int = 5) -> float:
    times = []
    for i in range(reps + warmup):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def norm_call(make, shape: tuple[int, ...], bf16: bool):
    """One forward and backward of a fresh norm over (shape), as a model calls it."""
    norm = make(shape[-1])
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape, dtype=torch.bfloat16 if bf16 else torch.float32)

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = norm(x.to(torch.bfloat16) if bf16 else x)  # a bf16 matmul's output, as in a model
        y.backward(grad)
    return call


def model_step(norm: str, inputs: torch.Tensor, bf16: bool):
    """A forward and backward of the default run's model with this norm everywhere."""
    torch.manual_seed(0)
    model = init_gpt2_weights(GPTModel(GPTConfig(vocab_size=4096, **DEFAULT_MODEL))).train()
    if norm != "gptmini RMSNorm":  # the model's own
        for name, module in list(model.named_modules()):
            if isinstance(module, RMSNorm):
                parent, _, leaf = name.rpartition(".")
                new = nn.Identity() if norm == "none" else NORMS[norm](module.weight.shape[0])
                setattr(model.get_submodule(parent) if parent else model, leaf, new)

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = lm_loss(model, inputs, inputs)
        loss.backward()
    return call


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Mismatch dtype")  # torch RMSNorm's, each call
    precision, _ = auto_precision("cpu")
    print(f"machine: {cpu_description()}, {os.cpu_count()} cores, {args.threads} threads, "
          f"torch {torch.__version__}, default precision {precision}")
    print(f"forward + backward of one norm, ms (median of {args.reps} calls, median of "
          f"{args.rounds} alternating rounds)")
    print(f"{'shape':<24}{'dtype':<7}" + "".join(f"{n:>17}" for n in NORMS)
          + f"{'gptmini/torch':>15}")
    for label, shape in SHAPES.items():
        for bf16 in (False, True):
            calls = {n: norm_call(make, shape, bf16) for n, make in NORMS.items()}
            rounds = {n: [] for n in NORMS}
            for _ in range(args.rounds):
                for n, call in calls.items():
                    rounds[n].append(median_ms(call, args.reps))
            ms = {n: statistics.median(r) for n, r in rounds.items()}
            print(f"{label:<24}{'bf16' if bf16 else 'fp32':<7}"
                  + "".join(f"{ms[n]:>17.3f}" for n in NORMS)
                  + f"{ms['gptmini RMSNorm'] / ms['torch RMSNorm']:>14.2f}x", flush=True)

    bf16 = precision == "bf16-mixed"
    inputs = torch.randint(0, 4096, (8, 128), generator=torch.Generator().manual_seed(0))
    names = [*NORMS, "none"]
    steps = {n: model_step(n, inputs, bf16) for n in names}
    rounds = {n: [] for n in names}
    for _ in range(args.rounds):
        for n in names:
            rounds[n].append(median_ms(steps[n], max(5, args.reps // 5), warmup=3))
    ms = {n: statistics.median(r) for n, r in rounds.items()}
    print(f"\nthe default run's model, batch 8 x 128, {precision}: forward + backward, ms "
          f"(17 norms a step)")
    for n in names:
        share = "" if n == "none" else f"  norms {(ms[n] - ms['none']) / ms[n]:.1%} of it"
        print(f"  {n:<17}{ms[n]:>8.1f}{share}")


if __name__ == "__main__":
    main()
