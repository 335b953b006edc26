"""The paged KV cache's memory: one pool of blocks per layer, read through slot tables.

`KVPool` holds, for every layer, keys and values for `num_blocks * block_size` token
slots (and each slot's position); slot `block * block_size + i` is token `i` of that
block. A step sees the pool through one `PagedView` per layer, a KV cache as attention
knows them (`gptmini.attention.BaseKVCache`): `update` writes the step's new tokens' keys,
values and positions into their slots (the new tokens of every sequence, packed in one
row), then reads back every key the step attends to, gathered by slot into one row per
sequence, left-padded to the longest (the padding reads slot 0 and is hidden by the
step's mask; see `gptmini.context.Ragged`).
"""

import torch
from torch import Tensor

from gptmini.attention import BaseKVCache


class KVPool:
    """Keys and values of every block, per layer: (num_slots, num_kv_heads, head_dim)."""

    def __init__(self, cfg, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        kv_heads = cfg.n_kv_heads or cfg.n_heads
        shape = (cfg.n_layers, num_blocks * block_size, kv_heads, cfg.emb_dim // cfg.n_heads)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.zeros(shape[1], dtype=torch.long, device=device)  # per slot
        self.block_size = block_size

    @property
    def bytes_per_block(self) -> int:
        per_slot = self.keys[0, 0].numel() * self.keys.element_size() * 2  # keys and values
        return per_slot * self.block_size * self.keys.shape[0]

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """The slots of tokens start ... end - 1 of a sequence whose blocks are `table`
        (a dropped block, -1, reads block 0: a dummy the window mask hides)."""
        size = self.block_size
        return [max(table[i // size], 0) * size + i % size for i in range(start, end)]

    def views(self, read: Tensor, write: Tensor, num_cached: int) -> list["PagedView"]:
        """One view per layer for a step that writes slots `write` (1, num_new) and then
        attends over slots `read` (num_seqs, num_keys), of which the last `num_keys -
        num_cached` of the longest rows are new."""
        return [PagedView(self.keys[i], self.values[i], self.positions, read, write,
                          num_cached, writes_positions=i == 0)  # the same for every layer
                for i in range(self.keys.shape[0])]


class PagedView(BaseKVCache):
    """One layer of the pool as one step's KV cache (see `gptmini.attention.BaseKVCache`)."""

    def __init__(self, keys: Tensor, values: Tensor, positions: Tensor, read: Tensor,
                 write: Tensor, num_cached: int, writes_positions: bool = True):
        self.keys, self.values, self.read, self.write = keys, values, read, write
        self._slot_positions = positions  # (num_slots,), shared by every layer's view
        self._writes_positions, self._num_cached = writes_positions, num_cached

    def __len__(self) -> int:
        """Keys before the new ones in the step's padded rows (`Ragged.context`'s)."""
        return self._num_cached

    @property
    def positions(self) -> Tensor:
        """(num_seqs, num_keys): the positions of the keys this step reads (padding reads
        slot 0)."""
        return self._slot_positions[self.read]

    def update(self, keys: Tensor, values: Tensor,
               positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # (b, kv_heads, num_new, head_dim) -> (b * num_new, kv_heads, head_dim) into slots
        write = self.write.flatten()
        self.keys.index_copy_(0, write, keys.transpose(1, 2).flatten(0, 1).to(self.keys.dtype))
        self.values.index_copy_(0, write,
                                values.transpose(1, 2).flatten(0, 1).to(self.values.dtype))
        if positions is not None and self._writes_positions:
            self._slot_positions[write] = positions.flatten()
        # gathered (num_seqs, num_keys, kv_heads, head_dim) -> (.., kv_heads, num_keys, ..);
        # index_select: 1.6-2.5x faster than indexing with the (num_seqs, num_keys) tensor
        # on a CPU (bench/bench_paged.py)
        shape = (*self.read.shape, *self.keys.shape[1:])
        read = self.read.flatten()
        return (self.keys.index_select(0, read).view(shape).transpose(1, 2),
                self.values.index_select(0, read).view(shape).transpose(1, 2))
