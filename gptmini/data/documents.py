"""Reading a corpus: documents as strings through Hugging Face `datasets` (plain-text files
without it), with errors that name the file, the line and the fix."""


import codecs
import gzip
import io
import json
import logging
import lzma
import os
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from gptmini.data.corpus import (
    COMPRESSION_SUFFIXES,
    CorpusSpec,
    default_cache_dir,
    reader_of,
)

_log = logging.getLogger("gptmini.data")


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
        return _hub_documents(spec)
    hf_cache = str(Path(cache_dir or default_cache_dir()) / "hf")
    groups: dict[str, list[str]] = {}
    for f in spec.files:
        groups.setdefault(reader_of(f), []).append(str(f))
    parts = []
    with explain_read_errors(spec):
        for builder, files in groups.items():
            docs = _read_files(builder, files, spec, hf_cache)
            where = files[0] if len(files) == 1 else f"{spec.description} ({builder} files)"
            docs = _select_text(docs, "text" if builder == "text" else spec.text_field, where)
            parts.append(_check_missing_text(docs, spec, where, files))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


class TextFiles:
    """Plain-text files as documents, one per file, read without `datasets`: the embedded
    corpus's path, on machines without datasets (a GPU machine may lack it) and without
    its import (seconds). Each file is read as `load_documents` reads it (UTF-8, universal
    newlines, the spec's encoding errors; .gz, .bz2 and .xz decompressed), so the
    documents, and so their tokens, are the same. It has what the tokenizing stages
    read of a dataset: `len` and `iter(batch_size)`."""

    def __init__(self, files: Sequence[Path], encoding_errors: str = "strict"):
        self.files, self.errors = tuple(files), encoding_errors

    def __len__(self) -> int:
        return len(self.files)

    def iter(self, batch_size: int) -> Iterator[dict[str, list[str]]]:
        """Batches of up to `batch_size` documents, {"text": [...]}, in file order."""
        for start in range(0, len(self.files), batch_size):
            yield {"text": [self.read(f) for f in self.files[start:start + batch_size]]}

    def read(self, path: Path) -> str:
        with io.TextIOWrapper(_open_binary(path), encoding="utf-8", errors=self.errors) as f:
            return f.read()


def read_documents(spec: CorpusSpec, cache_dir: str | os.PathLike | None = None):
    """The documents the tokenizing stages read: `TextFiles` when every file of a local,
    unstreamed corpus is plain text, else `load_documents`' dataset. Compressed files with
    encoding errors other than strict stay with `load_documents`, which decodes them
    without translating newlines (`_decoded_text_files`)."""
    compressed = any(f.suffix.lower() in COMPRESSION_SUFFIXES for f in spec.files)
    if (spec.hub_name is None and not spec.streaming and spec.files
            and all(reader_of(f) == "text" for f in spec.files)
            and not (compressed and spec.encoding_errors != "strict")):
        return TextFiles(spec.files, spec.encoding_errors)
    return load_documents(spec, cache_dir)


def _hub_documents(spec: CorpusSpec):
    """A hub dataset's split as documents (datasets' own cache: offline once downloaded)."""
    import datasets

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
            "files: --data.corpus.source corpus.txt, a directory, or a glob like "
            "'data/*.jsonl' (with --data.corpus.text_field for json/parquet); or download "
            "the dataset once while online so datasets' cache has it"
        ) from err
    docs = _select_text(docs, spec.text_field, spec.description)
    return _check_missing_text(docs, spec, spec.description)


def _read_files(builder: str, files: list[str], spec: CorpusSpec, hf_cache: str):
    """Local files of one format as a dataset, read by datasets' `builder` ("text", "json"
    or "parquet") with the encoding errors `spec` asks for; all their columns."""
    import datasets

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
        return _decoded_text_files(files, errors, spec, hf_cache)

    def load(data_files: list[str]):
        return datasets.load_dataset(
            builder,
            data_files=data_files,
            split="train",
            streaming=spec.streaming,
            cache_dir=None if spec.streaming else hf_cache,
            **kwargs,
        )

    try:
        with _no_reading_bars():
            return load(files)
    except Exception as err:
        if builder != "json" or len(files) == 1 or not _schema_differs(err):
            raise
        # datasets reads every json file with the first one's fields; files whose fields
        # differ are read one at a time, keeping only the text field.
        with _no_reading_bars():
            return datasets.concatenate_datasets(
                [_select_text(load([f]), spec.text_field, f, rename=False) for f in files])


@contextmanager
def _no_reading_bars() -> Iterator[None]:
    """datasets draws "Downloading data: 42/42" and "Generating train split" for local
    files: nothing is downloaded, and tokenizing draws its own bar, so those two stay
    hidden (the bars' setting is put back after)."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


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


def _schema_differs(err: BaseException) -> bool:
    return any(type(e).__name__ == "CastError" for e in _causes(err))


def _select_text(docs, text_field: str, where: str, rename: bool = True):
    columns = docs.column_names
    if columns is None:  # a streamed dataset whose features are unknown: look at one record
        columns = list(next(iter(docs), {}).keys())
    if text_field not in columns:
        hint = columns[0] if columns else "NAME"
        raise ValueError(
            f"{where} has no field {text_field!r}; its fields are {columns}. Pass the one "
            f"holding the text as text_field (--data.corpus.text_field {hint})"
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
    return docs if text_field == "text" or not rename else docs.rename_column(text_field, "text")


def _check_missing_text(docs, spec: CorpusSpec, where: str, files: Sequence[str] = ()):
    """Refuse records without the text field, or count them out with skip_missing_text.

    They used to vanish silently (an empty document each). A streamed corpus is checked
    while it is tokenized (`missing_text`).
    """
    if spec.streaming:
        return docs
    import pyarrow.compute as pc

    column = docs.data.column("text")
    if column.null_count:
        first = pc.index(pc.is_null(column), True).as_py()
        missing_text(column.null_count, len(docs), first, spec, where, files)
    return docs


def missing_text(
    missing: int, total: int, first: int, spec: CorpusSpec, where: str, files: Sequence[str] = ()
) -> None:
    """Raise, or with skip_missing_text log, that `missing` of `total` records lack text."""
    place = _record_place([Path(f) for f in files], first)
    if not spec.skip_missing_text:
        raise ValueError(
            f"{missing} of {total} records in {where} have no {spec.text_field!r} field (the "
            f"first is {place}). Fix them, or pass --data.corpus.skip_missing_text true to "
            "train on the others"
        )
    _log.info(f"skipping {missing} of {total} records in {where} that have no "
              f"{spec.text_field!r} field (the first is {place})")


def _record_place(files: list[Path], index: int) -> str:
    """Where record `index` of `files` (read in order) is: "data.jsonl line 12"."""
    for path in files:
        if path.suffix.lower() in COMPRESSION_SUFFIXES or reader_of(path) == "parquet":
            count = None  # counting would mean decoding the file; say the record number
        elif path.suffix.lower() == ".json":
            with open(path, "rb") as f:
                count = len(json.load(f))
        else:  # one record per non-blank line
            with open(path, "rb") as f:
                lines = [n for n, line in enumerate(f, start=1) if line.strip()]
            count = len(lines)
            if index < count:
                return f"{path} line {lines[index]}"
        if count is None or index < count:
            return f"{path} record {index + 1}" if count is not None else f"record {index + 1}"
        index -= count
    return f"record {index + 1}"


@contextmanager
def explain_read_errors(spec: CorpusSpec) -> Iterator[None]:
    """Turn errors from deep inside datasets into ones that name the file, line and fix.

    Bytes that are not UTF-8 (and whole files in UTF-16/32), compressed files that do not
    decompress, and json lines that do not parse.
    """
    try:
        yield
    except Exception as err:
        chain = _causes(err)
        decode = next((e for e in chain if isinstance(e, UnicodeDecodeError)), None)
        if decode is not None:
            raise _not_utf8(spec, decode) from err
        if any(isinstance(e, _DECOMPRESS_ERRORS) for e in chain):
            found = _first_undecompressable(spec.files)
            if found is not None:
                raise ValueError(
                    f"{found[0]} is not a valid {found[0].suffix} file ({found[1]}). If it is "
                    f"plain text, rename it without {found[0].suffix}; else copy it again"
                ) from err
        bad_json = _first_bad_json_line(spec.files) if _mentions_json(chain) else None
        if bad_json is not None:
            path, line, problem = bad_json
            raise ValueError(
                f"{path} line {line} is not valid JSON ({problem}); fix or remove that line "
                "(a file cut off mid-write often ends in one)"
            ) from err
        raise


_DECOMPRESS_ERRORS = (gzip.BadGzipFile, lzma.LZMAError, EOFError, zlib.error)


def _causes(err: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _mentions_json(chain: list[BaseException]) -> bool:
    return any("json" in f"{type(e).__name__} {e}".lower() for e in chain)


def _first_undecompressable(files: Sequence[Path]) -> tuple[Path, str] | None:
    for path in files:
        if path.suffix.lower() not in COMPRESSION_SUFFIXES:
            continue
        try:
            with _open_binary(path) as f:
                while f.read(1 << 20):
                    pass
        except (*_DECOMPRESS_ERRORS, OSError) as err:
            return path, str(err) or type(err).__name__
    return None


def _first_bad_json_line(files: Sequence[Path]) -> tuple[Path, int, str] | None:
    """The first line of a json-lines file that does not parse, if any."""
    for path in files:
        if reader_of(path) != "json" or path.suffix.lower() == ".json":
            continue
        with _open_binary(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except ValueError as err:
                    return path, number, str(err)
    return None


def _not_utf8(spec: CorpusSpec, cause: UnicodeDecodeError) -> ValueError:
    found = _first_undecodable(spec.files)
    encoding = _byte_order_mark(found[0]) if found else None
    if encoding is not None:  # a whole other encoding, not a few stray bytes
        return ValueError(
            f"{found[0]} is {encoding}, not UTF-8: it starts with a {encoding} byte-order "
            f"mark. Convert it: iconv -f {encoding.split()[0]} -t UTF-8 {found[0].name} > "
            f"{found[0].stem}.utf8{found[0].suffix}"
        )
    kind = _binary_kind(found[0]) if found else None
    if kind is not None:  # no text encoding to convert from: Latin-1 advice would mislead
        return ValueError(
            f"{found[0]} is not text: it is {kind}. A corpus is text (.txt, .md), json lines "
            "with a text field, or parquet; point the source at those files (UTF-16 or "
            "UTF-32 text without a byte-order mark: convert it with iconv -t UTF-8)")
    where = (
        f"{found[0]} is not valid UTF-8 (byte 0x{found[2]:02x} near offset {found[1]})"
        if found
        else f"{spec.description} is not valid UTF-8 ({cause})"
    )
    return ValueError(
        f"{where}. Convert it to UTF-8 (for Latin-1 text: iconv -f latin1 -t utf-8), or "
        "pass encoding_errors='replace' (--data.corpus.encoding_errors replace) to read bad bytes "
        "as U+FFFD, or 'ignore' to drop them"
    )


_BYTE_ORDER_MARKS = (  # longest first: UTF-32 LE starts with UTF-16 LE's mark
    (b"\xff\xfe\x00\x00", "UTF-32LE (little-endian)"),
    (b"\x00\x00\xfe\xff", "UTF-32BE (big-endian)"),
    (b"\xff\xfe", "UTF-16LE (little-endian)"),
    (b"\xfe\xff", "UTF-16BE (big-endian)"),
)


_MAGIC = ((b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"),
          (b"GIF8", "a GIF image"), (b"%PDF", "a PDF document"),
          (b"PK\x03\x04", "a zip archive (or a .docx/.xlsx, or a torch checkpoint)"),
          (b"\x1f\x8b", "gzip-compressed (name it .gz)"), (b"\x7fELF", "a program"),
          (b"SQLite format 3", "an SQLite database"))


def _binary_kind(path: Path) -> str | None:
    """What a file that is not text is (by its magic bytes, or a NUL among its first 8 KiB:
    text in any 8-bit encoding has none), or None for text in some other encoding."""
    with _open_binary(path) as f:
        head = f.read(8192)
    known = next((kind for magic, kind in _MAGIC if head.startswith(magic)), None)
    return known or ("a binary file (it holds NUL bytes)" if b"\0" in head else None)


def _byte_order_mark(path: Path) -> str | None:
    """The encoding a file's byte-order mark names, for the encodings that are not UTF-8."""
    with _open_binary(path) as f:
        head = f.read(4)
    return next((name for mark, name in _BYTE_ORDER_MARKS if head.startswith(mark)), None)


def _open_binary(path: Path) -> IO[bytes]:
    opener = COMPRESSION_SUFFIXES.get(path.suffix.lower(), open)
    return opener(path, "rb")


def _first_undecodable(files: Sequence[Path]) -> tuple[Path, int, int] | None:
    """The first (file, byte offset, byte) that is not UTF-8, reading in 1 MiB chunks."""
    for path in files:
        if reader_of(path) == "parquet":
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
