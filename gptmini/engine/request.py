"""One request: how it samples (`SamplingParams`), where it stands (`Request`), and its
text as its tokens come (`Detokenizer`).

Decoding all of a request's tokens again at every step would cost O(length) per token; the
detokenizer's incremental UTF-8 decoder costs O(1). It keeps the bytes of a character split
over tokens until the character is whole, so the text only ever grows (a stream can send
it as it is), and once finished it equals `tokenizer.decode(tokens)`, replacement
characters for invalid bytes included. A stop string can only appear where the new text
is, so only the last `len(stop) - 1` old characters are searched again.
"""

import codecs
import queue
from dataclasses import dataclass, field

import torch

from gptmini.generation import _check_sampling


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates (the names of `generate()`'s arguments)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    """0: greedy."""
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    """Seeds the request's own generator: the same text whatever else is batched in
    float64; in float32/bfloat16 other requests in the batch can move the logits' last bits
    and so flip a draw near a tie (see the README)."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end the request (not included in its output)."""
    stop: tuple[str, ...] = ()
    """Strings that end the request (its text is cut before them; needs a tokenizer)."""

    def check(self) -> None:
        _check_sampling(self.temperature, self.top_k, self.top_p)
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {n!r}")


class Detokenizer:
    """The text of one request's tokens, cut before the first of `stops` that appears."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.text, self.stopped = "", False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._overlap = max(map(len, stops), default=1) - 1

    def add(self, token: int) -> bool:
        """Append `token`'s text; True when that completed a stop string."""
        return self._extend(self._decoder.decode(
            self.tokenizer.decode_single_token_bytes(token)))

    def finish(self) -> None:
        """Decode the bytes still waiting, as replacement characters (the request ended)."""
        self._extend(self._decoder.decode(b"", final=True))

    def _extend(self, piece: str) -> bool:
        if self.stopped or not piece:
            return self.stopped
        start = max(0, len(self.text) - self._overlap)
        self.text += piece
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
        return self.stopped


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
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    table: list[int] = field(default_factory=list)
    """Block ids of the tokens in the cache, in order (-1: dropped behind the window)."""
    names: list[bytes] = field(default_factory=list)
    """Prefix-cache names of its full blocks, in order."""
    start: int = 0
    """Index in prompt + tokens of the first cached token (> 0 once it slides)."""
    num_cached: int = 0
    """Tokens from `start` whose keys and values are in the blocks."""
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
    def all_tokens(self) -> list[int]:
        return self.prompt + self.tokens
