"""KV-cache bytes per token of multi-head latent attention beside MHA and GQA (issue 37).

Measured, not computed: each model prefills a prompt into its own caches, and the bytes
the caches hold are divided by the tokens. At the default shape (GPTConfig(): 12 layers of
12 heads of 64, the same sizes as GPT-2 124M's), at cpu-tiny's and at the 124M preset's, in
float32 and bfloat16.

    python bench/kv_mla.py
"""

import platform

import torch

from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights

SHAPES = {
    "default": {},
    "cpu-tiny": GPTConfig.from_preset("cpu-tiny").to_dict(),
    "124M": GPTConfig.from_preset("gpt2-124m").to_dict(),
}
PROMPT = 32


def variants(shape: dict) -> dict[str, dict]:
    """Each attention of one shape: MHA, GQA (a third, and 1 key/value heads), MLA at DeepSeek's
    proportions (latent = 4 head dims, rotary key = half a head)."""
    cfg = GPTConfig(**shape)
    head_dim, gqa = cfg.emb_dim // cfg.n_heads, max(1, cfg.n_heads // 3)
    return {
        "MHA": {},
        f"GQA ({gqa} kv heads)": {"n_kv_heads": gqa},
        "MQA (1 kv head)": {"n_kv_heads": 1},
        f"MLA (latent {4 * head_dim}, rope {head_dim // 2})": {
            "position": "rope", "layer_kinds": ["mla"] * cfg.n_layers,
            "mixer_options": {"mla": {"kv_lora_rank": 4 * head_dim}}},
        f"MLA (latent {2 * head_dim}, rope {head_dim // 2})": {
            "position": "rope", "layer_kinds": ["mla"] * cfg.n_layers,
            "mixer_options": {"mla": {"kv_lora_rank": 2 * head_dim}}},
    }


def cache_bytes_per_token(cfg: GPTConfig, dtype: torch.dtype) -> float:
    """Bytes all layers' caches hold per token after a prompt of PROMPT tokens."""
    small = GPTConfig(**{**cfg.to_dict(), "vocab_size": 64, "tie_weights": False})
    model = init_gpt2_weights(GPTModel(small)).to(dtype).eval()
    caches = model.new_kv_caches()
    with torch.no_grad():
        model(torch.zeros(1, PROMPT, dtype=torch.long), kv_caches=caches)
    held = sum(c.keys.nbytes + c.values.nbytes for c in caches)
    return held / PROMPT


def main() -> None:
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"{'shape':<8} {'attention':<28} {'float32 B/token':>16} {'bf16 B/token':>13} "
          f"{'vs MHA':>7}")
    for shape_name, shape in SHAPES.items():
        mha = None
        for name, fields in variants(shape).items():
            cfg = GPTConfig(**{**shape, **fields})
            f32 = cache_bytes_per_token(cfg, torch.float32)
            bf16 = cache_bytes_per_token(cfg, torch.bfloat16)
            mha = mha or f32
            print(f"{shape_name:<8} {name:<28} {f32:>16,.0f} {bf16:>13,.0f} {f32 / mha:>7.3f}")


if __name__ == "__main__":
    main()
