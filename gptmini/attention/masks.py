"""The mask algebra (gptmini.core.masks, re-exported here; `full` and `or_masks` added) and
score modifiers beside it.

A mask (True = may attend) serves every kernel in the kernel's own form: `dense` for the
explicit path and SDPA, a BlockMask in gptmini.attention.kernels.flex, a tile plan in
gptmini.attention.kernels.tiled. A score modifier `(score, b, h, q_idx, kv_idx) -> score`
(FlexAttention's `score_mod`) changes the scaled scores q·k / sqrt(head_dim) before the
softmax, with the masks' absolute positions:

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

from gptmini.core.masks import (
    MaskMod,
    and_masks,
    causal,
    dense,
    document,
    index_grids,
    padding,
    sliding_window,
)

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

__all__ = ["MaskMod", "ScoreMod", "alibi", "and_masks", "apply_score_mod", "chain", "causal",
           "dense", "document", "full", "index_grids", "or_masks", "padding",
           "rows_with_keys", "score_bias", "sliding_window", "softcap"]


def full(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (q_idx >= 0) & (kv_idx >= 0)  # always True, in the broadcast shape


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


def rows_with_keys(mask: MaskMod, batch: int, num_tokens: int, num_keys: int, device=None,
                   chunk: int = 256) -> Tensor:
    """(batch, num_tokens): whether each query may attend any key at all (left padding may
    leave a query none), evaluated `chunk` queries at a time."""
    found = []
    for start in range(0, num_tokens, chunk):
        rows = min(chunk, num_tokens - start)
        grids = index_grids(batch, 1, num_keys - num_tokens + start, rows, 0, num_keys, device)
        found.append(mask(*grids).expand(batch, 1, rows, num_keys).any(dim=-1)[:, 0])
    return torch.cat(found, dim=1)
