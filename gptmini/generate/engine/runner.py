"""The model runner: a scheduled step turned into tensors, and the model run once over it.

For the chunks of a step (gptmini.generate.engine.scheduler) it builds, once:

    ids         (1, num_new) the new tokens of every chunk, packed one after another
    positions   (1, num_new) each new token's position in its sequence
    read        (num_seqs, num_keys) the slots of every key each sequence attends to,
                left-padded (see gptmini.attention.context.Ragged)
    write       (1, num_new) the slots the new tokens' keys and values go to
    keep        the packed index of the last token of every chunk that samples

and one attention context holding the positions and the ragged layout, then runs the model
once over the packed row, every layer reading and writing the pool through its view, and
returns the logits of the kept tokens.
"""

import torch
from torch import Tensor, nn

from gptmini.generate.engine.paged import KVPool
from gptmini.generate.engine.scheduler import Chunk


class ModelRunner:
    """Runs a `GPTModel` over the steps of an engine, its KV cache in `pool`."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int):
        self.model = model
        weight = next(model.parameters())
        self.device = weight.device
        self.pool = KVPool(model.cfg, num_blocks, block_size, weight.dtype, weight.device)
        self.block_size = block_size

    def run(self, chunks: list[Chunk]) -> Tensor:
        """The float32 logits (num_sampling_chunks, vocab_size) of the chunks that sample,
        in order, after the model has written every chunk's keys and values."""
        device, size = self.device, self.block_size
        requests = [c.request for c in chunks]
        num_new = [c.num_new for c in chunks]
        ragged = self.model.new_ragged(num_new, [r.num_cached for r in requests],
                                       device=device)
        longest_table = max(len(r.table) for r in requests)
        tables = torch.tensor([r.table + [0] * (longest_table - len(r.table))
                               for r in requests], device=device).clamp(min=0)  # -1: block 0
        token = ragged.key_index.clamp(min=0)  # (num_seqs, num_keys), 0 in the padding
        read = tables.gather(1, token // size) * size + token % size
        read = read.masked_fill(ragged.key_index < 0, 0)  # the padding reads slot 0
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
        views = self.pool.views(read, write, ragged.num_keys - ragged.longest_new)
        logits = self.model(ids, kv_caches=views, context=context, logits_to_keep=keep)
        return logits[0].float()
