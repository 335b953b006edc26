"""Recipes side by side at equal wall clock: which one learns the embedded corpus best?

Each recipe trains the default run's data (the embedded Shakespeare, its 4,096-token BPE,
8 windows of 128 tokens a step) from scratch for the same seconds of training, for several
seeds, in a plain PyTorch loop over gptmini's model and optimizers (`gptmini.train.optim`, as
train.py builds them), with gradient clipping at 1.0. The schedule is the default run's
warmup (in steps) then a cosine decay over the rest of the time budget, so every recipe
ends its decay when its time is up, however fast its steps are. At fractions of the budget
the clock stops while the model is scored on the whole validation split in float32, as
`evaluate.py` scores a checkpoint (bits per byte: summed nats / summed bytes / ln 2).

Prints the machine (CPU, vector units, threads, precision), then per recipe the steps,
training tokens/s and final bits per byte (mean, min-max over the seeds), and draws bits per
byte against training seconds (one curve per recipe, the seeds' range shaded) to a PNG.

    python bench/speedrun.py [--seconds 60] [--seeds 1 2 3] [--recipes book +muon ...]
                             [--points 4] [--plot docs/speedrun.png] [--threads N]
"""

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from gptmini.threads import sleep_when_idle

sleep_when_idle()  # before torch loads OpenMP: a shared CPU keeps its fair share

import torch  # noqa: E402
from machine import cpu_description  # noqa: E402  (bench/machine.py, this folder's)

from gptmini.analysis.evaluate import score_text  # noqa: E402
from gptmini.data import Corpus, GPTDataModule, Windows  # noqa: E402
from gptmini.data.vocab import parse_bpe  # noqa: E402
from gptmini.model import GPTConfig, GPTModel  # noqa: E402
from gptmini.runtime import auto_precision  # noqa: E402
from gptmini.tokenizer import load_tokenizer  # noqa: E402
from gptmini.train.optim import make_optimizer  # noqa: E402

BOOK = {  # today's default run (configs/book-gpt2.yaml): the book's GPT-2 blocks, AdamW
    "model": {"context_length": 128, "emb_dim": 256, "n_heads": 4, "n_layers": 4,
              "drop_rate": 0.0, "tie_weights": True},
    "optimizer": "adamw", "learning_rate": 2e-3, "muon_learning_rate": 2e-3,
    "warmup_steps": 100, "min_lr_ratio": 0.1, "weight_decay": 0.1, "batch_size": 8,
}
MODERN = {"position": "rope", "norm": "rmsnorm", "qk_norm": True, "mlp": "relu2"}
RECIPES = {  # name: changes to BOOK (model fields under "model")
    "book": {},
    "+rope": {"model": {"position": "rope"}},
    "+rmsnorm+qknorm": {"model": {"norm": "rmsnorm", "qk_norm": True}},
    "+relu2": {"model": {"mlp": "relu2"}},
    "+swiglu": {"model": {"mlp": "swiglu"}},
    "+muon": {"optimizer": "muon"},
    "all": {"model": MODERN, "optimizer": "muon"},
    "tuned": {"model": {"position": "rope", "norm": "rmsnorm", "norm_eps": 1e-6,
                        "mlp": "swiglu", "qk_norm": True, "bias": False},
              "optimizer": "muon"},  # the default run's recipe (exports as a Qwen3)
}


def recipe_settings(name: str, overrides: dict | None = None) -> dict:
    """BOOK with the recipe's changes (and `overrides`) applied, model fields merged."""
    settings = {**BOOK, "model": dict(BOOK["model"])}
    for change in (RECIPES[name], overrides or {}):
        settings["model"].update(change.get("model", {}))
        settings.update({k: v for k, v in change.items() if k != "model"})
    return settings


def corpus(cache_dir: str | None):
    """(tokenizer, training windows, validation tokens) of the default run's data."""
    length = BOOK["model"]["context_length"]
    corpus = Corpus(val_fraction=0.05, cache_dir=cache_dir)
    vocab = corpus.fit_tokenizer(parse_bpe("bpe:4096"))  # cached, as train.py fits it
    data = GPTDataModule(replace(corpus, tokenizer=str(vocab)), Windows(max_length=length))
    data.setup("fit")
    return load_tokenizer(vocab), data.train_dataset, data.val_dataset.tokens


def train(settings: dict, seed: int, budget: float, points: int, enc, windows, val_tokens,
          precision: str, by_steps: bool = False) -> dict:
    """One run of `budget` training seconds (or optimizer steps, `by_steps`):
    {"curve": [(seconds, bpb)], "steps", "tokens_per_sec"}."""
    torch.manual_seed(seed)
    model = GPTModel(GPTConfig(vocab_size=enc.n_vocab, **settings["model"])).train()
    optimizer = make_optimizer(model, settings["optimizer"],
                               learning_rate=settings["learning_rate"],
                               muon_learning_rate=settings["muon_learning_rate"],
                               weight_decay=settings["weight_decay"], betas=(0.9, 0.95),
                               device=torch.device("cpu"))
    bases = [group["lr"] for group in optimizer.param_groups]
    batch, warmup = settings["batch_size"], settings["warmup_steps"]
    floor = settings["min_lr_ratio"]
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))
    checks = [budget * (i + 1) / points for i in range(points)]
    curve, step, trained, warm_at = [], 0, 0.0, None
    while checks:
        start = time.perf_counter()
        while (step if by_steps else trained + time.perf_counter() - start) < checks[0]:
            spent = step if by_steps else trained + time.perf_counter() - start
            if step < warmup:
                factor = (step + 1) / warmup
            else:  # cosine over the budget left after warmup
                warm_at = spent if warm_at is None else warm_at
                progress = min(1.0, (spent - warm_at) / max(1e-9, budget - warm_at))
                factor = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
            for group, base in zip(optimizer.param_groups, bases, strict=True):
                group["lr"] = base * factor
            first = (step * batch) % (len(order) - batch + 1)
            inputs, targets = (torch.stack(t) for t in zip(
                *(windows[int(i)] for i in order[first:first + batch]), strict=True))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = model(inputs, targets=targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
        trained += time.perf_counter() - start
        model.eval()
        bpb = score_text(model, enc, val_tokens, batch_size=16, progress=False).bpb
        model.train()
        curve.append((trained, bpb))
        checks.pop(0)
    if not all(math.isfinite(b) for _, b in curve):
        raise FloatingPointError(f"a run of {settings} went non-finite: {curve}")
    return {"curve": curve, "steps": step,
            "tokens_per_sec": step * batch * settings["model"]["context_length"] / trained}


def step_cost(enc, windows, precision: str, steps: int = 30, warmup: int = 5) -> None:
    """Milliseconds per training step, and of optimizer.step alone, with AdamW and with Muon
    at the book recipe's shape (medians over `steps` steps)."""
    times = {}
    for name in ("adamw", "muon"):
        settings = recipe_settings("book", {"optimizer": name})
        torch.manual_seed(0)
        model = GPTModel(GPTConfig(vocab_size=enc.n_vocab, **settings["model"])).train()
        optimizer = make_optimizer(model, name, learning_rate=2e-3, muon_learning_rate=2e-3,
                                   weight_decay=0.1, betas=(0.9, 0.95),
                                   device=torch.device("cpu"))
        whole, alone = [], []
        for step in range(steps + warmup):
            batch = [windows[i] for i in range(step * 8, step * 8 + 8)]
            inputs, targets = (torch.stack(t) for t in zip(*batch, strict=True))
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = model(inputs, targets=targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            stepping = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            if step >= warmup:
                whole.append(end - start)
                alone.append(end - stepping)
        times[name] = (statistics.median(whole) * 1e3, statistics.median(alone) * 1e3)
    (aw, ao), (mw, mo) = times["adamw"], times["muon"]
    print(f"step cost at the book shape, batch 8 (median of {steps}): AdamW {aw:.1f} ms "
          f"(optimizer.step {ao:.1f}), Muon {mw:.1f} ms (optimizer.step {mo:.1f}): Muon steps "
          f"cost {mw / aw - 1:+.1%}", flush=True)


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def plot(results: dict, path: Path, seconds: float, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, runs in results.items():
        curves = [r["curve"] for r in runs]
        xs = [statistics.mean(c[i][0] for c in curves) for i in range(len(curves[0]))]
        ys = [[c[i][1] for c in curves] for i in range(len(curves[0]))]
        line, = ax.plot(xs, [statistics.mean(y) for y in ys], marker="o", ms=3, label=name)
        ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.2,
                        color=line.get_color())
    ax.set_xlabel("training seconds (validation excluded)")
    ax.set_ylabel("validation bits per byte (whole split)")
    ax.set_title(f"{seconds:g} s per run; mean of {len(next(iter(results.values())))} seeds, "
                 f"range shaded\n{machine}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="training seconds per run (validation not counted)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--set", default="{}",
                        help='JSON changes for every recipe, e.g. \'{"learning_rate": 3e-3, '
                             '"model": {"n_layers": 6}}\' (exploration)')
    parser.add_argument("--steps", type=int, default=None,
                        help="a budget of optimizer steps instead of seconds: bits per byte "
                             "that a busy machine cannot move (exploration)")
    parser.add_argument("--points", type=int, default=4, help="validations per run")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--plot", type=Path, default=None, help="PNG to draw (default: none)")
    parser.add_argument("--json", type=Path, default=None, help="write every run's results")
    parser.add_argument("--cache_dir", default=None)
    parser.add_argument("--step_cost", action="store_true",
                        help="first time a step with AdamW and with Muon (the book's shape)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    precision, why = auto_precision("cpu")
    machine = (f"{cpu_description()}, {os.cpu_count()} cores, {args.threads} threads, "
               f"torch {torch.__version__}, {precision}")
    print(f"machine: {machine} ({why})\n{args.seconds:g} s of training per run, seeds "
          f"{args.seeds}, {args.points} validations on the whole split", flush=True)
    enc, windows, val_tokens = corpus(args.cache_dir)
    if args.step_cost:
        step_cost(enc, windows, precision)
    overrides = json.loads(args.set)
    results = {}
    for name in args.recipes:
        settings = recipe_settings(name, overrides)
        results[name] = []
        for seed in args.seeds:
            run = train(settings, seed, args.steps or args.seconds, args.points, enc, windows,
                        val_tokens, precision, by_steps=args.steps is not None)
            results[name].append(run)
            print(f"{name} seed {seed}: {run['steps']} steps, {run['tokens_per_sec']:.0f} "
                  f"tok/s, bpb {' '.join(f'{b:.3f}' for _, b in run['curve'])}", flush=True)
    base = statistics.mean(r["curve"][-1][1] for r in results[args.recipes[0]])
    print(f"\n{'recipe':<18}{'steps':>7}{'tok/s':>8}  {'val bpb mean (min-max)':<24}"
          f"{'vs ' + args.recipes[0]:>10}")
    for name, runs in results.items():
        finals = [r["curve"][-1][1] for r in runs]
        print(f"{name:<18}{statistics.mean(r['steps'] for r in runs):>7.0f}"
              f"{statistics.mean(r['tokens_per_sec'] for r in runs):>8.0f}  "
              f"{spread(finals):<24}{statistics.mean(finals) - base:>+10.3f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "seconds": args.seconds,
                                         "settings": {n: recipe_settings(n, overrides)
                                                      for n in results},
                                         "results": results}, indent=1))
    if args.plot:
        plot(results, args.plot, args.seconds, machine)


if __name__ == "__main__":
    main()
