"""The paged KV cache's memory: one pool of blocks per layer, read through slot tables.

`KVPool` holds, for every layer (or for the layers of one group: a model of local and
global layers has one pool for each, see gptmini.generate.engine.block_manager), keys and
values for `num_blocks * block_size` token slots (and each slot's position); slot
`block * block_size + i` is token `i` of that block. A step sees the pool through one
`PagedView` per layer, a KV cache as attention knows them (`gptmini.attention.BaseKVCache`):
`update` writes the step's new tokens' keys, values and positions into their slots (the new
tokens of every sequence, packed in one row), then reads back every key the step attends
to, gathered by slot into one row per sequence, left-padded to the longest (the padding
reads slot 0 and is hidden by the step's mask; see `PackedRow`, packed.py),
into a buffer that every layer and step reuses.
Measured on a CPU (bench/bench_paged.py), that gather costs about what attention over it
costs; attending over the whole pool instead, with other sequences' slots masked, costs
10-100x more, so the gather stays.
"""

import torch
from torch import Tensor

from gptmini.attention import BaseKVCache


class KVPool:
    """Keys and values of every block, per layer: (num_slots, num_kv_heads, head_dim), for
    `num_layers` layers (None: all of cfg's)."""

    def __init__(self, cfg, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, num_layers: int | None = None):
        kv_heads = cfg.kv_heads
        num_layers = cfg.n_layers if num_layers is None else num_layers
        shape = (num_layers, num_blocks * block_size, kv_heads, cfg.head_size)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.zeros(shape[1], dtype=torch.long, device=device)  # per slot
        self.block_size = block_size
        # What a layer gathers to attend over, reused by every layer and step: the layers of
        # a step read one after another, and a fresh 30 MB a layer costs more in page faults
        # than the copy itself (bench/bench_paged.py)
        self._gathered = torch.empty(2, 0, *shape[2:], dtype=dtype, device=device)

    def gather(self, layer: int, read: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of `layer` at slots `read` (num_seqs, num_keys), as
        (num_seqs, num_kv_heads, num_keys, head_dim) views of the reused buffer: valid
        until the next call."""
        n, per_slot = read.numel(), self.keys.shape[2:]
        if self._gathered.shape[1] < n:
            self._gathered = self.keys.new_empty(2, n, *per_slot)
        keys, values = self._gathered[0, :n], self._gathered[1, :n]
        flat = read.flatten()
        torch.index_select(self.keys[layer], 0, flat, out=keys)
        torch.index_select(self.values[layer], 0, flat, out=values)
        shape = (*read.shape, *per_slot)
        return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)

    @property
    def bytes_per_block(self) -> int:
        """Keys and values of one block in all of this pool's layers."""
        per_slot = self.keys[0, 0].numel() * self.keys.element_size() * 2  # keys and values
        return per_slot * self.block_size * self.keys.shape[0]

    def views(self, read: Tensor, write: Tensor, num_cached: int) -> list["PagedView"]:
        """One view per layer for a step that writes slots `write` (1, num_new) and then
        attends over slots `read` (num_seqs, num_keys), of which the last `num_keys -
        num_cached` of the longest rows are new."""
        return [PagedView(self, i, read, write, num_cached) for i in range(self.keys.shape[0])]


class PagedView(BaseKVCache):
    """One layer of the pool as one step's KV cache (see `gptmini.attention.BaseKVCache`)."""

    def __init__(self, pool: KVPool, layer: int, read: Tensor, write: Tensor, num_cached: int):
        self.pool, self.layer, self.read, self.write = pool, layer, read, write
        self._num_cached = num_cached

    def __len__(self) -> int:
        """Keys before the new ones in the step's padded rows (`PackedRow.context`'s)."""
        return self._num_cached

    @property
    def positions(self) -> Tensor:
        """(num_seqs, num_keys): the positions of the keys this step reads (padding reads
        slot 0)."""
        return self.pool.positions[self.read]

    def update(self, keys: Tensor, values: Tensor,
               positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # (b, kv_heads, num_new, head_dim) -> (b * num_new, kv_heads, head_dim) into slots
        pool, write = self.pool, self.write.flatten()
        for store, new in ((pool.keys[self.layer], keys), (pool.values[self.layer], values)):
            store.index_copy_(0, write, new.transpose(1, 2).flatten(0, 1).to(store.dtype))
        if positions is not None and self.layer == 0:  # every layer's are the same
            pool.positions[write] = positions.flatten()
        return pool.gather(self.layer, self.read)
