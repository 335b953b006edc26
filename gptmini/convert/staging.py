"""A directory written whole or not at all: what `export_hf` writes its model into.

As a checkpoint file is (gptmini.checkpoint.atomic), a model directory is first written
beside its target (same parent, same filesystem, hidden: `.<name>.tmp-<pid>`), flushed,
and only then swapped in: the old directory is renamed aside, the new one renamed to the
target, and the old one deleted. A failure while writing (a full disk, a file-size limit,
Ctrl-C) removes the new directory and leaves the old one as it was; no file of the old
export is ever replaced by one of the new (a new tokenizer.json beside old weights).

A kill in the instant between the two renames leaves the old directory at
`.<name>.old-<pid>`; the next write to the same target puts it back first.

Only a directory holding a model's files (`MODEL_FILES`) is replaced: anything else in
it (notes, a README, sub-folders) is refused by name rather than deleted with it.
"""

import contextlib
import fnmatch
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MODEL_FILES", "staged_directory"]

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors",
               "model-*-of-*.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "merges.txt", "tokenizer.model")
"""The files of a Hugging Face model directory (patterns): what a new export replaces."""
_STAGE, _OLD = ".tmp-", ".old-"


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike) -> Iterator[Path]:
    """A new, empty directory to fill; on a clean exit it replaces `target` whole.

    Yields:
        The directory to write into (beside `target`, made with the usual permissions).

    Raises:
        ValueError: `target` is a file, or a directory holding other files than a model's
            (named), which would be lost; nothing is written.
        OSError: writing or swapping failed; `target` is as it was and the new directory
            is removed.
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    _recover(target)
    _check_replaceable(target)
    stage = target.with_name(f".{target.name}{_STAGE}{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)  # a save of this process that was killed
    os.mkdir(stage)  # not mkdtemp: its 0700 would make the export unreadable to the group
    try:
        yield stage
        _sync_files(stage)
        _swap(stage, target)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _check_replaceable(target: Path) -> None:
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} is a file, not a directory: export to a directory path")
    if not target.is_dir():
        return
    others = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir()
                    if p.is_dir() or not any(fnmatch.fnmatch(p.name, pattern)
                                             for pattern in MODEL_FILES))
    if others:
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        raise ValueError(
            f"{target} holds files that are not a model's ({', '.join(others[:5])}{more}), "
            "and an export replaces the whole directory: export into a new or empty "
            "directory, or one that holds only an earlier export")


def _recover(target: Path) -> None:
    """Put back an old directory that a kill between the two renames left aside, and
    delete the leftovers of swaps and writes that were killed."""
    olds = sorted(target.parent.glob(f".{target.name}{_OLD}*"))
    if olds and not target.exists():
        os.replace(olds.pop(), target)
    for leftover in [*olds, *target.parent.glob(f".{target.name}{_STAGE}*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def _swap(stage: Path, target: Path) -> None:
    # rename(2) cannot replace a non-empty directory: the old one steps aside first.
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}{_OLD}{os.getpid()}")
        os.replace(target, old)
    try:
        os.replace(stage, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)
        raise
    _sync(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sync_files(directory: Path) -> None:
    """Flush every file and the directory itself to the disk before the swap."""
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _sync(directory)


def _sync(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not possible everywhere (Windows, some NFS)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
