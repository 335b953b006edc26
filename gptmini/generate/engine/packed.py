"""One engine step's sequences packed in one row: where each token sits, and how attention
reads them one sequence per row.

The runner (runner.py) packs the new tokens of every scheduled request one after another
in a single row, so that every linear layer runs on exactly the tokens there are. Attention
cannot attend a packed row as it is (each sequence sees only its own keys), so the step's
`AttentionContext` carries a `PackedRow`, which implements what attention asks of such a
layout (`gptmini.attention.context.Ragged`: `unpack`, `context_for`, `pack`); the rest of
it (`key_index`, `new_of`) is how the runner finds each key's slot and position.
"""

import torch
from torch import Tensor

from gptmini.attention.context import AttentionContext, AttentionSettings


class PackedRow:
    """Sequences packed in one row, as an engine step runs them, and how attention reads them.

    Sequence i has `num_new[i]` new tokens in the packed row, one sequence after another,
    after `num_cached[i]` tokens of its own in the KV cache. Linear layers see the packed row
    (1, total_new); attention sees one row per sequence, left-padded: `unpack` lays the
    packed queries out as (num_seqs, heads, longest_new, head_dim), the cache returns each
    sequence's keys left-padded to the longest sequence, `context` masks the padding (and is
    causal, windowed, modified as the model's attention is: the new tokens of every row are
    the last of its keys), and `pack` puts the output back in packed order. `key_index` is
    each key's place in its own sequence (negative in the padding), from which the engine
    finds its slots and positions (`new_of`: the new tokens' in packed order). Padding costs
    only attention's share of the work, and only in the rows shorter than the longest.

    Args:
        num_new, num_cached: per sequence, its new tokens and those already cached.
        settings: the model's attention settings (`GPTModel.attention_settings`); None:
            the defaults (causal, no window).
        device: where the indices and the mask live.
    """

    def __init__(self, num_new: list[int], num_cached: list[int],
                 settings: AttentionSettings | None = None, *, device=None):
        longest_new = self.longest_new = max(num_new)
        self.num_keys = max(n + c for n, c in zip(num_new, num_cached, strict=True))
        starts = torch.tensor([0, *num_new], device=device).cumsum(0)[:-1]  # packed offsets
        new = torch.tensor(num_new, device=device)
        column = torch.arange(longest_new, device=device)  # (longest_new,)
        first = longest_new - new  # (num_seqs,): the first real column of each row
        real = column >= first[:, None]  # (num_seqs, longest_new)
        # the packed index of every (row, column), padding reading token 0 (thrown away)
        self.query_index = torch.where(real, starts[:, None] + column - first[:, None], 0)
        self.real = real.flatten().nonzero().squeeze(1)  # packed order, row by row
        total = new + torch.tensor(num_cached, device=device)
        # each key's place in its own sequence, negative in the left padding
        self.key_index = (torch.arange(self.num_keys, device=device)
                          - (self.num_keys - total[:, None]))  # (num_seqs, num_keys)
        self.context = AttentionContext.build(
            len(num_new), longest_new, self.num_keys - longest_new, settings=settings,
            attention_mask=self.key_index >= 0, uses_cache=True)

    def context_for(self, settings: AttentionSettings) -> AttentionContext:
        """The per-sequence context as a layer with `settings` (its own window) sees it."""
        if settings == self.context.settings:
            return self.context
        return self.context.for_layer(settings)

    def new_of(self, per_key: Tensor) -> Tensor:
        """(num_seqs, num_keys) values per key -> (total_new,) those of the new tokens, in
        packed order (the new tokens are the last keys of every row)."""
        return per_key[:, self.num_keys - self.longest_new:].flatten()[self.real]

    def unpack(self, x: Tensor) -> Tensor:
        """(1, heads, total_new, head_dim) packed -> (num_seqs, heads, longest_new, head_dim)."""
        return x[0][:, self.query_index].transpose(0, 1)

    def pack(self, x: Tensor) -> Tensor:
        """(num_seqs, heads, longest_new, head_dim) -> (1, heads, total_new, head_dim)."""
        return x.transpose(0, 1).flatten(1, 2)[:, self.real].unsqueeze(0)
