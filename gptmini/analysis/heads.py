"""Head roles: the scores mechanistic studies name an attention head's job by.

For every layer and head, on a random token sequence repeated twice after one first token
(`[first] + r + r`, Olsson et al.'s "In-context learning and induction heads" and
TransformerLens's induction test):

- previous-token score: the mean weight a query puts on the token just before it;
- induction score: the mean weight a query in the second copy puts on the token that
  followed its own token's earlier occurrence (the diagonal `period - 1` keys back);
- attention-sink mass: the mean weight a query (after the first) puts on the first token
  (Xiao et al.'s attention sinks; a head with nothing to do parks its weight there).

Each score is a share of the query's attention in [0, 1]: 1 means the whole of it.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["HeadRoles", "head_roles", "role_scores"]


@dataclass(frozen=True)
class HeadRoles:
    """The three scores of every head, each (n_layers, n_heads), and what they came from."""

    previous_token: Tensor
    induction: Tensor
    sink: Tensor
    period: int
    """Length of the random sequence that is repeated."""

    def to_dict(self) -> dict:
        """Plain lists, for JSON: {"previous_token": [[layer 0's heads], ...], ...}."""
        return {"previous_token": self.previous_token.tolist(),
                "induction": self.induction.tolist(), "sink": self.sink.tolist(),
                "period": self.period}


def role_scores(weights: Tensor, period: int) -> tuple[Tensor, Tensor, Tensor]:
    """The previous-token, induction and sink scores of attention weights over
    `[first] + r + r` with `len(r) == period`.

    Args:
        weights: (..., num_tokens, num_tokens) with num_tokens == 2 * period + 1; query i
            in row i.
        period: the length of r.

    Returns:
        Three tensors of shape `weights.shape[:-2]`.
    """
    num_tokens = weights.shape[-1]
    if num_tokens != 2 * period + 1 or period < 2:
        raise ValueError(f"weights over [first] + r + r need 2 * period + 1 tokens and a "
                         f"period >= 2; got {num_tokens} tokens for period {period}")
    query = torch.arange(1, num_tokens, device=weights.device)
    previous = weights[..., query, query - 1].mean(-1)
    second = torch.arange(period + 1, num_tokens, device=weights.device)
    induction = weights[..., second, second - period + 1].mean(-1)
    sink = weights[..., 1:, 0].mean(-1)
    return previous, induction, sink


@torch.no_grad()
def head_roles(model: nn.Module, *, period: int | None = None, batch: int = 4,
               seed: int = 0, first_token: int | None = None) -> HeadRoles:
    """Score every head of `model` on `batch` random sequences repeated twice.

    The model runs once, in eval mode, on the explicit attention path (`attention_weights`);
    its mode is restored afterwards and the global random state is not touched.

    Args:
        model: a `GPTModel` (anything with `.cfg` and `attention_weights`).
        period: length of the random sequence; None: 50, or less to fit the context
            (`(context_length - 1) // 2`).
        batch: random sequences averaged over.
        seed: seeds the draw of the sequences.
        first_token: the token before them; None: the last id, `<|endoftext|>` in every
            gptmini tokenizer. The random tokens are drawn from the ids below it.

    Returns:
        `HeadRoles`, each score (n_layers, n_heads) as float32 on the CPU.
    """
    cfg = model.cfg
    period = period or min(50, (cfg.context_length - 1) // 2)
    if not 2 <= period <= (cfg.context_length - 1) // 2:
        raise ValueError(f"period must be in 2..{(cfg.context_length - 1) // 2} for "
                         f"context_length {cfg.context_length} (2 * period + 1 tokens), got "
                         f"{period}")
    first = cfg.vocab_size - 1 if first_token is None else first_token
    generator = torch.Generator().manual_seed(seed)
    high = first if first > 1 else cfg.vocab_size
    r = torch.randint(0, high, (batch, period), generator=generator)  # (batch, period)
    idx = torch.cat([torch.full((batch, 1), first), r, r], dim=1)  # (batch, 2 * period + 1)
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        weights = model.attention_weights(idx.to(device))
    finally:
        model.train(was_training)
    # (n_layers, batch, n_heads, num_tokens, num_tokens), averaged over the batch
    stacked = torch.stack([w.float().cpu() for w in weights]).mean(1)
    previous, induction, sink = role_scores(stacked, period)
    return HeadRoles(previous, induction, sink, period)
