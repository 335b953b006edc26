"""The requests as the server accepts them, a `CompletionRequest` (/v1/completions) and a
`ChatRequest` (/v1/chat/completions): every field checked for its JSON type and range
before anything runs, so a wrong value is a 400 naming the field, never a 500, and never
read by Python truthiness (`"stream": "false"` is not `false`, and `"temperature": true`
is not 1).

The sampling settings are `SamplingParams`' fields under their own names (OpenAI's
`max_tokens` is the one renamed: `API_NAMES`; chat also calls it `max_completion_tokens`
and asks logprobs as `logprobs: true` with `top_logprobs: N`), checked by SamplingParams
itself, so a field added there is a request field of both.
"""

import codecs
import hashlib
from collections.abc import Callable, Mapping
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


def seeded(sampling: SamplingParams, i: int, stop_ids: tuple[int, ...]) -> SamplingParams:
    """Choice i's settings, stopping at `stop_ids`: a seeded request's choice i draws from
    `choice_seed(seed, i)`."""
    seed = sampling.seed
    return replace(sampling, seed=None if seed is None else choice_seed(seed, i),
                   stop_ids=stop_ids)


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
        return seeded(self.sampling, i, stop_ids)

    @staticmethod
    def api_name(field: str) -> str:
        """The request field that holds `field` (a SamplingParams field or "prompt")."""
        return API_NAMES.get(field, field)


def refused(err: RequestError, names: Callable[[str], str] = CompletionRequest.api_name
            ) -> APIError:
    """The 400 for a setting or prompt that SamplingParams or the engine refused, naming
    the request's own field (max_tokens, not max_new_tokens), in its message too; `names`
    maps a SamplingParams field (or "prompt") to the request's field."""
    name = names(err.field)
    return APIError(400, err.message_for(name), name)


def _check_common(body: Any, model_name: str, known: set[str],
                  neutral: Mapping[str, tuple | None]) -> None:
    """What both endpoints check alike: a JSON object of known fields, the neutral ones at
    their neutral values, the model, user, stop and stream_options."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise APIError(400, f"unsupported field {unknown[0]!r}", unknown[0])
    for name, values in neutral.items():
        if values is not None and name in body and not _neutral(body[name], values):
            raise APIError(400, f"{name}={body[name]!r} is not supported; leave it at "
                           f"{values[-1]!r}", name)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise APIError(400, f"user must be a string, got {json_type(body['user'])}", "user")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, f"model must be a string, got {json_type(model)}", "model")
    if model not in (model_name, None):
        raise APIError(404, f"the model {model!r} does not exist; this server "
                       f"serves {model_name!r}", "model", kind="not_found_error")
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


def _sampling(settings: dict, names: Callable[[str], str]) -> SamplingParams:
    """SamplingParams of `settings` (OpenAI's defaults where unset), or the 400 naming the
    request's field."""
    try:
        return SamplingParams(**{**OPENAI_DEFAULTS, **settings})
    except RequestError as err:
        raise refused(err, names) from None


def _flags(body: dict) -> dict:
    """n, stream, stream_options.include_usage and return_token_ids, checked."""
    return {"n": _integer(body, "n", 1, 1, 16),
            "stream": _boolean(body.get("stream"), "stream"),
            "include_usage": _boolean((body.get("stream_options") or {}).get("include_usage"),
                                      "stream_options.include_usage"),
            "return_token_ids": _boolean(body.get("return_token_ids"), "return_token_ids")}


def parse(body: Any, model_name: str) -> CompletionRequest:
    """The completions body as a CompletionRequest, or an APIError naming the field."""
    _check_common(body, model_name, KNOWN, NEUTRAL)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, str) or _is_ids(p) for p in prompts):
        raise APIError(400, "prompt must be a string, a list of strings, a list of token "
                       "ids or a list of such lists", "prompt")
    settings = {field: body[name] for name, field in SAMPLING.items()
                if body.get(name) is not None}  # null: the default
    return CompletionRequest(prompts, _sampling(settings, CompletionRequest.api_name),
                             **_flags(body))


# --------------------------------------------------------------------- chat completions

CHAT_NEUTRAL = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "logit_bias": (None, {}), "user": None, "stream_options": None,
                "tools": (None, []), "tool_choice": (None, "none"), "store": (None, False),
                "parallel_tool_calls": None, "response_format": (None, {"type": "text"}),
                "metadata": None, "service_tier": None}
"""Chat fields clients may send, accepted at their neutral values (None: any value)."""
CHAT_RENAMED = ("max_new_tokens", "logprobs")
"""SamplingParams fields chat asks under other names (max_tokens or max_completion_tokens;
top_logprobs under logprobs: true)."""
CHAT_SAMPLING = {name: field for name, field in SAMPLING.items() if field not in CHAT_RENAMED}
CHAT_KNOWN = {"model", "messages", "n", "stream", "return_token_ids", "max_tokens",
              "max_completion_tokens", "logprobs", "top_logprobs", *CHAT_SAMPLING,
              *CHAT_NEUTRAL}


@dataclass(frozen=True)
class ChatRequest:
    """A /v1/chat/completions body, checked: what the server reads of it, by attribute."""

    messages: list
    """OpenAI's messages, as sent (the model's chat template renders and checks them)."""
    sampling: SamplingParams
    """Every choice's settings; `max_new_tokens` is only meaningful when `max_tokens_field`
    is set (else the reply may run to the end of the context)."""
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    max_tokens_field: str | None = None
    """"max_tokens" or "max_completion_tokens", whichever the request set; None: none."""

    def choice_sampling(self, i: int, stop_ids: tuple[int, ...]) -> SamplingParams:
        """Choice i's settings: seeded from (seed, i) when the request has a seed."""
        return seeded(self.sampling, i, stop_ids)

    def api_name(self, field: str) -> str:
        """The request field that holds `field` (a SamplingParams field or "prompt")."""
        return {"prompt": "messages", "logprobs": "top_logprobs",
                "max_new_tokens": self.max_tokens_field or "max_completion_tokens"
                }.get(field, field)


def parse_chat(body: Any, model_name: str) -> ChatRequest:
    """The chat completions body as a ChatRequest, or an APIError naming the field. The
    messages are checked when the model's template renders them (`submit_chat`)."""
    _check_common(body, model_name, CHAT_KNOWN, CHAT_NEUTRAL)
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise APIError(400, "messages must be a non-empty list of {\"role\", \"content\"} "
                       f"objects, got {json_type(body.get('messages'))}", "messages")
    given = [name for name in ("max_completion_tokens", "max_tokens")
             if body.get(name) is not None]
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise APIError(400, "max_tokens and max_completion_tokens differ; send one "
                       "(max_tokens is the older name of max_completion_tokens)", "max_tokens")
    settings = {field: body[name] for name, field in CHAT_SAMPLING.items()
                if body.get(name) is not None}
    if given:
        settings["max_new_tokens"] = body[given[0]]
    asked = _boolean(body.get("logprobs"), "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not asked:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if asked:
        settings["logprobs"] = 0 if top is None else top
    draft = ChatRequest(body["messages"], SamplingParams(),
                        max_tokens_field=given[0] if given else None)
    return replace(draft, sampling=_sampling(settings, draft.api_name), **_flags(body))


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


class ChatLogprobsWriter:
    """OpenAI's chat `logprobs` object of one choice, a few tokens at a time: `{"content":
    [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}`
    (exactly the N asked in `top_logprobs`, most likely first)."""

    def __init__(self, enc):
        self.enc = enc

    def entry(self, token: int, logprob: float) -> dict:
        return {"token": token_text(self.enc, token), "logprob": logprob,
                "bytes": list(self.enc.decode_single_token_bytes(token))}

    def add(self, tokens: list[int], entries: list) -> dict:
        """The object for `tokens`, given their `Request.logprobs` entries."""
        return {"content": [{**self.entry(token, logprob),
                             "top_logprobs": [self.entry(i, value) for i, value in top]}
                            for token, (logprob, top) in zip(tokens, entries, strict=True)]}
