"""The scheduler: which requests run at a step, which wait, which are preempted, and how
many of their tokens are computed, within the blocks of the pool and a token budget.

A step computes, for every running request, the tokens it still has to compute (a
request's `pending` tokens): one for a request that is decoding, its prompt (or what is
left of it) for one being prefilled. All of them go through the model in one forward pass,
packed together, and no step computes more than `max_step_tokens`: decodes come first (one
token each), then prefills, oldest first, each taking what is left of the budget. A prompt
longer than what is left is prefilled over several steps (chunked prefill), so a long
prompt never stalls the requests decoding beside it for more than one budget's worth of
work.

Blocks: a request is admitted when the pool has blocks for its whole prompt (reusing the
cached blocks of a prefix seen before, and adopting the partly filled last block of an
ended request whose tokens it continues: a conversation's next turn computes only its new
tokens); a decoding request whose blocks are full gets one
more, and when none is free the youngest running request is *preempted*: its blocks go back
(named ones stay cached) and it waits at the front of the queue, to compute its prompt and
tokens so far again when readmitted (the cached blocks make that cheap).

A request that outgrows `context_length` slides exactly as `generate()` does: its blocks go
back and it recomputes its last `context_length` tokens, from then on at every token. Such
recomputes are prefills, and prefills go least recently served first (a new prompt before
any request that has sampled, then the one that sampled longest ago): when more requests
slide than one budget can recompute, they take turns instead of the oldest taking the whole
budget at every step while the others wait for them to finish.

Local and global layers (GPTConfig.layer_windows with a global layer among windowed ones):
two pools, as vLLM's hybrid allocator keeps a block table per group of layers. `blocks` and
a request's `table` hold the global layers' keys; `local_blocks` and its `local_table` (the
same length, block i holding the same tokens) the windowed layers', and blocks of the local
table wholly behind the widest local window go back to their pool (-1 in the table), so a
sequence holds about window/block_size + 1 of them however long it grows. Both tables are
allocated together (a prompt's blocks in both at admission, a decode's next block in both),
and a request is preempted when either pool is short. Prefix caching names a block of both
tables by the same hash; a prefix is reused only as far as the local pool still holds the
blocks its window needs (those before it may be gone: they are -1), and a partly filled
last block is adopted only when both pools still have it.
"""

import math
from collections import deque
from dataclasses import dataclass

from gptmini.generate.engine.blocks import BlockAllocator, block_hash, partial_hash
from gptmini.generate.engine.request import Request


@dataclass
class Chunk:
    """`num_new` tokens of one request computed at a step, after its `num_cached`."""

    request: Request
    num_new: int

    @property
    def samples(self) -> bool:
        """The chunk ends the request's pending tokens: its last logits pick a token."""
        return self.request.num_cached + self.num_new == self.request.num_tokens


class Scheduler:
    """Waiting and running requests over one pool of blocks (see the module docstring).

    Args:
        context_length: the model's; a request never holds more tokens than this.
        num_blocks, block_size: the pool.
        max_batch: most requests running at once.
        max_step_tokens: most tokens computed by one step (prefill chunks and decodes).
        window_size: the model's sliding window, or None: blocks wholly behind the window
            go back to the pool as a request moves on.
        prefix_caching: reuse the blocks of prompts that start the same way.
        local_window, num_local_blocks: with both, a second pool of `num_local_blocks` for
            the windowed layers of a local/global model, its blocks behind `local_window`
            (the widest local window) given back (see the module docstring).
    """

    def __init__(self, context_length: int, num_blocks: int, block_size: int, max_batch: int,
                 max_step_tokens: int, window_size: int | None = None,
                 prefix_caching: bool = True, local_window: int | None = None,
                 num_local_blocks: int | None = None):
        if (local_window is None) != (num_local_blocks is None):
            raise ValueError("give local_window and num_local_blocks together (a local "
                             f"pool), or neither; got {local_window} and {num_local_blocks}")
        self.context, self.block_size, self.max_batch = context_length, block_size, max_batch
        self.max_step_tokens, self.window_size = max_step_tokens, window_size
        self.blocks = BlockAllocator(num_blocks, block_size)
        self.local_window = local_window
        self.local_blocks = (None if num_local_blocks is None
                             else BlockAllocator(num_local_blocks, block_size))
        self.prefix_caching = prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_steps = 0

    def schedule(self) -> list[Chunk]:
        """The chunks of this step: decodes first, then prefills within the budget."""
        self.num_steps += 1
        for request in [r for r in self.running if r.num_tokens > self.context]:
            self._requeue(request)  # past the context: recompute the last context_length
        self._admit()
        decoding = self._reserve([r for r in self.running if r.pending == 1])
        chunks = [Chunk(r, 1) for r in decoding]
        budget = self.max_step_tokens - len(chunks)
        for request in sorted(self.running, key=lambda r: (r.sampled_at, r.id)):
            if request.pending > 1 and budget > 0:
                chunks.append(Chunk(request, min(request.pending, budget)))
                budget -= chunks[-1].num_new
        return chunks

    def computed(self, chunks: list[Chunk]) -> None:
        """After the model ran `chunks`: their tokens are in the blocks."""
        for chunk in chunks:
            request = chunk.request
            if chunk.samples:
                request.sampled_at = self.num_steps
            request.num_cached += chunk.num_new
            self._name_full_blocks(request)
            self._drop_blocks_behind_window(request)

    def finish(self, request: Request) -> None:
        """Take a request out of the queues and give its blocks back."""
        self._release(request)
        for where in (self.running, self.waiting):
            if request in where:
                where.remove(request)

    # --- admission and room -----------------------------------------------------------

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            request.start = max(0, len(request.all_tokens) - self.context)
            tokens = request.all_tokens[request.start:]
            hits = self._cached_prefix(request, tokens)
            local_hits = self._local_prefix(request, hits)  # (may shorten hits)
            needed = math.ceil(len(tokens) / self.block_size) - len(hits)
            if self._short(needed):
                self._release_table(self.blocks, hits)
                self._release_table(self.local_blocks, local_hits)
                break  # oldest first: later requests wait their turn
            request.names = request.names[:len(hits)]
            request.num_cached = len(hits) * self.block_size
            adopted = self._adopt_partial(request, tokens)
            if adopted is not None:  # (it takes the place of one block allocated below)
                hits.append(adopted[0])
                local_hits.append(adopted[1])
                needed -= 1
            request.table = hits + [self.blocks.allocate() for _ in range(needed)]
            if self.local_blocks is not None:
                request.local_table = local_hits + [self.local_blocks.allocate()
                                                    for _ in range(needed)]
            self.waiting.popleft()
            self.running.append(request)

    def _cached_prefix(self, request: Request, tokens: list[int]) -> list[int]:
        """Blocks of the longest cached prefix of `tokens` (each now used once more). The
        last token is always computed: its logits pick the next token."""
        hits, names, parent = [], [], None
        if not self.prefix_caching:
            return hits
        size = self.block_size
        for i in range((len(tokens) - 1) // size):
            parent = block_hash(parent, tokens[i * size:(i + 1) * size])
            block = self.blocks.lookup(parent)
            if block is None:
                break
            hits.append(block)
            names.append(parent)
        request.names = names
        return hits

    def _local_prefix(self, request: Request, hits: list[int]) -> list[int]:
        """The local table's start for a prefix of `hits` cached blocks: -1 behind the
        window of the first token to compute, then the local pool's blocks of the same
        names (each now used once more). Where the local pool no longer has them all,
        `hits` is cut back (its blocks released) to the longest prefix it has. Empty
        without a local pool."""
        if self.local_blocks is None:
            return []
        size = self.block_size
        for k in range(len(hits), -1, -1):  # k = 0 always succeeds: nothing to find
            first = max(0, k * size + 1 - self.local_window) // size
            found = []
            for name in request.names[first:k]:
                block = self.local_blocks.lookup(name)
                if block is None:
                    break
                found.append(block)
            if len(found) == k - first:
                self._release_table(self.blocks, hits[k:])
                del hits[k:]
                return [-1] * first + found
            self._release_table(self.local_blocks, found)
        raise AssertionError("unreachable: an empty prefix needs no block")

    def _adopt_partial(self, request: Request, tokens: list[int]
                       ) -> tuple[int, int | None] | None:
        """After the cached full blocks: the longest partly filled block an ended request
        left (`BlockAllocator.adopt`) that `tokens` continue, its tokens added to
        `request.num_cached`, with the local pool's block of the same name (None without a
        local pool); None when there is none (or the local pool no longer has it). The last
        token is always computed."""
        if not self.prefix_caching:
            return None
        size, start = self.block_size, request.num_cached
        parent = request.names[-1] if request.names else None
        for k in range(min(size - 1, len(tokens) - 1 - start), 0, -1):
            name = partial_hash(parent, tokens[start:start + k])
            block = self.blocks.adopt(name)
            if block is None:
                continue
            local = None if self.local_blocks is None else self.local_blocks.adopt(name)
            if self.local_blocks is not None and local is None:
                self.blocks.release(block)  # the windowed layers' half is gone: compute it
                return None
            request.num_cached += k
            return block, local
        return None

    def _short(self, needed: int) -> bool:
        """Fewer than `needed` blocks free in a pool (either, with a local pool)."""
        return needed > self.blocks.num_free or (
            self.local_blocks is not None and needed > self.local_blocks.num_free)

    @staticmethod
    def _release_table(blocks: BlockAllocator | None, table: list[int]) -> None:
        for block in table:
            if block >= 0:  # -1: dropped behind the window already
                blocks.release(block)

    def _reserve(self, decoding: list[Request]) -> list[Request]:
        """A slot for every decoding request's newest token, preempting the youngest
        running requests while the pool is short. Returns those still decoding."""
        for request in sorted(decoding, key=lambda r: r.id):
            if request not in self.running:
                continue  # preempted for an older one
            if request.num_cached == len(request.table) * self.block_size:  # all full
                while self._short(1):
                    self._requeue(max(self.running, key=lambda r: r.id), preempted=True)
                    if request not in self.running:
                        break
                else:
                    request.table.append(self.blocks.allocate())
                    if self.local_blocks is not None:
                        request.local_table.append(self.local_blocks.allocate())
        return [r for r in decoding if r in self.running]

    def _requeue(self, request: Request, preempted: bool = False) -> None:
        self._release(request)
        self.running.remove(request)
        self.waiting.appendleft(request)
        if preempted:
            request.num_preemptions += 1
            self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        size = self.block_size
        full = request.num_cached // size
        tables = [(self.blocks, request.table), (self.local_blocks, request.local_table)]
        for blocks, table in tables[:1 if self.local_blocks is None else 2]:
            if (self.prefix_caching and request.num_cached % size
                    and len(request.names) == full and table[full] >= 0):
                # a partly filled last block: named for adopt (in both pools alike)
                tokens = request.all_tokens[request.start:][full * size:request.num_cached]
                blocks.release_partial(table[full], partial_hash(
                    request.names[-1] if request.names else None, tokens))
                table[full] = -1
            self._release_table(blocks, table)
        request.table, request.local_table = [], []
        request.num_cached, request.decoding = 0, False

    # --- after a step -----------------------------------------------------------------

    def _drop_blocks_behind_window(self, request: Request) -> None:
        """With a sliding window, the next query (position num_cached) sees keys from
        num_cached + 1 - window_size on: blocks wholly before that go back to the pool,
        leaving a hole (-1) in the table, so a sequence holds about window/block + 1 blocks.
        The holes still count as positions (read from a dummy slot that the window mask
        hides)."""
        for blocks, table, window in ((self.blocks, request.table, self.window_size),
                                      (self.local_blocks, request.local_table,
                                       self.local_window)):
            if window is None:
                continue
            first_seen = request.num_cached + 1 - window
            for i in range(max(0, first_seen) // self.block_size):
                if table[i] >= 0:
                    blocks.release(table[i])
                    table[i] = -1

    def _name_full_blocks(self, request: Request) -> None:
        if not self.prefix_caching:
            return
        size, tokens = self.block_size, request.all_tokens[request.start:]
        for i in range(len(request.names), request.num_cached // size):
            parent = request.names[-1] if request.names else None
            name = block_hash(parent, tokens[i * size:(i + 1) * size])
            request.table[i] = self.blocks.register(request.table[i], name)
            if self.local_blocks is not None and request.local_table[i] >= 0:
                request.local_table[i] = self.local_blocks.register(request.local_table[i],
                                                                    name)
            request.names.append(name)
