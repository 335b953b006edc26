"""A BPE vocabulary fitted to a corpus's training split, cached like its tokens."""

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

from gptmini.data.corpus import CorpusSpec, default_cache_dir, pin_revision
from gptmini.data.documents import explain_read_errors, read_documents
from gptmini.data.tokens import is_validation
from gptmini.tokenizer import GPT2_PATTERN, save_tokenizer, train_bpe

MAX_FIT_BYTES = 100 * 2**20
"""Text a vocabulary is fitted on, at most: the first 100 MB of the training split."""

_log = logging.getLogger("gptmini.data")


def parse_bpe(name: str) -> int | None:
    """N for a tokenizer spelled "bpe:N", else None.

    Raises:
        ValueError: "bpe:" followed by something that is not a whole number.
    """
    if not name.startswith("bpe:"):
        return None
    try:
        return int(name[4:].replace("_", ""))
    except ValueError:
        raise ValueError(f"tokenizer {name!r}: write bpe:N with N the vocabulary size, e.g. "
                         "bpe:4096") from None


def fit_tokenizer(
    spec: CorpusSpec,
    vocab_size: int,
    *,
    val_fraction: float = 0.0,
    cache_dir: str | os.PathLike | None = None,
    max_bytes: int = MAX_FIT_BYTES,
) -> Path:
    """Fit a BPE of `vocab_size` ids to the training split of `spec`; the saved file's path.

    Only training documents are read (validation is every (1 / val_fraction)-th document,
    as in `tokenize_corpus`; a corpus of fewer documents leaves out its last val_fraction),
    at most `max_bytes` of them, so bits per byte on validation is measured on text the
    vocabulary never saw. The file is cached under `cache_dir`/tokenizers, keyed by the
    corpus, the split, the size and the trainer's version: a second run reads it at once.
    """
    root = Path(cache_dir or default_cache_dir())
    spec = pin_revision(spec)
    key_doc = {"corpus": spec.identity(), "val_fraction": val_fraction, "vocab": vocab_size,
               "max_bytes": max_bytes, "pattern": GPT2_PATTERN,
               "trainer": f"rustbpe {version('rustbpe')}"}
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:16]
    path = root / "tokenizers" / f"{spec.name}-bpe{vocab_size}-{key}.json"
    if path.is_file():
        _log.info(f"cache hit: the bpe:{vocab_size} vocabulary of {spec.description} is {path}")
        return path
    start = time.perf_counter()
    with explain_read_errors(spec):
        texts = list(training_texts(spec, root, val_fraction, max_bytes))
    enc = train_bpe(texts, vocab_size)
    save_tokenizer(enc, path)
    _log.info(f"fitted bpe:{vocab_size} on {sum(map(len, texts)):,} characters of "
              f"{spec.description} in {time.perf_counter() - start:.1f} s: {path}")
    return path


def training_texts(spec: CorpusSpec, cache_dir: Path, val_fraction: float,
                   max_bytes: int) -> Iterator[str]:
    """The training documents of `spec`, in order, until `max_bytes` of UTF-8."""
    docs = read_documents(spec, cache_dir)
    kept, total, index, any_val = [], 0, 0, False
    for batch in docs.iter(batch_size=256):
        for text in batch["text"]:
            val, index = is_validation(index, val_fraction), index + 1
            any_val |= val
            if val or not text:
                continue
            text = text[: max_bytes - total]  # characters >= bytes: trimmed again below
            kept.append(text)
            total += len(text.encode("utf-8"))
            if total >= max_bytes:
                break
        if total >= max_bytes:
            break
    if val_fraction > 0 and not any_val and kept:
        # Too few documents for a document split: validation is the corpus's last tokens.
        chars = sum(map(len, kept))
        drop = round(chars * val_fraction)
        while drop > 0:
            cut = min(drop, len(kept[-1]))
            kept[-1] = kept[-1][: len(kept[-1]) - cut]
            drop -= cut
            if not kept[-1]:
                kept.pop()
    yield from kept
