"""Where train.py's time goes: a short run of the default config, timed by Lightning's hooks.

`bench/speedrun.py --lightning STEPS` calls `lightning_costs`; alone:

    python bench/lightning_costs.py [--steps 120] [--cache_dir DIR] [-- train.py flags]

The run is the default (`gptmini/configs/shakespeare-cpu.yaml`) for STEPS steps, validating
and checkpointing every STEPS // 3 steps (its own 20 validation batches), in a temporary
directory. Printed: the wall clock of `fit`, what came before the first step (data,
tokenizer, model, the sanity check), the median step's forward, backward and optimizer (with
clipping), Lightning's loop between steps (callbacks, logging, the progress bar), each
validation's and each checkpoint's seconds, the first step's (compiling, when the run
compiles) and what they come to over the default run (its config's max_steps, a validation
and a checkpoint every val_check_interval).
"""

import argparse
import statistics
import tempfile
import time

import yaml
from lightning.pytorch import Callback

from gptmini.train.command import DEFAULT_CONFIG, build_cli, fit

_TRAINER = yaml.safe_load(DEFAULT_CONFIG.read_text())["trainer"]
DEFAULT_STEPS, DEFAULT_EVERY = _TRAINER["max_steps"], _TRAINER["val_check_interval"]


class PhaseTimer(Callback):
    """Seconds of each phase of each step, from Lightning's hooks (the optimizer's closure
    runs forward and backward inside `optimizer_step`)."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.validations: list[float] = []
        self.first_step_at: float | None = None
        self._t: dict[str, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self.first_step_at is None:
            self.first_step_at = now
        if "end" in self._t:  # Lightning's loop since the last step ended
            self.steps[-1]["loop"] = now - self._t["end"]
        self._t = {"start": now}

    def on_before_backward(self, trainer, pl_module, loss):
        self._t["backward"] = time.perf_counter()

    def on_after_backward(self, trainer, pl_module):
        self._t["backward_end"] = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        t, now = self._t, time.perf_counter()
        self.steps.append({"forward": t["backward"] - t["start"],
                           "backward": t["backward_end"] - t["backward"],
                           "optimizer": now - t["backward_end"], "loop": 0.0})
        t["end"] = now

    def on_validation_start(self, trainer, pl_module):
        self._t["validation"] = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validations.append(time.perf_counter() - self._t.pop("validation"))


def lightning_costs(steps: int, cache_dir: str | None = None,
                    extra_args: list[str] | None = None) -> dict:
    """Run the default config (with `extra_args` on top) for `steps` steps and print where
    the time went; returns the figures (seconds)."""
    every = max(1, steps // 3)
    with tempfile.TemporaryDirectory() as root:
        args = ["--trainer.default_root_dir", root, "--run_name", "costs",
                "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(every),
                "--checkpoint_every", str(every), "--sample_every", "0",
                "--trainer.enable_progress_bar", "false"]
        if cache_dir:
            args += ["--data.corpus.cache_dir", cache_dir]
        args += extra_args or []
        start = time.perf_counter()
        cli = build_cli(args)
        timer = PhaseTimer()
        cli.trainer.callbacks.insert(0, timer)  # first: its batch end precedes the others'
        saves: list[float] = []
        save = cli.trainer.save_checkpoint

        def timed_save(*a, **k):
            began = time.perf_counter()
            save(*a, **k)
            saves.append(time.perf_counter() - began)
        cli.trainer.save_checkpoint = timed_save  # this trainer's, for this run only
        fit(cli)
        wall = time.perf_counter() - start
    before = timer.first_step_at - start
    median = {p: statistics.median(s[p] for s in timer.steps) for p in timer.steps[0]}
    step = sum(median.values())
    first = sum(timer.steps[0].values())  # a compiled run compiles here
    validation = statistics.median(timer.validations) if timer.validations else 0.0
    saved = statistics.median(saves) if saves else 0.0
    print(f"\ntrain.py's default run, {steps} steps (validating and checkpointing every "
          f"{every}): fit {wall:.1f} s, {before:.1f} s before the first step, the first "
          f"step {first:.1f} s")
    print("  median step " + ", ".join(f"{p} {v * 1e3:.1f} ms" for p, v in median.items())
          + f" (sum {step * 1e3:.1f} ms)")
    print(f"  a validation {validation:.2f} s ({len(timer.validations)} timed), a checkpoint "
          f"{saved:.2f} s ({len(saves)} timed)")
    runs = DEFAULT_STEPS // DEFAULT_EVERY + 1  # every 200 steps, and at the end
    extra = max(0.0, first - step)  # what the first step cost beyond a step: compiling
    total = before + extra + DEFAULT_STEPS * step + runs * (validation + saved)
    print(f"  over the default run ({DEFAULT_STEPS} steps, about {runs} validations and "
          f"checkpoints): steps {DEFAULT_STEPS * step / total:.1%} (Lightning's loop "
          f"{DEFAULT_STEPS * median['loop'] / total:.1%}), validation "
          f"{runs * validation / total:.1%}, checkpoints {runs * saved / total:.1%}, the "
          f"first step's extra {extra / total:.1%}, before the first step "
          f"{before / total:.1%} of about {total:.0f} s")
    return {"wall": wall, "before": before, "first_step": first, "step": median,
            "validation": validation, "checkpoint": saved}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--cache_dir", default=None)
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="train.py flags on top of the default run's, after --")
    args = parser.parse_args()
    lightning_costs(args.steps, args.cache_dir, [a for a in args.train_args if a != "--"])


if __name__ == "__main__":
    main()
