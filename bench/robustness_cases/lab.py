"""What every case shares: a scratch folder and corpus (`Lab`), the tiny run's flags, and
how a finished process is classed."""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

TINY = ["--trainer.accelerator", "cpu", "--trainer.max_steps", "8",
        "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", "1",
        "--checkpoint_every", "4", "--sample_every", "0", "--model.context_length", "16",
        "--model.emb_dim", "32", "--model.n_heads", "2", "--model.n_layers", "2",
        "--model.warmup_steps", "2", "--model.peak_flops", "1e10", "--data.loader.batch_size", "4",
        "--data.corpus.val_fraction", "0.1"]


class Lab:
    """A scratch folder, a corpus, the tree whose scripts are run, and what several cases
    share (the server), stopped by `close`."""

    def __init__(self, tree: Path, root: Path):
        self.tree, self.root, self.n = tree, root, 0
        self.env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
                    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
                    "TIKTOKEN_CACHE_DIR": str(root / "no-tiktoken-cache")}
        lines = [f"{n} said {w} to the {t}." for n in ("Romeo", "Juliet", "Tybalt")
                 for w in ("hello", "farewell", "nothing") for t in ("moon", "sun", "night")]
        self.corpus = root / "corpus.txt"
        self.corpus.write_text("\n".join(lines * 12))
        self._shared: dict[str, Any] = {}

    def folder(self) -> Path:
        self.n += 1
        path = self.root / f"case{self.n}"
        path.mkdir()
        return path

    def args(self, where: Path, *extra: str, source: Path | str | None = None) -> list[str]:
        source = self.corpus if source is None else source
        return [*TINY, "--trainer.default_root_dir", str(where / "runs"), "--run_name", "r",
                "--data.corpus.cache_dir", str(where / "cache"),
                "--data.corpus.source", str(source), *extra]

    def run(self, script: str, *args: str, cwd: Path, timeout: float = 600, **kwargs):
        return subprocess.run([sys.executable, str(self.tree / script), *args], cwd=cwd,
                              env=self.env, capture_output=True, text=True, timeout=timeout,
                              **kwargs)

    def python(self, code: str, *args: str, cwd: Path):
        return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=self.env,
                              capture_output=True, text=True, timeout=600)

    def shared(self, name: str, start: Callable[["Lab"], Any]) -> Any:
        """The `name` thing several cases use, started by `start(lab)` for the first."""
        if name not in self._shared:
            self._shared[name] = start(self)
        return self._shared[name]

    def close(self) -> None:
        """Stop what `shared` started."""
        for thing in self._shared.values():
            thing.stop()
        self._shared = {}


def outcome(proc) -> str:
    if "Traceback (most recent call last)" in proc.stderr:
        return "traceback"
    return "ok" if proc.returncode == 0 else "clear error"


def last_line(proc) -> str:
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1][:150] if lines else ""


def trained(lab: Lab, where: Path) -> Path:
    """The last.ckpt of a two-step run in `where`."""
    lab.run("train.py", *lab.args(where, "--trainer.max_steps", "2"), cwd=where)
    return where / "runs" / "r" / "checkpoints" / "last.ckpt"
