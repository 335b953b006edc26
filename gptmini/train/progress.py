"""The training progress bar: optimizer steps out of the run's max_steps, with an ETA,
across epochs and resumes, that says when the first step is compiling the model."""

import math
import sys
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from gptmini.train.module import GPTLitModule

__all__ = ["ProgressBar", "progress_bar"]


class ProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting optimizer steps out of the run's (`max_steps`) with an
    ETA, one bar across epochs and resumes (Lightning's counts the batches of each epoch,
    and after a resume showed "1000/?"); loss, lr, tokens/s, val loss and bits per byte
    under short names, each in a format that shows its digits.

    The loss is a tensor on the device, so it is not a prog_bar metric (Lightning would read
    it after every batch); the bar reads it here, when it refreshes: at logging steps.
    """

    COMPILING = "compiling the model (the first step: a minute or more the first time)"
    """What the bar says during the first step of a compiled run, which would otherwise sit
    at 0 with no rate while inductor traces the model and builds its kernels."""

    SHORT = {"train/loss": ("loss", "{:.3f}"), "train/lr": ("lr", "{:.2e}"),
             "train/tokens_per_sec": ("tok/s", "{:.0f}"), "val/loss": ("val_loss", "{:.3f}"),
             "val/bpb": ("val_bpb", "{:.3f}")}

    def __init__(self, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate)
        self._shown: dict[str, str] = {}
        self._compiling_since: float | None = None
        self._compiled_in = ""  # shown beside the metrics once the first step compiled

    def on_train_start(self, trainer: Trainer, pl_module: GPTLitModule) -> None:
        total = trainer.estimated_stepping_batches  # optimizer steps: max_steps when set
        # Resumed at step N: the bar starts at N, and its rate (so the ETA) counts from there.
        self.train_progress_bar = Tqdm(
            desc="Training", total=total if math.isfinite(total) else None,
            initial=trainer.global_step, position=2 * self.process_position,
            disable=self.is_disabled, leave=True, dynamic_ncols=True, file=sys.stdout,
            smoothing=0, bar_format=self.BAR_FORMAT)
        if pl_module.compiled:
            self._compiling_since = time.monotonic()
            self.train_progress_bar.set_postfix_str(self.COMPILING)  # refreshes

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        pass  # one bar for the whole run, whatever the epoch

    def on_train_batch_end(self, trainer: Trainer, pl_module: GPTLitModule, *_: Any) -> None:
        bar, step = self.train_progress_bar, trainer.global_step
        if self._compiling_since is not None:
            self._compiled(bar, step)
        every = max(1, self.refresh_rate // max(1, trainer.accumulate_grad_batches))
        # Once per optimizer step (the module's OptimizerSteps), at the refresh interval.
        stepped = pl_module.optimizer_steps.stepped(trainer)
        due = stepped and (step % every == 0 or step == bar.total)
        if due and not bar.disable:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes

    def _compiled(self, bar: Tqdm, step: int) -> None:
        """After the compiling step: the rate and the ETA count from here (tqdm's average
        over a run that began with minutes of compiling put a 5-minute run at hours)."""
        seconds, self._compiling_since = time.monotonic() - self._compiling_since, None
        self._compiled_in = f"{seconds:.0f}s"
        if bar.disable:
            return
        bar.reset(total=bar.total)
        bar.initial = bar.n = bar.last_print_n = step
        bar.set_postfix_str(f"compiled in {self._compiled_in}")

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        every = max(1, getattr(trainer, "log_every_n_steps", 1))
        if not getattr(trainer, "training", False) or trainer.global_step % every == 0:
            # Read the values off the device only when they were just logged (or validated):
            # the last batch of an epoch refreshes too, and shows what was read before.
            values = {**trainer.callback_metrics, **metrics}
            self._shown = {short: fmt.format(float(values[key]))
                           for key, (short, fmt) in self.SHORT.items() if key in values}
        rest = {key: value for key, value in metrics.items() if key not in self.SHORT}
        compiled = {"compiled": self._compiled_in} if self._compiled_in else {}
        return {**rest, **self._shown, **compiled}


def progress_bar(refresh_rate: int = 1) -> Callback:
    return ProgressBar(refresh_rate)
