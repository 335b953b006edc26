"""The model runner: a scheduled step turned into tensors, and the model run once over it.

For the chunks of a step (gptmini.generate.engine.scheduler) it builds, once:

    ids         (1, num_new) the new tokens of every chunk, packed one after another
    positions   (1, num_new) each new token's position in its sequence
    read        (num_seqs, num_keys) the slots of every key each sequence attends to,
                left-padded (see `PackedRow`, packed.py)
    write       (1, num_new) the slots the new tokens' keys and values go to
    keep        the packed index of the last token of every chunk that samples

and one attention context holding the positions and the packed layout, then runs the model
once over the packed row, every layer reading and writing the pool through its view, and
returns the logits of the kept tokens.

A model of local and global layers (GPTConfig.layer_windows with a global layer) has two
pools: `pool` for the global layers, read through each request's `table`, and `local_pool`
for the windowed ones, read through its `local_table`, whose blocks behind the widest local
window are gone (-1: such a key reads a slot of block 0, which the window hides).
"""

import torch
from torch import Tensor, nn

from gptmini.generate.engine.packed import PackedRow
from gptmini.generate.engine.paged import KVPool
from gptmini.generate.engine.scheduler import Chunk


class ModelRunner:
    """Runs a `GPTModel` over the steps of an engine, its KV cache in `pool` (and, with
    `num_local_blocks`, its windowed layers' in `local_pool`; see the module docstring)."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int,
                 num_local_blocks: int | None = None):
        self.model = model
        weight = next(model.parameters())
        self.device = weight.device
        cfg = model.cfg
        # each layer's pool and its index there: global ones in `pool`, windowed in the other
        local = [num_local_blocks is not None and cfg.window_of(i) is not None
                 for i in range(cfg.n_layers)]
        self.pool = KVPool(cfg, num_blocks, block_size, weight.dtype, weight.device,
                           num_layers=local.count(False))
        self.local_pool = None if num_local_blocks is None else KVPool(
            cfg, num_local_blocks, block_size, weight.dtype, weight.device,
            num_layers=local.count(True))
        self.layers = [(is_local, sum(1 for earlier in local[:i] if earlier == is_local))
                       for i, is_local in enumerate(local)]
        self.block_size = block_size

    def run(self, chunks: list[Chunk]) -> Tensor:
        """The float32 logits (num_sampling_chunks, vocab_size) of the chunks that sample,
        in order, after the model has written every chunk's keys and values."""
        device = self.device
        requests = [c.request for c in chunks]
        num_new = [c.num_new for c in chunks]
        ragged = PackedRow(num_new, [r.num_cached for r in requests],
                           self.model.attention_settings, device=device)
        token = ragged.key_index.clamp(min=0)  # (num_seqs, num_keys), 0 in the padding
        read = self._slots([r.table for r in requests], token, ragged.key_index < 0)
        write = ragged.new_of(read)[None]  # (1, total_new)
        positions = ragged.new_of(token)[None]  # counted from the request's start
        ids = torch.tensor([[t for r, c in zip(requests, chunks, strict=True)
                             for t in r.all_tokens[r.start + r.num_cached:][:c.num_new]]],
                           device=device)
        ends = torch.tensor(num_new, device=device).cumsum(0) - 1  # each chunk's last token
        keep = ends[torch.tensor([i for i, c in enumerate(chunks) if c.samples],
                                 dtype=torch.long, device=device)]
        context = self.model.new_context(1, ids.shape[1], positions=positions,
                                         uses_cache=True, ragged=ragged, device=device)
        num_cached = ragged.num_keys - ragged.longest_new
        views = self.pool.views(read, write, num_cached)
        if self.local_pool is not None:
            local_read = self._slots([r.local_table for r in requests], token,
                                     ragged.key_index < 0)
            local_views = self.local_pool.views(local_read, ragged.new_of(local_read)[None],
                                                num_cached)
            views = [(local_views if is_local else views)[i] for is_local, i in self.layers]
        logits = self.model(ids, kv_caches=views, context=context, logits_to_keep=keep)
        return logits[0].float()

    def _slots(self, tables: list[list[int]], token: Tensor, padding: Tensor) -> Tensor:
        """(num_seqs, num_keys) the slot of every key `token` (each key's place in its
        sequence) through the sequences' block `tables`; the padding reads slot 0."""
        size, longest = self.block_size, max(len(t) for t in tables)
        blocks = torch.tensor([t + [0] * (longest - len(t)) for t in tables],
                              device=self.device).clamp(min=0)  # -1: block 0
        read = blocks.gather(1, token // size) * size + token % size
        return read.masked_fill(padding, 0)
