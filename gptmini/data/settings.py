"""A run's data settings, by concept: the corpus (which text, split and tokenized how), the
windows cut from its tokens, and the loader that batches them.

They are the `data:` section of a config in three parts (``--data.corpus.source``,
``--data.windows.stride``, ``--data.loader.batch_size``), each field's docstring its
``--help`` text. A checkpoint records them as one flat dict of every field (the form it had
before they were grouped: names are unique across the three), read back by `from_record`.
"""

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from gptmini.data.chat import Chat
from gptmini.data.corpus import CorpusSpec, check_error_handler, resolve_source
from gptmini.data.labels import Labels
from gptmini.data.preference import Preference
from gptmini.data.rl import RL
from gptmini.data.tokens import tokenize_corpus
from gptmini.data.vocab import fit_tokenizer
from gptmini.data.windows import SlidingWindowDataset, check_positive


@dataclass(frozen=True)
class Corpus:
    """The text to train on, where validation comes from, and how it becomes tokens."""

    source: str | None = None
    """Corpus file, directory, glob or hub dataset name; None for the embedded Shakespeare
    corpus."""
    val_source: str | None = None
    """A separate validation corpus (same forms); None splits `source`."""
    val_fraction: float = 0.05
    """Share of documents (of tokens, for corpora with fewer than 1 / val_fraction
    documents) kept for validation; 0 for none. Not used with `val_source` or
    `hub_val_split`."""
    text_field: str = "text"
    """The field holding the text in json/jsonl/parquet files and hub datasets."""
    hub_config: str | None = None
    """Hub dataset configuration (subset) name."""
    hub_split: str = "train"
    """Hub dataset split to train on."""
    hub_val_split: str | None = None
    """Validate on this split of the hub dataset (e.g. "validation") instead of splitting
    off `val_fraction`; also the split of a hub `val_source`."""
    hub_revision: str | None = None
    """Branch, tag or commit of the hub dataset (None: its main branch); the token cache
    is keyed on the commit it resolves to."""
    streaming: bool = False
    """Read the corpus as a stream (tokenizing needs no Arrow copy of it)."""
    encoding_errors: str = "strict"
    """Bytes that are not UTF-8: "strict" raises naming the file, "replace" reads them as
    U+FFFD, "ignore" drops them."""
    skip_missing_text: bool = False
    """Train on the json/parquet records that have `text_field` when some lack it, saying
    how many were left out; by default such a corpus is refused, naming the count and the
    first one."""
    tokenizer: str = "gpt2"
    """"gpt2" (offline), "byte", a saved tokenizer's path or a tiktoken name (see
    `gptmini.tokenizer.get_tokenizer`); train.py sets it from --model.tokenizer, and turns
    "bpe:N" into the path of the vocabulary it fits (`fit_tokenizer`)."""
    cache_dir: str | None = None
    """Folder for token files (and datasets' Arrow copies of local files); None means
    $GPTMINI_CACHE or ~/.cache/gptmini."""
    num_proc: int = 1
    """Processes that tokenize."""

    def __post_init__(self):
        check_positive(num_proc=self.num_proc)
        check_error_handler(self.encoding_errors)
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction={self.val_fraction} must be in [0, 1); 0 disables it")

    def resolve(self, validation: bool = False) -> CorpusSpec:
        """The training corpus as a `CorpusSpec` (no text read yet); with `validation`, the
        separate validation corpus: `val_source`, and/or the hub split `hub_val_split`."""
        source, split = self.source, self.hub_split
        if validation:
            source, split = self.val_source or source, self.hub_val_split or split
        return resolve_source(
            source,
            text_field=self.text_field,
            hub_config=self.hub_config,
            hub_split=split,
            hub_revision=self.hub_revision,
            streaming=self.streaming,
            encoding_errors=self.encoding_errors,
            skip_missing_text=self.skip_missing_text,
        )

    def tokens(self, quiet: bool = False) -> tuple[np.ndarray, np.ndarray, str, str]:
        """(train tokens, val tokens, train description, val description), each tokens a
        read-only memmap of shape (n,); tokenizes into the cache on a miss."""

        def cached(spec: CorpusSpec, val_fraction: float):
            return tokenize_corpus(spec, tokenizer=self.tokenizer, val_fraction=val_fraction,
                                   cache_dir=self.cache_dir, num_proc=self.num_proc, quiet=quiet)

        train_spec = self.resolve()
        if self.val_source is not None or (train_spec.hub_name and self.hub_val_split):
            val_spec = self.resolve(validation=True)
            train = cached(train_spec, 0.0).load("train")
            val = cached(val_spec, 0.0).load("train")
            return train, val, train_spec.description, val_spec.description
        cache = cached(train_spec, self.val_fraction)
        name = train_spec.description
        return cache.load("train"), cache.load("val"), name, f"{name} (validation split)"

    def fit_tokenizer(self, vocab_size: int) -> Path:
        """Fit a BPE of `vocab_size` ids to the training split (cached); its file's path."""
        split_apart = self.val_source is not None or self.hub_val_split is not None
        return fit_tokenizer(self.resolve(), vocab_size,
                             val_fraction=0.0 if split_apart else self.val_fraction,
                             cache_dir=self.cache_dir)


@dataclass(frozen=True)
class Windows:
    """The (input, target) windows cut from the tokens: the book's `GPTDatasetV1`."""

    max_length: int = 256
    """Tokens per window: the model's context length (train.py sets it from
    --model.context_length)."""
    stride: int | None = None
    """Tokens between training windows; None means max_length (no overlap)."""
    val_stride: int | None = None
    """Tokens between validation windows; None means max_length."""
    document_mask: bool = False
    """Give every window the document ids of its tokens (<|endoftext|> opens the next
    document, as a BOS token), so that no token attends across a document's edge and
    positions restart at each document."""

    def __post_init__(self):
        check_positive(max_length=self.max_length, stride=self.stride,
                       val_stride=self.val_stride)

    def over(self, tokens: np.ndarray, *, validation: bool = False,
             document_token: int | None = None) -> SlidingWindowDataset:
        """The training (or validation) windows of `tokens`, shape (n,); `document_token`
        (the tokenizer's <|endoftext|>) is used only with `document_mask`."""
        stride = self.val_stride if validation else self.stride
        starts = document_token if self.document_mask else None
        return SlidingWindowDataset(tokens, self.max_length, stride or self.max_length, starts)


@dataclass(frozen=True)
class Loader:
    """How windows are shuffled and batched."""

    batch_size: int = 8
    """Windows per batch, per rank."""
    num_workers: int = 0
    """DataLoader worker processes."""
    seed: int = 1234
    """Training shuffle seed; epoch e's order depends only on (seed, e)."""

    def __post_init__(self):
        check_positive(batch_size=self.batch_size)
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"num_workers={self.num_workers} is invalid: use 0 or more")


GROUPS = {"corpus": Corpus, "windows": Windows, "loader": Loader, "labels": Labels,
          "chat": Chat}
"""The data section's parts, by the name each has in a config."""
NESTED = {"preference": Preference, "rl": RL}
"""Parts recorded under their own key (their fields share names with chat's)."""


def as_record(corpus: Corpus, windows: Windows, loader: Loader,
              labels: Labels | None = None, chat: Chat | None = None,
              preference: Preference | None = None, rl: RL | None = None) -> dict[str, Any]:
    """The parts as one flat dict of fields: what a checkpoint records of its data (the
    labels' only for a classification run, the chat part's only for a fine-tune on
    records, so a language model's record is as it was); a preference or RL run's part
    under its own key ("preference", "rl")."""
    record = {**asdict(corpus), **asdict(windows), **asdict(loader)}
    for part in (labels, chat):
        if part is not None and part.active:
            record |= asdict(part)
    for name, part in (("preference", preference), ("rl", rl)):
        if part is not None and part.active:
            record[name] = asdict(part)
    return record


def from_record(record: dict[str, Any]
                ) -> tuple[Corpus, Windows, Loader, Labels, Chat, Preference, RL]:
    """The settings `as_record` wrote (or a checkpoint from before they were grouped, which
    holds the same flat fields); keys starting with "_" (Lightning's own) are skipped.

    Raises:
        ValueError: a key that is no field of any part (names the key and the fields).
    """
    owner = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}
    parts: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
    nested = {name: dict(record.get(name) or {}) for name in NESTED}
    for key, value in record.items():
        if key.startswith("_") or key in NESTED:
            continue
        if key not in owner:
            raise ValueError(f"data setting {key!r} is unknown; the settings are "
                             f"{', '.join([*owner, *NESTED])}")
        parts[owner[key]][key] = value
    for part in (parts["chat"], nested["preference"]):
        if isinstance(part.get("split"), list):  # YAML and JSON have no tuples
            part["split"] = tuple(part["split"])
    corpus, windows, loader, labels, chat = (cls(**parts[g]) for g, cls in GROUPS.items())
    return (corpus, windows, loader, labels, chat, Preference(**nested["preference"]),
            RL(**nested["rl"]))

