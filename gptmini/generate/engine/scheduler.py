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
    """

    def __init__(self, context_length: int, num_blocks: int, block_size: int, max_batch: int,
                 max_step_tokens: int, window_size: int | None = None,
                 prefix_caching: bool = True):
        self.context, self.block_size, self.max_batch = context_length, block_size, max_batch
        self.max_step_tokens, self.window_size = max_step_tokens, window_size
        self.blocks = BlockAllocator(num_blocks, block_size)
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
            needed = math.ceil(len(tokens) / self.block_size) - len(hits)
            if needed > self.blocks.num_free:
                for block in hits:
                    self.blocks.release(block)
                break  # oldest first: later requests wait their turn
            request.names = request.names[:len(hits)]
            request.num_cached = len(hits) * self.block_size
            adopted = self._adopt_partial(request, tokens)
            if adopted is not None:  # (it takes the place of one block allocated below)
                hits.append(adopted)
                needed -= 1
            request.table = hits + [self.blocks.allocate() for _ in range(needed)]
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

    def _adopt_partial(self, request: Request, tokens: list[int]) -> int | None:
        """After the cached full blocks: the longest partly filled block an ended request
        left (`BlockAllocator.adopt`) that `tokens` continue, its tokens added to
        `request.num_cached`; None when there is none. The last token is always computed."""
        if not self.prefix_caching:
            return None
        size, start = self.block_size, request.num_cached
        parent = request.names[-1] if request.names else None
        for k in range(min(size - 1, len(tokens) - 1 - start), 0, -1):
            block = self.blocks.adopt(partial_hash(parent, tokens[start:start + k]))
            if block is not None:
                request.num_cached += k
                return block
        return None

    def _reserve(self, decoding: list[Request]) -> list[Request]:
        """A slot for every decoding request's newest token, preempting the youngest
        running requests while the pool is short. Returns those still decoding."""
        for request in sorted(decoding, key=lambda r: r.id):
            if request not in self.running:
                continue  # preempted for an older one
            if request.num_cached == len(request.table) * self.block_size:  # all full
                while self.blocks.num_free == 0:
                    self._requeue(max(self.running, key=lambda r: r.id), preempted=True)
                    if request not in self.running:
                        break
                else:
                    request.table.append(self.blocks.allocate())
        return [r for r in decoding if r in self.running]

    def _requeue(self, request: Request, preempted: bool = False) -> None:
        self._release(request)
        self.running.remove(request)
        self.waiting.appendleft(request)
        if preempted:
            request.num_preemptions += 1
            self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        size, partial = self.block_size, None
        full = request.num_cached // size
        if (self.prefix_caching and request.num_cached % size and len(request.names) == full
                and request.table[full] >= 0):  # a partly filled last block: named for adopt
            tokens = request.all_tokens[request.start:][full * size:request.num_cached]
            partial = full
            self.blocks.release_partial(request.table[full], partial_hash(
                request.names[-1] if request.names else None, tokens))
        for i, block in enumerate(request.table):
            if block >= 0 and i != partial:  # -1: dropped behind the window already
                self.blocks.release(block)
        request.table, request.num_cached, request.decoding = [], 0, False

    # --- after a step -----------------------------------------------------------------

    def _drop_blocks_behind_window(self, request: Request) -> None:
        """With a sliding window, the next query (position num_cached) sees keys from
        num_cached + 1 - window_size on: blocks wholly before that go back to the pool,
        leaving a hole (-1) in the table, so a sequence holds about window/block + 1 blocks.
        The holes still count as positions (read from a dummy slot that the window mask
        hides)."""
        if self.window_size is None:
            return
        first_seen = request.num_cached + 1 - self.window_size
        for i in range(max(0, first_seen) // self.block_size):
            if request.table[i] >= 0:
                self.blocks.release(request.table[i])
                request.table[i] = -1

    def _name_full_blocks(self, request: Request) -> None:
        if not self.prefix_caching:
            return
        size, tokens = self.block_size, request.all_tokens[request.start:]
        for i in range(len(request.names), request.num_cached // size):
            parent = request.names[-1] if request.names else None
            name = block_hash(parent, tokens[i * size:(i + 1) * size])
            request.table[i] = self.blocks.register(request.table[i], name)
            request.names.append(name)
