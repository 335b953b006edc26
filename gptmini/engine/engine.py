"""Continuous batching: many requests through one model, over a paged KV cache.

Each `step` does what a chapter 4 reader would do by hand for a batch, but with requests
that come and go:

1. take the requests added since the last step (from any thread) and drop cancelled ones;
2. admit waiting requests, oldest first, while the pool has blocks for their prompts,
   reusing the cached blocks of a prefix seen before, and *prefill* each one: run its
   prompt (the part not cached) once, writing its keys and values into its blocks;
3. *decode*: one forward pass over the newest token of every other running request, each
   attending to its own blocks, so a short request leaves the batch as soon as it ends
   and a new one takes its place at the next step;
4. sample every request's next token in one call, each with its own settings and random
   generator, and finish requests that drew a stop token, wrote a stop string or reached
   max_new_tokens.

When a decode step needs a block and none is free, the youngest running request is
*preempted*: its blocks go back (named ones stay cached), it waits at the front of the
queue, and when readmitted its prompt and tokens so far are computed again (the cached
blocks make that cheap). Its generator is kept, so its text is the same as if it had never
been preempted.

Positions are each request's own (the step's attention context counts them from each row's
first real token, as `GPTModel.forward` does for padding). A request that
outgrows `context_length` slides exactly as `generate()` does: from then on each token
recomputes the last `context_length` tokens. Unlike `generate()`, which crops a prompt
that is too long, the engine refuses it: silently dropping the start of a prompt is not
what a server's client asked for.
"""

import itertools
import math
import queue
import threading
from collections import deque
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from gptmini.context import AttentionContext
from gptmini.engine.blocks import BlockAllocator, block_hash
from gptmini.engine.paged import KVPool
from gptmini.engine.request import Request
from gptmini.sampling import Detokenizer, SamplingParams, sample, token_logprobs


class Engine:
    """Generate for many requests at once from one `GPTModel` (see the module docstring).

    Args:
        model: a `GPTModel`; put in eval mode. Its dtype and device are the cache's.
        tokenizer: a tiktoken `Encoding`, needed for stop strings and `Request.text`.
        block_size: tokens per KV block.
        num_blocks: blocks in the pool (all layers together); None: enough for
            `max_batch` requests of `context_length` tokens.
        max_batch: most requests running at once.
        prefix_caching: reuse the blocks of prompts that start the same way.
    """

    def __init__(self, model: nn.Module, tokenizer=None, *, block_size: int = 16,
                 num_blocks: int | None = None, max_batch: int = 32,
                 prefix_caching: bool = True):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.context = model.cfg.context_length
        self.block_size, self.max_batch = block_size, max_batch
        self.blocks_per_sequence = math.ceil(self.context / block_size)
        num_blocks = num_blocks or max_batch * self.blocks_per_sequence
        weight = next(model.parameters())
        self.pool = KVPool(model.cfg, num_blocks, block_size, weight.dtype, weight.device)
        self.blocks = BlockAllocator(num_blocks, block_size)
        self.device, self.prefix_caching = weight.device, prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._incoming: list[Request] = []
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.num_prefilled = 0
        """Prompt tokens computed by prefills (the ones found in the prefix cache are not)."""

    # --- requests in ----------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    **settings) -> Request:
        """Queue a prompt (token ids); safe from any thread. `settings` are
        `SamplingParams` fields, for `params` not given.

        Raises:
            ValueError: an empty prompt, one longer than context_length, ids outside the
                vocabulary, invalid sampling settings, stop strings without a tokenizer,
                or a request the pool could never hold.
        """
        params = params or SamplingParams(**settings)  # checks itself
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty; start it with <|endoftext|> "
                             "(tokenizer.eot_token) to generate from nothing")
        if len(prompt) > self.context:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens but context_length is {self.context}; "
                f"shorten it to at most {self.context} (the engine never crops a prompt)")
        vocab = self.model.cfg.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt ids must be in [0, {vocab}), got "
                             f"{[t for t in prompt if not 0 <= t < vocab][:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer: Engine(model, "
                             "tokenizer, ...)")
        longest = min(len(prompt) + params.max_new_tokens, self.context)
        if math.ceil(longest / self.block_size) > self.blocks.num_blocks:
            raise ValueError(
                f"this request can grow to {longest} tokens, more than the whole KV pool "
                f"({self.blocks.num_blocks} blocks of {self.block_size}); raise num_blocks "
                "or lower max_new_tokens")
        request = Request(next(self._ids), prompt, params)
        if self.tokenizer is not None:
            request.detokenizer = Detokenizer(self.tokenizer, params.stop)
        request.generator = params.generator(self.device)
        if params.max_new_tokens == 0:
            self._finish(request, "length")
            return request
        with self._lock:
            self._incoming.append(request)
        return request

    def cancel(self, request: Request | int) -> None:
        """Stop a request at the next step; its blocks go back to the pool. Any thread."""
        with self._lock:
            self._cancelled.add(request if isinstance(request, int) else request.id)

    def abort(self, reason: str = "error") -> list[Request]:
        """Finish every request, queued or running, with `reason`; their blocks go back.
        After a failed step the server fails what was in flight and goes on. Call it from
        the thread that steps the engine."""
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
        aborted = [*self.running, *self.waiting]
        for request in aborted:
            self._finish(request, reason)
        return aborted

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._incoming)

    # --- one step -------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        """Admit, prefill, decode and sample once (see the module docstring)."""
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            cancelled, self._cancelled = self._cancelled, set()
        for request in [*self.waiting, *self.running]:
            if request.id in cancelled:
                self._finish(request, "cancelled")
        sliding = [r for r in self.running if len(r.all_tokens) > self.context]
        for request in sliding:  # past the context: recompute the last context_length
            self._release(request)
            self.running.remove(request)
            self.waiting.appendleft(request)
        fresh = self._admit()
        decoding = [r for r in self.running if r not in fresh]
        decoding = self._reserve(decoding)
        rows = [r for r in fresh if r in self.running]  # not preempted by an older one
        logits = [self._prefill(request) for request in rows]
        if decoding:
            rows += decoding
            logits.append(self._decode(decoding))  # (b, vocab_size)
        if rows:  # one call samples the step, each row with its settings and generator
            logits = torch.cat(logits)
            tokens = sample(logits, [r.params for r in rows], [r.generator for r in rows])
            found = self._logprobs(rows, logits, tokens)
            for i, (request, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
                self._accept(request, token, found.get(i))

    def _admit(self) -> list[Request]:
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            tokens = request.all_tokens[-self.context:]
            request.start = len(request.all_tokens) - len(tokens)
            hits = self._cached_prefix(request, tokens)
            needed = math.ceil(len(tokens) / self.block_size) - len(hits)
            if needed > self.blocks.num_free:
                for block in hits:
                    self.blocks.release(block)
                break  # oldest first: later requests wait their turn
            request.table = hits + [self.blocks.allocate() for _ in range(needed)]
            request.names = request.names[:len(hits)]
            request.num_cached = len(hits) * self.block_size
            self.waiting.popleft()
            self.running.append(request)
            admitted.append(request)
        return admitted

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

    def _reserve(self, decoding: list[Request]) -> list[Request]:
        """A slot for every decoding request's newest token, preempting the youngest
        running requests while the pool is short. Returns those still decoding."""
        for request in sorted(decoding, key=lambda r: r.id):
            if request not in self.running:
                continue  # preempted for an older one
            if request.num_cached == len(request.table) * self.block_size:  # all full
                while self.blocks.num_free == 0:
                    self._preempt(max(self.running, key=lambda r: r.id))
                    if request not in self.running:
                        break
                else:
                    request.table.append(self.blocks.allocate())
        return [r for r in decoding if r in self.running]

    def _preempt(self, request: Request) -> None:
        self._release(request)
        self.running.remove(request)
        self.waiting.appendleft(request)
        request.num_preemptions += 1
        self.num_preemptions += 1

    # --- the model ------------------------------------------------------------------

    def _prefill(self, request: Request) -> Tensor:
        tokens = request.all_tokens[request.start:]
        begin, end = request.num_cached, len(tokens)
        read = torch.tensor([self.pool.slots(request.table, 0, end)], device=self.device)
        write = read[:, begin:]
        ids = torch.tensor([tokens[begin:]], device=self.device)
        context = self._context(1, end - begin, begin)
        logits = self.model(ids, kv_caches=self.pool.views(read, write), context=context,
                            logits_to_keep=1)
        request.num_cached = end
        self.num_prefilled += end - begin
        self._name_full_blocks(request, tokens)
        self._drop_blocks_behind_window(request)
        return logits[:, -1].float()

    def _decode(self, batch: list[Request]) -> Tensor:
        longest = max(r.num_cached + 1 for r in batch)
        read, mask, write, ids = [], [], [], []
        for request in batch:
            n = request.num_cached + 1
            slots = self.pool.slots(request.table, 0, n)
            read.append([0] * (longest - n) + slots)
            mask.append([0] * (longest - n) + [1] * n)
            write.append(slots[-1:])
            ids.append(request.all_tokens[-1:])
        read, write = (torch.tensor(x, device=self.device) for x in (read, write))
        mask, ids = (torch.tensor(x, device=self.device) for x in (mask, ids))
        context = self._context(len(batch), 1, longest - 1, attention_mask=mask)
        logits = self.model(ids, kv_caches=self.pool.views(read, write), context=context,
                            logits_to_keep=1)
        for request in batch:
            request.num_cached += 1
            self._name_full_blocks(request, request.all_tokens[request.start:])
            self._drop_blocks_behind_window(request)
        return logits[:, -1].float()

    def _context(self, batch: int, num_tokens: int, num_cached: int,
                 attention_mask: Tensor | None = None) -> AttentionContext:
        """The step's attention context: built once, read by every layer."""
        return self.model.new_context(batch, num_tokens, num_cached,
                                      attention_mask=attention_mask, uses_cache=True,
                                      device=self.device)

    def _drop_blocks_behind_window(self, request: Request) -> None:
        """With a sliding window, the next query (position num_cached) sees keys from
        num_cached + 1 - window_size on: blocks wholly before that go back to the pool,
        leaving a hole (-1) in the table, so a sequence holds about window/block + 1 blocks.
        The holes still count as positions (read from a dummy slot that the window mask
        hides)."""
        window = self.model.cfg.window_size
        if window is None:
            return
        first_seen = request.num_cached + 1 - window
        for i in range(max(0, first_seen) // self.block_size):
            if request.table[i] >= 0:
                self.blocks.release(request.table[i])
                request.table[i] = -1

    def _name_full_blocks(self, request: Request, tokens: list[int]) -> None:
        if not self.prefix_caching:
            return
        size = self.block_size
        for i in range(len(request.names), request.num_cached // size):
            parent = request.names[-1] if request.names else None
            name = block_hash(parent, tokens[i * size:(i + 1) * size])
            request.table[i] = self.blocks.register(request.table[i], name)
            request.names.append(name)

    # --- tokens out -----------------------------------------------------------------

    @staticmethod
    def _logprobs(rows: list[Request], logits: Tensor, tokens: Tensor) -> dict:
        """{row: TokenLogprobs} for the rows whose requests asked for logprobs."""
        asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not asking:
            return {}
        found = token_logprobs(logits[asking], tokens[asking],
                               [rows[i].params.logprobs for i in asking])
        return dict(zip(asking, found, strict=True))

    def _accept(self, request: Request, token: int, logprobs=None) -> None:
        p = request.params
        if token in p.stop_ids:
            self._finish(request, "stop")
            return
        if logprobs is not None:
            request.logprobs.append(logprobs)
        request.tokens.append(token)
        reason = "length" if len(request.tokens) >= p.max_new_tokens else None
        if request.detokenizer is not None and request.detokenizer.add(token):
            reason = "stop"
        request.events.put(token)
        if reason:
            self._finish(request, reason)

    def _release(self, request: Request) -> None:
        for block in request.table:
            if block >= 0:  # -1: dropped behind the window already
                self.blocks.release(block)
        request.table, request.num_cached = [], 0

    def _finish(self, request: Request, reason: str) -> None:
        self._release(request)
        for where in (self.running, self.waiting):
            if request in where:
                where.remove(request)
        if request.detokenizer is not None:
            request.detokenizer.finish()
        request.finish_reason = reason
        request.events.put(None)

    # --- whole runs -----------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None,
                 **settings) -> list[Request]:
        """Run `prompts` to the end, batched; the finished requests, in order."""
        requests = [self.add_request(p, params, **settings) for p in prompts]
        while not all(r.done for r in requests):
            self.step()
        return requests

    def stream(self, request: Request) -> Iterator[int]:
        """Yield `request`'s tokens as they come, stepping the engine while it waits (from
        the thread that steps the engine; another thread may step it instead)."""
        while True:
            try:
                token = request.events.get_nowait()
            except queue.Empty:
                self.step()
                continue
            if token is None:
                return
            yield token
