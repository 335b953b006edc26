"""Optimizer steps as a training run sees them from its hooks: whether the optimizer stepped
at the batch now ending (the one signal every step-counting hook reads), and the steps
skipped for a non-finite loss or gradient, counted on the device until the next check."""

import torch
from torch import Tensor

__all__ = ["OptimizerSteps", "SkippedSteps"]


class OptimizerSteps:
    """Whether the optimizer step happened during the batch now ending.

    `on_train_batch_end` runs after every micro-batch, and with gradient accumulation
    several micro-batches share one `global_step`. `stepped` is true only at the batch
    whose optimizer step moved `global_step`: never for micro-batches before the first step
    or between steps, and never for the step a resumed run starts from (`start` runs at
    `on_train_start`, after the restore). Reading is free of side effects, so every hook of
    a batch (checkpoints, samples, the progress bar, the signal handler) reads the same
    answer from the one instance the LightningModule owns (`GPTLitModule.optimizer_steps`).
    """

    def __init__(self):
        self.step_at_batch_start = 0
        self.batches = 0
        """Micro-batches begun since the last optimizer step, the current one included."""

    def start(self, trainer) -> None:
        """At `on_train_start`: the restored step is not a step of this run."""
        self.step_at_batch_start, self.batches = trainer.global_step, 0

    def batch_started(self, trainer) -> None:
        """At `on_train_batch_start`, before the batch's forward, backward and step."""
        if trainer.global_step != self.step_at_batch_start:  # the previous batch stepped
            self.batches = 0
        self.step_at_batch_start = trainer.global_step
        self.batches += 1

    def stepped(self, trainer) -> bool:
        """Whether `global_step` moved since this batch began (its optimizer step ran)."""
        return trainer.global_step != self.step_at_batch_start

    def since_step(self, trainer) -> int:
        """Micro-batches done since the last optimizer step: 0 right after one."""
        return 0 if self.stepped(trainer) else self.batches


class SkippedSteps:
    """Optimizer steps skipped because the loss or the gradient was not finite.

    Counted on the device (no wait per step); `raise_if_any` reads the count, the one wait
    on the device per logging interval and per checkpoint.
    """

    def __init__(self):
        self.count: Tensor | None = None
        self.first: Tensor | None = None
        """The step the first skipped one followed (-1: none), on the device."""

    def reset(self) -> None:
        self.count = self.first = None

    def record(self, bad: Tensor, step: int) -> None:
        """Count `bad` (a 0-d bool tensor) as a skipped step after `step`."""
        if self.count is None:
            self.count = torch.zeros((), dtype=torch.long, device=bad.device)
            self.first = torch.full((), -1, dtype=torch.long, device=bad.device)
        self.count += bad
        self.first = torch.where(bad & (self.first < 0), step, self.first)

    def raise_if_any(self, step: int) -> None:
        """Raise FloatingPointError if a step up to `step` was skipped, naming the first."""
        skipped = 0 if self.count is None else int(self.count)
        if skipped:
            raise FloatingPointError(
                f"the loss or gradient was not finite at step {int(self.first)} ({skipped} "
                f"step(s) up to step {step}); those steps were skipped, so the weights are "
                "as before them, and the run stops here with the last checkpoint intact. "
                "Lower --model.learning_rate, raise --model.warmup_steps or set "
                "--trainer.gradient_clip_val, then resume with --ckpt_path last"
            )
