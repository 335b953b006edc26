"""Sampling, in one place: the settings (`SamplingParams`), the sampler (`sample`), and the
text of tokens as they come (`Detokenizer`, and `held_back`: what of it a stream may send);
a refused setting, or prompt, raises a `RequestError` naming its field.

`generate()`, `generate_stream()`, the engine, the server and the command line all build
one `SamplingParams`, which checks itself, and draw with `sample`, which takes a batch of
last-position logits with per-row settings and generators and returns one token per row.

Rows that share a setting are filtered together with the very tensor operations a single
row would get, and rows that share a generator draw in one call, so a row's token depends
only on its own logits, settings and generator, never on which rows sit beside it.
"""

import codecs
import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

__all__ = ["MAX_LOGPROBS", "SEED_RANGE", "Detokenizer", "RequestError", "SamplingError",
           "SamplingParams", "TokenLogprobs", "held_back", "json_type", "sample",
           "sample_next_token", "seeded_generator", "token_logprobs", "torch_seed"]

MAX_LOGPROBS = 20
"""Most candidates per token `SamplingParams.logprobs` may ask (OpenAI's limit)."""
SEED_RANGE = (-2**63, 2**64)
"""OpenAI's seed is a 64-bit integer; either signedness is taken."""
TORCH_SEEDS = 2**32
"""torch's CPU generator (a Mersenne Twister) starts from 32 bits of what manual_seed is
given and drops the rest, so seeds 1 and 2**32 + 1 would draw the same stream."""


def torch_seed(seed: int) -> int:
    """What to hand `torch.Generator.manual_seed` for `seed`, any integer of SEED_RANGE, so
    that every bit of it counts: a seed in [0, 2**32) as it is (the streams it always
    gave), any other hashed (BLAKE2b) to 64 bits, whose low 32, all the CPU keeps, depend
    on every bit of the seed. Two distinct seeds then share a CPU stream only by a 1 in
    2**32 chance, as two hashed ones do on the server."""
    if 0 <= seed < TORCH_SEEDS:
        return seed
    digest = hashlib.blake2b(str(seed).encode(), digest_size=8, person=b"gptmini-seed")
    return int.from_bytes(digest.digest(), "little")


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator on `device` whose stream is `seed`'s (see `torch_seed`): the one
    way generate.py, the engine, `generate()` and the server seed their draws."""
    return torch.Generator(device=device).manual_seed(torch_seed(seed))


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled; checked when built (SamplingError naming the field).

    The names are `generate()`'s arguments. Every reader of settings builds this object from
    names and plain values (the engine's `add_request(**settings)`, the server's request
    fields, `--batch_file` records), so a new field is taken by all of them: sequences may
    come as lists (JSON arrays) or None and are kept as tuples; `stop` also takes one string.
    """

    max_new_tokens: int = 64
    """Most tokens to add."""
    temperature: float = 0.0
    """0: greedy (argmax, no random draw); > 0 divides the logits before sampling."""
    top_k: int | None = None
    """Sample among the k most likely tokens (ties with the k-th kept, as in the book)."""
    top_p: float | None = None
    """Sample from the smallest set of most likely tokens holding this much probability."""
    seed: int | None = None
    """Seeds the sequence's own generator: the same text whatever else is batched in
    float64; in float32/bfloat16 other rows in the batch can move the logits' last bits
    and so flip a draw near a tie (see docs/inference.md)."""
    stop_ids: tuple[int, ...] = ()
    """Token ids that end the sequence (not included in its output)."""
    stop: tuple[str, ...] = ()
    """Strings that end the sequence (its text is cut before them; needs a tokenizer)."""
    logprobs: int | None = None
    """Also report, for every generated token, its log-probability and the `logprobs` most
    likely tokens' (0 to 20; None: none), from the model's distribution at temperature 1
    before top-k and top-p (what the model thinks, not what the filters left)."""

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for f in fields(self):  # lists (JSON arrays) kept as tuples, None (null) as none
            value = getattr(self, f.name)
            if isinstance(f.default, tuple) and (value is None or isinstance(value, list)):
                object.__setattr__(self, f.name, tuple(value or ()))
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise SamplingError(
                "temperature", f"temperature must be a number, any finite number >= 0, "
                f"{_got(t)}; use 0 for greedy decoding or a positive value such as 0.8 to "
                "sample")
        k = self.top_k
        if k is not None and (not _is_integer(k) or k < 1):
            raise SamplingError(
                "top_k", f"top_k must be an integer >= 1, {_got(k)}; use e.g. 50 to sample "
                "among the 50 most likely tokens, or None to turn top-k off")
        p = self.top_p
        if p is not None and (not _is_number(p) or not 0.0 < p <= 1.0):
            raise SamplingError(
                "top_p", f"top_p must be a number in (0, 1], {_got(p)}; use e.g. 0.9 to sample "
                "from the smallest set of tokens holding 90% of the probability, or None to "
                "turn it off")
        n = self.max_new_tokens
        if not _is_integer(n) or n < 0:
            raise SamplingError("max_new_tokens",
                                f"max_new_tokens must be an integer >= 0, {_got(n)}")
        s = self.seed
        if s is not None and (not _is_integer(s)
                              or not SEED_RANGE[0] <= s < SEED_RANGE[1]):  # manual_seed's
            raise SamplingError("seed", f"seed must be an integer of 64 bits (in [-2**63, "
                                f"2**64)), {_got(s)}; any smaller integer, e.g. seed % 2**63, "
                                "seeds as well")
        if not isinstance(self.stop_ids, tuple) or not all(map(_is_integer, self.stop_ids)):
            raise SamplingError("stop_ids", f"stop_ids must be a tuple of token ids, "
                                f"{_got(self.stop_ids)}")
        n = self.logprobs
        if n is not None and (not _is_integer(n) or not 0 <= n <= MAX_LOGPROBS):
            raise SamplingError("logprobs", f"logprobs must be an integer in 0..{MAX_LOGPROBS}, "
                                f"{_got(n)}; it asks that many candidates per generated token")
        if not isinstance(self.stop, tuple) or not all(isinstance(x, str) and x
                                                       for x in self.stop):
            raise SamplingError("stop", f"stop must be non-empty strings: one, or a tuple (a "
                                f"JSON array) of them, {_got(self.stop)}")

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A fresh generator of `seed`'s stream (`seeded_generator`), or None (torch's
        global one) without."""
        if self.seed is None:
            return None
        return seeded_generator(self.seed, device)


class RequestError(ValueError):
    """A generation request's input refused: `field` names it (a `SamplingParams` field, or
    "prompt"), so a caller with its own names for the inputs (the server's `max_tokens`)
    can blame the right one (`message_for`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def message_for(self, name: str) -> str:
        """The message with the field called `name` wherever it names it."""
        return re.sub(rf"\b{re.escape(self.field)}\b", lambda _: name, str(self))


class SamplingError(RequestError):
    """A sampling setting out of range; `field` names it (the server answers 400 with it)."""


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_integer(value) or isinstance(value, float)


def _got(value: Any) -> str:
    """The value and its JSON type, for messages read by Python and JSON callers alike."""
    return f"got {value!r} ({json_type(value)})"


def sample(logits: Tensor, params: SamplingParams | Sequence[SamplingParams],
           generators: torch.Generator | None | Sequence[torch.Generator | None] = None
           ) -> Tensor:
    """One token per row of `logits`, each row with its own settings and generator.

    Args:
        logits: (b, vocab_size) logits of each row's last position (any float dtype;
            probabilities are computed in float32).
        params: one SamplingParams for every row, or one per row.
        generators: one generator for every row (None: torch's global one), or one per row.
            Rows sharing a generator draw in one call, in row order.

    Returns:
        (b,) token ids.
    """
    b = logits.shape[0]
    rows = [params] * b if isinstance(params, SamplingParams) else list(params)
    gens = list(generators) if isinstance(generators, list | tuple) else [generators] * b
    if len(rows) != b or len(gens) != b:
        raise ValueError(f"sample got {b} rows of logits but {len(rows)} settings and "
                         f"{len(gens)} generators; pass one for every row or one for all")
    logits = logits.float()  # probabilities in float32, whatever the model computed in
    top_ks = _groups(r.top_k for r in rows)
    if any(k is not None for k, _ in top_ks):
        logits = logits.clone()  # top-k writes into it: never into the caller's logits
    for k, where in top_ks:
        if k is not None:
            part = logits[where]
            kth = torch.topk(part, min(k, part.shape[-1]), dim=-1).values[:, -1:]  # (n, 1)
            logits[where] = part.masked_fill(part < kth, -torch.inf)
    # greedy rows draw no random numbers; max's indices are argmax's (the first maximum),
    # 2-3x faster on a CPU over a 50k vocabulary
    tokens = logits.max(dim=-1).indices
    drawn = [i for i, r in enumerate(rows) if r.temperature != 0.0]
    if not drawn:
        return tokens
    probs = torch.empty_like(logits)
    for (t, p), where in _groups((r.temperature, r.top_p) for r in rows):
        if t == 0.0:
            continue
        part = logits[where] / t
        if p is not None and p < 1.0:
            part = _top_p_filter(part, p)
        probs[where] = torch.softmax(part, dim=-1)
    for _, where in _groups((id(g) for g in gens), among=drawn):
        generator = gens[where[0]]
        tokens[where] = torch.multinomial(probs[where], num_samples=1,
                                          generator=generator).squeeze(-1)
    return tokens


TokenLogprobs = tuple[float, list[tuple[int, float]]]
"""A generated token's log-probability and the top candidates' (token id, log-probability)."""


def token_logprobs(logits: Tensor, tokens: Tensor, counts: Sequence[int]
                   ) -> list[TokenLogprobs]:
    """Each row's drawn token's log-probability and its `counts[i]` most likely tokens',
    under the row's logits at temperature 1 (float32), most likely first.

    Args:
        logits: (b, vocab_size) the logits the tokens were drawn from (unfiltered).
        tokens: (b,) the drawn tokens.
        counts: candidates wanted per row (0 to vocab_size).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens[:, None].long())[:, 0].tolist()
    top = torch.topk(logp, max(counts, default=0), dim=-1)
    ids, values = top.indices.tolist(), top.values.tolist()
    return [(chosen[i], list(zip(ids[i][:n], values[i][:n], strict=True)))
            for i, n in enumerate(counts)]


def _groups(keys, among: Sequence[int] | None = None) -> list[tuple[object, list[int]]]:
    """Row indices grouped by key, in order of first appearance."""
    groups: dict = {}
    keys = list(keys)
    for i in range(len(keys)) if among is None else among:
        groups.setdefault(keys[i], []).append(i)
    return list(groups.items())


def _top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # A token is dropped when the tokens ranked above it already hold top_p of the mass,
    # so the most likely token always survives.
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_next_token(
    logits: Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Pick the next token of every row with the same settings: `sample` for one setting.

    Temperature 0 is greedy (argmax) and draws no random numbers. Otherwise the logits are
    filtered by top-k, divided by `temperature`, filtered by top-p (nucleus), and one token
    is drawn per row.

    Args:
        logits: (b, vocab_size) logits of the last position.
        temperature, top_k, top_p: as in `SamplingParams`.
        generator: random source for the draw; None uses torch's global generator.

    Returns:
        (b,) token ids.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    return sample(logits, params, generator)


class Detokenizer:
    """The text of one sequence's tokens as they come, cut before the first of `stops`.

    Decoding all tokens again at every step would cost O(length) per token; the
    incremental UTF-8 decoder costs O(1). It keeps the bytes of a character split over
    tokens until the character is whole, so the text only ever grows (a stream can send it
    as it is), and once finished it equals `tokenizer.decode(tokens)`, replacement
    characters for invalid bytes included. A stop string can only appear where the new
    text is, so only the last `len(stop) - 1` old characters are searched again.
    """

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
        """Decode the bytes still waiting, as replacement characters (the sequence ended)."""
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


def held_back(text: str, stops: tuple[str, ...], final: bool) -> int:
    """Characters at the end of `text` a stream must not send yet: the start of a stop
    string that the next tokens may complete, none once the sequence is over (`final`).
    (A Detokenizer's text never ends in half a character: it keeps a character's bytes
    until it is whole.)"""
    if final:
        return 0
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
               default=0)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list | tuple) else "an object"
