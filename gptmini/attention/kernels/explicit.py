"""The book's attention, step by step: the reference kernel, and the only one with weights."""

import torch
import torch.nn.functional as F
from torch import Tensor

from gptmini.attention.masks import apply_score_mod


def explicit_attention(queries: Tensor, keys: Tensor, values: Tensor, context,
                       dropout_p: float = 0.0, *, sinks: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
    """Scores, in-place -inf fill, softmax, dropout, as the book's Listing 3.5.

    With `sinks` (num_heads,), each head's sink logit joins the softmax's denominator
    (gptmini.attention.sinks), and the weights sum to less than 1.

    Returns:
        The output (b, num_heads, num_tokens, head_dim) and the attention weights
        (b, num_heads, num_tokens, num_keys), zero at queries with no key to attend.
    """
    if keys.shape[1] != queries.shape[1]:
        # (b, num_kv_heads, num_keys, head_dim) -> (b, num_heads, num_keys, head_dim)
        group = queries.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_tokens, num_keys)
    divisor = keys.shape[-1] ** 0.5
    if context.score_mod is not None:  # modifiers act on the scaled scores, as flex's do
        attn_scores = apply_score_mod(context.score_mod, attn_scores / divisor,
                                      context.num_keys - context.num_tokens)
        divisor = 1.0
    allowed = context.dense()
    if allowed is not None:
        attn_scores.masked_fill_(~allowed, -torch.inf)
    # In float32 or wider (bf16 rounding in a softmax costs accuracy; float64 stays).
    wide = torch.promote_types(attn_scores.dtype, torch.float32)
    if sinks is None:
        attn_weights = torch.softmax(attn_scores / divisor, dim=-1, dtype=wide)
    else:  # (loaded by the option that needs it)
        from gptmini.attention.sinks import softmax_with_sinks

        attn_weights = softmax_with_sinks(attn_scores / divisor, sinks, wide)
    empty = context.empty_rows()
    if empty is not None:
        attn_weights = attn_weights.masked_fill(empty[:, None, :, None], 0.0)
    attn_weights = F.dropout(attn_weights, dropout_p, training=dropout_p > 0)
    return attn_weights.to(values.dtype) @ values, attn_weights


class ExplicitKernel:
    """The book's path (see `explicit_attention`)."""

    has_dropout = True
    has_sinks = True

    def __call__(self, queries: Tensor, keys: Tensor, values: Tensor, context,
                 dropout_p: float = 0.0, *, sinks: Tensor | None = None) -> Tensor:
        return explicit_attention(queries, keys, values, context, dropout_p, sinks=sinks)[0]
