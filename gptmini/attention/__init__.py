"""Attention beyond the core (gptmini.core.attention): the book's module with every option.

    multihead.py  MultiHeadAttention: the core's, with the kernels' table, ALiBi and rope
                  scaling through the position scheme, soft-capping, sinks, a gate, a score
                  scale, a layer's own window and an engine step's packed rows
    context.py    `AttentionContext` and `AttentionSettings`: the core's, with a soft-cap,
                  windows per layer and packed rows (`Ragged`)
    kv_cache.py   the `KVCache` generation uses, in buffers grown by doubling (window_cache.py:
                  a sliding-window layer's `WindowKVCache`); both load when first asked for
    norm.py       RMSNorm (the QK-norm's and the model's): torch's result, fast on a CPU
    masks.py      score modifiers (ALiBi, soft-cap) beside the core's mask algebra
    sinks.py      attention sinks (gpt-oss): a learned logit per head in the softmax's
                  denominator, as each kernel adds it
    gate.py       gated attention (Qwen3-Next): a sigmoid gate on each head's output
    positions/    position schemes as a table (`SCHEMES`): the core's, rope's scaling, alibi
    kernels/      sdpa, explicit, flex, tiled (flash attention's algorithm), as a table
    book.py       the book's teaching variants (Listings 3.1-3.4), kept as oracles
    table.py      names to classes (kernels, schemes)

Imports only torch.
"""

from gptmini.attention.context import AttentionContext, AttentionSettings, Ragged
from gptmini.attention.multihead import MultiHeadAttention
from gptmini.core.attention import BaseKVCache

__all__ = ["AttentionContext", "AttentionSettings", "BaseKVCache", "KVCache",
           "MultiHeadAttention", "Ragged", "WindowKVCache"]


def __getattr__(name: str):
    """KVCache and WindowKVCache by these names too, imported when first asked for."""
    if name == "KVCache":
        from gptmini.attention.kv_cache import KVCache

        return KVCache
    if name == "WindowKVCache":
        from gptmini.attention.window_cache import WindowKVCache

        return WindowKVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
