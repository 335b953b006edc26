"""Finding a corpus: a file, directory, glob or hub dataset name becomes a `CorpusSpec`."""


import bz2
import codecs
import difflib
import glob
import gzip
import lzma
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

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
    skip_missing_text: bool = False
    """Train on the records that have `text_field` when some lack it (default: refuse)."""
    description: str = field(default="", compare=False)

    def identity(self) -> dict[str, Any]:
        """What the token cache is keyed on: changes whenever the documents may change."""
        common = {"text_field": self.text_field, "encoding_errors": self.encoding_errors}
        if self.hub_name is not None:
            hub = {"name": self.hub_name, "config": self.hub_config, "split": self.hub_split,
                   "revision": self.hub_revision}
            return {"hub": hub, **common}
        if all(reader_of(f) == "text" for f in self.files):
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
    skip_missing_text: bool = False,
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
    check_error_handler(encoding_errors)
    options = dict(text_field=text_field, streaming=streaming, encoding_errors=encoding_errors,
                   skip_missing_text=skip_missing_text)
    if source is None:
        files = _corpus_files_in(EMBEDDED_CORPUS)
        return CorpusSpec("shakespeare", files, description="embedded Shakespeare", **options)
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.is_file():
        reader_of(path)  # fail early on an unsupported extension
        return CorpusSpec(_slug(path.name), (path.resolve(),), description=text, **options)
    if path.is_dir():
        return CorpusSpec(_slug(path.name), _corpus_files_in(path), description=text, **options)
    if glob.has_magic(text):
        return CorpusSpec(_slug(text), _files_matching(text), description=text, **options)
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
        "(for example --data.corpus.source 'data/*.txt'), or leave source unset to train on the "
        "embedded Shakespeare corpus"
    )


def check_error_handler(encoding_errors: str) -> None:
    """Raise ValueError unless `encoding_errors` names a Python codec error handler."""
    try:
        codecs.lookup_error(encoding_errors)
    except LookupError as err:
        raise ValueError(
            f"encoding_errors={encoding_errors!r} is not a Python codec error handler; "
            "use 'strict' (fail on bytes that are not UTF-8), 'replace' or 'ignore'"
        ) from err


def _files_matching(pattern: str) -> tuple[Path, ...]:
    """The files a glob matches (`**` recursive), sorted; each must be a corpus format."""
    found = sorted(Path(p).resolve()
                   for p in glob.glob(str(Path(pattern).expanduser()), recursive=True))
    files = tuple(p for p in found if p.is_file())
    if not files:
        raise FileNotFoundError(
            f"corpus glob {pattern!r} matches no files. Check the pattern (quote it so the "
            "shell does not expand it) or pass a file or directory instead"
        )
    for f in files:
        reader_of(f)
    return files


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


def reader_of(path: Path) -> str:
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


def _did_you_mean(name: str) -> str:
    """A hint naming the local file closest to `name`, if one is close."""
    parent = Path(name).parent
    try:
        here = [str(parent / p.name) if str(parent) != "." else p.name for p in parent.iterdir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(name, here, n=1, cutoff=0.6)
    return f"Did you mean the local {close[0]!r}? " if close else ""


def _slug(text: str) -> str:
    """A folder-name-safe short name: "data/books.jsonl.gz" -> "books"."""
    name = Path(text.rstrip("/")).name or text
    name = re.sub(r"(\.[A-Za-z]+)?(\.(gz|bz2|xz))?$", "", name)
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_")[:40] or "corpus"


_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def pin_revision(spec: CorpusSpec) -> CorpusSpec:
    """The same corpus with a hub dataset's revision resolved to a commit; others unchanged.

    The token cache is keyed on the commit, so a new upstream revision is tokenized again
    instead of served from a stale cache, and the documents are read at that commit. Online
    the hub says which commit a branch or tag is at; offline, `datasets` answers from the
    copy it cached. A full commit hash (--data.corpus.hub_revision) needs no lookup.

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
            f"no file or directory {spec.hub_name!r} here, so it was taken for a Hugging Face "
            f"hub dataset; but the hub could not say which revision to read ({err}), and "
            f"datasets has no cached copy. {_did_you_mean(spec.hub_name)}For a hub dataset, "
            "connect once or pin a commit with --data.corpus.hub_revision; offline, train on "
            "local files (--data.corpus.source corpus.txt, a directory, or a glob like "
            "'data/*.jsonl')"
        ) from err
    return replace(spec, hub_revision=builder.hash)
