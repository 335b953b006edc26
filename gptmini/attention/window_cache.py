"""A sliding-window layer's KV cache, which holds only its window (Gemma 3's and
gpt-oss's local layers: GPTConfig.layer_windows, window_size), made of KVCache's buffers."""

import torch
from torch import Tensor

from gptmini.attention.kv_cache import KVCache

__all__ = ["WindowKVCache"]


class WindowKVCache(KVCache):
    """The KV cache of a sliding-window layer: it holds only the `window - 1` newest tokens,
    all a next query can see besides itself (Gemma 3's and gpt-oss's local layers).

    `len(cache)` still counts every token seen, so positions continue; `update` returns
    the held tokens and the new ones, and attention masks over just those. Its buffer holds
    the window and a quarter more (16 tokens at least): what falls out is dropped as a
    view, and when an append outgrows the buffer the held tokens are copied to a fresh one;
    a long prompt's keys are copied out at once.
    """

    def __init__(self, window: int):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        super().__init__()
        self.window = window
        self.keep = max(window - 1, 1)  # one at least: positions continue from the newest
        self.num_forgotten = 0
        """Tokens seen but no longer held."""

    def __len__(self) -> int:
        return self.num_forgotten + self.num_held

    def __repr__(self) -> str:
        return f"WindowKVCache(window={self.window}, seen={len(self)}, held={self.num_held})"

    @property
    def num_held(self) -> int:
        """Tokens whose keys and values are held (at most window - 1)."""
        return super().__len__()

    def update(self, keys: Tensor, values: Tensor,
               positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        keys, values = super().update(keys, values, positions)
        excess = self.num_held - self.keep
        if excess > 0:
            super().drop_oldest(excess)  # views: the keys returned stay valid
            self.num_forgotten += excess
            if excess > self.keep and not torch.is_grad_enabled():
                self.regrow(self.num_held)  # a long prompt's buffer: a window-sized copy
        return keys, values

    def capacity_for(self, needed: int) -> int:
        # the window and a quarter more (16 tokens at least): the held tokens are copied
        # to a fresh buffer once per that many appends, a few tokens' copy per append
        return max(needed, self.keep + max(self.keep // 4, 16))

    def drop_oldest(self, n: int) -> None:
        """Forget the `n` oldest tokens seen (slide="roll"): those no longer held first."""
        if n <= 0:
            return
        gone = min(n, self.num_forgotten)
        self.num_forgotten -= gone
        super().drop_oldest(n - gone)
