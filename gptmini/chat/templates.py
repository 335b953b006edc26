"""Chat templates: gptmini's, the book's, a model directory's; which one a model or a run has.

A `ChatTemplate` is a Jinja template, as Hugging Face ships one in a model directory's
`tokenizer_config.json`, with the tokens that end an assistant turn. Three kinds:

- `GPTMINI`, gptmini's own for its tokenizers (GPT-2's, fitted `bpe:N`, bytes): one special
  token per role and one to end a turn, `<|user|>Hi<|end|><|assistant|>Hello<|end|>`. The
  four tokens are new to the vocabulary (`add_template_tokens`; the model grows by four rows,
  `gptmini.finetune.grow_vocab`).
- `BOOK`, the prompt of the book's chapter 7 (Alpaca's), plain text ending the response with
  `<|endoftext|>`: no new tokens, so any gptmini tokenizer renders it.
- a model directory's own (`directory_template`): Llama 3's, Qwen3's, any Jinja template.

`choose_template` is the one rule that turns `--data.chat.template` (and "auto") into a
template, for train.py and for a data module built in Python alike.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import tiktoken

from gptmini.tokenizer import END_OF_TEXT, special_tokens, with_special_tokens

AUTO = "auto"
"""`--data.chat.template auto`: the source model's template, else one for the records."""


class ChatDataError(ValueError):
    """A conversation gptmini cannot render; the message names the record and the field."""


class ChatTemplateError(ChatDataError):
    """A chat template that failed while rendering (a bug of its own, such as a division by
    zero): the template is at fault, not the conversation (a server answers 500)."""


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
        specials = special_tokens(tokenizer)
        return [specials[token] for token in self.stop]

    def check_tokenizer(self, tokenizer: tiktoken.Encoding) -> None:
        """Raise `ChatDataError` unless every token the template writes as one token (stop
        and new tokens) is a special token of `tokenizer`; else the template's text would
        silently be encoded as characters."""
        specials = special_tokens(tokenizer)
        missing = [t for t in (*self.new_tokens, *self.stop) if t not in specials]
        if missing:
            fix = ("add them with gptmini.chat.add_template_tokens (train.py does when it "
                   "fine-tunes with this template)" if self.new_tokens else
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
    config = (_json_object(config_path, "the tokenizer's settings") if config_path.is_file()
              else {})
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        config["chat_template"] = jinja_file.read_text()
    generation = directory / "generation_config.json"
    ids = (_json_object(generation, "the generation settings").get("eos_token_id")
           if generation.is_file() else None)
    return settings_template(directory.name, config, ids if isinstance(ids, list)
                             else [] if ids is None else [ids], tokenizer, config_path)


def settings_template(name: str, config: Mapping, stop_ids: list, tokenizer: tiktoken.Encoding,
                      where: Path) -> ChatTemplate | None:
    """The chat template of a tokenizer's settings (`config`: tokenizer_config.json's
    `chat_template` and special tokens, as a directory or a GGUF file's metadata holds
    them), ending a turn at its `eos_token` and the tokens `stop_ids`. None: it has none.

    Raises:
        ChatDataError: no eos_token, or stop tokens `tokenizer` lacks (naming `where`).
    """
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return None
    specials = {key: _token_text(config.get(key))
                for key in ("bos_token", "eos_token", "unk_token", "pad_token")
                if _token_text(config.get(key)) is not None}
    stop = [specials["eos_token"]] if "eos_token" in specials else []
    by_id = {i: t for t, i in special_tokens(tokenizer).items()}
    stop += [by_id[i] for i in stop_ids if i in by_id and by_id[i] not in stop]
    template = ChatTemplate(name=name, source=source, stop=tuple(stop),
                            special_tokens=specials)
    if not stop:
        raise ChatDataError(f"{where} has a chat template but no eos_token to end an "
                            "assistant turn")
    template.check_tokenizer(tokenizer)
    return template


def _json_object(path: Path, what: str) -> dict:
    """The JSON object in `path`, or a ValueError naming the file, where it breaks and what
    it should hold (json's own error names neither)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); it "
                         f"should be {what} in JSON") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err.msg}, line {err.lineno} column "
                         f"{err.colno}); it should be {what}: fix or download it again"
                         ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}; it should be {what}, "
                         "a JSON object")
    return data


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
    specials = special_tokens(tokenizer)
    if all(t in specials for t in GPTMINI.new_tokens):
        return GPTMINI
    if END_OF_TEXT in specials:
        return BOOK
    raise ChatDataError(f"tokenizer {tokenizer.name!r} has no chat template and no "
                        f"{END_OF_TEXT}: give a model directory with a chat_template")


def load_template(name: str, tokenizer: tiktoken.Encoding) -> ChatTemplate:
    """The template `--data.chat.template` names, other than "auto" (see `choose_template`):
    "gptmini", "book", a Hugging Face directory with a chat template, or a template's .json
    file (`ChatTemplate.to_dict`'s).

    Raises:
        ValueError: none of these, naming the setting and what it accepts.
    """
    if name in TEMPLATES:
        return TEMPLATES[name]
    path = Path(name)
    if path.is_dir():
        template = directory_template(path, tokenizer)
        if template is None:
            raise ValueError(f"chat template {name}: the directory has no chat_template in "
                             "tokenizer_config.json (nor chat_template.jinja)")
        return template
    if path.suffix == ".json" and path.is_file():
        data = _json_object(path, "a chat template")  # (its errors name the file)
        try:
            return ChatTemplate.from_dict(data)
        except ValueError as err:
            raise ValueError(f"chat template {name}: {err}") from None
    raise ValueError(f"chat template {name!r}: use auto, gptmini, book, a Hugging Face "
                     "directory with a chat template, or a template's .json file")


def choose_template(name: str, tokenizer: tiktoken.Encoding, *, alpaca: bool,
                    source: ChatTemplate | None = None) -> ChatTemplate:
    """The template a fine-tune renders its records with: the one `name` names, and for
    "auto" the fine-tune's source model's own (`source`: a chat-tuned checkpoint's, a
    Hugging Face directory's), so that the model keeps the format it was tuned to; a source
    without one gets the book's prompt for Alpaca records (`alpaca`) and gptmini's for chat
    records. The one rule, for train.py and a data module built in Python alike."""
    if name != AUTO:
        return load_template(name, tokenizer)
    if source is not None:
        return source
    return BOOK if alpaca else GPTMINI


def add_template_tokens(tokenizer: tiktoken.Encoding, template: ChatTemplate
                        ) -> tiktoken.Encoding:
    """`tokenizer` with the template's new special tokens after its ids (in the template's
    order); the same encoding when it has them all. GPT-2's vocabulary gets a new name,
    "gpt2+chat", since "gpt2" alone names the vocabulary without them."""
    name = tokenizer.name if tokenizer.name.endswith("+chat") else f"{tokenizer.name}+chat"
    return with_special_tokens(tokenizer, template.new_tokens, name)
