"""The token cache: documents encoded once into flat token files, keyed by what made them."""

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tiktoken import Encoding

from gptmini.data.corpus import CorpusSpec, default_cache_dir, pin_revision
from gptmini.data.documents import TextFiles, explain_read_errors, missing_text, read_documents
from gptmini.tokenizer import GPT2_PATTERN, get_tokenizer, split_pattern, tokenizer_fingerprint

CACHE_VERSION = 2  # 2: keyed on the tokenizer's content and a hub dataset's commit

_log = logging.getLogger("gptmini.data")
if not logging.getLogger().handlers and not _log.handlers:
    # Like lightning.pytorch: show our progress lines unless the application configured logging.
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("gptmini.data: %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)


@dataclass(frozen=True)
class TokenCache:
    """One tokenized corpus on disk: ``train.bin`` and ``val.bin`` plus ``meta.json``."""

    directory: Path

    @property
    def meta(self) -> dict[str, Any]:
        return json.loads((self.directory / "meta.json").read_text())

    def path(self, split: str) -> Path:
        return self.directory / f"{split}.bin"

    def num_tokens(self, split: str) -> int:
        return self.meta["tokens"][split]

    def load(self, split: str) -> np.ndarray:
        """The tokens of `split` ("train" or "val") as a read-only memmap, shape (n,)."""
        dtype = np.dtype(self.meta["dtype"])
        if self.num_tokens(split) == 0:
            return np.empty(0, dtype=dtype)  # mmap cannot map an empty file
        return np.memmap(self.path(split), dtype=dtype, mode="r")


def is_validation(index: int, val_fraction: float) -> bool:
    """Whether document `index` belongs to the validation split (the split every reader of
    a corpus uses: the token cache, the vocabulary fitter, the benchmarks)."""
    # Every (1 / val_fraction)-th document goes to validation: evenly spread, independent of
    # the corpus length, so the same rule serves streamed corpora of unknown size.
    return int((index + 1) * val_fraction) > int(index * val_fraction)


LONG_DOCUMENT = 1 << 20
"""Characters past which a document is encoded piece by piece (same ids, bounded memory)."""
# A space between two non-space characters always starts a new pre-token under GPT-2's
# split pattern: no pre-token runs across it, and those after it depend on nothing before.
_SAFE_CUT = re.compile(r"(?<=\S) (?=\S)")


def _encode_documents(
    texts: list[str | None], tokenizer: str, dtype: str, num_threads: int
) -> list[np.ndarray]:
    enc = get_tokenizer(tokenizer)
    texts = [t or "" for t in texts]
    short = [t if len(t) <= LONG_DOCUMENT else "" for t in texts]
    encoded = enc.encode_ordinary_batch(short, num_threads=num_threads)
    # Each non-empty document ends in <|endoftext|>; the file's last one is cut off after,
    # which leaves the token exactly *between* documents.
    out = []
    for text, doc in zip(texts, encoded, strict=True):
        long = len(text) > LONG_DOCUMENT
        ids = encode_in_pieces(enc, text, dtype) if long else np.asarray(doc, dtype=dtype)
        out.append(np.append(ids, np.asarray([enc.eot_token], dtype=dtype)) if len(ids) else ids)
    return out


def encode_in_pieces(enc: Encoding, text: str, dtype: str = "uint32",
                     piece: int = LONG_DOCUMENT) -> np.ndarray:
    """`enc.encode_ordinary(text)` as an array of `dtype`, shape (n,), a piece at a time.

    A 50 MB document as one list of Python ints takes about 430 MB; in pieces of about
    `LONG_DOCUMENT` characters, cut where the split pattern cuts anyway, it takes the
    array's 2 bytes per token. Encodings with another split pattern are encoded whole.
    """
    if split_pattern(enc) != GPT2_PATTERN:
        return np.asarray(enc.encode_ordinary(text), dtype=dtype)
    pieces, start = [], 0
    while start < len(text):
        cut = _SAFE_CUT.search(text, start + piece) if len(text) - start > piece else None
        end = cut.start() if cut else len(text)
        pieces.append(np.asarray(enc.encode_ordinary(text[start:end]), dtype=dtype))
        start = end
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)


def _encode_batch(
    batch: dict[str, list], indices: list[int], tokenizer: str, val_fraction: float, dtype: str
) -> dict[str, list]:
    # One thread per process: num_proc alone says how many cores tokenizing takes.
    ids = _encode_documents(batch["text"], tokenizer, dtype, num_threads=1)
    return {"ids": ids, "val": [is_validation(i, val_fraction) for i in indices]}


def _write_docs(flat: np.ndarray, lengths: np.ndarray, val: np.ndarray, train_f, val_f) -> None:
    if not val.any():
        train_f.write(flat.tobytes())
        return
    in_val = np.repeat(val, lengths)
    train_f.write(flat[~in_val].tobytes())
    val_f.write(flat[in_val].tobytes())


def cache_key(spec: CorpusSpec, tokenizer: Encoding, val_fraction: float) -> dict[str, Any]:
    """What a token file depends on, and so what names it in the cache.

    The source's identity (file paths, sizes and mtimes; or a hub dataset's name, config,
    split and commit: call `pin_revision` first), the tokenizer's content (not its name) and
    the validation split. Anything that changes the tokens changes the key.
    """
    return {
        "version": CACHE_VERSION,
        "corpus": spec.identity(),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "val_fraction": val_fraction,
    }


def tokenize_corpus(
    spec: CorpusSpec,
    *,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.0,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int = 1,
    quiet: bool = False,
) -> TokenCache:
    """Tokenize a corpus once into flat token files; later calls find them in the cache.

    Documents are encoded with tiktoken's `encode_ordinary_batch` (a literal
    "<|endoftext|>" in the text stays ordinary text) inside `datasets.map` on `num_proc`
    processes, or on `num_proc` threads when streaming or reading plain text (`TextFiles`).
    Files hold uint16 when the vocabulary fits, else uint32, with `<|endoftext|>` between
    documents.

    Validation: every (1 / val_fraction)-th document; a corpus with fewer documents than
    that (say, one book) gives the last `val_fraction` of its tokens instead.

    The cache folder is keyed by `cache_key`; it is written to a temporary folder and
    renamed into place, so an interrupted run leaves nothing half-written.

    Raises:
        ValueError: the corpus holds no text, or a file is not UTF-8.
        ConnectionError: a hub dataset whose revision cannot be looked up (offline, and
            datasets has no copy of it).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1); 0.05 keeps 5% for val")
    root = Path(cache_dir or default_cache_dir())
    spec = pin_revision(spec)
    enc = get_tokenizer(tokenizer)  # (workers rebuild it from the name: it pickles big)
    key_doc = cache_key(spec, enc, val_fraction)
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:16]
    final = root / "tokens" / f"{spec.name}-{key}"
    cache = TokenCache(final)
    if (final / "meta.json").is_file():
        if not quiet:
            tokens = cache.meta["tokens"]
            _log.info(
                f"cache hit: {spec.description} is already tokenized with {tokenizer} in "
                f"{final} ({tokens['train']:,} train / {tokens['val']:,} val tokens); "
                "skipping tokenization"
            )
        return cache

    if not quiet:
        _log.info(f"tokenizing {spec.description} with {tokenizer} (num_proc={num_proc})")
    with _written_atomically(final) as tmp:
        counts, n_docs, split_by = _write_splits(spec, tmp, root, tokenizer, val_fraction,
                                                 num_proc)
        meta = {**key_doc, "source": spec.description, "tokenizer_name": tokenizer,
                "dtype": token_dtype(enc).name, "eot_token": enc.eot_token,
                "documents": n_docs, "val_split_by": split_by, "tokens": counts}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if not quiet:
        _log.info(f"wrote {counts['train']:,} train / {counts['val']:,} val tokens to {final}")
    return cache


def token_dtype(enc: Encoding) -> np.dtype:
    """The dtype a token file of `enc` holds: uint16 when its ids fit, else uint32."""
    return np.dtype(np.uint16 if enc.n_vocab <= 2**16 else np.uint32)


@contextmanager
def _written_atomically(final: Path) -> Iterator[Path]:
    """A fresh temporary folder beside `final`, renamed to `final` when the block ends
    without error, and removed in any case: an interrupted run leaves nothing half-written."""
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        try:
            tmp.rename(final)
        except OSError:  # another process finished the same cache first: keep theirs
            if not (final / "meta.json").is_file():
                raise
    except OSError as err:
        if err.errno not in _FULL_DISK:
            raise
        raise OSError(err.errno, f"could not write the token cache {final} "
                      f"({err.strerror or err}); free space, or set --data.corpus.cache_dir "
                      "(or $GPTMINI_CACHE) to a disk with room") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
"""The OS errors of a disk that cannot take the cache (an OS error names no file)."""


def _write_splits(spec: CorpusSpec, directory: Path, cache_root: Path, tokenizer: str,
                  val_fraction: float, num_proc: int) -> tuple[dict[str, int], int, str]:
    """Encode every document of `spec` into `directory`'s train.bin and val.bin, with
    <|endoftext|> between documents; (tokens per split, documents, how val was split off).

    Raises:
        ValueError: the corpus holds no text.
    """
    enc = get_tokenizer(tokenizer)
    dtype = token_dtype(enc)
    docs = read_documents(spec, cache_root)
    with (
        open(directory / "train.bin", "wb") as train_f,
        open(directory / "val.bin", "wb") as val_f,
        explain_read_errors(spec),
    ):
        args = {"tokenizer": tokenizer, "val_fraction": val_fraction, "dtype": dtype.name}
        if spec.streaming or isinstance(docs, TextFiles):  # batch by batch, on threads
            n_docs = _tokenize_stream(docs, spec, args, num_proc, train_f, val_f)
        else:
            n_docs = _tokenize_dataset(docs, args, num_proc, directory, train_f, val_f)
    counts = {split: _drop_trailing_eot(directory / f"{split}.bin", dtype, enc.eot_token)
              for split in ("train", "val")}
    if counts["train"] + counts["val"] == 0:
        raise ValueError(
            f"corpus {spec.description} is empty: {n_docs} documents, 0 tokens. Point "
            "source at files that hold text (for json/parquet, check text_field)"
        )
    if val_fraction > 0 and counts["val"] == 0:
        return _split_tail(directory, dtype, val_fraction, counts["train"]), n_docs, "tokens"
    return counts, n_docs, "documents" if counts["val"] else "none"


def _tokenize_dataset(docs, args: dict, num_proc: int, directory: Path, train_f,
                      val_f) -> int:
    """Encode a `datasets.Dataset` in `num_proc` processes (`datasets.map`, whose Arrow
    output goes to `directory` and is deleted after); the number of documents."""
    n_docs = len(docs)
    encoded = docs.map(
        _encode_batch,
        batched=True,
        with_indices=True,
        remove_columns=["text"],
        fn_kwargs=args,
        num_proc=min(num_proc, n_docs) if num_proc > 1 and n_docs > 1 else None,
        cache_file_name=str(directory / "encoded.arrow"),
        desc="tokenizing",
    )
    dtype = np.dtype(args["dtype"])
    for table in encoded.with_format("arrow").iter(batch_size=1024):
        ids = table.column("ids").combine_chunks()
        lengths = np.diff(ids.offsets.to_numpy())
        flat = ids.flatten().to_numpy().astype(dtype, copy=False)
        _write_docs(flat, lengths, table.column("val").to_numpy(), train_f, val_f)
    del encoded
    for leftover in directory.glob("encoded*.arrow"):
        leftover.unlink()
    return n_docs


def _tokenize_stream(docs, spec: CorpusSpec, args: dict, num_threads: int, train_f,
                     val_f) -> int:
    index, missing, first_missing = 0, 0, None
    for batch in docs.iter(batch_size=256):
        nulls = [i for i, text in enumerate(batch["text"]) if text is None]
        if nulls:
            missing += len(nulls)
            first_missing = index + nulls[0] if first_missing is None else first_missing
        arrays = _encode_documents(batch["text"], args["tokenizer"], args["dtype"], num_threads)
        val = np.array([is_validation(index + i, args["val_fraction"]) for i in range(len(arrays))])
        index += len(arrays)
        lengths = np.array([len(a) for a in arrays])
        _write_docs(np.concatenate(arrays), lengths, val, train_f, val_f)
    if missing:  # a stream cannot be checked before it is read
        files = [str(f) for f in spec.files]
        missing_text(missing, index, first_missing, spec, spec.description, files)
    return index


def _drop_trailing_eot(path: Path, dtype: np.dtype, eot: int) -> int:
    n = path.stat().st_size // dtype.itemsize
    if n:
        with open(path, "rb+") as f:
            f.seek((n - 1) * dtype.itemsize)
            if np.frombuffer(f.read(dtype.itemsize), dtype)[0] == eot:
                n -= 1
                f.truncate(n * dtype.itemsize)
    return n


def _split_tail(directory: Path, dtype: np.dtype, val_fraction: float, n: int) -> dict[str, int]:
    """Move the last `val_fraction` of the train tokens into val.bin (single-document case)."""
    k = round(n * val_fraction)
    if k == 0 or k >= n:
        return {"train": n, "val": 0}
    with open(directory / "train.bin", "rb+") as f:
        f.seek((n - k) * dtype.itemsize)
        (directory / "val.bin").write_bytes(f.read())
        f.truncate((n - k) * dtype.itemsize)
    return {"train": n - k, "val": k}

