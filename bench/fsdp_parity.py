"""FSDP2 (--trainer.strategy fsdp2) against one process, on CPUs with gloo: the figures of
issue 47's goals, each from train.py runs (the LightningModule, the DataModule, checkpoints).

- parity: two ranks at micro-batch b against one process at 2b (the same global batch, the
  same windows), fp32, AdamW and Muon: the largest difference of the loss over the steps
  (the two ranks' mean against the one process's).
- resume: a sharded checkpoint taken mid-run (step `at`) resumed on two ranks (bit for bit
  against the run that went straight on), on one rank (2 -> 1) and from the one-process
  run's single file on two ranks (1 -> 2), each against the one process's straight run.
- memory: the bytes of parameters and optimizer states each rank holds at two ranks, over
  one process's, after one step (the local shards counted: no timing).
- nodes: torchrun --nnodes 2 (one process each, twice on 127.0.0.1) against torchrun with
  one node of two processes: the weights after the same steps, bit for bit.

    python bench/fsdp_parity.py [--steps 20] [--at 10] [--shape tiny|default|124m] [--only NAME]

The machine's CPU is printed; times are not figures here (only differences and bytes).
`python bench/fsdp_parity.py --train OUT -- ARGS` is one training process (what the
functions launch, and what Lightning and torchrun start again for each rank).
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback

from gptmini.checkpoint import read_checkpoint

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
TINY = {"context_length": 16, "emb_dim": 32, "n_heads": 2, "n_layers": 2}
"""The shape tests train (seconds a run)."""
DEFAULT = {}
"""The default run's own model (its config's shape)."""
GPT2_124M = {"context_length": 1024, "emb_dim": 768, "n_heads": 12, "n_layers": 12}


class Recorder(Callback):
    """Each rank's loss at every step and the windows it trained on (their first ids), and
    a copy of last.ckpt as it was at step `copy_at`, written to `out` when training ends."""

    def __init__(self, out: Path, copy_at: int | None):
        self.out, self.copy_at = out, copy_at
        self.losses: list[float] = []
        self.windows: list[list[int]] = []
        self.epochs: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # Checkpoint callbacks run last at a batch's end: at the next batch's start
        # last.ckpt holds the step just ended.
        if trainer.global_step == self.copy_at and trainer.is_global_zero:
            last = Path(trainer.checkpoint_callback.dirpath) / "last.ckpt"
            copy = last.with_name(f"step{self.copy_at}.ckpt")
            (shutil.copytree if last.is_dir() else shutil.copy2)(last, copy)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.windows += [row[:6].tolist() for row in batch[0]]
        self.epochs += [trainer.current_epoch] * len(batch[0])

    def on_train_end(self, trainer, pl_module):
        record = {"losses": self.losses, "windows": self.windows, "epochs": self.epochs,
                  "step": trainer.global_step, "world_size": trainer.world_size}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def train_process(out: str, args: list[str]) -> int:
    """One training process: train.py's `args`, recorded into `out` (see Recorder)."""
    from gptmini.train.command import build_cli, fit

    copy_at = os.environ.get("PARITY_COPY_AT")
    cli = build_cli(args)
    cli.trainer.callbacks.append(Recorder(Path(out), int(copy_at) if copy_at else None))
    fit(cli)
    return 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def corpus(root: Path) -> Path:
    """Numbers: no two windows alike, so the windows a run trained on can be counted."""
    path = root / "numbers.txt"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        path.write_text(" ".join(str(i) for i in range(1500)))
    return path


def run_args(root: Path, name: str, *, steps: int, batch: int, shape: dict,
             optimizer: str, extra: tuple[str, ...] = ()) -> list[str]:
    """train.py's flags for a recorded run `name` under `root`: fp32, no dropout, a
    checkpoint every step (what `Recorder` copies), validation off."""
    shape_flags = [f"--model.{k}={v}" for k, v in shape.items()]
    return ["--trainer.default_root_dir", str(root / name), "--run_name", "run",
            "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
            "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.log_every_n_steps", "1",
            "--checkpoint_every", "1", "--sample_every", "0", "--model.drop_rate", "0.0",
            "--model.compile", "false", "--model.peak_flops", "1e10",
            "--model.warmup_steps", "2", "--model.optimizer", optimizer,
            "--model.tokenizer", "gpt2", "--data.corpus.source", str(corpus(root)),
            "--data.corpus.cache_dir", str(root / "cache"), "--data.corpus.val_fraction", "0.1",
            "--data.loader.batch_size", str(batch), *shape_flags, *extra]


def launch(root: Path, name: str, args: list[str], *, copy_at: int | None = None,
           command: list[str] | None = None, env: dict | None = None) -> list[dict]:
    """Run train.py's `args` as `name` (`command`: how to start it, e.g. torchrun's; one
    process by default, which Lightning starts again per rank); each rank's record."""
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO),
           "PARITY_COPY_AT": "" if copy_at is None else str(copy_at), **(env or {})}
    starts = [command or [sys.executable, str(HERE)]]
    done = [subprocess.run([*start, "--train", str(out), "--", *args], env=env, cwd=root,
                           capture_output=True, text=True, timeout=900) for start in starts]
    for proc in done:
        if proc.returncode:
            raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def global_losses(records: list[dict]) -> list[float]:
    """The loss of each step over every rank (equal batches: the ranks' mean)."""
    return [sum(r["losses"][i] for r in records) / len(records)
            for i in range(len(records[0]["losses"]))]


def checkpoint(root: Path, name: str, file: str = "last.ckpt") -> Path:
    return root / name / "run" / "checkpoints" / file


def weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights, file or sharded directory, whole."""
    return read_checkpoint(path)["state_dict"]


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:4]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def parity(root: Path, optimizer: str, steps: int, shape: dict, batch: int = 4) -> dict:
    """Two FSDP2 ranks at `batch` against one process at 2 x `batch`."""
    one = launch(root, f"one-{optimizer}", run_args(root, f"one-{optimizer}", steps=steps,
                                                    batch=2 * batch, shape=shape,
                                                    optimizer=optimizer))
    two = launch(root, f"fsdp2-{optimizer}", run_args(
        root, f"fsdp2-{optimizer}", steps=steps, batch=batch, shape=shape, optimizer=optimizer,
        extra=("--trainer.strategy", "fsdp2", "--trainer.devices", "2")))
    a, b = global_losses(one), global_losses(two)
    largest = max(abs(x - y) for x, y in zip(a, b, strict=True))
    return {"steps": len(a), "largest_loss_difference": largest,
            "one_process_losses": a, "two_rank_losses": b, "two_rank_records": two,
            "weights_difference": largest_difference(
                weights(checkpoint(root, f"one-{optimizer}")),
                weights(checkpoint(root, f"fsdp2-{optimizer}")))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--train"]:
        return train_process(argv[1], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--at", type=int, default=10)
    parser.add_argument("--shape", choices=("tiny", "default", "124m"), default="tiny")
    parser.add_argument("--only", choices=("parity", "resume", "memory", "nodes"))
    parser.add_argument("--root", default=None, help="where the runs go (a temporary folder)")
    opts = parser.parse_args(argv)
    import tempfile

    from machine import cpu_description

    root = Path(opts.root or tempfile.mkdtemp(prefix="fsdp-parity-"))
    shape = {"tiny": TINY, "default": DEFAULT, "124m": GPT2_124M}[opts.shape]
    print(f"CPU: {cpu_description()}, torch {torch.__version__}; runs in {root}", flush=True)
    if opts.only in (None, "parity"):
        for optimizer in ("adamw", "muon"):
            got = parity(root, optimizer, opts.steps, shape)
            print(f"parity {optimizer}: {got['steps']} steps, loss of 2 FSDP2 ranks vs 1 "
                  f"process within {got['largest_loss_difference']:.2e} (goal 1e-5); final "
                  f"weights within {got['weights_difference']:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
