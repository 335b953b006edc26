"""Recipes side by side at equal wall clock: which one learns the embedded corpus best, and
where does each one's time go?

Each recipe trains the default run's data (the embedded Shakespeare, its 4,096-token BPE,
8 windows of 128 tokens a step) from scratch for the same seconds of training, for several
seeds, in a plain PyTorch loop over gptmini's model and optimizers (`gptmini.train.optim`, as
train.py builds them), with gradient clipping at 1.0. The budget counts everything a step
costs, compiling included (a compiled recipe's first steps compile). The schedule is the
default run's warmup (in steps) then a cosine decay over the rest of the time budget, so
every recipe ends its decay when its time is up, however fast its steps are. At fractions of
the budget the clock stops while the model is scored on the whole validation split in
float32, as `evaluate.py` scores a checkpoint (bits per byte: summed nats / summed bytes /
ln 2).

Prints the machine, then per recipe the steps, tokens/s, final bits per byte (mean, standard
deviation, min-max over the seeds), its difference from the first recipe (the baseline) and
the one-sided Welch t-test's p that it is lower (gptmini.analysis.stats; a gain is claimed at
p < 0.01 over at least 5 seeds, modded-nanogpt's rule), and where a step's time goes: forward,
backward, clipping, optimizer, the loop's own (batches, rates), the first step (compiling),
and the validations the clock stopped for. `--lightning STEPS` also runs train.py's default
run for STEPS steps and prints where its time goes: the steps' parts, Lightning's loop,
validation, checkpoints, and what they come to over the default's 1,150 steps.

The levers of issue 39 are recipe settings (`--set` applies any to every recipe):
"torch_norms" (torch's nn.RMSNorm instead of gptmini's), "torch_muon" (torch's Muon, one
matrix at a time, instead of the batched one), "compile" (torch.compile the model),
"muon_ns_steps", "muon_ns_coefficients" (jordan, polar_express), and the knobs of a recipe
search: "batch_size", "learning_rate", "muon_learning_rate", "model" fields (n_layers,
emb_dim, n_heads, ...).

    python bench/speedrun.py [--budget 40] [--seeds 1 2 3 4 5] [--recipes NAME[JSON] ...]
                             [--set JSON] [--points 3] [--plot PNG] [--json FILE]
                             [--step_cost] [--lightning STEPS]
"""

import argparse
import json
import math
import os
import statistics
import time
import warnings
from dataclasses import replace
from pathlib import Path

from gptmini.threads import sleep_when_idle

sleep_when_idle()  # before torch loads OpenMP: a shared CPU keeps its fair share

import torch  # noqa: E402
from machine import cpu_description  # noqa: E402  (bench/machine.py, this folder's)
from torch import nn  # noqa: E402

from gptmini.analysis.evaluate import score_text  # noqa: E402
from gptmini.analysis.stats import welch_t_test  # noqa: E402
from gptmini.attention.norm import RMSNorm  # noqa: E402
from gptmini.data import Corpus, GPTDataModule, Windows  # noqa: E402
from gptmini.data.vocab import parse_bpe  # noqa: E402
from gptmini.model import (  # noqa: E402
    GPTConfig,
    GPTModel,
    lm_loss,  # noqa: E402
)
from gptmini.runtime import auto_precision  # noqa: E402
from gptmini.tokenizer import load_tokenizer  # noqa: E402
from gptmini.train.muon import muon_adamw  # noqa: E402
from gptmini.train.optim import adamw  # noqa: E402

BOOK = {  # today's default run (configs/book-gpt2.yaml): the book's GPT-2 blocks, AdamW
    "model": {"context_length": 128, "emb_dim": 256, "n_heads": 4, "n_layers": 4,
              "drop_rate": 0.0, "tie_weights": True},
    "optimizer": "adamw", "learning_rate": 2e-3, "muon_learning_rate": 2e-3,
    "warmup_steps": 100, "min_lr_ratio": 0.1, "weight_decay": 0.1, "batch_size": 8,
    "muon_ns_steps": 5, "muon_ns_coefficients": "jordan", "compile": False,
    "torch_norms": False, "torch_muon": False,
}
MODERN = {"position": "rope", "norm": "rmsnorm", "qk_norm": True, "mlp": "relu2"}
QWEN3 = {"position": "rope", "norm": "rmsnorm", "norm_eps": 1e-6, "mlp": "swiglu",
         "qk_norm": True, "bias": False}  # the default run's blocks
MQA_EXPLICIT = {"n_kv_heads": 1, "attention_backend": "explicit"}
RECIPES = {  # name: changes to BOOK (model fields under "model")
    "book": {},
    "+rope": {"model": {"position": "rope"}},
    "+rmsnorm+qknorm": {"model": {"norm": "rmsnorm", "qk_norm": True}},
    "+relu2": {"model": {"mlp": "relu2"}},
    "+swiglu": {"model": {"mlp": "swiglu"}},
    "+muon": {"optimizer": "muon"},
    "all": {"model": MODERN, "optimizer": "muon"},
    "tuned": {"model": QWEN3, "optimizer": "muon"},  # the default run's recipe before 39's search
    # issue 39's levers on the default run's recipe, from torch's kernels ("qwen3-torch"):
    "qwen3-torch": {"model": QWEN3, "optimizer": "muon", "torch_norms": True,
                    "torch_muon": True},  # the default run as measured before the levers
    "+fast-norm": {"model": QWEN3, "optimizer": "muon", "torch_muon": True},
    "+batched-muon": {"model": QWEN3, "optimizer": "muon", "torch_norms": True},
    "+compile": {"model": QWEN3, "optimizer": "muon", "torch_norms": True,
                 "torch_muon": True, "compile": True},
    "+ns3": {"model": QWEN3, "optimizer": "muon", "muon_ns_steps": 3},
    "+polar-express": {"model": QWEN3, "optimizer": "muon",
                       "muon_ns_coefficients": "polar_express"},
    "tuned+compile": {"model": QWEN3, "optimizer": "muon", "compile": True},
    # issue 39's search: one key/value head and the book's kernel (cheaper at 128 tokens),
    # compiled; then Muon's larger batch and rate (today's default run, a Qwen3 still)
    "+mqa+explicit": {"model": {**QWEN3, **MQA_EXPLICIT}, "optimizer": "muon"},
    "+mqa+explicit+compile": {"model": {**QWEN3, **MQA_EXPLICIT}, "optimizer": "muon",
                              "compile": True},
    "default": {"model": {**QWEN3, **MQA_EXPLICIT}, "optimizer": "muon", "compile": True,
                "batch_size": 24, "learning_rate": 4e-3, "muon_learning_rate": 4e-3},
}
LEVERS = ["qwen3-torch", "+fast-norm", "+batched-muon", "+compile", "tuned", "+ns3",
          "+polar-express", "tuned+compile"]
"""The default --recipes: the default run's recipe on torch's kernels, each lever alone,
the exact ones together ("tuned", today's default), and the inexact ones beside them."""


def recipe_settings(name: str, overrides: dict | None = None) -> dict:
    """BOOK with the recipe's changes (and `overrides`) applied, model fields merged. `name`
    is a RECIPES name, or one with JSON changes of its own after it, for a recipe search in
    one run: 'tuned{"batch_size": 16}'."""
    base, brace, own = name.partition("{")
    if base not in RECIPES:
        raise SystemExit(f"--recipes {name!r}: use one of {', '.join(RECIPES)}, optionally "
                         "followed by JSON changes such as 'tuned{\"batch_size\": 16}'")
    try:
        own = json.loads(brace + own) if brace else {}
    except json.JSONDecodeError as err:
        raise SystemExit(f"--recipes {name!r}: its changes are not JSON ({err})") from None
    settings = {**BOOK, "model": dict(BOOK["model"])}
    for change in (RECIPES[base], own, overrides or {}):
        settings["model"].update(change.get("model", {}))
        settings.update({k: v for k, v in change.items() if k != "model"})
    return settings


def corpus(cache_dir: str | None, length: int = BOOK["model"]["context_length"]):
    """(tokenizer, training windows of `length` tokens, validation tokens) of the default
    run's data."""
    corpus = Corpus(val_fraction=0.05, cache_dir=cache_dir)
    vocab = corpus.fit_tokenizer(parse_bpe("bpe:4096"))  # cached, as train.py fits it
    data = GPTDataModule(replace(corpus, tokenizer=str(vocab)), Windows(max_length=length))
    data.setup("fit")
    return load_tokenizer(vocab), data.train_dataset, data.val_dataset.tokens


PARTS = ("forward", "backward", "clip", "optimizer", "loop")
"""Where a plain-loop step's time goes ("loop": the batch, the rates, the clock)."""


def build(settings: dict, seed: int, vocab_size: int):
    """(model, optimizer, loss function) of a recipe, with its levers: torch's norms or Muon,
    compiled (the loss function: `lm_loss`, compiled with the pass as --model.compile does)."""
    torch.manual_seed(seed)
    model = GPTModel(GPTConfig(vocab_size=vocab_size, **settings["model"])).train()
    if settings["torch_norms"]:  # torch's nn.RMSNorm in place of gptmini's (same weights)
        for name, module in list(model.named_modules()):
            if isinstance(module, RMSNorm):
                parent, _, leaf = name.rpartition(".")
                torch_norm = nn.RMSNorm(module.normalized_shape, eps=module.eps)
                torch_norm.load_state_dict(module.state_dict())
                setattr(model.get_submodule(parent) if parent else model, leaf, torch_norm)
    rates = dict(learning_rate=settings["learning_rate"],
                 muon_learning_rate=settings["muon_learning_rate"],
                 weight_decay=settings["weight_decay"], betas=(0.9, 0.95),
                 device=torch.device("cpu"))
    if settings["optimizer"] == "muon":
        optimizer = muon_adamw(model, **rates, ns_steps=settings["muon_ns_steps"],
                               ns_coefficients=settings["muon_ns_coefficients"],
                               batched=not settings["torch_muon"])
    else:
        rates.pop("muon_learning_rate")
        optimizer = adamw(model.parameters(), **rates)
    if settings["compile"]:
        # Each run compiles its own graph, as train.py's: without a reset dynamo would make
        # the batch dynamic once a second recipe's shape is seen, and fall back to eager
        # after 8 models. Inductor's cache on disk still serves a graph compiled before.
        torch._dynamo.reset()
        return model, optimizer, torch.compile(lm_loss)  # as --model.compile: at first steps
    return model, optimizer, lm_loss


def train(settings: dict, seed: int, budget: float, points: int, enc, windows, val_tokens,
          precision: str, by_steps: bool = False) -> dict:
    """One run of `budget` training seconds (or optimizer steps, `by_steps`):
    {"curve": [(seconds, bpb)], "steps", "tokens_per_sec", "parts_ms" (median ms per step of
    each of PARTS), "first_step_s", "validation_s"}."""
    # One loop with its clock and its parts; long for that, and a reader sees it whole.
    model, optimizer, loss_fn = build(settings, seed, enc.n_vocab)
    bases = [group["lr"] for group in optimizer.param_groups]
    batch, warmup = settings["batch_size"], settings["warmup_steps"]
    floor = settings["min_lr_ratio"]
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))
    checks = [budget * (i + 1) / points for i in range(points)]
    curve, step, trained, warm_at, validating = [], 0, 0.0, None, 0.0
    parts = {part: [] for part in PARTS}
    first_step = 0.0
    while checks:
        start = time.perf_counter()
        while (step if by_steps else trained + time.perf_counter() - start) < checks[0]:
            began = time.perf_counter()
            spent = step if by_steps else trained + began - start
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
            marks = [time.perf_counter()]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = loss_fn(model, inputs, targets)
            marks.append(time.perf_counter())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            marks.append(time.perf_counter())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            marks.append(time.perf_counter())
            optimizer.step()
            marks.append(time.perf_counter())
            for part, a, b in zip(PARTS, marks, marks[1:], strict=False):
                parts[part].append(b - a)
            parts["loop"].append(marks[0] - began)
            if step == 0:
                first_step = marks[-1] - began
            step += 1
        trained += time.perf_counter() - start
        stopped = time.perf_counter()
        model.eval()
        with torch.compiler.set_stance("force_eager"):  # no recompiling for scoring's shapes
            bpb = score_text(model, enc, val_tokens, batch_size=16, progress=False).bpb
        model.train()
        validating += time.perf_counter() - stopped
        curve.append((trained, bpb))
        checks.pop(0)
    if not all(math.isfinite(b) for _, b in curve):
        raise FloatingPointError(f"a run of {settings} went non-finite: {curve}")
    return {"curve": curve, "steps": step,
            "tokens_per_sec": step * batch * settings["model"]["context_length"] / trained,
            "parts_ms": {p: statistics.median(t) * 1e3 if t else 0.0 for p, t in parts.items()},
            "first_step_s": first_step, "validation_s": validating}


def step_cost(enc, windows_for, precision: str, recipes: list[str], overrides: dict,
              steps: int = 30, warmup: int = 5) -> None:
    """Milliseconds per training step, and of optimizer.step alone, of each recipe at its
    own shape and batch (medians over `steps` steps, after `warmup` steps, compiling
    included there)."""
    print(f"step cost (median of {steps} steps; ms):")
    for name in recipes:
        settings = recipe_settings(name, overrides)
        model, optimizer, loss_fn = build(settings, 0, enc.n_vocab)
        windows = windows_for(settings)
        batch, whole, alone = settings["batch_size"], [], []
        for step in range(steps + warmup):
            rows = [windows[i] for i in range(step * batch, step * batch + batch)]
            inputs, targets = (torch.stack(t) for t in zip(*rows, strict=True))
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = loss_fn(model, inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            stepping = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            if step >= warmup:
                whole.append(end - start)
                alone.append(end - stepping)
        w, o = statistics.median(whole) * 1e3, statistics.median(alone) * 1e3
        print(f"  {name:<18} step {w:7.1f}   optimizer.step {o:6.1f} ({o / w:.0%} of the step)",
              flush=True)


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


def report(results: dict, baseline: str, budget: float) -> None:
    """The table: each recipe's bits per byte over its seeds against the baseline's, and
    where its steps' time went."""
    base = [r["curve"][-1][1] for r in results[baseline]]
    width = max(18, *(len(n) + 2 for n in results))
    print(f"\n{'recipe':<{width}}{'steps':>6}{'tok/s':>7}  {'val bpb mean ± sd (min-max)':<30}"
          f"{'vs ' + baseline:>10}{'p':>9}  | ms/step: " + " ".join(f"{p:>5.5}" for p in PARTS)
          + "  first s  val s")
    for name, runs in results.items():
        finals = [r["curve"][-1][1] for r in runs]
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        bpb = f"{statistics.mean(finals):.3f} ± {sd:.3f} ({min(finals):.3f}-{max(finals):.3f})"
        p = ("" if name == baseline or len(finals) < 2 or len(base) < 2
             else f"{welch_t_test(finals, base).p:.4f}")
        parts = " ".join(f"{statistics.mean(r['parts_ms'][q] for r in runs):5.1f}"
                         for q in PARTS)
        print(f"{name:<{width}}{statistics.mean(r['steps'] for r in runs):>6.0f}"
              f"{statistics.mean(r['tokens_per_sec'] for r in runs):>7.0f}  {bpb:<30}"
              f"{statistics.mean(finals) - statistics.mean(base):>+10.3f}{p:>9}  |          "
              f"{parts}  {statistics.mean(r['first_step_s'] for r in runs):7.1f}"
              f"{statistics.mean(r['validation_s'] for r in runs):7.1f}")
    seeds = min(len(runs) for runs in results.values())
    print(f"p: one-sided Welch t-test that the recipe's mean is below {baseline}'s; claim a "
          f"gain at p < 0.01 with at least 5 seeds ({seeds} here). The {budget:g} s budget "
          "counts every step, the first (compiling) included; validation stops the clock.")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", "--seconds", dest="seconds", type=float, default=40.0,
                        help="training seconds per run (validation not counted)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--recipes", nargs="+", default=LEVERS,
                        help=f"the first is the baseline of the t-tests; one of {list(RECIPES)}"
                             ', each optionally with JSON changes: \'tuned{"batch_size": 16}\'')
    parser.add_argument("--set", default="{}",
                        help='JSON changes for every recipe, e.g. \'{"batch_size": 16, '
                             '"muon_learning_rate": 4e-3, "model": {"n_layers": 6}}\'')
    parser.add_argument("--steps", type=int, default=None,
                        help="a budget of optimizer steps instead of seconds: bits per byte "
                             "that a busy machine cannot move (exploration)")
    parser.add_argument("--points", type=int, default=3, help="validations per run")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--plot", type=Path, default=None, help="PNG to draw (default: none)")
    parser.add_argument("--json", type=Path, default=None, help="write every run's results")
    parser.add_argument("--cache_dir", default=None)
    parser.add_argument("--val_tokens", type=int, default=None,
                        help="score only the first this many validation tokens (a quick "
                             "check; default: the whole split)")
    parser.add_argument("--step_cost", action="store_true",
                        help="first time a step and its optimizer.step for each recipe")
    parser.add_argument("--lightning", type=int, default=0, metavar="STEPS",
                        help="also time STEPS steps of train.py's default run (validating "
                             "and checkpointing every STEPS // 3) and print where it goes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # torch's RMSNorm (the torch_norms recipes) warns of its bf16 fallback at every call
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    precision, why = auto_precision("cpu")
    machine = (f"{cpu_description()}, {os.cpu_count()} cores, {args.threads} threads, "
               f"torch {torch.__version__}, {precision}")
    print(f"machine: {machine} ({why})\n{args.seconds:g} s of training per run, seeds "
          f"{args.seeds}, {args.points} validations on the whole split", flush=True)
    if args.lightning:
        from lightning_costs import lightning_costs  # bench/lightning_costs.py

        lightning_costs(args.lightning, args.cache_dir)
    enc, windows, val_tokens = corpus(args.cache_dir)
    val_tokens = val_tokens[: args.val_tokens]
    by_length = {BOOK["model"]["context_length"]: windows}

    def windows_for(settings: dict):
        """The training windows at a recipe's context length (cut once per length)."""
        length = settings["model"]["context_length"]
        if length not in by_length:
            by_length[length] = corpus(args.cache_dir, length)[1]
        return by_length[length]

    overrides = json.loads(args.set)
    for name in args.recipes:  # a typo fails now, not after an hour of other recipes
        recipe_settings(name, overrides)
    if args.step_cost:
        step_cost(enc, windows_for, precision, args.recipes, overrides)
    results = {}
    for name in args.recipes:
        settings = recipe_settings(name, overrides)
        results[name] = []
        for seed in args.seeds:
            run = train(settings, seed, args.steps or args.seconds, args.points, enc,
                        windows_for(settings), val_tokens, precision,
                        by_steps=args.steps is not None)
            results[name].append(run)
            print(f"{name} seed {seed}: {run['steps']} steps, {run['tokens_per_sec']:.0f} "
                  f"tok/s, bpb {' '.join(f'{b:.3f}' for _, b in run['curve'])}", flush=True)
    report(results, args.recipes[0], args.steps or args.seconds)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "seconds": args.seconds,
                                         "settings": {n: recipe_settings(n, overrides)
                                                      for n in results},
                                         "results": results}, indent=1))
    if args.plot:
        plot(results, args.plot, args.seconds, machine)


if __name__ == "__main__":
    main()
