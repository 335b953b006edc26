"""Attention sinks (gpt-oss): a learned logit per head in the softmax's denominator.

A sink is a key every query sees whose score is a learned number per head (not a dot
product) and whose value is zero. It takes a share of each row's weight and gives nothing
back, so a head can attend to "nothing" when no key fits, instead of piling its weight on
the first token (Xiao et al., 2023, found models learn such a sink on their own; gpt-oss
makes it a parameter):

    weights_j = exp(s_j) / (sum_k exp(s_k) + exp(sink))      (they sum to less than 1)

where s are the scaled scores after any score modifier (ALiBi, soft-cap) and the mask; the
sink itself is neither modified nor masked. It is not a token: it has no position, moves
no mask, changes no causality, and needs nothing in a KV cache. Each kernel adds it in its
own way, with the same result:

    explicit  one more column of scores, softmax, the column dropped   (`softmax_with_sinks`)
    sdpa      one more key and value, both zero, whose bias is the sink: 0 * scale + sink
              (`sdpa_with_sinks`; the float bias costs SDPA its flash kernels on a GPU)
    flex      the output without the sink, scaled by Z / (Z + exp(sink)) = sigmoid(lse - sink)
              from flex's log-sum-exp (`rescale_by_lse`)
    tiled     the online softmax starts from the sink: m = sink, l = 1 (in `tiled.py`)

A kernel that adds sinks says so with `has_sinks = True` (gptmini.attention.kernels);
`MultiHeadAttention(..., sinks=True)` refuses a kernel without it, by name.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["rescale_by_lse", "sdpa_with_sinks", "softmax_with_sinks"]


def softmax_with_sinks(scores: Tensor, sinks: Tensor, dtype: torch.dtype) -> Tensor:
    """softmax over the keys and the sink, the sink's weight dropped.

    Args:
        scores: (b, num_heads, num_tokens, num_keys) scaled, modified, masked scores.
        sinks: (num_heads,) each head's sink logit.
        dtype: the softmax's dtype (float32 or wider).

    Returns:
        (b, num_heads, num_tokens, num_keys) weights, each row summing to less than 1.
    """
    b, h, n, _ = scores.shape
    column = sinks.to(dtype).view(1, h, 1, 1).expand(b, h, n, 1)
    combined = torch.cat([scores.to(dtype), column], dim=-1)  # (b, h, n, num_keys + 1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def sdpa_with_sinks(queries: Tensor, keys: Tensor, values: Tensor, context, dropout_p: float,
                    sinks: Tensor) -> Tensor:
    """`F.scaled_dot_product_attention` with one more key and value, both zero, whose
    score is its bias, the sink: exact, and differentiable in the sinks through the bias.

    Args:
        queries: (b, num_heads, num_tokens, head_dim).
        keys, values: (b, num_kv_heads, num_keys, head_dim).
        context: the pass's AttentionContext (its mask, and an additive modifier if any).
        dropout_p: attention dropout.
        sinks: (num_heads,).

    Returns:
        (b, num_heads, num_tokens, head_dim).
    """
    b, h, n, _ = queries.shape
    num_keys = keys.shape[2]
    if context.score_mod is not None:  # an additive one (the caller checked): ALiBi
        bias = context.float_mask(h, queries.dtype)  # (b, h, n, num_keys)
    else:
        bias = queries.new_zeros(1, 1, n, num_keys)
        allowed = context.dense()  # (b, 1, n, num_keys) or None
        if allowed is not None:
            bias = bias.masked_fill(~allowed, -torch.inf)
    column = sinks.to(queries.dtype).view(1, h, 1, 1).expand(b, h, n, 1)
    bias = torch.cat([bias.expand(b, h, n, num_keys), column], dim=-1)  # (b, h, n, keys + 1)
    zero = keys.new_zeros(b, keys.shape[1], 1, keys.shape[3])  # the sink's key and value
    return F.scaled_dot_product_attention(
        queries, torch.cat([keys, zero], dim=2), torch.cat([values, zero], dim=2),
        attn_mask=bias, dropout_p=dropout_p, enable_gqa=keys.shape[1] != h)


def rescale_by_lse(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Attention without sinks made attention with them: out * Z / (Z + exp(sink)), where
    Z = exp(lse) is each row's softmax denominator.

    Args:
        out: (b, num_heads, num_tokens, head_dim) attention's output without sinks.
        lse: (b, num_heads, num_tokens) the log-sum-exp of each row's scores (-inf: a row
            with no key, whose output stays 0).
        sinks: (num_heads,).
    """
    kept = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))  # (b, h, n)
    return (out * kept[..., None].to(out.dtype)).to(out.dtype)
