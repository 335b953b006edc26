"""The completions request as the server accepts it: every field checked for its JSON type
and range before anything runs, so a wrong value is a 400 naming the field, never a
500, and never read by Python truthiness (`"stream": "false"` is not `false`, and
`"temperature": true` is not 1).
"""

import codecs
import hashlib
import math
from typing import Any

from gptmini.generate.sampling import MAX_LOGPROBS, SEED_RANGE, json_type
from gptmini.tokenizer import token_text

NEUTRAL = {"echo": (None, False), "best_of": (None, 1),
           "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
           "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "user": None,
           "stream_options": None}
"""Fields clients send by default, accepted at their neutral values (None: checked below)."""
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed",
         "stop", "stream", "logprobs", "return_token_ids", *NEUTRAL}


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


def _integer(body: dict, name: str, default: int | None, low: int,
             high: int | None = None, span: str | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        span = span or (f">= {low}" if high is None else f"in {low}..{high}")
        raise APIError(400, f"{name} must be an integer {span}, got {value!r} "
                       f"({json_type(value)})", name)
    return value


def _number(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value):
        raise APIError(400, f"{name} must be a number, got {value!r} ({json_type(value)})",
                       name)
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


def parse(body: Any, model_name: str) -> tuple[list[str | list[int]], dict]:
    """The prompts and sampling settings of a completions body, or an APIError."""
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
    stop = body.get("stop")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, list | tuple) or len(stops) > 4 or not all(
            isinstance(s, str) and s for s in stops):
        raise APIError(400, "stop must be a non-empty string or a list of up to 4", "stop")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object such as {\"include_usage\": "
                       f"true}}, got {json_type(options)}", "stream_options")
    if options and set(options) - {"include_usage"}:
        raise APIError(400, f"stream_options: unsupported field "
                       f"{sorted(set(options) - {'include_usage'})[0]!r}", "stream_options")
    settings = {
        "max_new_tokens": _integer(body, "max_tokens", 16, 0),
        "temperature": _number(body, "temperature", 1.0),
        "top_p": _number(body, "top_p", None), "top_k": _integer(body, "top_k", None, 1),
        "stop": tuple(stops), "n": _integer(body, "n", 1, 1, 16),
        "seed": _integer(body, "seed", None, SEED_RANGE[0], SEED_RANGE[1] - 1,
                         "of 64 bits (in [-2**63, 2**64))"),
        "stream": _boolean(body.get("stream"), "stream"),
        "logprobs": _integer(body, "logprobs", None, 0, MAX_LOGPROBS),
        "return_token_ids": _boolean(body.get("return_token_ids"), "return_token_ids"),
        "include_usage": _boolean((options or {}).get("include_usage"),
                                  "stream_options.include_usage")}
    if settings["top_p"] is not None and settings["top_p"] == 1:
        settings["top_p"] = None
    return prompts, settings


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
