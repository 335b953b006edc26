"""The scheduler: which requests run at a step, which wait, which are preempted, and how
many of their tokens are computed, within a token budget and the room the block manager
(block_manager.py) says there is.

A step computes, for every running request, the tokens it still has to compute (a
request's `pending` tokens): one for a request that is decoding, its prompt (or what is
left of it) for one being prefilled. All of them go through the model in one forward pass,
packed together, and no step computes more than `max_step_tokens`: decodes come first (one
token each), then prefills, oldest first, each taking what is left of the budget. A prompt
longer than what is left is prefilled over several steps (chunked prefill), so a long
prompt never stalls the requests decoding beside it for more than one budget's worth of
work.

A request is admitted, oldest first, when the block manager can give it blocks for its
whole prompt (cached prefixes cost none); a decoding request whose blocks are full needs
one more, and when a pool has none the youngest running request is *preempted*: its blocks
go back (named ones stay cached) and it waits at the front of the queue, to compute its
prompt and tokens so far again when readmitted (the cached blocks make that cheap).

A request that outgrows `context_length` slides exactly as `generate()` does: its blocks go
back and it recomputes its last `context_length` tokens, from then on at every token. Such
recomputes are prefills, and prefills go least recently served first (a new prompt before
any request that has sampled, then the one that sampled longest ago): when more requests
slide than one budget can recompute, they take turns instead of the oldest taking the whole
budget at every step while the others wait for them to finish.
"""

from collections import deque
from dataclasses import dataclass

from gptmini.generate.engine.block_manager import BlockManager
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
    """Waiting and running requests over the blocks of `block_manager` (see the module
    docstring).

    Args:
        context_length: the model's; a request never holds more tokens than this.
        block_manager: the pools and every request's block tables.
        max_batch: most requests running at once.
        max_step_tokens: most tokens computed by one step (prefill chunks and decodes).
    """

    def __init__(self, context_length: int, block_manager: BlockManager, max_batch: int,
                 max_step_tokens: int):
        self.context, self.block_manager = context_length, block_manager
        self.max_batch, self.max_step_tokens = max_batch, max_step_tokens
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
            if chunk.samples:
                chunk.request.sampled_at = self.num_steps
            self.block_manager.advance(chunk.request, chunk.num_new)

    def finish(self, request: Request) -> None:
        """Take a request out of the queues and give its blocks back."""
        self._release(request)
        for where in (self.running, self.waiting):
            if request in where:
                where.remove(request)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            request.start = max(0, len(request.all_tokens) - self.context)
            if not self.block_manager.allocate(request):
                break  # oldest first: later requests wait their turn
            self.running.append(self.waiting.popleft())

    def _reserve(self, decoding: list[Request]) -> list[Request]:
        """A slot for every decoding request's newest token, preempting the youngest
        running requests while a pool is short. Returns those still decoding."""
        for request in sorted(decoding, key=lambda r: r.id):
            while request in self.running and not self.block_manager.can_append(request):
                self._requeue(max(self.running, key=lambda r: r.id), preempted=True)
            if request in self.running:
                self.block_manager.append(request)
        return [r for r in decoding if r in self.running]

    def _requeue(self, request: Request, preempted: bool = False) -> None:
        self._release(request)
        self.running.remove(request)
        self.waiting.appendleft(request)
        if preempted:
            request.num_preemptions += 1
            self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        self.block_manager.free(request)
        request.decoding = False  # it computes its tokens again when readmitted
