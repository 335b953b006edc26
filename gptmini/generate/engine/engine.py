"""Continuous batching: many requests through one model, over a paged KV cache.

Each `step` does what a chapter 4 reader would do by hand for a batch, but with requests
that come and go:

1. take the requests added since the last step (from any thread) and drop cancelled ones;
2. *schedule* (gptmini.generate.engine.scheduler): admit waiting requests while the block
   manager (gptmini.generate.engine.block_manager) has blocks for their prompts (reusing
   cached blocks of a prefix seen before), and pick the tokens to compute: the newest
   token of every decoding request, and prompts (or chunks of them, within a per-step
   token budget) of those being prefilled;
3. *run* (gptmini.generate.engine.runner): one forward pass over all those tokens packed in
   one row, each sequence attending to its own blocks, writing their keys and values there;
4. *sample* every request whose tokens are all computed, in one call, each with its own
   settings and random generator, and finish requests that drew a stop token, wrote a stop
   string or reached max_new_tokens; the next step a new request takes a finished one's
   place.

A preempted request keeps its generator, so its text is the same as if it had never been
preempted. Positions are each request's own, counted from its first token (from the first
token kept, once it slides past `context_length` as `generate()` does). Unlike
`generate()`, which crops a prompt that is too long, the engine refuses it: silently
dropping the start of a prompt is not what a server's client asked for.
"""

import itertools
import math
import queue
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from gptmini.generate.engine.block_manager import BlockManager
from gptmini.generate.engine.request import Request
from gptmini.generate.engine.runner import ModelRunner
from gptmini.generate.engine.scheduler import Scheduler
from gptmini.generate.sampling import (
    Detokenizer,
    RequestError,
    SamplingParams,
    sample,
    token_logprobs,
)


class Engine:
    """Generate for many requests at once from one `GPTModel` (see the module docstring).

    Args:
        model: a `GPTModel`; put in eval mode. Its dtype and device are the cache's.
        tokenizer: a tiktoken `Encoding`, needed for stop strings and `Request.text`.
        block_size: tokens per KV block.
        num_blocks: blocks in the pool (all layers together; a local/global model's
            global layers); None: enough for `max_batch` requests of `context_length`
            tokens.
        max_batch: most requests running at once.
        max_step_tokens: most tokens one step computes (decodes first, one token each;
            prefills share what is left, a longer prompt over several steps). None:
            `max(512, context_length)`.
        prefix_caching: reuse the blocks of prompts that start the same way.
        num_local_blocks: with local and global layers (GPTConfig.layer_windows with a
            global layer), the blocks of the windowed layers' own pool, which a request
            holds only behind its window and its prompt while prefilling (see
            gptmini.generate.engine.block_manager). None: `max_batch` windows of
            `local_window / block_size + 1` blocks, and a budget's or a context's worth
            more for the prompts being prefilled, at most `num_blocks`.
    """

    def __init__(self, model: nn.Module, tokenizer=None, *, block_size: int = 16,
                 num_blocks: int | None = None, max_batch: int = 32,
                 max_step_tokens: int | None = None, prefix_caching: bool = True,
                 num_local_blocks: int | None = None):
        unpaged = [i for i, mixer in enumerate(model.mixers) if not mixer.pageable]
        if unpaged:  # the pool's blocks are (num_kv_heads, head_dim) keys and values per slot
            title = model.mixers[unpaged[0]].title
            raise ValueError(
                f"the engine cannot serve {title} layers yet (layers {unpaged}): its paged "
                f"blocks hold per-head keys and values, which a {title} layer does not keep; "
                "generate with generate.py --prompt (no --chat, no --batch-file) or "
                "gptmini.generate.loop.generate")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.context = model.cfg.context_length
        self.block_size, self.max_batch = block_size, max_batch
        num_blocks = num_blocks or max_batch * math.ceil(self.context / block_size)
        if max_step_tokens is None:
            max_step_tokens = max(512, self.context)
        if max_step_tokens < 1 or max_batch < 1:
            raise ValueError(f"max_step_tokens and max_batch must be >= 1, got "
                             f"{max_step_tokens} and {max_batch}")
        local_window = self.local_window(model.cfg)
        if local_window is None and num_local_blocks is not None:
            raise ValueError(
                f"num_local_blocks={num_local_blocks} needs a model of local and global "
                "layers (GPTConfig.layer_windows with both windows and None); this one has "
                "one pool for every layer: leave num_local_blocks None")
        if local_window is not None and num_local_blocks is None:
            most = max(max_step_tokens, self.context)  # prompts being prefilled hold it all
            num_local_blocks = min(num_blocks, max_batch * (
                math.ceil(local_window / block_size) + 1) + math.ceil(most / block_size))
        self.block_manager = BlockManager(
            num_blocks, block_size, window_size=model.cfg.kv_window,
            prefix_caching=prefix_caching, local_window=local_window,
            num_local_blocks=num_local_blocks)
        self.scheduler = Scheduler(self.context, self.block_manager, max_batch, max_step_tokens)
        self.runner = ModelRunner(model, num_blocks, block_size, num_local_blocks)
        self.device = self.runner.device
        self._incoming: list[Request] = []
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.num_prefilled = 0
        """Tokens computed for prompts, and for requests recomputing after a preemption or
        a slide (the ones found in the prefix cache are not)."""

    # the block manager's and the scheduler's state, as the engine's users read it
    blocks = property(lambda self: self.block_manager.blocks)
    pool = property(lambda self: self.runner.pool)
    local_blocks = property(lambda self: self.block_manager.local_blocks)  # None: one pool
    local_pool = property(lambda self: self.runner.local_pool)
    running = property(lambda self: self.scheduler.running)
    waiting = property(lambda self: self.scheduler.waiting)
    num_preemptions = property(lambda self: self.scheduler.num_preemptions)

    @staticmethod
    def local_window(cfg) -> int | None:
        """The widest window of a model of local and global layers, whose windowed layers
        get their own pool; None when every layer shares one (all global, or all
        windowed: then blocks behind the widest window go back, GPTConfig.kv_window)."""
        windows = [cfg.window_of(i) for i in range(cfg.n_layers)]
        local = [w for w in windows if w is not None]
        return max(local) if local and None in windows else None

    @property
    def held_bytes(self) -> int:
        """Bytes of the blocks in use now, in every pool: what the requests' keys and
        values hold (the pools' free blocks are allocated too, and not counted)."""
        held = self.blocks.in_use() * self.pool.bytes_per_block
        if self.local_blocks is not None:
            held += self.local_blocks.in_use() * self.local_pool.bytes_per_block
        return held

    # --- requests in ----------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    **settings) -> Request:
        """Queue a prompt (token ids); safe from any thread. `settings` are
        `SamplingParams` fields, for `params` not given.

        Raises:
            RequestError: what `check_request` refuses, or invalid sampling settings
                (`SamplingError`); its `field` names the input at fault.
        """
        params = params or SamplingParams(**settings)  # checks itself
        prompt = [int(t) for t in prompt]
        self.check_request(prompt, params)
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

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise the `RequestError` `add_request` would, adding nothing: an empty prompt,
        one longer than context_length (the engine never crops one), ids outside the
        vocabulary, stop strings without a tokenizer, or a request the whole pool could
        never hold. Its `field` names the input at fault ("prompt" or a SamplingParams
        field), so a caller can check every request of a batch before adding any."""
        if not prompt:
            raise RequestError("prompt", "the prompt is empty; start it with <|endoftext|> "
                               "(tokenizer.eot_token) to generate from nothing")
        if len(prompt) > self.context:
            raise RequestError(
                "prompt", f"the prompt has {len(prompt)} tokens but context_length is "
                f"{self.context}; shorten it to at most {self.context} (the engine never "
                "crops a prompt)")
        vocab = self.model.cfg.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise RequestError("prompt", f"prompt ids must be in [0, {vocab}), got "
                               f"{[t for t in prompt if not 0 <= t < vocab][:5]}")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop", "stop strings need the engine's tokenizer: "
                               "Engine(model, tokenizer, ...)")
        longest = min(len(prompt) + params.max_new_tokens, self.context)
        for blocks, name in ((self.blocks, "num_blocks"), (self.local_blocks, "num_local_blocks")):
            # (a preempted request recomputes all its tokens, so it needs them all at once)
            if blocks is not None and math.ceil(longest / self.block_size) > blocks.num_blocks:
                raise RequestError(
                    "max_new_tokens", f"this request can grow to {longest} tokens, more than "
                    f"the whole KV pool ({blocks.num_blocks} blocks of {self.block_size}); "
                    f"lower max_new_tokens or raise {name}")

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
        """Schedule, run the model once, and sample (see the module docstring)."""
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            cancelled, self._cancelled = self._cancelled, set()
        for request in [*self.waiting, *self.running]:
            if request.id in cancelled:
                self._finish(request, "cancelled")
        chunks = self.scheduler.schedule()
        if not chunks:
            return
        self.num_prefilled += sum(c.num_new for c in chunks if not c.request.decoding)
        rows = [c.request for c in chunks if c.samples]
        logits = self.runner.run(chunks)  # (len(rows), vocab_size)
        self.scheduler.computed(chunks)
        if rows:  # one call samples the step, each row with its settings and generator
            tokens = sample(logits, [r.params for r in rows], [r.generator for r in rows])
            found = self._logprobs(rows, logits, tokens)
            for i, (request, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
                request.decoding = True
                self._accept(request, token, found.get(i))

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
            request.stop_id, request.stop_logprobs = token, logprobs
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

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request)
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
