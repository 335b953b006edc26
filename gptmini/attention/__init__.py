"""Attention: the book's `MultiHeadAttention` (Listing 3.5) and everything it attends with.

    multihead.py  the module: projections, the call into a kernel
    kv_cache.py   the KV-cache interface and the contiguous KVCache (window_cache.py: a
                  sliding-window layer's WindowKVCache, loaded when first asked for)
    context.py    `AttentionContext`: positions and mask of one forward pass, built once
                  with the layers' `AttentionSettings`
    norm.py       RMSNorm (the QK-norm's and the model's): torch's result, fast on a CPU
    masks.py      the mask algebra (True = may attend) and score modifiers (ALiBi, soft-cap)
    sinks.py      attention sinks (gpt-oss): a learned logit per head in the softmax's
                  denominator, as each kernel adds it
    gate.py       gated attention (Qwen3-Next): a sigmoid gate on each head's output
    positions/    position schemes, one object each: learned, rope, alibi, none (`SCHEMES`)
    kernels/      sdpa, explicit, flex, tiled (flash attention's algorithm), as a table
    book.py       the book's teaching variants (Listings 3.1-3.4), kept as oracles
    table.py      names to classes (kernels, schemes), errors.py the refused argument's error

Imports only torch.
"""

from gptmini.attention.context import AttentionContext, AttentionSettings, Ragged
from gptmini.attention.kv_cache import BaseKVCache, KVCache
from gptmini.attention.multihead import MultiHeadAttention

__all__ = ["AttentionContext", "AttentionSettings", "BaseKVCache", "KVCache",
           "MultiHeadAttention", "Ragged", "WindowKVCache"]


def __getattr__(name: str):
    """WindowKVCache by this name too, imported when first asked for."""
    if name == "WindowKVCache":
        from gptmini.attention.window_cache import WindowKVCache

        return WindowKVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
