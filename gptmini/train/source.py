"""A fine-tune's source (`--model.init_from`): the model whose weights start a run, read once.

A `Source` is what the run takes from it: the architecture, the vocabulary and the chat
template, known before the module is built; its weights are copied in when training starts
(`load_weights`). A resumed run takes the architecture, vocabulary and template from
its own checkpoint, since the source may be gone (a LoRA run still reads the source's
weights: its checkpoints hold the adapters alone).
"""

from dataclasses import dataclass

import tiktoken

from gptmini.chat import ChatTemplate, directory_template
from gptmini.checkpoint import (
    CONFIG_FIELDS,
    gguf_source,
    is_sharded,
    load_checkpoint,
    model_config,
    model_source,
    read_checkpoint,
)
from gptmini.convert import local_checkpoint
from gptmini.convert.gguf import is_gguf
from gptmini.finetune import base_fingerprint, grow_vocab
from gptmini.model import GPTConfig, GPTModel

CHANGEABLE_FIELDS = ("drop_rate", "attn_drop_rate", "attention_backend", "context_length")
"""What a fine-tune may set differently from its init_from source: dropout, the attention
kernel, and a context_length up to the source's; every other GPTConfig field is its
architecture, taken from the source."""


@dataclass(frozen=True)
class Source:
    """The model a fine-tune starts from.

    Attributes:
        path: the .ckpt, Hugging Face directory or Hub name, as --model.init_from names it.
        config: its architecture (vocab_size the source's own, before a template grows it).
        tokenizer: its vocabulary; None when resuming (the run's checkpoint holds it).
        chat_template: the template it was tuned with (a chat fine-tune's checkpoint, a
            directory's chat_template), or None.
        classes: a classifier's class names (its head scores them, not tokens), or None.
    """

    path: str
    config: GPTConfig
    tokenizer: tiktoken.Encoding | None
    chat_template: ChatTemplate | None
    classes: tuple[str, ...] | None = None

    @classmethod
    def read(cls, path: str) -> "Source":
        """The source at `path`, its weights left on disk.

        Raises:
            FileNotFoundError: nothing there. ValueError: not a model gptmini reads.
        """
        local = local_checkpoint(path)  # (a Hub name's cached directory)
        if is_gguf(local):  # its metadata read once
            return cls(str(path), *gguf_source(local))
        config, tokenizer = model_source(path)
        if local.is_dir() and not is_sharded(local):  # a Hugging Face directory
            return cls(str(path), config, tokenizer, directory_template(local, tokenizer))
        checkpoint = read_checkpoint(path, "cpu", mmap=True, weights=False)
        entry = checkpoint.get("chat_template")
        classes = checkpoint["hyper_parameters"].get("classes")
        return cls(str(path), config, tokenizer,
                   ChatTemplate.from_dict(entry) if entry else None,
                   tuple(classes) if classes else None)

    @classmethod
    def resumed(cls, path: str, checkpoint: dict, n_vocab: int) -> "Source":
        """The source of a run being resumed, as its checkpoint (of `n_vocab` ids) recorded it."""
        entry = checkpoint.get("chat_template")
        return cls(str(path), model_config(checkpoint, n_vocab), None,
                   ChatTemplate.from_dict(entry) if entry else None)


def load_weights(path: str, model: GPTModel, *, fresh: set[str], grow: bool = True) -> str:
    """Copy the weights of the model at `path` (a .ckpt or a Hugging Face directory) into
    `model` (built by `model.cfg`, an architecture that fits the source's): all of them but
    the state keys in `fresh` (a class head, LoRA adapters), which start as they are. A
    shorter context keeps the first position embeddings; a vocabulary a chat template grew
    gets the new rows (`grow_vocab`).

    Returns:
        The fingerprint of the source's weights (before growing), which LoRA adapters
        remember.

    Raises:
        ValueError: another architecture (naming each field, its value there and the flag
            that matches it), weights that do not fit, or a vocabulary to grow with `grow`
            False (naming the fix).
    """
    pretrained = load_checkpoint(path).model
    fingerprint = base_fingerprint(pretrained.state_dict())
    ours = model.cfg
    if pretrained.cfg.vocab_size < ours.vocab_size:  # a chat template's new tokens
        if not grow:
            raise ValueError(
                f"model.init_from={path}: the chat template adds tokens to its vocabulary, "
                "whose new embedding rows LoRA would never train: use --data.chat.template "
                "book (it adds none), or fine-tune fully (no --model.lora_rank)")
        grow_vocab(pretrained, ours.vocab_size)
    differ = architecture_differences(pretrained.cfg, ours)
    if differ:
        theirs = pretrained.cfg
        wanted = " ".join(f"--model.{f} {getattr(theirs, f)}" for f in differ)
        raise ValueError(
            f"model.init_from={path} holds a different model "
            f"({', '.join(f'{f}={getattr(theirs, f)!r}' for f in differ)}); set {wanted}")
    state = {k: v for k, v in pretrained.state_dict().items() if k not in fresh}
    if "pos_emb.weight" in state:
        state["pos_emb.weight"] = state["pos_emb.weight"][: ours.context_length]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = sorted(set(missing) - fresh)
    if missing or unexpected:
        raise ValueError(f"model.init_from={path}: its weights do not fit this model "
                         f"(missing {missing[:3]}, unexpected {sorted(unexpected)[:3]})")
    return fingerprint


def architecture_differences(source: GPTConfig, cfg: GPTConfig) -> list[str]:
    """The GPTConfig fields where `cfg` contradicts the architecture of `source`: every field
    but CHANGEABLE_FIELDS, and a context_length past the source's. Spellings of the same
    model agree (n_kv_heads None is n_heads, head_dim None emb_dim / n_heads, mlp_hidden_dim
    None its default width, padded_vocab_size None is vocab_size)."""
    same = {"n_kv_heads": lambda c: c.kv_heads,
            "head_dim": lambda c: c.head_size,
            "mlp_hidden_dim": lambda c: c.hidden_dim,
            "padded_vocab_size": lambda c: c.vocab_width}
    differ = [f for f in CONFIG_FIELDS if f not in CHANGEABLE_FIELDS
              and same.get(f, lambda c, f=f: getattr(c, f))(source)
              != same.get(f, lambda c, f=f: getattr(c, f))(cfg)]
    if cfg.context_length > source.context_length:
        differ.append("context_length")
    return differ


def contradictions(source: GPTConfig, given: dict) -> list[str]:
    """The fields of `given` (GPTConfig fields a user set) that contradict the architecture
    of `source` (see `architecture_differences`), in `given`'s order."""
    merged = {**source.to_dict(), **given}
    try:
        differ = architecture_differences(source, GPTConfig(**merged))
    except (TypeError, ValueError):  # an invalid combination: compare the values as given
        differ = [f for f in given if merged[f] != getattr(source, f)]
    return [f for f in given if f in differ]
