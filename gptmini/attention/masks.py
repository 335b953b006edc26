"""Attention masks, written once: small functions of (b, h, q_idx, kv_idx) -> bool.

One convention everywhere: True means "may attend" (torchtitan's `q_idx >= kv_idx`), and
a mask is a function of the batch row, the head, the query's position and the key's
position, FlexAttention's `mask_mod` signature. The arguments are integer tensors that
broadcast against each other, or scalars inside FlexAttention. Masks combine with
`and_masks` and `or_masks`, and one definition serves every attention kernel:

    dense        a (b, 1, num_tokens, num_keys) boolean tensor: the explicit path and SDPA
    block_mask   a FlexAttention BlockMask (which 128 x 128 blocks to compute, which to
                 skip): in gptmini.attention.kernels.flex, which alone reads it
    tile_plan    which tiles the tiled kernel skips, computes whole, or masks: in
                 gptmini.attention.kernels.tiled, which alone reads it

Positions are absolute: the queries are the last `num_tokens` of `num_keys` positions (as
with a KV cache), so query i sits at position num_keys - num_tokens + i. The masks:

    causal            a query sees itself and earlier keys (a decoder; the book's mask)
    full              every key (seed 002's encoder attends both ways)
    sliding_window    keys fewer than `window` positions away (with causal: the last window)
    padding           only the real keys of its row (per-row padding, left or right)
    document          only keys of its own document (documents packed in one window)

Beside masks, score modifiers `(score, b, h, q_idx, kv_idx) -> score` (FlexAttention's
`score_mod`) change what a query's scores are before the softmax, on the scaled scores
q·k / sqrt(head_dim), with the same absolute positions:

    alibi(slopes)     score + slope_h * (kv_idx - q_idx): ALiBi's distance penalty (additive)
    softcap(cap)      cap * tanh(score / cap): scores bounded in (-cap, cap)
    chain(*mods)      one after the other

An additive modifier (`mod.additive`) is a bias: `score_bias` evaluates it once as a
tensor for SDPA's float mask; the explicit path and the tiled kernel apply any modifier to
their scores (`apply_score_mod`), and flex takes it as its `score_mod`.
"""

from collections.abc import Callable

import torch
from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

__all__ = [
    "MaskMod",
    "ScoreMod",
    "alibi",
    "and_masks",
    "apply_score_mod",
    "chain",
    "causal",
    "dense",
    "document",
    "full",
    "index_grids",
    "or_masks",
    "padding",
    "rows_with_keys",
    "score_bias",
    "sliding_window",
    "softcap",
]


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


def full(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (q_idx >= 0) & (kv_idx >= 0)  # always True, in the broadcast shape


def sliding_window(window: int) -> MaskMod:
    """Keys fewer than `window` positions from the query, on either side (and causal: the
    query and the window - 1 keys before it)."""

    def near(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx).abs() < window

    return near


def padding(key_is_real: Tensor) -> MaskMod:
    """Only real keys: `key_is_real` is (b, num_keys), True (or 1) at real tokens."""
    real = key_is_real.bool()

    def real_key(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return real[b, kv_idx]

    return real_key


def document(document_ids: Tensor) -> MaskMod:
    """Only keys of the query's own document: `document_ids` is (b, num_keys)."""

    def same_document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return document_ids[b, q_idx] == document_ids[b, kv_idx]

    return same_document


def and_masks(*masks: MaskMod) -> MaskMod:
    """Allowed where every mask allows."""

    def both(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        allowed = masks[0](b, h, q_idx, kv_idx)
        for mask in masks[1:]:
            allowed = allowed & mask(b, h, q_idx, kv_idx)
        return allowed

    return both


def or_masks(*masks: MaskMod) -> MaskMod:
    """Allowed where any mask allows."""

    def either(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        allowed = masks[0](b, h, q_idx, kv_idx)
        for mask in masks[1:]:
            allowed = allowed | mask(b, h, q_idx, kv_idx)
        return allowed

    return either


def alibi(slopes: Tensor) -> ScoreMod:
    """ALiBi: head h adds slopes[h] * (kv_idx - q_idx), a penalty growing with distance
    (keys before the query are at negative distance)."""

    def distance_penalty(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor,
                         kv_idx: Tensor) -> Tensor:
        return score + slopes[h] * (kv_idx - q_idx)

    distance_penalty.additive = True
    return distance_penalty


def softcap(cap: float) -> ScoreMod:
    """cap * tanh(score / cap): smooth, bounded scores (Gemma 2's attention soft-capping)."""

    def capped(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    capped.additive = False
    return capped


def chain(*mods: ScoreMod) -> ScoreMod:
    """The modifiers applied one after the other (additive when every one is)."""

    def chained(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        for mod in mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    chained.additive = all(getattr(mod, "additive", False) for mod in mods)
    return chained


# --------------------------------------------------------------------------- its forms


def index_grids(batch: int, num_heads: int, first_query: int, num_queries: int,
                first_key: int, num_keys: int, device=None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The arguments a mask or modifier is evaluated on, broadcasting against each other:
    b (batch,1,1,1), h (1,heads,1,1), q_idx (1,1,queries,1), kv_idx (1,1,1,keys), the
    queries at positions first_query..., the keys at first_key..."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(num_heads, device=device)[None, :, None, None]
    q = torch.arange(first_query, first_query + num_queries, device=device)[None, None, :, None]
    kv = torch.arange(first_key, first_key + num_keys, device=device)[None, None, None, :]
    return b, h, q, kv


def apply_score_mod(mod: ScoreMod, scores: Tensor, first_query: int, first_key: int = 0
                    ) -> Tensor:
    """`mod` on a block of scaled scores (b, heads, queries, keys) whose first query sits at
    position `first_query` and first key at `first_key`."""
    b, h, q, kv = index_grids(scores.shape[0], scores.shape[1], first_query, scores.shape[2],
                         first_key, scores.shape[3], scores.device)
    return mod(scores, b, h, q, kv)


def score_bias(mod: ScoreMod, batch: int, num_heads: int, num_tokens: int, num_keys: int,
               device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """An additive modifier as a bias, (batch, num_heads, num_tokens, num_keys)."""
    if not getattr(mod, "additive", False):
        raise ValueError("only an additive score modifier is a bias; apply this one to the "
                         "scores (apply_score_mod)")
    zeros = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device)
    bias = mod(zeros, *index_grids(batch, num_heads, num_keys - num_tokens, num_tokens, 0,
                              num_keys, device))
    return bias.expand(batch, num_heads, num_tokens, num_keys)



def dense(mask: MaskMod, batch: int, num_tokens: int, num_keys: int, device=None) -> Tensor:
    """The mask as a tensor, (batch, 1, num_tokens, num_keys) (heads broadcast)."""
    grids = index_grids(batch, 1, num_keys - num_tokens, num_tokens, 0, num_keys, device)
    return mask(*grids).expand(batch, 1, num_tokens, num_keys)


def rows_with_keys(mask: MaskMod, batch: int, num_tokens: int, num_keys: int, device=None,
                   chunk: int = 256) -> Tensor:
    """(batch, num_tokens): whether each query may attend any key at all (left padding may
    leave a query none), evaluated `chunk` queries at a time."""
    first = num_keys - num_tokens
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
    kv = torch.arange(num_keys, device=device)[None, None, None, :]
    found = []
    for start in range(0, num_tokens, chunk):
        q = torch.arange(first + start, first + min(start + chunk, num_tokens),
                         device=device)[None, None, :, None]
        allowed = mask(b, h, q, kv).expand(batch, 1, q.shape[2], num_keys)
        found.append(allowed.any(dim=-1)[:, 0])  # (batch, chunk)
    return torch.cat(found, dim=1)
