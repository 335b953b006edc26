"""What a finished run says: a short report card (nanochat's report is the anchor), printed
at the end of training and written as `report.txt` in the run directory, beside the curves.

    run shakespeare-cpu: 2,400 steps in 4 min 02 s, 2,457,600 tokens (10,155 tokens/s)
    validation   last  loss 4.447  bpb 2.193  (after step 2,400; 20 batches: evaluate.py ...)
                 best  loss 4.447  bpb 2.193  (after step 2,400)
    ...
"""

import os
import sys
import time
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

from gptmini.analysis.curves import load_metrics, plot_curves
from gptmini.train.callbacks import SHAKESPEARE_PROMPT, corpus_prompt


class RunReport(Callback):
    """Counts a run's steps, tokens and time; at the end of `fit` (rank zero) draws the
    curves to `<run_dir>/curves.png` (when matplotlib is there), then prints the report and
    writes it to `<run_dir>/report.txt`. A run stopped by a signal or an error reports
    nothing (its own message says what happened)."""

    def __init__(self, run_dir: str | Path, prompt: str | None = None):
        """`prompt`: the one the next `generate.py` is shown with; None: the start of a
        validation document of the corpus ("ROMEO:" on the embedded Shakespeare)."""
        self.run_dir, self.asked = Path(run_dir), prompt
        self.prompt = prompt or SHAKESPEARE_PROMPT
        self._start, self._seconds, self._first_step, self._tokens = 0.0, 0.0, 0, 0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule):
        if self.asked is None:
            self.prompt = corpus_prompt(trainer, 8, SHAKESPEARE_PROMPT)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule):
        self._start, self._first_step, self._tokens = time.monotonic(), trainer.global_step, 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch,
                           batch_idx: int):
        task = getattr(pl_module, "task", None)  # what the run's task counts (a shape)
        tokens = task.tokens(batch) if task is not None else batch[0].numel()
        self._tokens += tokens * trainer.world_size

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule):
        self._seconds = time.monotonic() - self._start

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule):
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        if trainer.fast_dev_run:  # a trial of every step's code: no files, no figures
            print(f"run {self.run_dir.name}: fast_dev_run trained and validated "
                  f"{int(trainer.fast_dev_run)} batch(es); nothing was saved", flush=True)
            return
        for logger in trainer.loggers:
            logger.save()  # the CSV rows written so far, for the curves and the best values
        try:
            metrics, _ = load_metrics(self.run_dir)
        except FileNotFoundError:
            metrics = {}
        curves = self.run_dir / "curves.png"
        try:
            curves = plot_curves(self.run_dir, curves)
        except (ImportError, ValueError, OSError) as err:  # OSError: a full disk, say
            curves = f"not drawn ({err})"
        text = format_report(
            run_name=self.run_dir.name, steps=trainer.global_step, first_step=self._first_step,
            seconds=self._seconds, tokens=self._tokens, metrics=metrics,
            val_batches=trainer.limit_val_batches, checkpoints=self.run_dir / "checkpoints",
            curves=curves, prompt=self.prompt,
            generates_text=pl_module.task.generates_text,
            benchmarks=[n for cb in trainer.callbacks for n in getattr(cb, "benchmarks", [])])
        print(text, flush=True)
        try:  # the checkpoints are saved: a report that cannot be written must not fail the run
            (self.run_dir / "report.txt").write_text(text + "\n")
        except OSError as err:
            print(f"report.txt not written ({err})", file=sys.stderr, flush=True)


HEADLINES = (("val/loss", "loss", min), ("val/pass_at_1", "pass@1", max))
"""What picks a run's best validation: the lowest loss, or an RL run's highest pass@1."""
SHOWN = (("val/bpb", "bpb"), ("val/acc", "acc"), ("val/accuracy", "accuracy"),
         ("val/margin", "margin"))
"""Validation metrics shown beside it when the run logged them (language modelling's
bits per byte, a classifier's accuracy, DPO's preference accuracy and margin)."""
TRENDS = (("train/reward", "reward", ".2f"), ("train/zero_variance", "zero-variance groups",
          ".2f"), ("train/response_length", "response tokens", ".1f"),
          ("train/clip_fraction", "clip fraction", ".2f"))
"""An RL run's rollouts, first logged -> last: whether it learns (the reward rises) or cannot
(every group's rewards alike, so no advantage; responses cut to nothing)."""


def format_report(*, run_name: str, steps: int, first_step: int, seconds: float, tokens: int,
                  metrics: dict, val_batches: int | float, checkpoints: Path,
                  curves: Path | str, prompt: str = "ROMEO:", generates_text: bool = True,
                  benchmarks: list[str] = ()) -> str:
    """The report's text. `metrics` is `load_metrics`'s: name -> (steps, values).
    `generates_text`: the model writes text, so the next commands are generate.py and
    serve.py beside evaluate.py; a classifier's are evaluate.py's (accuracy, confusion).
    `benchmarks`: the tasks scored at each validation (`val/<task>`, `val/tasks`)."""
    session = f" (steps {first_step:,} to {steps:,} in this session)" if first_step else ""
    rate = f" ({tokens / seconds:,.0f} tokens/s)" if seconds > 0 else ""
    lines = [f"run {run_name}: {steps:,} steps{session} in {_duration(seconds)}, "
             f"{tokens:,} tokens{rate}"]
    headline = next((h for h in HEADLINES if h[0] in metrics), None)
    if headline is not None:
        name, label, better = headline
        at, values = metrics[name]  # steps as load_metrics counts them: steps taken
        shown = {key: dict(zip(*metrics[key], strict=True)) for key, _ in SHOWN
                 if key in metrics and key != name}
        best = better(range(len(values)), key=values.__getitem__)
        scope = (f"{val_batches:,} batches" if isinstance(val_batches, int)
                 else f"{val_batches:.0%} of the split")
        for which, i, note in (("last", -1, f"; {scope}: evaluate.py scores the whole split"),
                               ("best", best, "")):
            more = "".join(f"  {short} {shown[key][at[i]]:.3f}" for key, short in SHOWN
                           if key in shown and at[i] in shown[key])
            head = "validation  " if which == "last" else "            "
            lines.append(f"{head} {which}  {label} {values[i]:.3f}{more}  "
                         f"(after step {at[i]:,}{note})")
    else:
        lines.append("validation   none yet (set --trainer.val_check_interval below max_steps)")
    trends = [f"{label} {metrics[key][1][0]:{form}} -> {metrics[key][1][-1]:{form}}"
              for key, label, form in TRENDS if metrics.get(key, ((), ()))[1]]
    if trends:
        lines.append(f"rollouts     {', '.join(trends)} (first -> last logged)")
    scored = [(label, metrics[key][1]) for key, label in
              (("val/tasks", "centred mean"), *((f"val/{b}", b) for b in benchmarks))
              if metrics.get(key, ((), ()))[1]]
    if scored:
        lines.append("benchmarks   " + ", ".join(f"{label} {v[0]:.3f} -> {v[-1]:.3f}"
                                                  for label, v in scored)
                     + " (first -> last validation)")
    last, best = _shown(checkpoints / "last.ckpt"), _shown(checkpoints / "best.ckpt")
    saved_best = (checkpoints / "best.ckpt").exists()  # a sharded one is a directory
    lines.append(f"checkpoints  {last}" + (f", {best}" if saved_best else ""))
    lines.append(f"curves       {_shown(curves) if isinstance(curves, Path) else curves}")
    python = _python()
    chosen = best if saved_best else last
    lines.append("next")
    if generates_text:
        lines += [f"  {python} generate.py --checkpoint {last} --prompt {_quote(prompt)} --stream",
                  f"  {python} serve.py --checkpoint {last}",
                  f"  {python} evaluate.py --checkpoint {chosen}"]
    else:  # accuracy and the confusion table, on the run's validation split or a file's
        lines += [f"  {python} evaluate.py --checkpoint {chosen}",
                  f"  {python} evaluate.py --checkpoint {chosen} --data LABELLED.csv "
                  "--text_field text --label_field label"]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{seconds:.1f} s"


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is under it, as a user types it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _python() -> str:
    """This interpreter as a command a new shell runs: `.venv/bin/python` from the clone."""
    here = os.path.relpath(sys.executable)
    return here if not here.startswith("..") and os.sep in here else sys.executable


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
