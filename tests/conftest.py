"""Shared fixtures, and the rule that tests never reach the network.

Offline variables are set before anything imports datasets or huggingface_hub (so the
processes tests start inherit them too), tiktoken's download is stubbed, and a socket may
only connect to this machine (loopback or a Unix socket).
"""

import filecmp
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                  WANDB_MODE="offline", WANDB_SILENT="true")

# datasets' log handler binds sys.stderr when first imported: import it now, under the
# session's stream, not inside a test whose captured stream later closes ("--- Logging error ---").
# Where it is not installed (a GPU machine running tests/test_gpu.py for bench/gpu_proof.py)
# nothing can bind, and no test that runs there needs it.
try:
    import datasets  # noqa: F401
except ImportError:
    pass
import pytest  # noqa: E402
import tiktoken.load  # noqa: E402
import torch  # noqa: E402
from helpers import HANG_SECONDS, write_corpus, write_metrics  # noqa: E402

from gptmini.model import GPTConfig  # noqa: E402


def _local_only(connect):
    def guarded(sock, address, *args):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = address[0]
            if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
                raise ConnectionError(f"tests never reach the network (tried {address})")
        return connect(sock, address, *args)

    return guarded


@pytest.fixture(autouse=True)
def _eager_flex(monkeypatch):
    """FlexAttention uncompiled (the same math, no minutes of compiling); the tests of the
    compiled kernel switch it back on. The flex kernel reads the variable at every call."""
    monkeypatch.setenv("GPTMINI_COMPILE_FLEX", "0")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    def no_download(*args, **kwargs):
        raise ConnectionError("tests never download (tiktoken tried to fetch a vocabulary)")

    monkeypatch.setattr(tiktoken.load, "read_file", no_download)
    monkeypatch.setattr(socket.socket, "connect", _local_only(socket.socket.connect))
    monkeypatch.setattr(socket.socket, "connect_ex", _local_only(socket.socket.connect_ex))


@pytest.fixture
def tiny_config() -> GPTConfig:
    """2 layers, 2 heads, emb_dim 16, vocab 64: the smallest model that exercises everything."""
    return GPTConfig(
        vocab_size=64, context_length=32, emb_dim=16, n_heads=2, n_layers=2, drop_rate=0.0
    )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run stopped after step 30, resumed from its step-20 checkpoint, up to step 50.

    Validations are written as Lightning writes them: the one after step 40 on row 39."""
    run = tmp_path / "runs" / "demo"
    first, second = [], []
    for step in range(10, 31, 10):
        first.append({"epoch": 0, "step": step, "train/loss": 9 - step / 10, "train/lr": 1e-3})
    first.append({"epoch": 0, "step": 29, "val/loss": 8.5, "val/ppl": 4914.8})
    for step in range(20, 51, 10):  # steps 20 and 30 run again after the resume
        second.append({"epoch": 0, "step": step, "train/loss": 5 - step / 100, "train/lr": 5e-4})
    second.append({"epoch": 1, "step": 39, "val/loss": 4.0, "val/ppl": 54.6})
    write_metrics(run / "logs" / "version_0" / "metrics.csv", first)
    write_metrics(run / "logs" / "version_1" / "metrics.csv", second)
    return run


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus.txt", repeats=12)


class PackageCopy:
    """A copy of the gptmini package in a folder of its own: a test adds to it what a
    contributor would, runs Python against it in a fresh process, and asks which files it
    changed."""

    def __init__(self, root: Path):
        self.original = Path(__file__).resolve().parents[1] / "gptmini"
        self.root = root
        shutil.copytree(self.original, root / "gptmini",
                        ignore=shutil.ignore_patterns("__pycache__"))

    def write(self, path: str, text: str) -> None:
        """A new file at `path` (relative to the package)."""
        (self.root / "gptmini" / path).write_text(text)

    def insert_after(self, path: str, anchor: str, line: str) -> None:
        """`line` on a line of its own after the first line holding `anchor`."""
        file = self.root / "gptmini" / path
        lines = file.read_text().splitlines(keepends=True)
        at = next(i for i, text in enumerate(lines) if anchor in text)
        lines.insert(at + 1, line + "\n")
        file.write_text("".join(lines))

    def changed(self) -> list[str]:
        """The package's files that differ from the original's, or are new."""
        found = []
        for file in sorted((self.root / "gptmini").rglob("*.py")):
            name = file.relative_to(self.root / "gptmini")
            before = self.original / name
            if not before.exists() or not filecmp.cmp(file, before, shallow=False):
                found.append(str(name))
        return found

    def run(self, code: str) -> str:
        """`code` run by a fresh interpreter that imports gptmini from this copy; its stdout.

        Raises:
            AssertionError: the process failed (with its stderr).
        """
        env = {**os.environ, "PYTHONPATH": str(self.root), "OMP_NUM_THREADS": "1"}
        check = f"import gptmini; assert gptmini.__file__.startswith({str(self.root)!r})\n"
        done = subprocess.run([sys.executable, "-c", check + code], cwd=self.root, env=env,
                              capture_output=True, text=True, timeout=HANG_SECONDS)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout


@pytest.fixture
def package_copy(tmp_path) -> PackageCopy:
    """A copy of the gptmini package to extend, as a contributor would (see PackageCopy)."""
    return PackageCopy(tmp_path / "copy")
