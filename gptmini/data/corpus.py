"""Corpora in: a file, directory, glob or hub dataset name to documents (one string each)."""

import bz2
import codecs
import glob
import gzip
import json
import lzma
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

EMBEDDED_CORPUS = Path(__file__).parents[1] / "assets" / "shakespeare"
"""The default corpus: 42 works of Shakespeare as .txt.gz files (see assets/NOTICE)."""

TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown")
JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
# datasets decompresses these on the fly; the UTF-8 check below opens them the same way.
COMPRESSION_SUFFIXES = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_KNOWN = ", ".join(TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES)  # for messages
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def default_cache_dir() -> Path:
    """Where token files go unless told otherwise: $GPTMINI_CACHE, else ~/.cache/gptmini."""
    if env := os.environ.get("GPTMINI_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gptmini"



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
    hub_revision: str | None = None
    """A branch, tag or commit of the hub dataset; `pin_revision` turns it into a commit."""
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
            hub = {"name": self.hub_name, "config": self.hub_config, "split": self.hub_split,
                   "revision": self.hub_revision}
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
    hub_revision: str | None = None,
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
            hub_revision=hub_revision,
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
                spec.hub_name,
                spec.hub_config,
                split=spec.hub_split,
                revision=spec.hub_revision,
                streaming=spec.streaming,
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


_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def pin_revision(spec: CorpusSpec) -> CorpusSpec:
    """The same corpus with a hub dataset's revision resolved to a commit; others unchanged.

    The token cache is keyed on the commit, so a new upstream revision is tokenized again
    instead of served from a stale cache, and the documents are read at that commit. Online
    the hub says which commit a branch or tag is at; offline, `datasets` answers from the
    copy it cached. A full commit hash (--data.hub_revision) needs no lookup.

    Raises:
        ConnectionError: offline, with no cached copy of the dataset to name a commit.
    """
    if spec.hub_name is None or (spec.hub_revision and _COMMIT.match(spec.hub_revision)):
        return spec
    import datasets

    try:
        builder = datasets.load_dataset_builder(
            spec.hub_name, spec.hub_config, revision=spec.hub_revision
        )
    except (ConnectionError, FileNotFoundError) as err:
        raise ConnectionError(
            f"cannot tell which revision of hub dataset {spec.hub_name!r} to read: the hub is "
            f"out of reach and datasets has no cached copy ({err}). Connect once, or pass a "
            "commit hash with --data.hub_revision; offline, train on local files instead "
            "(--data.source corpus.txt, a directory, or a glob like 'data/*.jsonl')"
        ) from err
    return replace(spec, hub_revision=builder.hash)


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

