"""Checkpoint files are whole or absent: kills mid-write and after the rename, full disks."""

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import HANG_SECONDS

from gptmini.checkpoint.atomic import (
    AtomicCheckpointIO,
    CheckpointWriteError,
    atomic_save,
    remove_stale_temporaries,
    temporary_path,
)

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT = {"state_dict": {"w": torch.arange(300_000, dtype=torch.float32)}, "step": 2}

DIES = textwrap.dedent("""
    import os, sys, torch
    from pathlib import Path
    import gptmini.checkpoint.atomic as io

    path, how, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    if how == "mid-write":  # dies after writing n bytes of the new checkpoint
        real = torch.save
        def torch_save(obj, f):
            f.write(b"x" * n)
            f.flush()
            os._exit(9)
        io.torch.save = torch_save
    else:  # dies the moment the new file has replaced the old
        real = os.replace
        def replace(src, dst):
            real(src, dst)
            os._exit(9)
        io.os.replace = replace
    io.atomic_save({"state_dict": {"w": torch.ones(300_000)}, "step": 3}, path)
""")


def die_while_saving(path: Path, how: str, n: int = 0) -> int:
    proc = subprocess.run([sys.executable, "-c", DIES, str(path), how, str(n)], cwd=REPO,
                          capture_output=True, timeout=HANG_SECONDS)
    return proc.returncode


@pytest.mark.parametrize("n", [0, 1000, 1_100_000])  # nothing, a little, nearly all of it
def test_a_kill_mid_write_leaves_the_previous_checkpoint_whole(tmp_path, n):
    path = tmp_path / "last.ckpt"
    atomic_save(CHECKPOINT, path)
    before = path.read_bytes()
    assert die_while_saving(path, "mid-write", n) == 9
    assert path.read_bytes() == before  # the old checkpoint, untouched
    leftovers = list(tmp_path.glob(".last.ckpt.tmp-*"))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size == n
    atomic_save({**CHECKPOINT, "step": 4}, path)  # the next save clears the leftover
    assert not list(tmp_path.glob(".last.ckpt.tmp-*"))
    assert torch.load(path, weights_only=True)["step"] == 4


def test_a_kill_right_after_the_rename_leaves_the_new_checkpoint_whole(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_save(CHECKPOINT, path)
    assert die_while_saving(path, "after-rename") == 9
    saved = torch.load(path, weights_only=True)
    assert saved["step"] == 3 and torch.equal(saved["state_dict"]["w"], torch.ones(300_000))
    assert not list(tmp_path.glob(".*.tmp-*"))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EFBIG])
def test_a_full_or_read_only_disk_raises_a_clear_error_and_keeps_the_old_file(
    tmp_path, monkeypatch, code
):
    path = tmp_path / "last.ckpt"
    atomic_save(CHECKPOINT, path)
    before = path.read_bytes()

    def fails(obj, f):
        f.write(b"partial")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(torch, "save", fails)
    with pytest.raises(CheckpointWriteError, match=os.strerror(code)) as caught:
        atomic_save({**CHECKPOINT, "step": 3}, path)
    assert "unchanged" in str(caught.value) and "--ckpt_path last" in str(caught.value)
    assert caught.value.errno == code
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_a_signal_handlers_exception_mid_write_comes_out_as_itself(tmp_path, monkeypatch):
    """Before: a second SIGTERM landing in a save came out as torch's RuntimeError from
    the zip writer, and train.py exited 1 with a traceback instead of 143."""
    from gptmini.train.callbacks import StoppedAtOnce

    path = tmp_path / "last.ckpt"
    atomic_save(CHECKPOINT, path)
    before = path.read_bytes()

    def interrupted(obj, f):
        def signal_arrives(data):
            raise StoppedAtOnce(15)
        f.file.write = signal_arrives
        try:
            f.write(b"partial")
        except BaseException:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from None

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(StoppedAtOnce):
        atomic_save({**CHECKPOINT, "step": 3}, path)
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_nothing_is_staged_in_tmpdir(tmp_path, monkeypatch):
    """Lightning's writer staged every checkpoint in $TMPDIR, then moved it across."""
    staging = tmp_path / "tmpdir"
    staging.mkdir()
    monkeypatch.setenv("TMPDIR", str(staging))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    AtomicCheckpointIO().save_checkpoint(CHECKPOINT, tmp_path / "run" / "last.ckpt")
    assert list(staging.iterdir()) == []
    assert torch.load(tmp_path / "run" / "last.ckpt", weights_only=True)["step"] == 2


def test_stale_temporaries_are_found_by_name(tmp_path):
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    for name in ("last.ckpt", "best.ckpt"):
        temporary_path(tmp_path / name).write_bytes(b"partial")
    assert len(remove_stale_temporaries(tmp_path, "best.ckpt")) == 1
    assert [p.name for p in remove_stale_temporaries(tmp_path)] == [
        temporary_path(tmp_path / "last.ckpt").name]
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
