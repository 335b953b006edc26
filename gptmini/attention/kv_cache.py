"""The contiguous KV cache of one attention layer, grown by doubling: the core's
(gptmini.core.attention) made fast for generation. Other caches: a sliding-window layer's
`WindowKVCache` (window_cache.py), the engine's paged view (gptmini.generate.engine.paged).

Shapes: keys and values (b, num_kv_heads, num_keys, head_dim), positions (b, num_keys).
"""

import torch
from torch import Tensor

from gptmini.core.attention import BaseKVCache

__all__ = ["BaseKVCache", "KVCache"]


class KVCache(BaseKVCache):
    """Keys and values of the tokens seen so far, for one attention layer.

    `keys` and `values` are (b, num_kv_heads, num_cached, head_dim), `positions`
    (b, num_cached); `update` appends the new tokens' and returns all keys and values.

    Without autograd the tensors live in buffers that grow by doubling, so appending one
    token writes one token: concatenating instead would copy the whole cache (and fault in
    fresh memory) at every step, which at batch 8 costs as much as the matmuls. With
    autograd (a new key that requires grad) it concatenates, so gradients flow as before.
    """

    def __init__(self, keys: Tensor | None = None, values: Tensor | None = None):
        self._keys, self._values, self._positions, self._len = None, None, None, 0
        if keys is not None:
            self.keys, self.values = keys, values

    # Assigning keys/values replaces the cache's contents (the former dataclass fields).
    @property
    def keys(self) -> Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self._len]

    @keys.setter
    def keys(self, keys: Tensor | None):
        self._keys, self._positions = keys, None
        self._len = 0 if keys is None else keys.shape[2]

    @property
    def values(self) -> Tensor | None:
        return None if self._values is None else self._values[:, :, : self._len]

    @values.setter
    def values(self, values: Tensor | None):
        self._values = values

    @property
    def positions(self) -> Tensor | None:
        """(b, num_cached) positions of the cached tokens, or None where some token's was
        not given (keys assigned directly, or an update without positions)."""
        return None if self._positions is None else self._positions[:, : self._len]

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"KVCache(num_cached={self._len})"

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers holding keys and values, spare capacity included (what the
        cache costs in memory)."""
        return sum(0 if t is None else t.untyped_storage().nbytes()
                   for t in (self._keys, self._values))

    def update(self, keys: Tensor, values: Tensor,
               positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # positions are kept only while every token's is known
        track = positions is not None and (self._len == 0 or self._positions is not None)
        if self._keys is None:
            self._keys, self._values, self._len = keys, values, keys.shape[2]
            self._positions = positions if track else None
            return keys, values
        if torch.is_grad_enabled() and (keys.requires_grad or self._keys.requires_grad):
            self._positions = torch.cat([self.positions, positions], dim=1) if track else None
            self._keys = torch.cat([self.keys, keys], dim=2)
            self._values = torch.cat([self.values, values], dim=2)
            self._len = self._keys.shape[2]
            return self.keys, self.values
        start, end = self._len, self._len + keys.shape[2]
        if not track:
            self._positions = None
        if end > self._keys.shape[2] or self._keys.requires_grad:
            self.regrow(end)
        self._keys[:, :, start:end] = keys
        self._values[:, :, start:end] = values
        if track:
            self._positions[:, start:end] = positions
        self._len = end
        return self.keys, self.values

    def drop_oldest(self, n: int) -> None:
        """Forget the `n` oldest tokens (generation past the context with slide="roll").
        A view, no copy: the next append that outgrows it copies, doubling as ever."""
        if n <= 0:
            return
        self._keys, self._values = self._keys[:, :, n:], self._values[:, :, n:]
        if self._positions is not None:
            self._positions = self._positions[:, n:]
        self._len -= n

    def capacity_for(self, needed: int) -> int:
        """Tokens of a new buffer for `needed`: doubling, so appends cost O(1) amortized (a
        subclass that holds a window sizes it otherwise)."""
        return max(needed, 2 * self._len, 64)

    def regrow(self, needed: int) -> None:
        """Copy the held tokens into fresh buffers of `capacity_for(needed)` tokens."""
        capacity = self.capacity_for(needed)  # (b, num_kv_heads, capacity, head_dim)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], capacity, old.shape[3])
            new[:, :, : self._len] = old[:, :, : self._len]
            setattr(self, name, new)
        if self._positions is not None:  # (b, capacity)
            old = self._positions
            self._positions = old.new_empty(old.shape[0], capacity)
            self._positions[:, : self._len] = old[:, : self._len]
