"""One training run per run directory at a time.

Two `train.py` on the same --run_name would write the same checkpoints, one over the other.
The run's process takes an exclusive lock on `<run dir>/run.lock` for its whole life. The
operating system holds it (flock on POSIX, msvcrt on Windows) and drops it when the process
ends however it ends, SIGKILL and power loss included, so a dead run never leaves a stale
lock behind: the file that remains only tells who held it last.
"""

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = "run.lock"
RANK_VARIABLES = ("RANK", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK", "SLURM_PROCID")
"""Set by torchrun, Lightning's launchers and SLURM: only the first process locks."""


class RunInUse(ValueError):
    """Another live process trains in this run directory."""


def is_first_process() -> bool:
    """Whether this is global rank 0 of a launch, judged from the launchers' variables
    (Lightning's own rank is known only once fit() has started its processes)."""
    return all(os.environ.get(name, "0") == "0" for name in RANK_VARIABLES)


@contextlib.contextmanager
def run_lock(directory: str | os.PathLike, *, enabled: bool = True) -> Iterator[Path | None]:
    """Hold `directory`'s run lock while the block runs.

    Args:
        enabled: False yields without locking (the other ranks of a launch).

    Raises:
        RunInUse: another live process holds it; the message names that process.
    """
    if not enabled:
        yield None
        return
    path = Path(directory) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as f:
        if not _try_lock(f):
            raise RunInUse(
                f"the run directory {path.parent} is in use by another training run "
                f"({_describe(f)}); wait for it to finish, or use another --run_name")
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}) + "\n")
        f.flush()
        try:
            yield path
        finally:
            _unlock(f)


def _describe(f) -> str:
    try:
        f.seek(0)
        holder = json.loads(f.read())
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):  # (Windows locks reads too)
        return "a process that has not written its name yet"


try:
    import fcntl

    def _try_lock(f) -> bool:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _unlock(f) -> None:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)

except ImportError:  # Windows
    import msvcrt

    def _try_lock(f) -> bool:
        try:
            f.seek(0)
            msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True

    def _unlock(f) -> None:
        f.seek(0)
        msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
