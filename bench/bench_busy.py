"""The default run alone and beside a busy competitor: first compile and steady state apart.

Runs train.py's default recipe (no config, no flags but a step cap and a run directory of
its own) in a fresh process per measurement, compiled (the default) and eager
(`--model.compile false`), each alone and beside one competitor: a process spinning on one
core, as a browser tab or a second job would. Every compiled run starts from an empty
compile cache, so its first step pays what a new user's first run pays (tracing, then g++
building the kernels, here with the competitor on the other core). Prints the CPU, then per
run: startup (imports, data, model), the first step (compiling, for a compiled run), the
steady state (median step, tokens/s), the wall clock of the capped run and the full run's
projected from those parts (startup, first step, the rest of the default run's steps at the
median step, its validations; in float32 the run's steps are its config's
cpu_float32_steps, as train.py plans them); then the
goals of issue 48: beside the competitor at least 0.4x the steady throughput alone, and at
most 2.5x the whole wall clock alone. The mode `unordered` is the compiled run without
`deterministic_kernels` (gptmini/train/compiling.py): beside `compiled`, what exact runs cost.

    python bench/bench_busy.py                     # 100 steps x 4 runs: about 10-20 minutes
    python bench/bench_busy.py --steps 960         # the full default run, 4 times
    python bench/bench_busy.py --modes compiled --beside 1 -- --trainer.precision 32-true
    python bench/bench_busy.py --threads 1 2 --beside 1   # the thread count beside a job
    python bench/bench_busy.py --modes compiled unordered --beside 0   # determinism's cost

Arguments after `--` go to train.py (e.g. a precision, to see an AVX2-only CPU's float32).
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "gptmini" / "configs" / "shakespeare-cpu.yaml"
SPINNER = "while True: pass"


def child(spec: dict) -> None:
    """One measured run, as train.py starts it (the OpenMP policy before torch loads, glibc
    keeping freed memory), with a clock on every step; writes its figures to spec["out"]."""
    from gptmini.threads import sleep_when_idle

    sleep_when_idle()
    import torch
    from lightning.pytorch import Callback

    from gptmini.train.command import build_cli, fit, keep_freed_memory
    from gptmini.train.plan import float32_on_cpu

    class StepClock(Callback):
        def __init__(self):
            self.ends: list[float] = []
            self.validations: list[float] = []
            self.start = self.tokens = 0

        def on_train_start(self, trainer, pl_module):
            self.start = time.time()  # the parent's clock: startup counts from its launch

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.time())
            self.tokens = batch[0].numel()

        def on_validation_start(self, trainer, pl_module):
            self.validations.append(time.time())

        def on_validation_end(self, trainer, pl_module):
            self.validations[-1] = time.time() - self.validations[-1]

    keep_freed_memory()
    if spec["unordered"]:  # what determinism costs: the compiled run without its switch
        import gptmini.train.command

        gptmini.train.command.deterministic_kernels = lambda *args: contextlib.nullcontext()
    cli = build_cli(spec["args"])
    clock = StepClock()
    cli.trainer.callbacks.append(clock)
    fit(cli)
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]
    from torch._dynamo.utils import compile_times, counters  # a benchmark may look inside

    names, seconds = compile_times(repr="csv", aggregate=True)
    phases = sorted(zip(names, map(float, seconds), strict=True), key=lambda p: -p[1])
    Path(spec["out"]).write_text(json.dumps({
        "graphs": counters["stats"]["unique_graphs"], "phases": phases[:4],
        "startup": clock.start - spec["t0"], "first_step": clock.ends[0] - clock.start,
        "median_step": statistics.median(steps[2:] or steps),
        "validation": statistics.fmean(clock.validations or [0.0]),
        "tokens_per_step": clock.tokens,
        "threads": torch.get_num_threads(), "precision": str(cli.trainer.precision),
        "float32": float32_on_cpu(cli.config, cli.config.trainer.precision),
        "compiled": bool(cli.model.compiled)}))


def measure(mode: str, competitors: int, steps: int, extra: list[str], root: Path,
            threads: int | None = None, name: str = "") -> dict:
    """A fresh process training the default recipe for `steps` steps beside `competitors`
    spinning processes (on `threads` OpenMP threads; None: the default); its figures and
    its whole wall clock."""
    name = name or f"{mode}-beside-{competitors}-threads-{threads or 'default'}"
    out = root / f"{name}.json"
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    every = config["trainer"]["val_check_interval"]
    args = ["--trainer.default_root_dir", str(root / "runs"), "--run_name", name,
            "--trainer.max_steps", str(steps), "--trainer.enable_progress_bar", "false",
            "--trainer.val_check_interval", str(min(steps, every)),  # one at least
            "--model.compile", str(mode != "eager").lower(), *extra]
    cache = tempfile.mkdtemp(prefix="inductor-", dir=root)  # a first run's empty cache
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": path}  # this tree
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    spinners = [subprocess.Popen([sys.executable, "-c", SPINNER]) for _ in range(competitors)]
    try:
        start = time.time()
        spec = {"args": args, "out": str(out), "t0": start, "unordered": mode == "unordered"}
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                              cwd=REPO, capture_output=True, text=True)
        wall = time.time() - start
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    figures = json.loads(out.read_text())
    # the whole default run's steps as train.py plans them (float32 on a CPU: fewer)
    full = (config["cpu_float32_steps"] if figures["float32"]
            else config["trainer"]["max_steps"])
    validations = -(-full // every)  # every `every` steps, and after the last
    projected = (figures["startup"] + figures["first_step"]  # samples and saves left out
                 + (full - 1) * figures["median_step"] + validations * figures["validation"])
    return {**figures, "mode": mode, "competitors": competitors, "wall": wall,
            "projected": projected, "full_steps": full,
            "tokens_per_sec": figures["tokens_per_step"] / figures["median_step"]}


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def where(row: dict) -> str:
    return "alone" if not row["competitors"] else f"beside {row['competitors']} busy"


def whole(row: dict, steps: int) -> tuple[float, str]:
    """The whole default run's wall clock: measured when the run was whole, else projected."""
    return (row["wall"], "measured") if steps >= row["full_steps"] else (row["projected"],
                                                                         "projected")


def table(rows: list[dict], steps: int) -> None:
    """Every run's parts: startup, the first step (compiling, for a compiled run) and the
    steady state apart."""
    full = rows[0]["full_steps"]  # one precision for every run
    print(f"{'run':34s} {'startup':>8s} {'first step':>11s} {'median step':>12s} {'tokens/s':>9s}"
          f" {'wall, ' + str(steps) + ' steps':>17s} {'projected ' + str(full):>16s}")
    for r in rows:
        print(f"{r['kind'] + ', ' + where(r):34s} {r['startup']:7.1f}s {r['first_step']:10.1f}s"
              f" {1000 * r['median_step']:10.1f}ms {r['tokens_per_sec']:9,.0f}"
              f" {minutes(r['wall']):>17s} {minutes(r['projected']):>16s}")
    for r in rows:
        if r["compiled"]:
            phases = ", ".join(f"{name} {sec:.1f}s" for name, sec in r["phases"])
            print(f"  {r['kind']}, {where(r)}: {r['graphs']} graph(s) compiled;"
                  f" slowest phases (nested): {phases}")


def goals(rows: list[dict], steps: int) -> None:
    """Issue 48's two goals per kind of run, alone and beside the competitor side by side:
    at least 0.4x the steady throughput alone, at most 2.5x the whole wall clock alone."""
    for kind in dict.fromkeys(r["kind"] for r in rows):
        alone = next((r for r in rows if r["kind"] == kind and not r["competitors"]), None)
        for busy in (r for r in rows if r["kind"] == kind and r["competitors"] and alone):
            rate = busy["tokens_per_sec"] / alone["tokens_per_sec"]
            (wall_alone, how), (wall_busy, _) = whole(alone, steps), whole(busy, steps)
            print(f"{kind}, alone | {where(busy)}:\n"
                  f"  first step {alone['first_step']:.1f} s | {busy['first_step']:.1f} s\n"
                  f"  steady {alone['tokens_per_sec']:,.0f} | {busy['tokens_per_sec']:,.0f}"
                  f" tokens/s: {rate:.2f}x (goal >= 0.4: {'met' if rate >= 0.4 else 'missed'})\n"
                  f"  whole run ({how}) {minutes(wall_alone)} | {minutes(wall_busy)}:"
                  f" {wall_busy / wall_alone:.2f}x (goal <= 2.5:"
                  f" {'met' if wall_busy <= 2.5 * wall_alone else 'missed'})")


def compiling_pays(rows: list[dict], steps: int) -> None:
    """Whether compiling pays for itself where it ran, and what its exact kernels cost."""
    for competitors in dict.fromkeys(r["competitors"] for r in rows):
        same = {(r["mode"], r["threads"]): r for r in rows if r["competitors"] == competitors}
        for (mode, threads), compiled in same.items():
            eager = same.get(("eager", threads))
            if mode != "compiled":
                continue
            if eager is not None:
                gain = whole(eager, steps)[0] / whole(compiled, steps)[0]
                print(f"compiling {'pays' if gain > 1 else 'loses'} {where(compiled)} ({threads}"
                      f" threads): the default run eager takes {gain:.2f}x the compiled one's")
            unordered = same.get(("unordered", threads))
            if unordered is not None:
                cost = compiled["median_step"] / unordered["median_step"]
                print(f"deterministic kernels {where(compiled)} ({threads} threads): a step takes"
                      f" {cost:.3f}x the unordered one's ({1000 * compiled['median_step']:.1f}"
                      f" against {1000 * unordered['median_step']:.1f} ms)")


def report(rows: list[dict], steps: int) -> None:
    table(rows, steps)
    print()
    goals(rows, steps)
    compiling_pays(rows, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100,
                        help="the step cap of each run (default: %(default)s; the default run's "
                             "max_steps, or cpu_float32_steps in float32, measures it whole)")
    parser.add_argument("--modes", nargs="+", default=["compiled", "eager"],
                        choices=["compiled", "eager", "unordered"],
                        help="unordered: compiled without deterministic kernels")
    parser.add_argument("--beside", nargs="+", type=int, default=[0, 1],
                        help="numbers of spinning competitors to run beside (default: 0 1)")
    parser.add_argument("--threads", nargs="+", type=int, default=[0],
                        help="OpenMP threads of the run (OMP_NUM_THREADS); 0: train.py's "
                             "default (default: %(default)s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.child:
        child(json.loads(args.child))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from machine import cpu_description  # bench/machine.py

    print(f"CPU: {cpu_description()}, {os.cpu_count()} logical CPUs; load average "
          f"{os.getloadavg()[0]:.1f} before starting (a goal's figures want it near 0)",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-busy-") as tmp:
        root = Path(tmp)
        # Tokenize (and fit the default's BPE) once, unmeasured: every run then reads the cache.
        warm = measure("eager", 0, 2, extra, root, name="warm-up")
        print(f"default run: precision {warm['precision']}, {warm['threads']} threads, "
              f"{warm['tokens_per_step']:,} tokens a step; {args.steps} steps a run\n", flush=True)
        rows = []
        for threads in args.threads:
            for mode in args.modes:
                for competitors in args.beside:
                    row = measure(mode, competitors, args.steps, extra, root, threads)
                    rows.append({**row, "kind": f"{mode}, {row['threads']} threads"})
                    print(f"  {rows[-1]['kind']}, beside {competitors}: "
                          f"{minutes(row['wall'])} (load average now "
                          f"{os.getloadavg()[0]:.1f})", flush=True)
    print()
    report(rows, args.steps)


if __name__ == "__main__":
    main()
