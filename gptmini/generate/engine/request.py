"""One request: its prompt, how it samples (`SamplingParams`, gptmini.generate.sampling), where it
stands in the engine, and its text as its tokens come (a `Detokenizer`)."""

import queue
from dataclasses import dataclass, field

import torch

from gptmini.generate.sampling import Detokenizer, SamplingParams


@dataclass(eq=False)
class Request:
    """One prompt's generation; `tokens` grows as the engine steps."""

    id: int
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    """Generated ids (stop ids excluded)."""
    finish_reason: str | None = None
    """None while running; then "length", "stop", "cancelled" (or `Engine.abort`'s)."""
    logprobs: list = field(default_factory=list)
    """With `params.logprobs` set: one `sampling.TokenLogprobs` per token of `tokens`."""
    stop_id: int | None = None
    """The stop id that ended it (finish_reason "stop"), which `tokens` leaves out."""
    stop_logprobs: tuple | None = None
    """With `params.logprobs` set, the stop id's `TokenLogprobs`: it was drawn too (an RL
    rollout learns when to stop from it)."""
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    tables: list[list[int]] = field(default_factory=list)
    """Its block table in each pool (the `BlockManager`'s to write, block_manager.py): block
    ids of the tokens in the cache, in order (-1: dropped behind the window); none while
    it waits."""
    names: list[bytes] = field(default_factory=list)
    """Prefix-cache names of its full blocks, in order (the `BlockManager`'s)."""
    start: int = 0
    """Index in prompt + tokens of the first cached token (> 0 once it slides)."""
    num_cached: int = 0
    """Tokens from `start` whose keys and values are in the blocks."""
    sampled_at: int = -1
    """The scheduler's step at which it last sampled a token (-1: never): prefills go least
    recently served first."""
    decoding: bool = False
    """Its prompt is computed and it adds one token a step (until preempted or slid)."""
    events: queue.Queue = field(default_factory=queue.Queue, repr=False)
    detokenizer: Detokenizer | None = field(default=None, repr=False)

    @property
    def text(self) -> str:
        """The generated text, when the engine has a tokenizer (cut before a stop string;
        a character split over tokens appears once whole)."""
        return "" if self.detokenizer is None else self.detokenizer.text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def table(self) -> list[int]:
        """Its blocks in the pool of every layer (a local/global model's global layers)."""
        return self.tables[0] if self.tables else []

    @property
    def local_table(self) -> list[int]:
        """With a model of local and global layers, the windowed layers' blocks, as `table`
        (-1: dropped behind the widest local window); empty otherwise."""
        return self.tables[1] if len(self.tables) > 1 else []

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def num_tokens(self) -> int:
        """Tokens from `start` on: what the cache holds once the request is up to date."""
        return len(self.prompt) + len(self.tokens) - self.start

    @property
    def pending(self) -> int:
        """Tokens still to compute: 1 while decoding, more while (re)prefilling."""
        return self.num_tokens - self.num_cached
