"""The core's two attention kernels, the book's explicit path and torch's fused SDPA, each
called as `kernel(queries, keys, values, context, dropout_p) -> (b, num_heads, num_tokens,
head_dim)` with keys and values (b, num_kv_heads, num_keys, head_dim) and the pass's
`AttentionContext`, whose mask a kernel applies in the form it wants (`dense()`, or its own
made once with `context.once`). `has_dropout = False` says a kernel has no attention
dropout. More attach from outside (gptmini.attention.kernels: flex, tiled, sinks).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from gptmini.core.masks import index_grids

__all__ = ["KERNELS", "ExplicitKernel", "SdpaKernel", "explicit_attention"]


def explicit_attention(queries: Tensor, keys: Tensor, values: Tensor, context,
                       dropout_p: float = 0.0, *, softmax=None) -> tuple[Tensor, Tensor]:
    """Scores, in-place -inf fill, softmax, dropout, as the book's Listing 3.5.

    `softmax(scores, dtype)` replaces torch's (the attention sinks' adds a logit to each
    row's denominator). Returns the output and the attention weights (b, num_heads,
    num_tokens, num_keys), zero at queries with no key to attend.
    """
    if keys.shape[1] != queries.shape[1]:
        # (b, num_kv_heads, num_keys, head_dim) -> (b, num_heads, num_keys, head_dim)
        group = queries.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_tokens, num_keys)
    divisor = keys.shape[-1] ** 0.5
    if context.score_mod is not None:  # modifiers act on the scaled scores (ALiBi, a cap)
        b, h, n, k = attn_scores.shape
        grids = index_grids(b, h, context.num_keys - n, n, 0, k, attn_scores.device)
        attn_scores, divisor = context.score_mod(attn_scores / divisor, *grids), 1.0
    allowed = context.dense()
    if allowed is not None:
        attn_scores.masked_fill_(~allowed, -torch.inf)
    # In float32 or wider (bf16 rounding in a softmax costs accuracy; float64 stays).
    wide = torch.promote_types(attn_scores.dtype, torch.float32)
    if softmax is None:
        attn_weights = torch.softmax(attn_scores / divisor, dim=-1, dtype=wide)
    else:
        attn_weights = softmax(attn_scores / divisor, wide)
    empty = context.empty_rows()
    if empty is not None:
        attn_weights = attn_weights.masked_fill(empty[:, None, :, None], 0.0)
    attn_weights = F.dropout(attn_weights, dropout_p, training=dropout_p > 0)
    return attn_weights.to(values.dtype) @ values, attn_weights


class ExplicitKernel:
    """The book's path (see `explicit_attention`): the reference, and the only kernel whose
    weights can be seen."""

    has_dropout = True

    def __call__(self, queries: Tensor, keys: Tensor, values: Tensor, context,
                 dropout_p: float = 0.0) -> Tensor:
        return explicit_attention(queries, keys, values, context, dropout_p)[0]


class SdpaKernel:
    """`F.scaled_dot_product_attention`, the default. With causal alone over the whole call
    it passes `is_causal=True` and no mask, so flash kernels stay eligible on GPUs; any
    other mask goes as the context's dense boolean mask. A score modifier has no place in
    it: with one, the explicit path computes the scores."""

    has_dropout = True

    def __call__(self, queries: Tensor, keys: Tensor, values: Tensor, context,
                 dropout_p: float = 0.0) -> Tensor:
        if context.score_mod is not None:
            return explicit_attention(queries, keys, values, context, dropout_p)[0]
        gqa = keys.shape[1] != queries.shape[1]
        if context.plain_causal:
            return F.scaled_dot_product_attention(queries, keys, values, is_causal=True,
                                                  dropout_p=dropout_p, enable_gqa=gqa)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=context.dense(),
                                              dropout_p=dropout_p, enable_gqa=gqa)


KERNELS = {"sdpa": SdpaKernel, "explicit": ExplicitKernel}
"""The core's kernels by name (gptmini.attention.kernels.KERNELS has every built-in)."""
