"""Attention masks, written once: functions (b, h, q_idx, kv_idx) -> bool, True = may attend
(torchtitan's `q_idx >= kv_idx`; FlexAttention's `mask_mod`). The arguments are integer
tensors that broadcast (or scalars inside FlexAttention); masks combine with `and_masks`.
Positions are absolute: the queries are the last num_tokens of num_keys positions (the
keys before them come from a KV cache). `dense` makes the tensor the explicit path and
SDPA read; other kernels make their own forms (gptmini.attention.kernels).
"""

from collections.abc import Callable

import torch
from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

__all__ = ["MaskMod", "and_masks", "causal", "dense", "document", "index_grids", "padding",
           "sliding_window"]


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


def sliding_window(window: int) -> MaskMod:
    """Keys fewer than `window` positions from the query, on either side."""

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


def index_grids(batch: int, num_heads: int, first_query: int, num_queries: int,
                first_key: int, num_keys: int, device=None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A mask's arguments: b (batch,1,1,1), h (1,heads,1,1), q_idx (1,1,queries,1) from
    first_query on, kv_idx (1,1,1,keys) from first_key on."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(num_heads, device=device)[None, :, None, None]
    q = torch.arange(first_query, first_query + num_queries, device=device)[None, None, :, None]
    kv = torch.arange(first_key, first_key + num_keys, device=device)[None, None, None, :]
    return b, h, q, kv


def dense(mask: MaskMod, batch: int, num_tokens: int, num_keys: int, device=None) -> Tensor:
    """The mask as a tensor, (batch, 1, num_tokens, num_keys) (heads broadcast)."""
    grids = index_grids(batch, 1, num_keys - num_tokens, num_tokens, 0, num_keys, device)
    return mask(*grids).expand(batch, 1, num_tokens, num_keys)
