"""Checkpoint files that are either whole or absent, on any filesystem.

Lightning's default writer stages a checkpoint in `$TMPDIR` and then moves it over the
target; when `$TMPDIR` is another filesystem (tmpfs /tmp, Docker volumes, NFS) the move is
a truncate-then-copy, so a kill during it leaves the target empty or partial and the
previous good checkpoint gone, and leaks a checkpoint-sized file into `$TMPDIR`. Databases
do it this way instead, and so does `atomic_save`:

1. write the new file beside the target (same directory, same filesystem),
2. flush it to the disk (fsync),
3. rename it over the target (`os.replace`: atomic within one filesystem),
4. fsync the directory, so the rename itself survives a power loss.

A kill at any point leaves either the old checkpoint or the new one, never a mix; the only
leftover can be a hidden `.<name>.tmp-<pid>` file, which the next save or the next start
of the run removes.

A sharded checkpoint is a directory (`gptmini.checkpoint.sharded`), which no rename can put
over another: `replace_directory` moves the previous one aside (`.<name>.old-<pid>`), then
the new one in, then deletes the old. Each step is one rename; a kill between the two
leaves no `<name>` but the previous checkpoint aside, which `remove_stale_temporaries` (at
the next start of the run) puts back.
"""

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import fsspec
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

TEMPORARY_MARK = ".tmp-"
PREVIOUS_MARK = ".old-"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous one at that path is unchanged."""


def temporary_path(path: Path) -> Path:
    """Where `atomic_save` writes `path` before renaming: beside it, hidden, per process."""
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{os.getpid()}")


def remove_stale_temporaries(directory: str | os.PathLike, name: str = "*") -> list[Path]:
    """Delete the temporary files and directories that killed saves left in `directory`,
    and put back a previous sharded checkpoint that a killed `replace_directory` left aside.

    Args:
        name: only the temporaries of this checkpoint's name ("*": all of them).

    Returns:
        The paths removed.
    """
    removed = []
    for aside in Path(directory).glob(f".{name}{PREVIOUS_MARK}*"):
        target = aside.with_name(aside.name[1:].rsplit(PREVIOUS_MARK, 1)[0])
        if target.exists():  # the new one is in place: the old one goes
            remove_checkpoint_path(aside)
            removed.append(aside)
        else:  # killed between the two renames: the previous one comes back
            os.replace(aside, target)
    for path in Path(directory).glob(f".{name}{TEMPORARY_MARK}*"):
        remove_checkpoint_path(path)
        removed.append(path)
    return removed


def remove_checkpoint_path(path: Path) -> None:
    """Delete a checkpoint file or a sharded checkpoint's directory; nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def replace_directory(new: Path, target: Path) -> None:
    """Put the complete directory `new` (beside `target`) in the place of `target`, a file
    or a directory or nothing, so that `target` is the old checkpoint or the new one (see
    the module's docstring); the old one is then deleted."""
    for written in (*new.iterdir(), new):  # torch.distributed.checkpoint syncs its shards
        _fsync_path(written)
    aside = target.with_name(f".{target.name}{PREVIOUS_MARK}{os.getpid()}")
    if target.exists():
        os.replace(target, aside)
    os.replace(new, target)
    _fsync_directory(target.parent)
    remove_checkpoint_path(aside)


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """`torch.save(obj)` to `path` so that `path` is always the old file or the new one.

    Raises:
        CheckpointWriteError: the disk is full or read-only, a file-size limit was hit, ...:
            the temporary file is removed and the file at `path` is as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent, path.name)  # leftovers of a save that was killed
    tmp = temporary_path(path)
    writer = None
    try:
        with open(tmp, "wb") as f:
            writer = _Writer(f)
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        # torch.save's zip writer reports a failed write as a RuntimeError of its own.
        err = writer.error if writer is not None and writer.error is not None else err
        if isinstance(err, OSError):
            reason = err.strerror or str(err)
            raise CheckpointWriteError(
                err.errno,
                f"could not write the checkpoint {path} ({reason}); the checkpoint that was "
                "there is unchanged. Free space or fix the disk, then resume with --ckpt_path "
                "last",
            ) from err
        raise err  # (the recorded one: torch would have turned it into a RuntimeError)
    _fsync_directory(path.parent)
    return path


class _Writer:
    """The file torch.save writes to, remembering the OS error (a full disk, a file-size
    limit), or the exception a signal handler raised while it wrote, that torch would
    otherwise turn into an 'unexpected pos' RuntimeError."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except BaseException as err:  # also a signal handler's exception, raised in here
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()

    def tell(self) -> int:
        return self.file.tell()


def _fsync_directory(directory: Path) -> None:
    # The rename is an entry in the directory: sync it too. Not possible everywhere
    # (Windows, some network filesystems); the rename itself is atomic regardless.
    _fsync_path(directory)


def _fsync_path(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, with local files written by `atomic_save`.

    Remote paths (s3://, gs://, ...) go through Lightning's own writer, which uploads them
    whole.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options=None
    ) -> None:
        if storage_options is not None or fsspec.utils.get_protocol(str(path)) != "file":
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_save(checkpoint, path)
