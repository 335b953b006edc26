"""Training inside another program (pytest, a notebook) gives that program its signals back:
the run saves at a step, then Ctrl-C is the caller's KeyboardInterrupt and SIGTERM the
caller's handler. train.py's own exits (128 + the number) are tested in test_resume.py."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import HANG_SECONDS, tiny_args
from lightning.pytorch import Callback

from gptmini.train.callbacks import RunInterrupted
from gptmini.train.command import build_cli, fit

REPO = Path(__file__).resolve().parents[2]


class SignalWhen(Callback):
    """Sends `signum` to this process at a Lightning hook: after optimizer step 2's batch,
    or at the start of fit (before training installs its handlers)."""

    def __init__(self, signum: int, at_fit_start: bool = False):
        self.signum, self.at_fit_start = signum, at_fit_start

    def on_fit_start(self, trainer, *args):
        if self.at_fit_start:
            os.kill(os.getpid(), self.signum)

    def on_train_batch_end(self, trainer, *args):
        if not self.at_fit_start and trainer.global_step == 2:
            os.kill(os.getpid(), self.signum)


def test_a_sigterm_goes_on_to_the_callers_handler_after_the_save(tmp_path, corpus):
    """Before: the run kept the SIGTERM to itself; a program running it never heard of it."""
    heard = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: heard.append(signum))
    try:
        cli = build_cli(tiny_args(tmp_path, corpus, "--trainer.max_steps", "10"))
        cli.trainer.callbacks.insert(0, SignalWhen(signal.SIGTERM))
        with pytest.raises(RunInterrupted):
            fit(cli)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert heard == [signal.SIGTERM]
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2  # saved first


def test_ctrl_c_before_training_is_the_callers_and_ctrl_c_still_works_after(tmp_path, corpus):
    """Before: Lightning turned it into SystemExit(1) and left SIGINT ignored for the rest of
    the process, so pytest ignored every later Ctrl-C. The caller's handler is Python's own,
    set here: an earlier test of the session may have left another (in the whole suite one
    did, and this test failed there while passing alone)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cli = build_cli(tiny_args(tmp_path, corpus, "--trainer.max_steps", "10"))
    cli.trainer.callbacks.insert(0, SignalWhen(signal.SIGINT, at_fit_start=True))
    try:
        with pytest.raises(KeyboardInterrupt):
            fit(cli)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


INNER = textwrap.dedent("""
    import json, os
    from gptmini.train.command import main

    ARGS = json.loads(os.environ["RUN_ARGS"])

    def test_first():
        main([*ARGS, "--run_name", "first"])

    def test_second():
        main([*ARGS, "--run_name", "second"])
""")


@pytest.mark.slow
def test_ctrl_c_ends_a_pytest_session_that_trains_in_process(tmp_path, corpus):
    """Before: each test's run caught the Ctrl-C, saved, and pytest went on to the next
    test's run, which caught the next Ctrl-C: pytest ignored them all."""
    (tmp_path / "test_inner.py").write_text(INNER)
    endless = ["--trainer.max_steps", "100000", "--checkpoint_every", "100000",
               "--trainer.val_check_interval", "100000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "RUN_ARGS": json.dumps(tiny_args(tmp_path, corpus, *endless))}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "test_inner.py"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    runs = tmp_path / "runs"
    deadline = time.monotonic() + HANG_SECONDS  # a hang guard, not a speed test
    try:
        metrics = runs / "first" / "logs" / "version_0" / "metrics.csv"
        while not (metrics.is_file() and "train/loss" in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        while proc.poll() is None:
            assert not (runs / "second").exists(), "pytest went on to the next test"
            assert time.monotonic() < deadline, "pytest did not end"
            time.sleep(0.1)
        out = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 2 and "KeyboardInterrupt" in out, out[-3000:]  # interrupted
    last = runs / "first" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] > 0  # after the run saved
