"""The paged KV cache's memory: one pool of blocks per layer, read through slot tables.

`KVPool` holds, for every layer, keys and values for `num_blocks * block_size` token
slots (and each slot's position); slot `block * block_size + i` is token `i` of that
block. A model step sees the pool through one `PagedView` per layer, a KV cache as
attention knows them (`gptmini.attention.BaseKVCache`): `update` writes the new tokens'
keys, values and positions into their slots, then reads back every key the step attends
to, gathered by slot into an ordinary (b, num_kv_heads, num_keys, head_dim) tensor. Rows
of different lengths are left-padded in that gather (the padding reads slot 0 and is
hidden by the attention mask), so the step's context counts each row's positions from its
own first token, exactly as `generate()` does with `left_pad`.
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

    def views(self, read: Tensor, write: Tensor) -> list["PagedView"]:
        """One view per layer for a step that writes slots `write` (b, num_new) and then
        attends over slots `read` (b, num_keys)."""
        return [PagedView(self.keys[i], self.values[i], self.positions, read, write,
                          writes_positions=i == 0)  # every layer's are the same: once a step
                for i in range(self.keys.shape[0])]


class PagedView(BaseKVCache):
    """One layer of the pool as one step's KV cache (see `gptmini.attention.BaseKVCache`)."""

    def __init__(self, keys: Tensor, values: Tensor, positions: Tensor, read: Tensor,
                 write: Tensor, writes_positions: bool = True):
        self.keys, self.values, self.read, self.write = keys, values, read, write
        self._slot_positions = positions  # (num_slots,), shared by every layer's view
        self._writes_positions = writes_positions

    def __len__(self) -> int:
        """Tokens before the new ones (what the model's length check counts)."""
        return self.read.shape[1] - self.write.shape[1]

    @property
    def positions(self) -> Tensor:
        """(b, num_keys): the positions of the keys this step reads (padding reads slot 0)."""
        return self._slot_positions[self.read]

    def update(self, keys: Tensor, values: Tensor,
               positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # (b, kv_heads, num_new, head_dim) -> (b, num_new, kv_heads, head_dim) into slots
        self.keys[self.write] = keys.transpose(1, 2).to(self.keys.dtype)
        self.values[self.write] = values.transpose(1, 2).to(self.values.dtype)
        if positions is not None and self._writes_positions:
            self._slot_positions[self.write] = positions
        # (b, num_keys, kv_heads, head_dim) gathered -> (b, kv_heads, num_keys, head_dim)
        return self.keys[self.read].transpose(1, 2), self.values[self.read].transpose(1, 2)
