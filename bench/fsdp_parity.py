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
from gptmini.checkpoint.sharded import consolidate

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

    def __init__(self, out: Path, copy_at: int | None, stop_at: int | None = None):
        self.out, self.copy_at, self.stop_at = out, copy_at, stop_at
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
        if trainer.global_step == self.stop_at:  # as an interrupted run stops: last.ckpt
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module):
        record = {"losses": self.losses, "windows": self.windows, "epochs": self.epochs,
                  "step": trainer.global_step, "world_size": trainer.world_size,
                  "environment": type(getattr(trainer.strategy, "cluster_environment",
                                              None)).__name__}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def train_process(out: str, args: list[str]) -> int:
    """One training process: train.py's `args`, recorded into `out` (see Recorder)."""
    from gptmini.train.command import build_cli, fit

    copy_at, stop_at = (os.environ.get(f"PARITY_{name}_AT") for name in ("COPY", "STOP"))
    cli = build_cli(args)
    cli.trainer.callbacks.append(Recorder(Path(out), int(copy_at) if copy_at else None,
                                          int(stop_at) if stop_at else None))
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
           stop_at: int | None = None, commands: list[list[str]] | None = None,
           each_env: list[dict] | None = None) -> list[dict]:
    """Run train.py's `args` as `name`; each rank's record. `copy_at`: keep last.ckpt of
    that step; `stop_at`: stop there, as an interrupted run (the schedule is the whole
    run's). `commands`: how to start it, all at once (torchrun on each node), `each_env`
    their own variables; by default one process, which Lightning starts again per rank."""
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO),
           "PARITY_COPY_AT": "" if copy_at is None else str(copy_at),
           "PARITY_STOP_AT": "" if stop_at is None else str(stop_at)}
    starts = commands or [[sys.executable, str(HERE)]]
    envs = each_env or [{}] * len(starts)
    procs = [subprocess.Popen([*start, "--train", str(out), "--", *args], env={**env, **own},
                              cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for start, own in zip(starts, envs, strict=True)]  # at once: one job's nodes
    try:
        done = [(proc.communicate(timeout=900), proc.returncode) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for (_, err), code in done:
        if code:
            raise RuntimeError(f"{name} failed ({code}): {err[-3000:]}")
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
    """Two FSDP2 ranks at `batch` against one process at 2 x `batch`, and the floor of
    such a difference: one process against itself, its steps in two micro-batches."""
    one = launch(root, f"one-{optimizer}", run_args(root, f"one-{optimizer}", steps=steps,
                                                    batch=2 * batch, shape=shape,
                                                    optimizer=optimizer))
    two = launch(root, f"fsdp2-{optimizer}", run_args(
        root, f"fsdp2-{optimizer}", steps=steps, batch=batch, shape=shape, optimizer=optimizer,
        extra=("--trainer.strategy", "fsdp2", "--trainer.devices", "2")))
    a, b = global_losses(one), global_losses(two)
    largest = max(abs(x - y) for x, y in zip(a, b, strict=True))
    # The floor: one process against itself, the same windows a step in two micro-batches
    # (the gradient summed in another order, as two ranks sum it). Lightning records each
    # micro-batch's loss divided by the accumulation: a step's loss is the two added.
    halves = launch(root, f"accumulated-{optimizer}", run_args(
        root, f"accumulated-{optimizer}", steps=steps, batch=batch, shape=shape,
        optimizer=optimizer, extra=("--trainer.accumulate_grad_batches", "2")))[0]["losses"]
    accumulated = [x + y for x, y in zip(halves[::2], halves[1::2], strict=True)]
    return {"steps": len(a), "largest_loss_difference": largest,
            "floor": max(abs(x - y) for x, y in zip(accumulated, a, strict=True)),
            "one_process_losses": a, "two_rank_losses": b, "two_rank_records": two,
            "weights_difference": largest_difference(
                weights(checkpoint(root, f"one-{optimizer}")),
                weights(checkpoint(root, f"fsdp2-{optimizer}")))}


FSDP2_ON = ("--trainer.strategy", "fsdp2", "--trainer.devices")


def resume(root: Path, optimizer: str, steps: int, at: int, shape: dict, batch: int = 4) -> dict:
    """A checkpoint of step `at` resumed to `steps`, each against the straight run of the
    checkpoint's own run (the same state at `at`): on two ranks from two (bit for bit), on
    one FSDP2 rank from two (2 -> 1; also against the one process), on two from the one
    process's file (1 -> 2), and unsharded from the two ranks' checkpoint consolidated into
    one file; and the two straight runs' `parity`."""
    def run(name: str, *extra: str, per_rank: int = batch, copy: bool = False) -> list[dict]:
        args = run_args(root, name, steps=steps, batch=per_rank, shape=shape,
                        optimizer=optimizer, extra=extra)
        return launch(root, name, args, copy_at=at if copy else None)

    one = run(f"one-{optimizer}", per_rank=2 * batch, copy=True)
    two = run(f"fsdp2-{optimizer}", *FSDP2_ON, "2", copy=True)
    sharded = checkpoint(root, f"fsdp2-{optimizer}", f"step{at}.ckpt")
    single = checkpoint(root, f"one-{optimizer}", f"step{at}.ckpt")
    again = run(f"2to2-{optimizer}", *FSDP2_ON, "2", "--ckpt_path", str(sharded))
    to_one = run(f"2to1-{optimizer}", *FSDP2_ON, "1", "--ckpt_path", str(sharded),
                 per_rank=2 * batch)
    to_two = run(f"1to2-{optimizer}", *FSDP2_ON, "2", "--ckpt_path", str(single))
    whole = consolidate(sharded, root / f"step{at}-{optimizer}-consolidated.ckpt")
    unsharded = run(f"whole-{optimizer}", "--ckpt_path", str(whole), per_rank=2 * batch)
    straight, two_straight = global_losses(one)[at:], global_losses(two)[at:]

    def against(records: list[dict], losses: list[float], name: str, reference: str) -> dict:
        got = global_losses(records)
        return {"steps": len(got),
                "largest_loss_difference": max(abs(x - y)
                                               for x, y in zip(got, losses, strict=True)),
                "weights_difference": largest_difference(weights(checkpoint(root, name)),
                                                         weights(checkpoint(root, reference)))}

    return {"parity": {"largest_loss_difference": max(
                abs(x - y) for x, y in zip(global_losses(one), global_losses(two), strict=True)),
                       "one_process": one, "two_ranks": two},
            "same_world_size": against(again, two_straight, f"2to2-{optimizer}",
                                       f"fsdp2-{optimizer}"),
            # each against the straight run of the checkpoint's own run (the same state)
            "consolidated_to_one": against(unsharded, two_straight, f"whole-{optimizer}",
                                           f"fsdp2-{optimizer}"),
            "two_to_one": against(to_one, two_straight, f"2to1-{optimizer}",
                                  f"fsdp2-{optimizer}"),
            "two_to_one_vs_one_process": against(to_one, straight, f"2to1-{optimizer}",
                                                 f"one-{optimizer}"),
            "one_to_two": against(to_two, straight, f"1to2-{optimizer}", f"one-{optimizer}"),
            "sharded": sharded, "single": single, "consolidated": whole}


def torchrun(nodes: int, per_node: int, port: int) -> list[list[str]]:
    """The torchrun command of each node of a job on 127.0.0.1 (gloo over loopback)."""
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
             "--nproc_per_node", str(per_node), "--node_rank", str(rank), "--master_addr",
             "127.0.0.1", "--master_port", str(port), str(HERE)] for rank in range(nodes)]


def nodes(root: Path, optimizer: str, steps: int, at: int, shape: dict,
          batch: int = 4) -> dict:
    """torchrun --nnodes 2 (one process each), stopped at step `at` and resumed, and the
    same 2-node job started as SLURM's srun starts it (its variables faked), against torchrun
    with one node of two processes straight to `steps`; and that against one process."""
    def args(name: str, *extra: str) -> list[str]:
        return run_args(root, name, steps=steps, batch=batch, shape=shape,
                        optimizer=optimizer, extra=("--trainer.strategy", "fsdp2", *extra))

    one_node = launch(root, "one-node", args("one-node", "--trainer.devices", "2"),
                      commands=torchrun(1, 2, free_port()))
    two = ("--trainer.num_nodes", "2", "--trainer.devices", "1")
    launch(root, "two-nodes", args("two-nodes", *two), stop_at=at,
           commands=torchrun(2, 1, free_port()))
    resumed = launch(root, "two-nodes", args("two-nodes", *two, "--ckpt_path", "last"),
                     commands=torchrun(2, 1, free_port()))
    slurm = launch(root, "slurm", args("slurm", *two), commands=[
        [sys.executable, str(HERE)]] * 2, each_env=slurm_variables(2, free_port()))
    one = launch(root, "one-process", run_args(root, "one-process", steps=steps,
                                               batch=2 * batch, shape=shape,
                                               optimizer=optimizer))
    a = weights(checkpoint(root, "one-node"))
    b = weights(checkpoint(root, "two-nodes"))
    straight = global_losses(one_node)
    return {"steps": resumed[0]["step"], "resumed_at": at,
            "bit_for_bit": all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys(),
            "weights_difference": largest_difference(a, b),
            "losses_equal": global_losses(resumed) == straight[at:],
            "slurm_losses_equal": global_losses(slurm) == straight,
            "environments": {"slurm": [r["environment"] for r in slurm],
                             "torchrun": [r["environment"] for r in resumed]},
            "one_process_loss_difference": max(
                abs(x - y) for x, y in zip(global_losses(one), straight, strict=True))}


def slurm_variables(nodes: int, port: int) -> list[dict]:
    """What srun sets for one task on each of `nodes` nodes (the variables Lightning's
    SLURMEnvironment reads), on 127.0.0.1."""
    return [{"SLURM_NTASKS": str(nodes), "SLURM_NNODES": str(nodes), "SLURM_PROCID": str(r),
             "SLURM_LOCALID": "0", "SLURM_NODEID": str(r), "SLURM_JOB_ID": "4747",
             "SLURM_JOB_NAME": "gptmini", "SLURM_NODELIST": "127.0.0.1",
             "SLURM_NTASKS_PER_NODE": "1", "MASTER_PORT": str(port)} for r in range(nodes)]


def model_config(shape: str):
    """The model of `shape`: "default" (the default run's, its 4,096-token vocabulary),
    "124m" (GPT-2 124M, the book's GPT_CONFIG_124M) or "tiny"."""
    import yaml

    from gptmini.model import GPT_CONFIG_124M, GPTConfig

    if shape == "124m":
        return GPTConfig(**GPT_CONFIG_124M)
    if shape == "tiny":
        return GPTConfig(vocab_size=64, **TINY)
    config = yaml.safe_load((REPO / "gptmini" / "configs" / "shakespeare-cpu.yaml").read_text())
    fields = set(GPTConfig.__dataclass_fields__)
    return GPTConfig(vocab_size=4096, **{k: v for k, v in config["model"].items() if k in fields})


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the parameters and optimizer states this process holds (a DTensor's
    local shard)."""
    from torch.distributed.tensor import DTensor

    def size(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    states = [v for s in optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor)]
    return sum(size(p) for p in model.parameters()) + sum(size(v) for v in states)


def bytes_after_a_step(shape: str, optimizer: str, mesh=None) -> int:
    """`held_bytes` after one optimizer step of the `shape` model, sharded over `mesh`
    (FSDP2, as --trainer.strategy fsdp2 shards) or whole."""
    from gptmini.model import GPTModel, lm_loss
    from gptmini.train.optim import OptimizerSettings, make_optimizer
    from gptmini.train.sharding import shard_model

    torch.manual_seed(0)
    cfg = model_config(shape)
    model = GPTModel(cfg)
    if mesh is not None:
        shard_model(model, mesh, "32-true", compile=False)
    settings = OptimizerSettings(optimizer, learning_rate=1e-3, muon_learning_rate=1e-3,
                                 weight_decay=0.1, beta1=0.9, beta2=0.95, warmup_steps=0,
                                 min_lr_ratio=0.1)
    opt = make_optimizer(model, settings, torch.device("cpu"))
    batch = torch.randint(0, cfg.vocab_size, (1, 9))
    lm_loss(model, batch[:, :-1], batch[:, 1:]).backward()
    opt.step()
    return held_bytes(model, opt)


def _memory_rank(rank: int, world: int, port: int, shape: str, optimizer: str, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    held = bytes_after_a_step(shape, optimizer, init_device_mesh("cpu", (world,)))
    Path(out, f"rank{rank}.bytes").write_text(str(held))
    torch.distributed.destroy_process_group()


def memory(root: Path, shape: str, optimizer: str, world: int = 2) -> dict:
    """Each rank's bytes of parameters and optimizer states at `world` ranks over one
    process's (`held_bytes`, after one step)."""
    out = root / f"memory-{shape}-{optimizer}"
    out.mkdir(parents=True, exist_ok=True)
    torch.multiprocessing.spawn(_memory_rank, args=(world, free_port(), shape, optimizer,
                                                    str(out)), nprocs=world)
    per_rank = [int((out / f"rank{r}.bytes").read_text()) for r in range(world)]
    whole = bytes_after_a_step(shape, optimizer)
    return {"one_process_bytes": whole, "per_rank_bytes": per_rank,
            "ratio": max(per_rank) / whole}


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
                  f"weights within {got['weights_difference']:.2e}; the floor (one process "
                  f"against itself with 2 micro-batches a step) {got['floor']:.2e}", flush=True)
    if opts.only in (None, "resume"):
        for optimizer in ("adamw", "muon"):
            got = resume(root / "resume", optimizer, opts.steps, opts.at, shape)
            for case, said in (("same_world_size", "2 -> 2 ranks against the straight run"),
                               ("two_to_one", "2 -> 1 against the 2 ranks' straight run"),
                               ("two_to_one_vs_one_process", "2 -> 1 against one process's "
                                                             "straight run"),
                               ("one_to_two", "1 -> 2 against one process's straight run"),
                               ("consolidated_to_one", "2 -> consolidated file -> one "
                                                       "unsharded process against the 2 "
                                                       "ranks' straight run")):
                f = got[case]
                print(f"resume {optimizer} at step {opts.at}, {said}: loss of {f['steps']} "
                      f"steps within {f['largest_loss_difference']:.2e}, final weights within "
                      f"{f['weights_difference']:.2e}", flush=True)
    if opts.only in (None, "memory"):
        for name in ("default", "124m"):
            for optimizer in ("adamw", "muon"):
                got = memory(root, name, optimizer)
                print(f"memory {name} {optimizer}: parameters + optimizer states "
                      f"{got['one_process_bytes'] / 2**20:,.1f} MiB in one process, "
                      f"{max(got['per_rank_bytes']) / 2**20:,.1f} MiB per rank at 2 ranks: "
                      f"{got['ratio']:.3f}x (goal <= 0.55x)", flush=True)
    if opts.only in (None, "nodes"):
        got = nodes(root / "nodes", "adamw", opts.steps, opts.at, shape)
        print(f"nodes: torchrun --nnodes 2 on 127.0.0.1, {got['resumed_at']} steps then resumed "
              f"to {got['steps']}, against one node of 2 processes: bit for bit "
              f"{got['bit_for_bit']} (weights within {got['weights_difference']:.1e}), losses "
              f"after the resume equal: {got['losses_equal']}; SLURM's variables (2 nodes) "
              f"losses equal: {got['slurm_losses_equal']}; one node against one process "
              f"(adamw): loss within {got['one_process_loss_difference']:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
