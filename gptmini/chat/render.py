"""Conversations to token ids, and the assistant's loss mask.

A conversation is OpenAI's `messages` list, `[{"role": "system" | "user" | "assistant",
"content": str}, ...]`. `render_chat` renders it with a `ChatTemplate` the way
`transformers`' `apply_chat_template` renders it (a sandbox with `trim_blocks` and
`lstrip_blocks`; the same `tojson`, `raise_exception` and `strftime_now`), then encodes it
with every special token the text spells: the ids equal `apply_chat_template(...,
tokenize=True)`'s for a model directory's own template (tests/chat/test_chat.py compares
them).

The loss mask is found the same way for every template, so no template needs markers of its
own: an assistant message's tokens start where the conversation before it, rendered with
the generation prompt, ends, and run to the first stop token after that, included (the
model learns to end its turn; the newline a template may write after the stop is never
generated, so it is not learned).
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache

import tiktoken

from gptmini.chat.templates import ChatDataError, ChatTemplate, ChatTemplateError

ROLES = ("system", "user", "assistant")
"""The roles a message may have (tool calls are not supported)."""
UNSUPPORTED = ("tool_calls", "function_call")
"""Message fields gptmini cannot render (OpenAI's tool calls): refused, never dropped."""
_MARKER = "\ue000gptmini: the next message\ue000"
"""Text no record holds (private-use characters): where a message's content lands."""


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation.

    Attributes:
        ids: the token ids, as `apply_chat_template(..., tokenize=True)` gives them.
        assistant_mask: one bool per id, True where the assistant wrote the token (its
            messages and their stop tokens): the tokens a fine-tune's loss counts.
    """

    ids: list[int]
    assistant_mask: list[bool]

    def inputs_and_targets(self) -> tuple[list[int], list[int]]:
        """Next-token training pairs: inputs `ids[:-1]`, targets `ids[1:]` with -100 where
        the target is not the assistant's (those positions count for nothing)."""
        targets = [t if keep else -100 for t, keep in zip(self.ids[1:], self.assistant_mask[1:],
                                                          strict=True)]
        return self.ids[:-1], targets


# ------------------------------------------------------------------------------ rendering


def check_messages(messages: object, where: str = "conversation", *,
                   need_assistant: bool = False) -> list[dict]:
    """The messages as plain `{"role", "content"}` dicts, or a `ChatDataError` naming
    `where` (e.g. "train.jsonl line 12") and the field.

    Content may be a string, None (empty), or OpenAI's list of parts
    (`[{"type": "text", "text": ...}]`, joined).

    Args:
        need_assistant: a training record must hold an assistant message to learn from.
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise ChatDataError(f"{where}: 'messages' must be a non-empty list of "
                            f"{{\"role\", \"content\"}} objects, got {_show(messages)}")
    plain = []
    for i, message in enumerate(messages):
        at = f"{where}: messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatDataError(f"{at} must be an object with 'role' and 'content', "
                                f"got {_show(message)}")
        if "role" not in message:
            raise ChatDataError(f"{at} has no 'role'; give one of {', '.join(ROLES)}")
        role = message["role"]
        if role not in ROLES:
            raise ChatDataError(f"{at}.role is {_show(role)}: use one of {', '.join(ROLES)}")
        for name in UNSUPPORTED:
            if message.get(name):  # (null or [] is what clients send for "none")
                raise ChatDataError(f"{at}.{name}: tool calls are not supported (a message is "
                                    "rendered from its role and content alone); send the "
                                    f"assistant's reply as content, without {name}")
        plain.append({"role": role, "content": _content(message.get("content"), at)})
    if need_assistant and not any(m["role"] == "assistant" for m in plain):
        raise ChatDataError(f"{where}: no 'assistant' message, so nothing to learn from; "
                            "each training conversation needs at least one")
    return plain


def _content(content: object, at: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                           and isinstance(p.get("text"), str) for p in content):
        text = "".join(p["text"] for p in content)
    else:
        raise ChatDataError(f"{at}.content must be a string or a list of "
                            f"{{\"type\": \"text\", \"text\": ...}} parts, got {_show(content)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ChatDataError(f"{at}.content cannot be encoded: {err.reason} at character "
                            f"{err.start} (a lone surrogate, e.g. from a broken \\u escape); "
                            "fix the text") from None
    return text


def _show(value: object, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[:limit] + "..."


def render_chat(messages: Sequence[Mapping], tokenizer: tiktoken.Encoding,
                template: ChatTemplate, *, add_generation_prompt: bool = False,
                mask: bool = True, where: str = "conversation") -> RenderedChat:
    """Render a conversation to token ids and the assistant's mask.

    Args:
        messages: OpenAI's list of `{"role", "content"}` (see `check_messages`).
        tokenizer: the model's tokenizer; it must hold the template's special tokens.
        template: the chat template (`template_for` picks a model's).
        add_generation_prompt: end with the opening of an assistant turn, for a model to
            write it (serving); the mask is then all False past the last message.
        mask: find the assistant's tokens (training); False leaves the mask all False
            and renders any conversation the template renders (serving).
        where: names the conversation in errors (e.g. "train.jsonl line 3").

    Raises:
        ChatDataError: bad messages (naming `where` and the field), a tokenizer without the
            template's tokens, or a template that breaks the rules the mask relies on.
    """
    plain = check_messages(messages, where)
    template.check_tokenizer(tokenizer)
    text = _render_text(template, plain, add_generation_prompt, where)
    ids, offsets = _encode(tokenizer, text)
    stops = set(template.stop_ids(tokenizer))
    assistant = [False] * len(ids)
    for i, message in enumerate(plain):
        if not mask or message["role"] != "assistant":
            continue
        _check_no_stop_text(message["content"], template, f"{where}: messages[{i}]")
        before = _render_text(template, plain[:i], True, where)
        if not text.startswith(before):
            raise ChatDataError(
                f"{where}: chat template {template.name!r} renders messages[:{i}] with the "
                "generation prompt differently from the start of the whole conversation "
                "(as Qwen3's does for two assistant messages in a row), so the assistant's "
                f"tokens of messages[{i}] cannot be found; merge such messages into one")
        start = next((k for k, o in enumerate(offsets) if o >= len(before)), len(ids))
        end = next((k for k in range(start, len(ids)) if ids[k] in stops), None)
        next_starts = _next_message_start(template, plain, i, text, add_generation_prompt,
                                          where)
        if end is None or offsets[end] >= next_starts:
            raise ChatDataError(_unended_turn(plain, i, template, where, end is not None))
        assistant[start:end + 1] = [True] * (end + 1 - start)
    return RenderedChat(ids, assistant)


def _unended_turn(plain: list[dict], i: int, template: ChatTemplate, where: str,
                  later: bool) -> str:
    """The refusal of an assistant turn with no stop token of its own (`later`: the first
    stop comes only after the next message began, as from a template that writes it after
    the last turn alone)."""
    said = (f" before messages[{i + 1}] ({plain[i + 1]['role']}) begins, so the loss mask "
            f"would teach messages[{i + 1}] as the assistant's words" if later else "")
    return (f"{where}: messages[{i}] (assistant) is not ended by a stop token "
            f"({', '.join(template.stop)}) of chat template {template.name!r}{said}; the "
            "template must end every assistant turn with its stop token (gptmini's writes "
            "<|end|> after each message)")


def _check_no_stop_text(content: str, template: ChatTemplate, at: str) -> None:
    """An assistant's text may not spell a stop token: it would be encoded as that token
    (special tokens are split out first), ending the turn there, and the loss mask would
    never reach the rest of the answer."""
    for stop in template.stop:
        if stop in content:
            rest = len(content) - content.index(stop) - len(stop)
            raise ChatDataError(
                f"{at} (assistant) holds {stop!r}, the stop token of chat template "
                f"{template.name!r}: it would be encoded as that token and end the turn "
                f"there, {rest} characters before the answer ends, which would never be "
                "learned; remove it from the record (the template writes the stop after "
                "each answer itself)")


def _next_message_start(template: ChatTemplate, plain: list[dict], i: int, text: str,
                        add_generation_prompt: bool, where: str) -> int:
    """Where messages[i + 1]'s content begins in `text` (the whole conversation rendered),
    found by rendering it once more with a marker for that content; len(text) when there
    is no next message or the template does not write its content."""
    if i + 1 >= len(plain):
        return len(text)
    marked = [*plain[:i + 1], {**plain[i + 1], "content": _MARKER}, *plain[i + 2:]]
    variant = _render_text(template, marked, add_generation_prompt, where)
    at = variant.find(_MARKER)
    return at if at >= 0 and variant[:at] == text[:at] else len(text)


def _render_text(template: ChatTemplate, messages: list[dict], add_generation_prompt: bool,
                 where: str) -> str:
    import jinja2

    try:
        compiled = _compiled(template.source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"chat template {template.name!r} is not valid Jinja: "
                                f"{err.message} (line {err.lineno}); fix the template, or "
                                "render with another one") from None
    try:
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
            documents=None, **template.special_tokens)
    except jinja2.TemplateError as err:  # raise_exception, or the sandbox: it refused them
        raise ChatDataError(f"{where}: chat template {template.name!r} refused it: "
                            f"{err}") from None
    except Exception as err:  # a template is code from elsewhere: its own bug, named
        raise ChatTemplateError(
            f"{where}: chat template {template.name!r} failed while rendering it "
            f"({type(err).__name__}: {err}); fix the template, or render with another "
            "one") from None


def _encode(tokenizer: tiktoken.Encoding, text: str) -> tuple[list[int], list[int]]:
    """Ids of the rendered text (every special token it spells is that token, as Hugging
    Face tokenizers split on added tokens first) and each id's first character."""
    ids = tokenizer.encode(text, allowed_special="all", disallowed_special=())
    _, offsets = tokenizer.decode_with_offsets(ids)
    return ids, offsets


@lru_cache(maxsize=16)
def _compiled(source: str):
    """The template compiled as `transformers` compiles chat templates: a sandbox (a
    model directory's template is code from elsewhere), trim_blocks and lstrip_blocks,
    loop controls, `{% generation %}` blocks rendered as their body, and the same helpers.
    (Cached by source text: no mutable state, the same template compiles once.)"""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it
        for its own assistant mask; ours is found without markers)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)  # (a TemplateSyntaxError is named by the caller)
