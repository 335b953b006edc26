"""Text corpora to sliding-window batches: loading, a token cache, the windows, a DataModule.

The path of a corpus, stage by stage:

1. `resolve_source`: a file, directory, glob or hub dataset name becomes a `CorpusSpec`
   (what to read, and an identity that changes when the data does).
2. `load_documents`: Hugging Face `datasets` reads it as documents, one string each (a text
   file is one document; a json/jsonl record or a parquet row is one document).
3. `tokenize_corpus`: tiktoken encodes the documents in parallel (`datasets.map`,
   `num_proc` processes) and writes one flat token file per split, documents joined by
   `<|endoftext|>`, under a cache key of source identity, tokenizer and split.
4. `SlidingWindowDataset`: the book's `GPTDatasetV1` windows read straight from a memmap
   of that file, so building one costs no memory and no time whatever the corpus size.
5. `ResumableSampler` and `GPTDataModule`: shuffled by (seed, epoch), one share per DDP
   rank, and able to resume mid-epoch on exactly the windows not yet seen.
"""

import bz2
import codecs
import glob
import gzip
import hashlib
import json
import logging
import lzma
import mmap
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from gptmini.tokenizer import END_OF_TEXT, get_tokenizer

__all__ = [
    "EMBEDDED_CORPUS",
    "CorpusSpec",
    "GPTDataModule",
    "ResumableSampler",
    "SlidingWindowDataset",
    "TokenCache",
    "create_dataloader",
    "default_cache_dir",
    "load_documents",
    "permute",
    "resolve_source",
    "tokenize_corpus",
]

EMBEDDED_CORPUS = Path(__file__).parent / "assets" / "shakespeare"
"""The default corpus: 42 works of Shakespeare as .txt.gz files (see assets/NOTICE)."""

TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown")
JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
# datasets decompresses these on the fly; the UTF-8 check below opens them the same way.
COMPRESSION_SUFFIXES = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_KNOWN = ", ".join(TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES)  # for messages
CACHE_VERSION = 1
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

_log = logging.getLogger(__name__)
if not logging.getLogger().handlers and not _log.handlers:
    # Like lightning.pytorch: show our progress lines unless the application configured logging.
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("gptmini.data: %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)


def default_cache_dir() -> Path:
    """Where token files go unless told otherwise: $GPTMINI_CACHE, else ~/.cache/gptmini."""
    if env := os.environ.get("GPTMINI_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gptmini"


# --------------------------------------------------------------------------- corpus in


@dataclass(frozen=True)
class CorpusSpec:
    """A corpus to read: local files, or one split of a Hugging Face hub dataset."""

    name: str
    """Short name for messages and cache folder names."""
    files: tuple[Path, ...] = ()
    """Local files, sorted; empty for a hub dataset."""
    hub_name: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"
    text_field: str = "text"
    """Column holding the text, for json/jsonl/parquet files and hub datasets."""
    streaming: bool = False
    encoding_errors: str = "strict"
    """What to do with bytes that are not UTF-8: "strict" (raise), "replace" or "ignore"."""
    description: str = field(default="", compare=False)

    def identity(self) -> dict[str, Any]:
        """What the token cache is keyed on: changes whenever the documents may change."""
        common = {"text_field": self.text_field, "encoding_errors": self.encoding_errors}
        if self.hub_name is not None:
            hub = {"name": self.hub_name, "config": self.hub_config, "split": self.hub_split}
            return {"hub": hub, **common}
        if all(_builder(f) == "text" for f in self.files):
            common["text_field"] = None  # text files have no fields: do not re-tokenize for it
        stats = [(str(f), (st := f.stat()).st_size, st.st_mtime_ns) for f in self.files]
        return {"files": stats, **common}


def resolve_source(
    source: str | os.PathLike | None,
    *,
    text_field: str = "text",
    hub_config: str | None = None,
    hub_split: str = "train",
    streaming: bool = False,
    encoding_errors: str = "strict",
) -> CorpusSpec:
    """Turn a user's `source` into a `CorpusSpec`, without reading any text yet.

    `source` is, in this order: None (the embedded Shakespeare corpus); an existing file or
    directory (every .txt/.md/.json/.jsonl/.parquet file below it, optionally .gz/.bz2/.xz
    compressed); a glob such as ``data/**/*.jsonl``; else a hub dataset name
    (``owner/name``), read with `hub_config`, `hub_split` and `text_field`.

    Raises:
        FileNotFoundError: the path or glob matches nothing; a directory holds no corpus file.
        ValueError: `encoding_errors` is not a Python error handler.
    """
    try:
        codecs.lookup_error(encoding_errors)
    except LookupError as err:
        raise ValueError(
            f"encoding_errors={encoding_errors!r} is not a Python codec error handler; "
            "use 'strict' (fail on bytes that are not UTF-8), 'replace' or 'ignore'"
        ) from err
    options = dict(text_field=text_field, streaming=streaming, encoding_errors=encoding_errors)
    if source is None:
        files = _corpus_files_in(EMBEDDED_CORPUS)
        return CorpusSpec("shakespeare", files, description="embedded Shakespeare", **options)
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.is_file():
        _builder(path)  # fail early on an unsupported extension
        return CorpusSpec(_slug(path.name), (path.resolve(),), description=text, **options)
    if path.is_dir():
        return CorpusSpec(_slug(path.name), _corpus_files_in(path), description=text, **options)
    if glob.has_magic(text):
        found = sorted(Path(p).resolve() for p in glob.glob(str(path), recursive=True))
        files = tuple(p for p in found if p.is_file())
        if not files:
            raise FileNotFoundError(
                f"corpus glob {text!r} matches no files. Check the pattern (quote it so the "
                "shell does not expand it) or pass a file or directory instead"
            )
        for f in files:
            _builder(f)
        return CorpusSpec(_slug(text), files, description=text, **options)
    if _HUB_NAME.match(text) and not _has_corpus_suffix(path):
        return CorpusSpec(
            _slug(text),
            hub_name=text,
            hub_config=hub_config,
            hub_split=hub_split,
            description=f"hub dataset {text}",
            **options,
        )
    raise FileNotFoundError(
        f"corpus path {text!r} does not exist. Pass an existing file, directory or glob "
        "(for example --data.source 'data/*.txt'), or leave source unset to train on the "
        "embedded Shakespeare corpus"
    )


def _format_of(path: Path) -> str | None:
    """"text", "json" or "parquet" by the extension under any compression one; else None."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    last = suffixes[-1] if suffixes else ""
    for builder, known in (("text", TEXT_SUFFIXES), ("json", JSON_SUFFIXES),
                           ("parquet", PARQUET_SUFFIXES)):
        if last in known:
            return builder
    return None


def _has_corpus_suffix(path: Path) -> bool:
    return _format_of(path) is not None


def _builder(path: Path) -> str:
    """The `datasets` builder that reads `path`: "text", "json" or "parquet"."""
    builder = _format_of(path)
    if builder is None:
        raise ValueError(
            f"corpus file {path} has an unsupported extension; gptmini reads {_KNOWN} "
            f"(text formats also as {', '.join(COMPRESSION_SUFFIXES)}). Rename it, e.g. to .txt"
        )
    return builder


def _corpus_files_in(directory: Path) -> tuple[Path, ...]:
    files = tuple(
        sorted(
            p.resolve()
            for p in directory.rglob("*")
            if p.is_file() and not p.name.startswith(".") and _has_corpus_suffix(p)
        )
    )
    if not files:
        raise FileNotFoundError(
            f"corpus directory {directory} holds no corpus files (looked for {_KNOWN}, "
            "optionally .gz/.bz2/.xz). Point source at the files, or add some"
        )
    return files


def _slug(text: str) -> str:
    """A folder-name-safe short name: "data/books.jsonl.gz" -> "books"."""
    name = Path(text.rstrip("/")).name or text
    name = re.sub(r"(\.[A-Za-z]+)?(\.(gz|bz2|xz))?$", "", name)
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_")[:40] or "corpus"


def load_documents(spec: CorpusSpec, cache_dir: str | os.PathLike | None = None):
    """Read a corpus as a `datasets.Dataset` (or `IterableDataset` when streaming) of documents.

    The result has one column, "text". Text files become one document each (datasets'
    "text" builder with ``sample_by="document"``), json/jsonl records and parquet rows one
    document each. Local files are cached as Arrow under `cache_dir`/hf; hub datasets use
    datasets' own cache, so a dataset downloaded before also loads offline.

    Raises:
        ConnectionError: a hub dataset cannot be reached (offline, or HF_HUB_OFFLINE=1).
        ValueError: `text_field` is not a column (lists the columns there are), or a file
            is not UTF-8 (names it and the way to replace bad bytes).
    """
    import datasets

    if spec.hub_name is not None:
        try:
            docs = datasets.load_dataset(
                spec.hub_name, spec.hub_config, split=spec.hub_split, streaming=spec.streaming
            )
        except ConnectionError as err:
            raise ConnectionError(
                f"cannot reach the Hugging Face hub for dataset {spec.hub_name!r} ({err}). "
                f"No local path named {spec.hub_name!r} exists either. Offline, train on local "
                "files: --data.source corpus.txt, a directory, or a glob like 'data/*.jsonl' "
                "(with --data.text_field for json/parquet); or download the dataset once while "
                "online so datasets' cache has it"
            ) from err
        return _select_text(docs, spec.text_field, spec.description)

    hf_cache = str(Path(cache_dir or default_cache_dir()) / "hf")
    groups: dict[str, list[str]] = {}
    for f in spec.files:
        groups.setdefault(_builder(f), []).append(str(f))
    parts = []
    with _explain_decode_errors(spec):
        for builder, files in groups.items():
            kwargs: dict[str, Any] = {}
            errors = None if spec.encoding_errors == "strict" else spec.encoding_errors
            if builder == "text":
                kwargs = {"sample_by": "document", "encoding_errors": errors}
            elif builder == "json" and errors is not None:
                # The json builder only decodes (and so only applies encoding_errors) when the
                # encoding is not spelled exactly "utf-8"; "UTF-8" is the same codec.
                kwargs = {"encoding": "UTF-8", "encoding_errors": errors}
            compressed = any(Path(f).suffix.lower() in COMPRESSION_SUFFIXES for f in files)
            if builder == "text" and errors is not None and compressed:
                # datasets opens compressed files through fsspec, which drops encoding_errors.
                docs = _decoded_text_files(files, errors, spec, hf_cache)
            else:
                docs = datasets.load_dataset(
                    builder,
                    data_files=files,
                    split="train",
                    streaming=spec.streaming,
                    cache_dir=None if spec.streaming else hf_cache,
                    **kwargs,
                )
            where = files[0] if len(files) == 1 else f"{spec.description} ({builder} files)"
            parts.append(
                _select_text(docs, "text" if builder == "text" else spec.text_field, where)
            )
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _decoded_text_files(files: list[str], errors: str, spec: CorpusSpec, cache_dir: str):
    import datasets

    # The identity (sizes, mtimes) is a generator argument so that datasets' cache, keyed on
    # the arguments, misses when a file changes.
    kwargs = {"files": files, "errors": errors, "identity": json.dumps(spec.identity())}
    if spec.streaming:
        return datasets.IterableDataset.from_generator(_read_text_files, gen_kwargs=kwargs)
    return datasets.Dataset.from_generator(_read_text_files, gen_kwargs=kwargs, cache_dir=cache_dir)


def _read_text_files(files: list[str], errors: str, identity: str) -> Iterator[dict[str, str]]:
    for name in files:
        with _open_binary(Path(name)) as f:
            yield {"text": f.read().decode("utf-8", errors=errors)}


def _select_text(docs, text_field: str, where: str):
    columns = docs.column_names
    if columns is None:  # a streamed dataset whose features are unknown: look at one record
        columns = list(next(iter(docs), {}).keys())
    if text_field not in columns:
        hint = columns[0] if columns else "NAME"
        raise ValueError(
            f"{where} has no field {text_field!r}; its fields are {columns}. Pass the one "
            f"holding the text as text_field (--data.text_field {hint})"
        )
    features = docs.features
    if features is not None and text_field in features:
        dtype = getattr(features[text_field], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise ValueError(
                f"field {text_field!r} of {where} holds {features[text_field]}, not text; "
                f"pick a string field among {columns} with text_field"
            )
    docs = docs.select_columns([text_field])
    return docs if text_field == "text" else docs.rename_column(text_field, "text")


@contextmanager
def _explain_decode_errors(spec: CorpusSpec) -> Iterator[None]:
    """Turn a bare UnicodeDecodeError from deep inside datasets into one that names the file."""
    try:
        yield
    except Exception as err:
        cause = err if isinstance(err, UnicodeDecodeError) else err.__cause__ or err.__context__
        if not isinstance(cause, UnicodeDecodeError):
            raise
        found = _first_undecodable(spec.files)
        where = (
            f"{found[0]} is not valid UTF-8 (byte 0x{found[2]:02x} near offset {found[1]})"
            if found
            else f"{spec.description} is not valid UTF-8 ({cause})"
        )
        raise ValueError(
            f"{where}. Convert it to UTF-8 (iconv -f latin1 -t utf-8), or pass "
            "encoding_errors='replace' (--data.encoding_errors replace) to read bad bytes as "
            "U+FFFD, or 'ignore' to drop them"
        ) from err


def _open_binary(path: Path) -> IO[bytes]:
    opener = COMPRESSION_SUFFIXES.get(path.suffix.lower(), open)
    return opener(path, "rb")


def _first_undecodable(files: Sequence[Path]) -> tuple[Path, int, int] | None:
    """The first (file, byte offset, byte) that is not UTF-8, reading in 1 MiB chunks."""
    for path in files:
        if _builder(path) == "parquet":
            continue  # Arrow has validated parquet strings already
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0  # file offset of the next chunk
        with _open_binary(path) as f:
            while True:
                chunk = f.read(1 << 20)
                pending = len(decoder.getstate()[0])  # bytes of a character split across chunks
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as err:
                    return path, offset - pending + err.start, err.object[err.start]
                if not chunk:
                    break
                offset += len(chunk)
    return None


# --------------------------------------------------------------------------- tokens


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


def _is_val(index: int, val_fraction: float) -> bool:
    # Every (1 / val_fraction)-th document goes to validation: evenly spread, independent of
    # the corpus length, so the same rule serves streamed corpora of unknown size.
    return int((index + 1) * val_fraction) > int(index * val_fraction)


def _encode_documents(
    texts: list[str | None], tokenizer: str, dtype: str, num_threads: int
) -> list[np.ndarray]:
    enc = get_tokenizer(tokenizer)
    encoded = enc.encode_ordinary_batch([t or "" for t in texts], num_threads=num_threads)
    # Each non-empty document ends in <|endoftext|>; the file's last one is cut off after,
    # which leaves the token exactly *between* documents.
    return [np.asarray(doc + [enc.eot_token] if doc else [], dtype=dtype) for doc in encoded]


def _encode_batch(
    batch: dict[str, list], indices: list[int], tokenizer: str, val_fraction: float, dtype: str
) -> dict[str, list]:
    # One thread per process: num_proc alone says how many cores tokenizing takes.
    ids = _encode_documents(batch["text"], tokenizer, dtype, num_threads=1)
    return {"ids": ids, "val": [_is_val(i, val_fraction) for i in indices]}


def _write_docs(flat: np.ndarray, lengths: np.ndarray, val: np.ndarray, train_f, val_f) -> None:
    if not val.any():
        train_f.write(flat.tobytes())
        return
    in_val = np.repeat(val, lengths)
    train_f.write(flat[~in_val].tobytes())
    val_f.write(flat[in_val].tobytes())


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
    processes, or on `num_proc` threads when streaming. Files hold uint16 when the
    vocabulary fits, else uint32, with `<|endoftext|>` between documents.

    Validation: every (1 / val_fraction)-th document; a corpus with fewer documents than
    that (say, one book) gives the last `val_fraction` of its tokens instead.

    The cache folder is keyed on the source identity (file paths, sizes and mtimes, or hub
    name, config and split), the tokenizer and `val_fraction`; it is written to a temporary
    folder and renamed into place, so an interrupted run leaves nothing half-written.

    Raises:
        ValueError: the corpus holds no text, or a file is not UTF-8.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1); 0.05 keeps 5% for val")
    root = Path(cache_dir or default_cache_dir())
    key_doc = {
        "version": CACHE_VERSION,
        "corpus": spec.identity(),
        "tokenizer": tokenizer,
        "val_fraction": val_fraction,
    }
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:16]
    final = root / "tokens" / f"{spec.name}-{tokenizer}-{key}"
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

    enc = get_tokenizer(tokenizer)
    dtype = np.dtype(np.uint16 if enc.n_vocab <= 2**16 else np.uint32)
    if not quiet:
        _log.info(f"tokenizing {spec.description} with {tokenizer} (num_proc={num_proc})")
    tmp = root / "tokens" / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        docs = load_documents(spec, root)
        counts = {"train": 0, "val": 0}
        with (
            open(tmp / "train.bin", "wb") as train_f,
            open(tmp / "val.bin", "wb") as val_f,
            _explain_decode_errors(spec),
        ):
            args = {"tokenizer": tokenizer, "val_fraction": val_fraction, "dtype": dtype.name}
            if spec.streaming:
                n_docs = _tokenize_stream(docs, args, num_proc, train_f, val_f)
            else:
                n_docs = len(docs)
                encoded = docs.map(
                    _encode_batch,
                    batched=True,
                    with_indices=True,
                    remove_columns=["text"],
                    fn_kwargs=args,
                    num_proc=min(num_proc, n_docs) if num_proc > 1 and n_docs > 1 else None,
                    cache_file_name=str(tmp / "encoded.arrow"),
                    desc="tokenizing",
                )
                for table in encoded.with_format("arrow").iter(batch_size=1024):
                    ids = table.column("ids").combine_chunks()
                    lengths = np.diff(ids.offsets.to_numpy())
                    flat = ids.flatten().to_numpy().astype(dtype, copy=False)
                    _write_docs(flat, lengths, table.column("val").to_numpy(), train_f, val_f)
                del encoded
        for split in counts:
            counts[split] = _drop_trailing_eot(tmp / f"{split}.bin", dtype, enc.eot_token)
        if counts["train"] + counts["val"] == 0:
            raise ValueError(
                f"corpus {spec.description} is empty: {n_docs} documents, 0 tokens. Point "
                "source at files that hold text (for json/parquet, check text_field)"
            )
        split_by = "documents" if counts["val"] else "none"
        if val_fraction > 0 and counts["val"] == 0:
            counts = _split_tail(tmp, dtype, val_fraction, counts["train"])
            split_by = "tokens"
        for leftover in tmp.glob("encoded*.arrow"):
            leftover.unlink()
        meta = {
            **key_doc,
            "source": spec.description,
            "dtype": dtype.name,
            "eot_token": enc.eot_token,
            "documents": n_docs,
            "val_split_by": split_by,
            "tokens": counts,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(final)
        except OSError:  # another process finished the same cache first: keep theirs
            if not (final / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        _log.info(f"wrote {counts['train']:,} train / {counts['val']:,} val tokens to {final}")
    return cache


def _tokenize_stream(docs, args: dict, num_threads: int, train_f, val_f) -> int:
    index = 0
    for batch in docs.iter(batch_size=256):
        arrays = _encode_documents(batch["text"], args["tokenizer"], args["dtype"], num_threads)
        val = np.array([_is_val(index + i, args["val_fraction"]) for i in range(len(arrays))])
        index += len(arrays)
        lengths = np.array([len(a) for a in arrays])
        _write_docs(np.concatenate(arrays), lengths, val, train_f, val_f)
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


# --------------------------------------------------------------------------- windows


class SlidingWindowDataset(Dataset):
    """The book's `GPTDatasetV1` windows, read lazily from a token array or memmap.

    Window i starts at token ``i * stride``: input is ``tokens[start : start + max_length]``
    and target the same shifted by one. For the same ids, `max_length` and `stride` it gives
    the same windows in the same order as ``for i in range(0, len(ids) - max_length,
    stride)``, but stores nothing: each item is sliced from `tokens` when asked for, so
    building it is O(1) in time and memory (the book's list of tensors needs 2 * max_length
    int64s per window).

    Args:
        tokens: token ids, shape (n,): an np.memmap (kept mapped, reopened by name in
            worker processes), any numpy array, a 1-D tensor or a sequence of ints.
        max_length: tokens per window (the model's context length).
        stride: tokens between the starts of consecutive windows; max_length for no
            overlap, 1 for every position.

    Raises:
        ValueError: `max_length` or `stride` below 1.
    """

    def __init__(
        self, tokens: np.ndarray | torch.Tensor | Sequence[int], max_length: int, stride: int
    ):
        _check_positive(max_length=max_length, stride=stride)
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        elif not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.max_length = max_length
        self.stride = stride
        self._len = len(range(0, max(len(tokens) - max_length, 0), stride))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window `index` as (input, target), each int64 of shape (max_length,)."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range for {self._len} windows")
        start = index * self.stride
        # One copy of max_length + 1 tokens; input and target are views into it.
        window = torch.from_numpy(self.tokens[start : start + self.max_length + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        t = self.tokens
        # Pickling a memmap would copy the whole corpus into every spawned worker; send the
        # file name instead. Only a memmap of a whole mapping (not a slice) has its own .base.
        if isinstance(t, np.memmap) and t.filename and isinstance(t.base, mmap.mmap):
            state["tokens"] = ("memmap", t.filename, t.dtype.str, t.offset, t.shape)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        t = state["tokens"]
        if isinstance(t, tuple) and t[0] == "memmap":
            _, name, dtype, offset, shape = t
            state["tokens"] = np.memmap(
                name, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape
            )
        self.__dict__.update(state)


def _check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"{name}={value!r} is invalid: use an integer of 1 or more")


def create_dataloader(
    text: str,
    batch_size: int = 4,
    max_length: int = 256,
    stride: int = 128,
    shuffle: bool = True,
    drop_last: bool = True,
    num_workers: int = 0,
    tokenizer: str = "gpt2",
) -> DataLoader:
    """The book's `create_dataloader_v1`: windows of one text in batches of (input, target).

    Tokenizes like the book (``encode(text, allowed_special={"<|endoftext|>"})``), so with
    the same `torch.manual_seed` it yields the same batches, each a pair of int64 tensors of
    shape (batch_size, max_length).

    Raises:
        ValueError: the text has fewer than max_length + 1 tokens; an argument below 1.
    """
    _check_positive(batch_size=batch_size, max_length=max_length, stride=stride)
    ids = get_tokenizer(tokenizer).encode(text, allowed_special={END_OF_TEXT})
    if len(ids) < max_length + 1:
        raise ValueError(
            f"the text has {len(ids)} tokens; max_length={max_length} needs at least "
            f"{max_length + 1} for one (input, target) window. Use a longer text or a smaller "
            "max_length"
        )
    dataset = SlidingWindowDataset(ids, max_length, stride)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        num_workers=num_workers,
    )


# --------------------------------------------------------------------------- sampling


def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Where `positions` go under a pseudo-random permutation of range(n) keyed by (seed, epoch).

    A keyed bijection (a 6-round Feistel network on the smallest even number of bits that
    holds n, with cycle walking to stay below n) instead of a shuffled array: any slice of
    the epoch's order is computed on its own, so shuffling 50M stride-1 windows takes no
    memory, and skipping to the middle of an epoch takes no time.

    Args:
        positions: positions in the epoch's order, shape (k,), each in [0, n).
        n: size of the permuted range.
        seed, epoch: the key; the permutation is a pure function of them.

    Returns:
        The window indices at those positions, shape (k,), int64.
    """
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng([seed % 2**63, epoch]).integers(0, 2**63, size=6, dtype=np.uint64)
    shift = np.uint64(half)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << shift) | right

    x = feistel(positions.astype(np.uint64))
    # Cycle walking: values that land in [n, 2^bits) step again until they are in range; as
    # 2^bits < 4n, a few steps at most, and the walk keeps the map a bijection of range(n).
    while (out := x >= n).any():
        x[out] = feistel(x[out])
    return x.astype(np.int64)


def _mix(z: np.ndarray) -> np.ndarray:
    # splitmix64's finalizer: every input bit flips about half the output bits.
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class ResumableSampler(DistributedSampler):
    """Window indices for one rank: a pure function of (seed, epoch), skippable for resume.

    Epoch e's order is `permute(range(n), n, seed, e)` (or 0..n-1 without shuffling); rank r
    takes positions r, r + world_size, r + 2 * world_size, ..., so ranks are disjoint and,
    together, complete. With `drop_last` the positions stop at a multiple of `world_size`
    (at most world_size - 1 windows a epoch left out, different ones each epoch) so every
    rank gets the same count, which DDP needs to keep gradient syncs in step; without it
    (validation) ranks may differ by one window and nothing is left out or repeated.

    Interleaving has a property resume relies on: after every rank has taken k windows, the
    first ``k * world_size`` positions of the epoch's order are used, whatever the world size.
    Memory is constant: indices are computed 64k at a time.

    It subclasses `DistributedSampler` so that Lightning, seeing a sampler that already
    shards, never wraps it in another; still create the Trainer with
    ``use_distributed_sampler=False`` to say so.

    Args:
        num_windows: the dataset's length.
        shuffle: permute each epoch; False gives 0, 1, 2, ... in order.
        seed: permutation seed.
        rank, world_size: this process's place among the DDP processes.
        drop_last: equal shares (training) rather than complete ones (validation).
        epoch: the epoch to iterate until `set_epoch` says otherwise.
        skip: windows of this rank's share to leave out at the start of `skip_epoch`.
        skip_epoch: the epoch `skip` applies to; None means `epoch`.
    """

    def __init__(
        self,
        num_windows: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        epoch: int = 0,
        skip: int = 0,
        skip_epoch: int | None = None,
    ):
        super().__init__(
            range(num_windows),
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.num_windows = num_windows
        self.epoch = epoch
        self.skip = skip
        self.skip_epoch = epoch if skip_epoch is None else skip_epoch
        self.iter_epoch: int | None = None
        """The epoch of the most recent `__iter__` (the order batches are coming from)."""

    def __len__(self) -> int:
        """Windows of this rank's full share; a resumed epoch yields `skip` fewer."""
        if self.drop_last:
            return self.num_windows // self.num_replicas
        return len(range(self.rank, self.num_windows, self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        skip = self.skip if self.epoch == self.skip_epoch else 0
        self.iter_epoch = self.epoch
        return self._indices(self.epoch, skip)

    def _indices(self, epoch: int, skip: int, chunk: int = 1 << 16) -> Iterator[int]:
        count = len(self)
        for first in range(skip, count, chunk):
            # this rank's k-th window sits at position rank + k * world_size of the order
            k = np.arange(first, min(first + chunk, count), dtype=np.int64)
            positions = self.rank + k * self.num_replicas
            if self.shuffle:
                positions = permute(positions, self.num_windows, self.seed, epoch)
            yield from positions.tolist()


# --------------------------------------------------------------------------- DataModule


class GPTDataModule(L.LightningDataModule):
    """A text corpus as (input, target) windows for Lightning, resumable mid-epoch.

    `prepare_data` tokenizes once (rank 0 of each node; later runs hit the cache) and
    `setup` memory-maps the token files. Training windows are shuffled by (seed, epoch)
    and split between DDP ranks by `ResumableSampler`; validation windows come in order,
    without overlap (stride = max_length unless `val_stride` says otherwise), also split.

    Exact resume: `state_dict` records the epoch and the training batches consumed in it,
    counted in `on_after_batch_transfer` while the trainer trains, i.e. batches that
    reached `training_step`, not batches prefetched by the loader or its workers. After
    `load_state_dict` the next `train_dataloader` starts from that epoch, skipping exactly
    those windows, and still reports the full epoch length, as Lightning's restored batch
    counter expects. Create the Trainer with ``use_distributed_sampler=False``, and do not
    override `on_after_batch_transfer` in the LightningModule (Lightning would call only the
    DataModule's). Exactness holds for the same data, batch size and world size; a change
    of world size keeps the same set of windows seen when batch * world sizes divide evenly.

    Args:
        source: corpus file, directory, glob or hub dataset name; None for the embedded
            Shakespeare corpus.
        val_source: a separate validation corpus (same forms); None splits `source`.
        val_fraction: share of documents (of tokens, for corpora with fewer than
            1 / val_fraction documents) kept for validation; 0 for none. Not used with
            `val_source` or `hub_val_split`.
        text_field: the field holding the text in json/jsonl/parquet files and hub datasets.
        hub_config: hub dataset configuration (subset) name.
        hub_split: hub dataset split to train on.
        streaming: read the corpus as a stream (tokenizing needs no Arrow copy of it).
        tokenizer: tiktoken encoding name; "gpt2" works offline.
        max_length: tokens per window (the model's context length).
        stride: tokens between training windows; None means max_length (no overlap).
        batch_size: windows per batch, per rank.
        num_workers: DataLoader worker processes.
        seed: training shuffle seed; epoch e's order depends only on (seed, e).
        cache_dir: folder for token files (and datasets' Arrow copies of local files);
            None means $GPTMINI_CACHE or ~/.cache/gptmini.
        num_proc: processes that tokenize.
        encoding_errors: bytes that are not UTF-8: "strict" raises naming the file,
            "replace" reads them as U+FFFD, "ignore" drops them.
        val_stride: tokens between validation windows; None means max_length.
        hub_val_split: validate on this split of the hub dataset (e.g. "validation")
            instead of splitting off `val_fraction`; also the split of a hub `val_source`.
    """

    def __init__(
        self,
        source: str | None = None,
        val_source: str | None = None,
        val_fraction: float = 0.05,
        text_field: str = "text",
        hub_config: str | None = None,
        hub_split: str = "train",
        streaming: bool = False,
        tokenizer: str = "gpt2",
        max_length: int = 256,
        stride: int | None = None,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 1234,
        cache_dir: str | None = None,
        num_proc: int = 1,
        encoding_errors: str = "strict",
        val_stride: int | None = None,
        hub_val_split: str | None = None,
    ):
        super().__init__()
        _check_positive(
            max_length=max_length,
            stride=stride,
            batch_size=batch_size,
            num_proc=num_proc,
            val_stride=val_stride,
        )
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} is invalid: use 0 or more")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1); 0 disables it")
        self.save_hyperparameters()
        self.source, self.val_source = source, val_source
        self.val_fraction, self.text_field = val_fraction, text_field
        self.hub_config, self.hub_split, self.hub_val_split = hub_config, hub_split, hub_val_split
        self.streaming, self.tokenizer = streaming, tokenizer
        self.max_length = max_length
        self.stride = stride or max_length
        self.val_stride = val_stride or max_length
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.cache_dir, self.num_proc, self.encoding_errors = cache_dir, num_proc, encoding_errors
        self.train_dataset: SlidingWindowDataset | None = None
        self.val_dataset: SlidingWindowDataset | None = None
        self._train_sampler: ResumableSampler | None = None
        self._resume: dict[str, int] | None = None
        self._consumed: tuple[int, int] = (0, 0)  # (epoch, training batches taken in it)

    # -- tokens

    def _spec(self, source: str | None, split: str) -> CorpusSpec:
        return resolve_source(
            source,
            text_field=self.text_field,
            hub_config=self.hub_config,
            hub_split=split,
            streaming=self.streaming,
            encoding_errors=self.encoding_errors,
        )

    def _token_arrays(self, quiet: bool) -> tuple[np.ndarray, np.ndarray, str, str]:
        """(train tokens, val tokens, train description, val description), building caches."""

        def tokenize(spec: CorpusSpec, val_fraction: float) -> TokenCache:
            return tokenize_corpus(
                spec,
                tokenizer=self.tokenizer,
                val_fraction=val_fraction,
                cache_dir=self.cache_dir,
                num_proc=self.num_proc,
                quiet=quiet,
            )

        train_spec = self._spec(self.source, self.hub_split)
        if self.val_source is not None or (train_spec.hub_name and self.hub_val_split):
            val_spec = self._spec(
                self.val_source or self.source, self.hub_val_split or self.hub_split
            )
            train = tokenize(train_spec, 0.0).load("train")
            val = tokenize(val_spec, 0.0).load("train")
            return train, val, train_spec.description, val_spec.description
        cache = tokenize(train_spec, self.val_fraction)
        name = train_spec.description
        return cache.load("train"), cache.load("val"), name, f"{name} (validation split)"

    def prepare_data(self) -> None:
        """Tokenize the corpus into the cache (Lightning calls this on one process per node)."""
        self._token_arrays(quiet=False)

    def setup(self, stage: str | None = None) -> None:
        """Memory-map the token files and build the window datasets.

        Raises:
            ValueError: the training (or validation) tokens are fewer than max_length + 1.
        """
        train, val, train_name, val_name = self._token_arrays(quiet=True)
        need = self.max_length + 1
        for tokens, name, what in ((train, train_name, "training"), (val, val_name, "validation")):
            if what == "validation" and len(tokens) == 0 and self.val_fraction == 0:
                continue
            if len(tokens) < need:
                fix = (
                    "use a larger corpus or a smaller max_length"
                    if what == "training"
                    else "raise val_fraction, pass a larger val_source, or lower max_length"
                )
                raise ValueError(
                    f"{what} corpus {name} has {len(tokens)} tokens; max_length="
                    f"{self.max_length} needs at least {need} for one window: {fix}"
                )
        self.train_dataset = SlidingWindowDataset(train, self.max_length, self.stride)
        self.val_dataset = (
            SlidingWindowDataset(val, self.max_length, self.val_stride) if len(val) else None
        )

    # -- loaders

    def _rank_and_world(self) -> tuple[int, int]:
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        return 0, 1

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches of this rank's share, resuming where a checkpoint left off."""
        if self.train_dataset is None:
            self.setup("fit")
        rank, world = self._rank_and_world()
        n = len(self.train_dataset)
        per_rank = n // world
        if per_rank < self.batch_size:
            raise ValueError(
                f"{n} training windows give each of {world} rank(s) {per_rank}, fewer than "
                f"batch_size={self.batch_size}: lower batch_size or stride, or use more data"
            )
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        epoch, skip = self._take_resume(epoch, n, world)
        self._train_sampler = ResumableSampler(
            n, shuffle=True, seed=self.seed, rank=rank, world_size=world, epoch=epoch, skip=skip
        )
        self._consumed = (epoch, skip // self.batch_size)
        return self._loader(self.train_dataset, self._train_sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches in order, this rank's share; [] when there is no validation."""
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        rank, world = self._rank_and_world()
        sampler = ResumableSampler(
            len(self.val_dataset), shuffle=False, rank=rank, world_size=world, drop_last=False
        )
        return self._loader(self.val_dataset, sampler, drop_last=False)

    def _loader(self, dataset: Dataset, sampler: ResumableSampler, drop_last: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    # -- resume

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count training batches as they reach the model (see the class docstring)."""
        trainer = self.trainer
        if trainer is not None and trainer.training and self._train_sampler is not None:
            epoch = self._train_sampler.iter_epoch
            taken = self._consumed[1] if epoch == self._consumed[0] else 0
            self._consumed = (epoch, taken + 1)
        return batch

    def state_dict(self) -> dict[str, int]:
        """Where training stands: the epoch and the batches per rank consumed in it."""
        if self._resume is not None:  # restored but not yet resumed: pass it on unchanged
            return dict(self._resume)
        rank, world = self._rank_and_world()
        epoch, batches = self._consumed
        n = len(self.train_dataset) if self.train_dataset is not None else -1
        return {
            "epoch": epoch,
            "batches": batches,
            "batch_size": self.batch_size,
            "world_size": world,
            "num_windows": n,
            "seed": self.seed,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Remember a checkpoint's position; the next `train_dataloader` resumes from it."""
        self._resume = dict(state_dict)
        # Lightning warns that a plain DataLoader cannot resume mid-epoch; this one can.
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended")

    def _take_resume(self, epoch: int, num_windows: int, world: int) -> tuple[int, int]:
        """(epoch to start, windows of this rank's share to skip), consuming the saved state."""
        state, self._resume = self._resume, None
        if state is None:
            return epoch, 0
        mine = (num_windows, self.seed, self.batch_size, world)
        saved = (state["num_windows"], state["seed"], state["batch_size"], state["world_size"])
        if mine != saved:
            warnings.warn(
                "resuming with different data settings than the checkpoint's "
                f"(windows, seed, batch_size, world_size) {saved} -> {mine}: the epoch continues "
                "after the same number of windows, but not exactly the windows left",
                stacklevel=2,
            )
        windows = state["batches"] * state["batch_size"] * state["world_size"] // world
        batches_per_epoch = num_windows // world // self.batch_size
        limit = self.trainer.limit_train_batches if self.trainer is not None else 1.0
        # An epoch cut short by Trainer(limit_train_batches) ends where Lightning ends it.
        if isinstance(limit, int):
            batches_per_epoch = min(batches_per_epoch, limit)
        elif limit < 1.0:
            batches_per_epoch = int(batches_per_epoch * limit)
        if windows // self.batch_size >= batches_per_epoch:
            return state["epoch"] + 1, 0  # the checkpoint's epoch was finished
        return state["epoch"], windows
