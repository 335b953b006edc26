"""The completions request as the server accepts it, a `CompletionRequest`: every field
checked for its JSON type and range before anything runs, so a wrong value is a 400 naming
the field, never a 500, and never read by Python truthiness (`"stream": "false"` is not
`false`, and `"temperature": true` is not 1).

The sampling settings are `SamplingParams`' fields under their own names (OpenAI's
`max_tokens` is the one renamed: `API_NAMES`), checked by SamplingParams itself, so a
field added there is a request field here.
"""

import codecs
import hashlib
from dataclasses import dataclass, fields, replace
from typing import Any

from gptmini.generate.sampling import RequestError, SamplingParams, json_type
from gptmini.tokenizer import token_text

NEUTRAL = {"echo": (None, False), "best_of": (None, 1),
           "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
           "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "user": None,
           "stream_options": None}
"""Fields clients send by default, accepted at their neutral values (None: checked below)."""
API_NAMES = {"max_new_tokens": "max_tokens"}
"""SamplingParams fields OpenAI calls otherwise: the one place the two vocabularies differ,
read both ways (a field's value, and the field an error names)."""
OPENAI_DEFAULTS = {"max_new_tokens": 16, "temperature": 1.0}
"""Where OpenAI's default is not SamplingParams' own."""
SET_BY_SERVER = ("stop_ids",)
"""SamplingParams fields no request sets: every choice stops at <|endoftext|>."""
SAMPLING = {API_NAMES.get(f.name, f.name): f.name for f in fields(SamplingParams)
            if f.name not in SET_BY_SERVER}
"""Request field -> SamplingParams field: every sampling setting, by its API name."""
KNOWN = {"model", "prompt", "n", "stream", "return_token_ids", *SAMPLING, *NEUTRAL}
MAX_STOPS = 4
"""Most stop strings a request may give (OpenAI's limit)."""


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}


def choice_seed(seed: int, i: int) -> int:
    """Choice i of a seeded request draws from (seed, i): the same request, the same texts."""
    digest = hashlib.blake2b(f"{seed},{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _integer(body: dict, name: str, default: int, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise APIError(400, f"{name} must be an integer in {low}..{high}, got {value!r} "
                       f"({json_type(value)})", name)
    return value


def _boolean(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {value!r} "
                       f"({json_type(value)})", name)
    return value


def _neutral(value: Any, neutral: tuple) -> bool:
    """`value` is one of `neutral`, of the same JSON type (0 is not false)."""
    return any(value == n and type(value) is type(n) for n in neutral)


@dataclass(frozen=True)
class CompletionRequest:
    """A /v1/completions body, checked: what the server reads of it, by attribute."""

    prompts: list[str | list[int]]
    """Texts, or token ids, one completion (or n) each."""
    sampling: SamplingParams
    """Every choice's sampling settings; a seeded request's choices draw from their own
    seeds (`choice_sampling`)."""
    n: int = 1
    """Choices per prompt."""
    stream: bool = False
    include_usage: bool = False
    """A stream ends with an event of usage (`stream_options.include_usage`)."""
    return_token_ids: bool = False
    """Each choice carries its token ids (vLLM's `return_token_ids`)."""

    @property
    def num_completions(self) -> int:
        return len(self.prompts) * self.n

    def choice_sampling(self, i: int, stop_ids: tuple[int, ...]) -> SamplingParams:
        """Choice i's settings: seeded from (seed, i) when the request has a seed."""
        seed = self.sampling.seed
        return replace(self.sampling, seed=None if seed is None else choice_seed(seed, i),
                       stop_ids=stop_ids)

    @staticmethod
    def api_name(field: str) -> str:
        """The request field that holds `field` (a SamplingParams field or "prompt")."""
        return API_NAMES.get(field, field)


def refused(err: RequestError) -> APIError:
    """The 400 for a setting or prompt that SamplingParams or the engine refused, naming
    the request's own field (max_tokens, not max_new_tokens), in its message too."""
    name = CompletionRequest.api_name(err.field)
    return APIError(400, err.message_for(name), name)


def parse(body: Any, model_name: str) -> CompletionRequest:
    """The completions body as a CompletionRequest, or an APIError naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise APIError(400, f"unsupported field {unknown[0]!r}", unknown[0])
    for name, neutral in NEUTRAL.items():
        if neutral is not None and name in body and not _neutral(body[name], neutral):
            raise APIError(400, f"{name}={body[name]!r} is not supported; leave it at "
                           f"{neutral[-1]!r}", name)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise APIError(400, f"user must be a string, got {json_type(body['user'])}", "user")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {json_type(model)}", "model")
    if model not in (model_name, None):
        raise APIError(404, f"the model {model!r} does not exist; this server "
                       f"serves {model_name!r}", "model", kind="not_found_error")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, str) or _is_ids(p) for p in prompts):
        raise APIError(400, "prompt must be a string, a list of strings, a list of token "
                       "ids or a list of such lists", "prompt")
    stops = body.get("stop")
    if isinstance(stops, list) and len(stops) > MAX_STOPS:
        raise APIError(400, f"stop must be a non-empty string or a list of up to {MAX_STOPS}",
                       "stop")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object such as {\"include_usage\": "
                       f"true}}, got {json_type(options)}", "stream_options")
    if options and set(options) - {"include_usage"}:
        raise APIError(400, f"stream_options: unsupported field "
                       f"{sorted(set(options) - {'include_usage'})[0]!r}", "stream_options")
    settings = {**OPENAI_DEFAULTS, **{field: body[name] for name, field in SAMPLING.items()
                                      if body.get(name) is not None}}  # null: the default
    try:
        sampling = SamplingParams(**settings)
    except RequestError as err:
        raise refused(err) from None
    return CompletionRequest(
        prompts, sampling, n=_integer(body, "n", 1, 1, 16),
        stream=_boolean(body.get("stream"), "stream"),
        include_usage=_boolean((options or {}).get("include_usage"),
                               "stream_options.include_usage"),
        return_token_ids=_boolean(body.get("return_token_ids"), "return_token_ids"))


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


class LogprobsWriter:
    """OpenAI's `logprobs` object of one choice, a few tokens at a time (a stream's chunks):
    `tokens`, `token_logprobs`, `top_logprobs` (the top N and the chosen token, so up to
    N + 1 names) and `text_offset` (characters before each token, the prompt's included)."""

    def __init__(self, enc, prompt_chars: int):
        self.enc, self.offset = enc, prompt_chars
        self._chars = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, tokens: list[int], entries: list) -> dict:
        """The object for `tokens`, given their `Request.logprobs` entries."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, (logprob, top) in zip(tokens, entries, strict=True):
            name = token_text(self.enc, token)
            candidates = {token_text(self.enc, i): value for i, value in top}
            candidates.setdefault(name, logprob)
            out["tokens"].append(name)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(candidates)
            out["text_offset"].append(self.offset)
            self.offset += len(self._chars.decode(self.enc.decode_single_token_bytes(token)))
        return out
