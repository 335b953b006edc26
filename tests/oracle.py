"""An independent oracle for attention and its masks: plain loops over positions.

Written from the definitions, not from gptmini's mask code, so that a test comparing the
two can fail. Slow on purpose (Python loops, float64): only for the small shapes tests use.

Positions are absolute: with `num_keys` keys and `num_tokens` queries, query i sits at
position num_keys - num_tokens + i (the queries are the newest tokens, as with a KV cache).
"""

import math

import torch


def may_attend(
    q_pos: int,
    k_pos: int,
    *,
    causal: bool = True,
    window: int | None = None,
    key_is_real: bool = True,
    same_document: bool = True,
) -> bool:
    """Whether the query at `q_pos` may attend the key at `k_pos`, by the definitions."""
    if not key_is_real:  # padding is never attended
        return False
    if causal and k_pos > q_pos:  # the future is hidden
        return False
    if window is not None and abs(q_pos - k_pos) >= window:  # the last `window` positions
        return False
    return same_document


def allowed(
    b: int,
    num_tokens: int,
    num_keys: int,
    *,
    causal: bool = True,
    window: int | None = None,
    real: list[list[bool]] | None = None,
    documents: list[list[int]] | None = None,
) -> list[list[list[bool]]]:
    """allowed[row][i][j] for every row of a batch, as nested lists of bools.

    Args:
        real: per row, per key position: a real token (True) or padding (False).
        documents: per row, per key position: the document id of that token.
    """
    first = num_keys - num_tokens
    out = []
    for row in range(b):
        rows = []
        for i in range(num_tokens):
            q = first + i
            rows.append([
                may_attend(
                    q, j, causal=causal, window=window,
                    key_is_real=True if real is None else bool(real[row][j]),
                    same_document=True if documents is None
                    else documents[row][j] == documents[row][q],
                )
                for j in range(num_keys)
            ])
        out.append(rows)
    return out


def attend(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: list
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention, one query at a time, in float64.

    Args:
        queries: (b, num_heads, num_tokens, head_dim).
        keys, values: (b, num_kv_heads, num_keys, head_dim); query head h reads key/value
            head h // (num_heads // num_kv_heads).
        mask: allowed[row][i][j] from `allowed`, the same for every head.

    Returns:
        (context (b, num_heads, num_tokens, head_dim), weights (b, num_heads, num_tokens,
        num_keys)); a query with no allowed key gets zero weights and a zero context.
    """
    b, num_heads, num_tokens, head_dim = queries.shape
    num_keys = keys.shape[2]
    group = num_heads // keys.shape[1]
    q, k, v = (t.detach().double().tolist() for t in (queries, keys, values))
    weights = torch.zeros(b, num_heads, num_tokens, num_keys, dtype=torch.float64)
    context = torch.zeros(b, num_heads, num_tokens, head_dim, dtype=torch.float64)
    scale = 1.0 / math.sqrt(head_dim)
    for row in range(b):
        for h in range(num_heads):
            kv = h // group
            for i in range(num_tokens):
                keys_seen = [j for j in range(num_keys) if mask[row][i][j]]
                if not keys_seen:
                    continue
                scores = {
                    j: scale * sum(a * c for a, c in zip(q[row][h][i], k[row][kv][j], strict=True))
                    for j in keys_seen
                }
                top = max(scores.values())
                exps = {j: math.exp(s - top) for j, s in scores.items()}
                total = sum(exps.values())
                for j, e in exps.items():
                    weights[row, h, i, j] = e / total
                    for d in range(head_dim):
                        context[row, h, i, d] += e / total * v[row][kv][j][d]
    return context, weights


def multi_head_attention(module, x: torch.Tensor, mask: list) -> tuple[torch.Tensor, torch.Tensor]:
    """What a `MultiHeadAttention` (the book's parameter names) computes for `x` under `mask`.

    The projections use the module's weights; the attention itself is `attend`. A query with
    no allowed key gives a zero output row (not out_proj's bias), gptmini's convention.

    Returns:
        (output (b, num_tokens, d_out), weights (b, num_heads, num_tokens, num_keys)), float64.
    """
    b, num_tokens, _ = x.shape
    heads, kv_heads = module.num_heads, module.num_kv_heads
    head_dim = module.d_out // heads
    x = x.double()

    def project(linear, n):
        y = x @ linear.weight.double().T
        if linear.bias is not None:
            y = y + linear.bias.double()
        return y.view(b, num_tokens, n, head_dim).transpose(1, 2)

    queries = project(module.W_query, heads)
    keys, values = project(module.W_key, kv_heads), project(module.W_value, kv_heads)
    context, weights = attend(queries, keys, values, mask)
    merged = context.transpose(1, 2).reshape(b, num_tokens, module.d_out)
    out = merged @ module.out_proj.weight.double().T + module.out_proj.bias.double()
    for row in range(b):
        for i in range(num_tokens):
            if not any(mask[row][i]):
                out[row, i] = 0.0
    return out, weights
