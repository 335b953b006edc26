"""One training run per run directory: a lock held for the run's life, whatever ends it."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import tiny_args
from lightning.pytorch import Callback

from gptmini.train.command import build_cli, fit, main
from gptmini.train.run_lock import RunInUse, is_first_process, run_lock

HOLDER = textwrap.dedent("""
    import sys
    from gptmini.train.run_lock import run_lock
    with run_lock(sys.argv[1]):
        print("locked", flush=True)
        sys.stdin.read()  # held until the test kills it: no deadline a slow machine outruns
""")


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of tmp_path/runs/tiny; yields it, kills it after."""
    directory = tmp_path / "runs" / "tiny"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_second_run_on_a_live_run_directory_is_refused_and_changes_nothing(
        tmp_path, corpus, holder, capsys):
    """Before: two train.py on one --run_name both ran, writing one checkpoint over the
    other."""
    assert main(tiny_args(tmp_path, corpus, "--trainer.max_steps", "2")) == 1
    err = capsys.readouterr().err
    assert "is in use by another training run" in err and f"pid {holder.pid}" in err
    assert "another --run_name" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "tiny" / "checkpoints").exists()


def test_the_lock_of_a_killed_run_is_not_stale(tmp_path, holder):
    directory = tmp_path / "runs" / "tiny"
    with pytest.raises(RunInUse), run_lock(directory):
        pass
    holder.send_signal(signal.SIGKILL)  # no cleanup runs: the OS drops the lock
    holder.wait()
    with run_lock(directory) as path:
        assert f'"pid": {os.getpid()}' in path.read_text()


def test_the_lock_is_released_when_the_run_fails(tmp_path, corpus):
    cli = build_cli(tiny_args(tmp_path, corpus, "--trainer.max_steps", "2"))
    cli.trainer.callbacks.append(Explodes())
    with pytest.raises(RuntimeError, match="boom"):
        fit(cli)
    with run_lock(tmp_path / "runs" / "tiny"):  # free again
        pass


def test_only_the_first_process_of_a_launch_locks(monkeypatch):
    for name in ("RANK", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert is_first_process()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert is_first_process()
    monkeypatch.setenv("NODE_RANK", "1")  # Lightning's second node
    assert not is_first_process()
    monkeypatch.setenv("NODE_RANK", "0")
    monkeypatch.setenv("RANK", "3")  # torchrun
    assert not is_first_process()


class Explodes(Callback):
    def on_train_batch_end(self, *args):
        raise RuntimeError("boom")
