"""Attention sinks and gated attention: their KV-cache bytes per token beside MHA and GQA,
and what they cost a training step, side by side in one run.

KV-cache bytes per token are measured, not computed: a model of each shape prefills a
prompt into its caches, and the caches' key and value tensors are counted (float32; bf16
halves every row). Sinks and gates add parameters (n_heads sink logits per layer; a gate
of emb_dim x n_heads or emb_dim x emb_dim per layer) and nothing to the cache.

Then the default run's model (the shipped config's shape, batch 8 x 128 tokens) is timed
for a training step (forward and backward, no optimizer; median ms over --reps, variants
alternating) with neither option, with sinks, and with each gate, on the sdpa kernel.

    python bench/kv_sinks.py [--reps 10] [--threads N]
"""

import argparse
import statistics
import time

from gptmini.threads import sleep_when_idle

sleep_when_idle()  # before torch loads OpenMP: a shared CPU keeps its fair share

import torch  # noqa: E402
from machine import cpu_description  # noqa: E402  (bench/machine.py, this folder's)

from gptmini.model import (  # noqa: E402
    GPTConfig,
    GPTModel,
    init_gpt2_weights,
    lm_loss,  # noqa: E402
)

DEFAULT = {"vocab_size": 4096, "context_length": 128, "emb_dim": 256, "n_heads": 4,
           "n_layers": 4, "drop_rate": 0.0, "tie_weights": True, "position": "rope",
           "norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True, "bias": False}
"""The shipped default run's model (gptmini/configs/shakespeare-cpu.yaml)."""
SHAPES = {"default": DEFAULT, "124M": {"vocab_size": 50257, "context_length": 1024,
                                       "emb_dim": 768, "n_heads": 12, "n_layers": 12}}
VARIANTS = {
    "MHA": {},
    "GQA (kv heads = heads / 4)": {"n_kv_heads": "quarter"},
    "MHA + sinks": {"attn_sinks": True},
    "MHA + headwise gate": {"attn_gate": "headwise"},
    "MHA + elementwise gate": {"attn_gate": "elementwise"},
}


def _config(shape: dict, options: dict) -> GPTConfig:
    options = dict(options)
    if options.get("n_kv_heads") == "quarter":
        options["n_kv_heads"] = max(1, shape["n_heads"] // 4)
    return GPTConfig(**{**shape, **options})


@torch.no_grad()
def kv_bytes_per_token(cfg: GPTConfig, prompt: int = 16) -> tuple[float, int]:
    """(KV-cache bytes per token, all layers, float32; parameters) measured on a prefill."""
    model = init_gpt2_weights(GPTModel(cfg)).eval()
    caches = model.new_kv_caches()
    model(torch.zeros(1, prompt, dtype=torch.long), kv_caches=caches)
    held = sum(c.keys.nbytes + c.values.nbytes for c in caches)
    return held / prompt, sum(p.numel() for p in model.parameters())


def step_ms(models: dict, reps: int) -> dict[str, float]:
    """Median ms of forward + backward per model, the models alternating each rep."""
    idx = torch.randint(0, DEFAULT["vocab_size"], (8, DEFAULT["context_length"]))
    times = {name: [] for name in models}
    for rep in range(reps + 1):
        for name, model in models.items():
            start = time.perf_counter()
            lm_loss(model, idx, idx).backward()
            if rep:  # the first is warm-up
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {cpu_description()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print("\nKV-cache bytes per token (all layers, float32), measured on a 16-token prefill")
    print(f"{'variant':28s} {'default':>10s} {'124M':>10s} {'params default':>15s}")
    for name, options in VARIANTS.items():
        default, params = kv_bytes_per_token(_config(DEFAULT, options))
        big, _ = kv_bytes_per_token(_config(SHAPES["124M"], options))
        print(f"{name:28s} {default:10,.0f} {big:10,.0f} {params:15,d}")
    print(f"\ntraining step (forward + backward), default model, batch 8 x "
          f"{DEFAULT['context_length']}, sdpa, median of {args.reps}")
    torch.manual_seed(0)
    models = {name: GPTModel(_config(DEFAULT, options)).train()
              for name, options in VARIANTS.items() if "GQA" not in name}
    base = None
    for name, ms in step_ms(models, args.reps).items():
        base = base or ms
        print(f"{name:28s} {ms:8.1f} ms  ({ms / base:.2f}x MHA)")


if __name__ == "__main__":
    main()
