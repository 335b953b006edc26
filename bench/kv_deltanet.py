"""What a Gated DeltaNet layer keeps instead of a KV cache: its fixed state, beside MHA/GQA.

For the default run's shape (configs: 4 layers of 256, 4 heads, 128 tokens) and the book's
124M shape (12 layers of 768, 12 heads, 1,024 tokens), each model prefills one full context
(batch 1, float32) through `model.new_kv_caches()`, and the bytes its caches hold are
measured (the tokens' keys and values, or each DeltaNet layer's state: a (k_dim, v_dim)
matrix per head and the convolution's last 3 inputs). Rows:

    MHA                 attention everywhere, a key and a value head per query head
    GQA (1/4 kv heads)  attention everywhere, a quarter of the key/value heads
    3:1 DeltaNet        Qwen3-Next's pattern: three DeltaNet layers per attention layer
    DeltaNet only       every layer DeltaNet

"per token" is the cache at the full context divided by its tokens: an attention layer's
is the same at any length, a DeltaNet layer's falls as 1/length (its state does not grow).
bf16 halves every figure. Runs in seconds on a CPU:

    python bench/kv_deltanet.py
"""

import torch
from machine import cpu_description

from gptmini.attention import KVCache
from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights
from gptmini.variants.deltanet import DeltaNetState

SHAPES = {
    "default (configs/shakespeare-cpu.yaml)": dict(emb_dim=256, n_heads=4, n_layers=4,
                                                   context_length=128),
    "124M (GPT_CONFIG_124M)": dict(emb_dim=768, n_heads=12, n_layers=12, context_length=1024),
}


def variants(shape: dict) -> dict[str, dict]:
    layers, heads = shape["n_layers"], shape["n_heads"]
    return {
        "MHA": {},
        "GQA (1/4 kv heads)": {"n_kv_heads": heads // 4},
        "3:1 DeltaNet": {"layer_kinds": ["deltanet", "deltanet", "deltanet", "attention"]
                         * (layers // 4)},
        "DeltaNet only": {"layer_kinds": ["deltanet"] * layers},
    }


def cache_bytes(cache: KVCache | DeltaNetState) -> int:
    if isinstance(cache, DeltaNetState):
        return cache.nbytes
    return sum(t.numel() * t.element_size() for t in (cache.keys, cache.values))


@torch.inference_mode()
def measure(shape: dict, overrides: dict) -> int:
    """Bytes all the layers' caches hold after one full context (batch 1, float32)."""
    # A small vocabulary: the caches do not depend on it, and the model builds faster.
    cfg = GPTConfig(vocab_size=256, drop_rate=0.0, position="rope", **shape, **overrides)
    torch.manual_seed(0)
    model = init_gpt2_weights(GPTModel(cfg)).eval()
    caches = model.new_kv_caches()
    model(torch.randint(0, 256, (1, cfg.context_length)), kv_caches=caches, logits_to_keep=1)
    return sum(cache_bytes(c) for c in caches)


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"machine: {cpu_description()}, torch {torch.__version__}, float32, batch 1")
    for name, shape in SHAPES.items():
        tokens = shape["context_length"]
        print(f"\n{name}: {shape['n_layers']} layers, emb_dim {shape['emb_dim']}, "
              f"{shape['n_heads']} heads, after {tokens} tokens")
        print(f"  {'layers':<20} {'cache bytes':>12} {'per token':>10} {'vs MHA':>7}")
        mha = None
        for label, overrides in variants(shape).items():
            total = measure(shape, overrides)
            mha = mha or total
            print(f"  {label:<20} {total:>12,} {total / tokens:>10,.0f} {total / mha:>7.2f}")


if __name__ == "__main__":
    main()
