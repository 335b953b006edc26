"""Conversations to tokens: chat templates, the assistant's loss mask, the stop tokens.

A conversation is OpenAI's `messages` list, `[{"role": "system" | "user" | "assistant",
"content": str}, ...]`. A `ChatTemplate` is a Jinja template, as Hugging Face ships one in
a model directory's `tokenizer_config.json`, rendered here the way `transformers`'
`apply_chat_template` renders it (a sandbox with `trim_blocks` and `lstrip_blocks`; the
same `tojson`, `raise_exception` and `strftime_now`), then encoded with every special token
the text spells: the ids equal `apply_chat_template(..., tokenize=True)`'s for a model
directory's own template (tests/finetune/test_chat.py compares them). Three kinds:

- `GPTMINI`, gptmini's own for its tokenizers (GPT-2's, fitted `bpe:N`, bytes): one special
  token per role and one to end a turn, `<|user|>Hi<|end|><|assistant|>Hello<|end|>`. The
  four tokens are new to the vocabulary (`add_template_tokens`) and the model's embedding
  and head grow by four rows (`grow_vocab`: the mean of the rows already there).
- `BOOK`, the prompt of the book's chapter 7 (Alpaca's), plain text ending the response with
  `<|endoftext|>`: no new tokens, so any gptmini tokenizer renders it.
- a model directory's own (`directory_template`): Llama 3's, Qwen3's, any Jinja template.

The loss mask is found the same way for every template, so no template needs markers of its
own: an assistant message's tokens start where the conversation before it, rendered with
the generation prompt, ends, and run to the first stop token after that, included (the
model learns to end its turn; the newline a template may write after the stop is never
generated, so it is not learned).
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

import tiktoken
import torch
from torch import nn

from gptmini.model import GPTModel
from gptmini.tokenizer import END_OF_TEXT

__all__ = [
    "BOOK",
    "GPTMINI",
    "ROLES",
    "TEMPLATES",
    "ChatDataError",
    "ChatTemplate",
    "RenderedChat",
    "add_template_tokens",
    "check_messages",
    "directory_template",
    "grow_vocab",
    "render_chat",
    "template_for",
]

ROLES = ("system", "user", "assistant")
"""The roles a message may have (tool calls are not supported)."""


class ChatDataError(ValueError):
    """A conversation gptmini cannot render; the message names the record and the field."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and what rendering it needs (plain data: checkpoints carry it).

    Attributes:
        name: "gptmini", "book", or the model directory a template came from.
        source: the Jinja text; it sees `messages`, `add_generation_prompt` and the
            special tokens (`bos_token`, `eos_token`, ...), as in `transformers`.
        stop: the tokens that end an assistant turn; generation stops at any of them.
        special_tokens: `bos_token`, `eos_token`, ... as the template reads them.
        new_tokens: special tokens the template adds to a gptmini vocabulary.
    """

    name: str
    source: str
    stop: tuple[str, ...]
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    new_tokens: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """The template as JSON-ready data (a checkpoint's "chat_template" entry)."""
        return {"name": self.name, "source": self.source, "stop": list(self.stop),
                "special_tokens": dict(self.special_tokens),
                "new_tokens": list(self.new_tokens)}

    @classmethod
    def from_dict(cls, data: Mapping) -> "ChatTemplate":
        """The template `to_dict` wrote."""
        try:
            return cls(name=str(data["name"]), source=str(data["source"]),
                       stop=tuple(data["stop"]),
                       special_tokens=dict(data.get("special_tokens", {})),
                       new_tokens=tuple(data.get("new_tokens", ())))
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a chat template entry (missing {err}); it needs name, "
                             "source and stop") from None

    def stop_ids(self, tokenizer: tiktoken.Encoding) -> list[int]:
        """The ids of the stop tokens in `tokenizer` (generation ends at any of them).

        Raises:
            ChatDataError: `tokenizer` lacks one of them (see `check_tokenizer`).
        """
        self.check_tokenizer(tokenizer)
        specials = tokenizer._special_tokens
        return [specials[token] for token in self.stop]

    def check_tokenizer(self, tokenizer: tiktoken.Encoding) -> None:
        """Raise `ChatDataError` unless every token the template writes as one token (stop
        and new tokens) is a special token of `tokenizer`; else the template's text would
        silently be encoded as characters."""
        specials = tokenizer._special_tokens
        missing = [t for t in (*self.new_tokens, *self.stop) if t not in specials]
        if missing:
            fix = ("add them with gptmini.finetune.add_template_tokens (train.py does when "
                   "it fine-tunes with this template)" if self.new_tokens else
                   "use a template written for this tokenizer")
            raise ChatDataError(
                f"chat template {self.name!r} cannot be encoded by tokenizer "
                f"{tokenizer.name!r}: it has no special token {', '.join(missing)}; {fix}")


_GPTMINI_SOURCE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)
GPTMINI = ChatTemplate(
    name="gptmini", source=_GPTMINI_SOURCE, stop=("<|end|>",),
    special_tokens=MappingProxyType({"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT}),
    new_tokens=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"))
"""gptmini's template: a token per role, `<|end|>` after every message."""

BOOK_PREAMBLE = ("Below is an instruction that describes a task. Write a response that "
                 "appropriately completes the request.")
# The book's format_input and response text (chapter 7): the preamble, "### Instruction:",
# the input under "### Input:" when there is one (Alpaca records put it in the user's
# message), then "### Response:" and the output, which <|endoftext|> ends. A system message
# replaces the preamble; a later user message is a new "### Instruction:".
_BOOK_SOURCE = (
    "{%- set ns = namespace(text='" + BOOK_PREAMBLE + "') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.text = messages[0]['content'] -%}{%- endif -%}"
    "{{ ns.text }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ '\\n\\n### Instruction:\\n' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '\\n\\n### Response:\\n' + message['content'] + eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\\n\\n### Response:\\n' }}{%- endif -%}"
)
BOOK = ChatTemplate(
    name="book", source=_BOOK_SOURCE, stop=(END_OF_TEXT,),
    special_tokens=MappingProxyType({"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT}))
"""The book's (Alpaca's) prompt, with `<|endoftext|>` after each response."""

TEMPLATES = MappingProxyType({"gptmini": GPTMINI, "book": BOOK})
"""The built-in templates by name (read-only)."""


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
        before = _render_text(template, plain[:i], True, where)
        if not text.startswith(before):
            raise ChatDataError(
                f"{where}: chat template {template.name!r} renders messages[:{i}] with the "
                "generation prompt differently from the start of the whole conversation "
                "(as Qwen3's does for two assistant messages in a row), so the assistant's "
                f"tokens of messages[{i}] cannot be found; merge such messages into one")
        start = next((k for k, o in enumerate(offsets) if o >= len(before)), len(ids))
        end = next((k for k in range(start, len(ids)) if ids[k] in stops), None)
        if end is None:
            raise ChatDataError(
                f"{where}: messages[{i}] (assistant) is not ended by a stop token "
                f"({', '.join(template.stop)}) of chat template {template.name!r}")
        assistant[start:end + 1] = [True] * (end + 1 - start)
    return RenderedChat(ids, assistant)


def _render_text(template: ChatTemplate, messages: list[dict], add_generation_prompt: bool,
                 where: str) -> str:
    import jinja2

    try:
        return _compiled(template.source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
            documents=None, **template.special_tokens)
    except jinja2.TemplateError as err:
        raise ChatDataError(f"{where}: chat template {template.name!r} refused it: "
                            f"{err}") from None


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
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatDataError(f"the chat template is not valid Jinja: {err} (line {err.lineno})"
                            ) from None


# ------------------------------------------------------------- templates of models, vocab


def directory_template(directory: str | Path, tokenizer: tiktoken.Encoding
                       ) -> ChatTemplate | None:
    """The chat template a Hugging Face model directory ships (`chat_template.jinja`, or
    `chat_template` in `tokenizer_config.json`), with its stop tokens: the config's
    `eos_token` and `generation_config.json`'s `eos_token_id`s. None: it has none.

    Raises:
        ChatDataError: a template whose stop tokens `tokenizer` lacks.
    """
    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text()
    if not isinstance(source, str):
        return None
    specials = {key: _token_text(config.get(key))
                for key in ("bos_token", "eos_token", "unk_token", "pad_token")
                if _token_text(config.get(key)) is not None}
    stop = [specials["eos_token"]] if "eos_token" in specials else []
    generation = directory / "generation_config.json"
    if generation.is_file():
        ids = json.loads(generation.read_text()).get("eos_token_id")
        ids = ids if isinstance(ids, list) else [] if ids is None else [ids]
        by_id = {i: t for t, i in tokenizer._special_tokens.items()}
        stop += [by_id[i] for i in ids if i in by_id and by_id[i] not in stop]
    template = ChatTemplate(name=directory.name, source=source, stop=tuple(stop),
                            special_tokens=specials)
    if not stop:
        raise ChatDataError(f"{config_path} has a chat template but no eos_token to end an "
                            "assistant turn")
    template.check_tokenizer(tokenizer)
    return template


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def template_for(tokenizer: tiktoken.Encoding, hparams: Mapping | None = None) -> ChatTemplate:
    """The chat template of a loaded model: the one its checkpoint (or Hugging Face
    directory) carries in `hparams["chat_template"]`; else gptmini's when the tokenizer has
    its tokens; else the book's, which any tokenizer with `<|endoftext|>` renders (a
    pretrained model that was never tuned to chat).

    Raises:
        ChatDataError: none of them fits the tokenizer.
    """
    entry = (hparams or {}).get("chat_template")
    if entry:
        return ChatTemplate.from_dict(entry)
    specials = tokenizer._special_tokens
    if all(t in specials for t in GPTMINI.new_tokens):
        return GPTMINI
    if END_OF_TEXT in specials:
        return BOOK
    raise ChatDataError(f"tokenizer {tokenizer.name!r} has no chat template and no "
                        f"{END_OF_TEXT}: give a model directory with a chat_template")


def add_template_tokens(tokenizer: tiktoken.Encoding, template: ChatTemplate
                        ) -> tiktoken.Encoding:
    """`tokenizer` with the template's new special tokens after its ids (in the template's
    order); the same encoding when it has them all. GPT-2's vocabulary gets a new name,
    "gpt2+chat", since "gpt2" alone names the vocabulary without them."""
    specials = dict(tokenizer._special_tokens)
    missing = [t for t in template.new_tokens if t not in specials]
    if not missing:
        return tokenizer
    n = tokenizer.n_vocab
    specials.update({token: n + k for k, token in enumerate(missing)})
    name = tokenizer.name if tokenizer.name.endswith("+chat") else f"{tokenizer.name}+chat"
    return tiktoken.Encoding(name=name, pat_str=tokenizer._pat_str,
                             mergeable_ranks=tokenizer._mergeable_ranks, special_tokens=specials,
                             explicit_n_vocab=n + len(missing))


@torch.no_grad()
def grow_vocab(model: GPTModel, n_vocab: int) -> GPTModel:
    """Make room for `n_vocab` ids in `model`'s embedding and output head, in place.

    New rows start at the mean of the rows the vocabulary had: a new token's embedding is
    an average token's, and its logit the average logit, so the pretrained model's
    predictions barely move until fine-tuning teaches the new tokens (Hewitt, "Initializing
    new word embeddings", 2021). Rows of a padded vocabulary (`padded_vocab_size`) are
    reused before the matrices grow. A tied head stays tied.

    Returns:
        `model`, whose `cfg.vocab_size` is now `n_vocab`.
    """
    cfg, old = model.cfg, model.cfg.vocab_size
    if n_vocab < old:
        raise ValueError(f"grow_vocab cannot shrink the vocabulary from {old} to {n_vocab}")
    if n_vocab == old:
        return model
    width = max(cfg.vocab_width, n_vocab)
    tied = model.out_head.weight is model.tok_emb.weight
    emb = _grown(model.tok_emb.weight, old, width)
    model.tok_emb = nn.Embedding.from_pretrained(emb, freeze=False)
    if tied:
        model.out_head.weight = model.tok_emb.weight
    else:
        head = nn.Linear(cfg.emb_dim, width, bias=False).to(emb.device, emb.dtype)
        head.weight = nn.Parameter(_grown(model.out_head.weight, old, width))
        model.out_head = head
    padded = width if width > n_vocab else None
    model.cfg = replace(cfg, vocab_size=n_vocab, padded_vocab_size=padded)
    return model


def _grown(weight: torch.Tensor, old: int, width: int) -> torch.Tensor:
    """`weight` (rows, emb) with `width` rows: its first `old` kept, the rest their mean."""
    rows = weight.new_empty(width, weight.shape[1])
    rows[:old] = weight[:old]
    rows[old:] = weight[:old].mean(dim=0)
    return rows
