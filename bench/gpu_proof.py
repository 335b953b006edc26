"""The GPU path proven in one command, its figures written to gpu_proof.json and .md.

Part 1, the headline (one command of at most 8 minutes): the device parity check in float32
and bf16 (gptmini.testing.device); GPT-2 124M training at context 1024, compiled, bf16-mixed
(tokens/s and MFU through the LightningModule and a plain loop, peak memory); decoding at
batch 1 and 64 (eager); FSDP2 on one GPU (train, then resume from its checkpoint); the GPU
tests (`pytest -m gpu tests/test_gpu.py`). Part 2, more speed: the largest micro-batch
(tokens/s and MFU at each) and compiled decoding. Part 3, runs: the GPU config
(configs/shakespeare-gpu.yaml) trained for a fixed number of steps and scored in bits per
byte on its whole validation split; the engine at the 124M shape with 256 requests sharing
a prefix, against one request alone.

Each part fits a few minutes of a GPU (a machine billed by the minute, a scheduler's short
slot): its items run in order while --budget lasts (an item found past it is written "out of
time"; long items stop themselves at it), and the figures file is rewritten after every
item, so a killed command still leaves what it measured. No part imports datasets or wandb;
those that run train.py (the GPU tests, FSDP2, the default run) need jsonargparse and
rustbpe: docs/benchmarks.md says how to carry them to a machine without a package index.

    python bench/gpu_proof.py --out DIR               # part 1, the headline
    python bench/gpu_proof.py --part 2 --out DIR      # then --part 3 (one command each)
    python bench/gpu_proof.py --merge A.json B.json C.json --out DIR   # the parts in one file
    python bench/gpu_proof.py --device cpu --tiny --part 1 2 3   # every part on tiny shapes
"""

import argparse
import datetime
import gc
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning
import numpy as np
import torch
import yaml
from bench_gpu import (
    GPT2,
    TINY,
    decoding_figures,
    describe,
    largest_batch,
    model_figures,
    training_figures,
)

from gptmini.analysis.evaluate import score_text
from gptmini.checkpoint import consolidate, read_checkpoint
from gptmini.generate.engine import Engine
from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights
from gptmini.model.flops import flops_per_token
from gptmini.testing.device import check_device
from gptmini.train.command import build_cli, fit

REPO = Path(__file__).resolve().parents[1]
GPU_CONFIG = REPO / "configs" / "shakespeare-gpu.yaml"
LLMC_TOKENS_PER_S, H100_BF16_PEAK = 470_000, 989.4e12
"""llm.c's GPT-2 124M on one H100 SXM (140 ms per 524,288-token step on 8 of them), and
that GPU's dense bf16 peak: MFU by the same formula as ours, for comparison."""
TINY_RUN = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
            "--model.compile", "false", "--model.n_layers", "1", "--model.emb_dim", "32",
            "--model.n_heads", "2", "--model.context_length", "32",
            "--data.loader.batch_size", "4", "--data.loader.num_workers", "0",
            "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
            "--checkpoint_every", "2", "--model.warmup_steps", "1"]
"""What --tiny changes in the GPU config's runs: a CPU, no compiling, a tiny model."""
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                   "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
"""What torch.distributed (Lightning, for the fsdp item) sets in this process's environment."""


@dataclass
class Proof:
    """What every item is given: where to run, how small, where to write, until when."""

    device: torch.device
    tiny: bool
    out: Path
    """The figures file's folder (--out)."""
    runs: Path
    """Training runs' folder (checkpoints stay out of `out`)."""
    deadline: float
    """time.monotonic() at which the part's budget ends."""
    run_steps: int
    micro_batch: int = 16
    """The training item's micro-batch (124M at context 1024)."""

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def shape(self) -> dict:
        return TINY if self.tiny else GPT2


# --- part 1: the headline ------------------------------------------------------------------


def gpu_tests(proof: Proof) -> dict:
    """tests/test_gpu.py in a process of its own; counts and failures from its JUnit XML."""
    xml, log = proof.out / "gpu_tests.xml", proof.out / "gpu_tests.log"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p",
               "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py", f"--junitxml={xml}"]
    # Not the process group the fsdp item left behind: on one H200 the tests' own FSDP2 run
    # inherited its MASTER_PORT and failed with EADDRINUSE (the proof still listens on it).
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env = {**env, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with log.open("w") as output:
        subprocess.run(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
                       timeout=max(proof.left(), 1))
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('name')}: {bad.get('message', '')[:200]}"
              for case in suite.iter("testcase")
              for bad in [*case.findall("failure"), *case.findall("error")]]
    status = ("failed" if failed or counts["tests"] == 0 else
              "skipped" if counts["skipped"] == counts["tests"] else "ok")
    return {"status": status, **counts, "failed": failed,
            "headline": f"{counts['tests'] - counts['skipped'] - len(failed)} passed, "
                        f"{len(failed)} failed, {counts['skipped']} skipped (log: gpu_tests.log)"}


def parity(proof: Proof) -> dict:
    report = check_device(proof.device, (torch.float32, torch.bfloat16))
    cases = [{"dtype": str(c.dtype).removeprefix("torch."), "backend": c.backend,
              "passed": c.passed, "worst": c.worst, "tolerance": c.tolerance, "line": c.line()}
             for c in report.cases]
    passed = sum(c["passed"] for c in cases)
    return {"status": "ok" if report.passed else "failed", "versions": report.versions,
            "cases": cases, "headline": f"{passed} of {len(cases)} cases within tolerance "
                                        "(forward, backward, an AdamW step against CPU float64)"}


def train_args(proof: Proof, name: str, steps: int, *extra: str) -> list[str]:
    """train.py's flags for a run of the GPU config under the proof's runs folder."""
    return ["--config", str(GPU_CONFIG), "--trainer.default_root_dir", str(proof.runs),
            "--run_name", name, "--trainer.max_steps", str(steps),
            "--trainer.enable_progress_bar", "false", *(TINY_RUN if proof.tiny else []),
            *extra]


def fsdp(proof: Proof) -> dict:
    """The GPU config under --trainer.strategy fsdp2 with Muon (the sharded Muon's
    all-to-alls on NCCL, FSDP2's bf16 gathers): N steps, then N more resumed from its
    sharded last.ckpt, whose consolidated file must hold the same weights. Compiled as the
    config says; if that fails, again without compiling, so the figures say which breaks.
    On a CPU (--tiny) it runs on gloo."""
    steps = 2 if proof.tiny else 20
    figures: dict = {}
    for compiled in ("true", "false"):
        shutil.rmtree(proof.runs / "fsdp2", ignore_errors=True)
        flags = ["--trainer.strategy", "fsdp2", "--model.optimizer", "muon",
                 "--model.compile", compiled, "--checkpoint_every", str(steps),
                 "--trainer.val_check_interval", str(steps)]
        try:
            started = time.perf_counter()
            fit(build_cli(train_args(proof, "fsdp2", steps, *flags)))
            last = proof.runs / "fsdp2" / "checkpoints" / "last.ckpt"
            again = build_cli(train_args(proof, "fsdp2", 2 * steps, *flags, "--ckpt_path",
                                         "last"))
            fit(again)
            seconds = time.perf_counter() - started
            whole = read_checkpoint(consolidate(last))["state_dict"]
            sharded = read_checkpoint(last)["state_dict"]
        except Exception as err:  # noqa: BLE001 - a failure is a figure: said, not raised
            figures[f"compile_{compiled}_error"] = (
                f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}")
            continue
        loss = again.trainer.callback_metrics.get("train/loss")
        same = whole.keys() == sharded.keys() and all(torch.equal(whole[k], sharded[k])
                                                      for k in whole)
        return {**figures, "status": "ok" if same else "failed", "compiled": compiled == "true",
                "steps": again.trainer.global_step, "resumed_from_step": steps,
                "seconds": seconds, "checkpoint": "directory" if last.is_dir() else "file",
                "consolidated_equal": same,
                "final_train_loss": None if loss is None else float(loss),
                "headline": f"FSDP2 + Muon: {steps} steps, then resumed from last.ckpt ("
                            f"{'sharded, a directory' if last.is_dir() else 'one file'}) to "
                            f"{again.trainer.global_step} in {seconds:.0f} s; compiled: "
                            f"{compiled}; consolidated file equal: {same}"}
    return {**figures, "status": "failed", "headline": "FSDP2 failed compiled and not"}


def training(proof: Proof) -> dict:
    """124M at context 1024 through the LightningModule and a plain loop, at micro-batch 16
    (--micro_batch; the largest that fits is part 2's)."""
    figures = training_figures(proof.shape, proof.device,
                               **(dict(batch=4, steps=3, warmup=1) if proof.tiny
                                  else dict(batch=proof.micro_batch)), tries=())
    lit, plain = figures["lightning_mfu"], figures["plain_mfu"]
    mfu = (f"MFU {lit:.1%} Lightning, {plain:.1%} plain (goal >= 45% Lightning; llm.c "
           f"~{LLMC_TOKENS_PER_S * flops_per_token(GPTConfig(**GPT2)) / H100_BF16_PEAK:.0%})"
           if lit and plain else "MFU unknown (no peak for this device)")
    for key in ("largest_micro_batch", "tokens_per_s_by_micro_batch", "mfu_by_micro_batch"):
        figures.pop(key)
    return {**figures, "status": "ok",
            "headline": f"{figures['lightning_tokens_per_s']:,.0f} tokens/s Lightning, "
                        f"{figures['plain_tokens_per_s']:,.0f} plain; {mfu}; peak "
                        f"{figures['peak_memory_bytes'] / 2**30:.1f} GiB"}


def decoding(proof: Proof, modes: tuple[bool, ...] = (False,)) -> dict:
    """Greedy KV-cache decoding at batch 1 and 64 (`modes`: compiled or not)."""
    figures = decoding_figures(proof.shape, proof.device, new_tokens=8 if proof.tiny else 128,
                               deadline=proof.deadline - 120, modes=modes)  # compiles: minutes
    said = [f"{label} {rates['1']:,.0f} tokens/s at batch 1, {rates['64']:,.0f} at 64"
            for label in ("eager", "compiled")
            if (rates := figures.get(f"{label}_tokens_per_s"))]
    return {**figures, "status": "ok" if said else "out of time",
            "headline": "; ".join(said) or "not started"}


# --- part 2: more speed ---------------------------------------------------------------------


def micro_batches(proof: Proof) -> dict:
    """The largest power-of-two micro-batch whose compiled step fits, with tokens/s and MFU
    at each (the plain loop)."""
    model = model_figures(proof.shape, proof.device)
    largest, rates = largest_batch(proof.shape, proof.device, proof.device.type == "cuda",
                                   (4, 8) if proof.tiny else (16, 32, 64, 128),
                                   deadline=proof.deadline - 60)
    peak = model["peak_bf16_flops"]
    mfu = {str(b): model["flops_per_token"] * r / peak if peak else None
           for b, r in rates.items()}
    return {**model, "status": "ok", "largest_micro_batch": largest,
            "tokens_per_s_by_micro_batch": {str(b): r for b, r in rates.items()},
            "mfu_by_micro_batch": mfu,
            "headline": f"largest micro-batch {largest}; " + ", ".join(
                f"{b}: {r:,.0f} tokens/s" for b, r in rates.items())}


def decoding_compiled(proof: Proof) -> dict:
    return decoding(proof, modes=(True,))


# --- part 3: the default run on the GPU, the engine ----------------------------------------


def default_run(proof: Proof) -> dict:
    """The GPU config for --run_steps steps (stopped early by the budget, if need be, which
    the figures then say), then bits per byte over its whole validation split."""
    shutil.rmtree(proof.runs / "default-run", ignore_errors=True)
    seconds = int(proof.left() - (10 if proof.tiny else 90))  # the engine's time
    if seconds < 30:
        return {"status": "out of time", "headline": f"{seconds} s left: not started"}
    stop = f"00:{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    start = time.perf_counter()
    cli = build_cli(train_args(proof, "default-run", proof.run_steps, "--trainer.max_time",
                               stop))
    fit(cli)
    took = time.perf_counter() - start
    trained = cli.model.model  # compiled in place: score a plain copy (no recompiling)
    model = GPTModel(cli.model.cfg)
    model.load_state_dict(trained.state_dict())
    model = model.to(cli.model.device).eval()
    tokens = np.asarray(cli.datamodule.val_dataset.tokens)
    score = score_text(model, cli.model.tokenizer, tokens,
                       batch_size=4 if proof.tiny else 64, progress=False)
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()
               if k in ("val/bpb", "val/loss", "train/tokens_per_sec", "train/mfu")}
    steps = cli.trainer.global_step
    return {"status": "ok" if steps == proof.run_steps else "out of time",
            "steps": steps, "steps_asked": proof.run_steps, "seconds": took,
            "val_bpb_whole_split": score.bpb, "val_loss_whole_split": score.loss,
            "val_tokens": score.tokens, "last_logged": metrics,
            "headline": f"{steps} of {proof.run_steps} steps in {took:.0f} s; "
                        f"{score.bpb:.4f} bits per byte on the whole validation split"}


def engine(proof: Proof) -> dict:
    """256 requests whose prompts share a prefix, greedy, through the engine at batch 64,
    against one such request alone; the prefix's blocks are computed once and reused."""
    cfg = GPTConfig(**proof.shape)
    dtype = torch.bfloat16 if proof.device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = init_gpt2_weights(GPTModel(cfg)).to(proof.device, dtype).eval()
    prefix_len, own_len, new = (16, 4, 4) if proof.tiny else (512, 64, 128)
    rng = random.Random(0)

    def prompt(prefix: list[int]) -> list[int]:
        return prefix + [rng.randrange(cfg.vocab_size) for _ in range(own_len)]

    shared = [rng.randrange(cfg.vocab_size) for _ in range(prefix_len)]
    prompts = [prompt(shared) for _ in range(256)]
    rates = {}
    for batch in (1, 64):
        run = Engine(model, max_batch=batch)
        run.generate([prompt([1] * prefix_len)], max_new_tokens=2)  # warm-up
        before = run.num_prefilled
        todo = prompts[:1] if batch == 1 else prompts
        if proof.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        done = run.generate(todo, max_new_tokens=new, temperature=0.0)
        if proof.device.type == "cuda":
            torch.cuda.synchronize()
        rates[batch] = len(todo) * new / (time.perf_counter() - start)
        assert all(len(r.tokens) == new for r in done), "a request stopped early"
    prefilled = run.num_prefilled - before  # of the 256, at batch 64
    asked = sum(len(p) for p in prompts)
    return {"status": "ok", "requests": len(prompts), "prefix_tokens": prefix_len,
            "prompt_tokens": asked, "prefilled_tokens": prefilled,
            "prefix_reuse": 1 - prefilled / asked, "new_tokens_each": new,
            "dtype": str(dtype).removeprefix("torch."),
            "tokens_per_s_batch_1": rates[1], "tokens_per_s_batch_64": rates[64],
            "batch_64_vs_1": rates[64] / rates[1],
            "headline": f"{rates[64]:,.0f} tokens/s at batch 64 against {rates[1]:,.0f} "
                        f"alone ({rates[64] / rates[1]:.1f}x); {prefilled:,} of {asked:,} "
                        "prompt tokens computed (the rest from cached prefix blocks)"}


PARTS: dict[int, tuple[Callable[[Proof], dict], ...]] = {
    1: (parity, training, decoding, fsdp, gpu_tests), 2: (micro_batches, decoding_compiled),
    3: (default_run, engine)}
"""Part 1 is the headline, in the order the figures matter if the command is cut short."""


# --- the figures file ----------------------------------------------------------------------


def machine(device: torch.device) -> dict:
    return {"device": describe(device), "torch": torch.__version__,
            "cuda": torch.version.cuda, "lightning": lightning.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def write(figures: dict, out: Path) -> None:
    """gpu_proof.json, and gpu_proof.md: one table row per item, with its headline."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_proof.json").write_text(json.dumps(figures, indent=2) + "\n")
    m = figures["machine"]
    lines = [f"# GPU proof: {m['device']}", "",
             f"torch {m['torch']} (CUDA {m['cuda']}), Lightning {m['lightning']}, Python "
             f"{m['python']}, {m['date']}; tiny shapes: {figures['tiny']}", "",
             "| part | item | status | seconds | figures |", "| --- | --- | --- | --- | --- |"]
    for name, item in figures["items"].items():
        said = item.get("headline") or item.get("error", "")
        lines.append(f"| {item['part']} | {name} | {item['status']} | {item['seconds']:.0f} | "
                     f"{said} |")
    (out / "gpu_proof.md").write_text("\n".join(lines) + "\n")


def run_parts(proof: Proof, parts: list[int]) -> dict:
    proof.out.mkdir(parents=True, exist_ok=True)
    figures = {"machine": machine(proof.device), "tiny": proof.tiny, "parts": parts,
               "reference": {"llmc_tokens_per_s_per_h100": LLMC_TOKENS_PER_S,
                             "llmc_mfu_same_formula": LLMC_TOKENS_PER_S * flops_per_token(
                                 GPTConfig(**GPT2)) / H100_BF16_PEAK},
               "items": {}}
    for part in parts:
        for item in PARTS[part]:
            name, start = item.__name__, time.monotonic()
            print(f"\n=== part {part}: {name} ({proof.left():.0f} s left)", flush=True)
            result = run_item(item, proof) if proof.left() > 0 else {"status": "out of time"}
            result = {"part": part, **result, "seconds": time.monotonic() - start}
            figures["items"][name] = result
            print(f"=== {name}: {result['status']}: {result.get('headline', '')}", flush=True)
            write(figures, proof.out)
    return figures


def run_item(item: Callable[[Proof], dict], proof: Proof) -> dict:
    """An item's figures; a failure is said in them (with the traceback on stderr), and the
    next item starts from a clean slate."""
    try:
        return item(proof)
    except subprocess.TimeoutExpired:
        return {"status": "out of time"}
    except Exception as err:  # noqa: BLE001 - said in the file; the next item runs
        traceback.print_exc()
        lines = str(err).strip().splitlines() or [""]
        return {"status": "error", "error": f"{type(err).__name__}: {lines[0][:300]}"}
    finally:
        gc.collect()
        torch._dynamo.reset()  # each item compiles afresh, within dynamo's cache limits
        if proof.device.type == "cuda":
            torch.cuda.empty_cache()


def merge(paths: list[Path], out: Path) -> dict:
    """The parts' files (one per command) as one file: items and parts together."""
    files = [json.loads(p.read_text()) for p in paths]
    figures = {**files[0], "parts": sorted({p for f in files for p in f["parts"]}),
               "items": {k: v for f in files for k, v in f["items"].items()}}
    write(figures, out)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", type=int, nargs="+", choices=sorted(PARTS), default=[1],
                        help="which parts (default: 1, the headline; one command each)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke test)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-proof",
                        help="folder of gpu_proof.json and .md")
    parser.add_argument("--runs", type=Path, default=REPO / "runs" / "gpu-proof",
                        help="folder of the training runs' checkpoints")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds for all the parts asked (the headline's: 480)")
    parser.add_argument("--run_steps", type=int, default=None,
                        help="the default run's steps (default: the GPU config's, 5000; 4 "
                             "with --tiny)")
    parser.add_argument("--micro_batch", type=int, default=16,
                        help="part 1's training micro-batch (124M at context 1024; 16 took "
                             "8.5 GiB on an H200; llm.c trains at 64)")
    parser.add_argument("--merge", type=Path, nargs="+", help="gpu_proof.json files to merge")
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.merge, args.out)
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpu_proof.py: --device {args.device}: no CUDA GPU here (torch "
              f"{torch.__version__}); use --device cpu --tiny to smoke-test", file=sys.stderr)
        return 2
    steps = args.run_steps or (4 if args.tiny else
                               yaml.safe_load(GPU_CONFIG.read_text())["trainer"]["max_steps"])
    proof = Proof(device, args.tiny, args.out, args.runs, time.monotonic() + args.budget, steps,
                  args.micro_batch)
    figures = run_parts(proof, sorted(set(args.part)))
    bad = [k for k, v in figures["items"].items() if v["status"] in ("failed", "error")]
    print(f"\nfigures: {args.out / 'gpu_proof.md'}" + (f"; not ok: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
