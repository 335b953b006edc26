"""Optimizer steps as a training run sees them from its hooks: whether the optimizer stepped
at the batch now ending (the one signal every step-counting hook reads), the steps skipped
for a non-finite loss or gradient, counted on the device until the next check, and the
throughput of the steps between two logging steps."""

import math
import time
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from gptmini.train.optim import skips_on_device

__all__ = ["OptimizerSteps", "SkippedSteps", "Throughput", "clip_gradients"]


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

    def skip_if_not_finite(self, optimizer: torch.optim.Optimizer, norm: Tensor, step: int,
                           precision: str) -> None:
        """A NaN or infinite loss or gradient (a NaN loss makes NaN gradients, hence a NaN
        `norm`) never updates the weights.

        Fused AdamW and MuonAdamW skip their update on the device when `found_inf` is set
        (what a grad scaler does), so nothing waits for the answer; the step is counted on
        the device and reported at the next logging step or checkpoint save. fp16 mixed precision
        overflows on purpose and its grad scaler skips those steps itself.
        """
        if precision == "16-mixed":
            return
        bad = ~torch.isfinite(norm)
        if skips_on_device(optimizer):  # fused AdamW, MuonAdamW
            optimizer.found_inf = bad.float()
        elif bool(bad):  # an optimizer without on-device skipping: wait, and skip here
            optimizer.zero_grad(set_to_none=True)
        self.record(bad, step)

    def raise_if_any(self, step: int, weights: Iterable[Tensor] = ()) -> None:
        """Raise FloatingPointError if a step up to `step` was skipped, naming the first; or
        if any of `weights` (a checkpoint's about to be written) is not finite."""
        skipped = 0 if self.count is None else int(self.count)
        if skipped:
            raise FloatingPointError(
                f"the loss or gradient was not finite at step {int(self.first)} ({skipped} "
                f"step(s) up to step {step}); those steps were skipped, so the weights are "
                "as before them, and the run stops here with the last checkpoint intact. "
                "Lower --model.learning_rate, raise --model.warmup_steps or set "
                "--trainer.gradient_clip_val, then resume with --ckpt_path last"
            )
        if not all(bool(torch.isfinite(w).all()) for w in weights):
            raise FloatingPointError(
                f"the weights hold NaN or infinite values at step {step}, so no checkpoint "
                "was written; the last one is intact. Resume from it with a lower "
                "--model.learning_rate: --ckpt_path last")


def clip_gradients(parameters: Sequence[nn.Parameter], clip: float | None,
                   algorithm: str | None) -> Tensor:
    """Measure the gradients' norm in one pass and clip by it (Lightning's gradient_clip_val
    and gradient_clip_algorithm; None or 0 measures without clipping), without waiting on
    the device. FSDP2's gradients are shards: the norm spans every rank's.

    Returns:
        The norm before clipping, a 0-d tensor (whole, also under FSDP2).
    """
    if algorithm == "value":
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
        torch.nn.utils.clip_grad_value_(parameters, clip)
    else:
        norm = torch.nn.utils.clip_grad_norm_(parameters, clip or math.inf)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class Throughput:
    """Tokens per second and model FLOPs utilization over a logging interval (data wait,
    forward, backward, optimizer), validation left out.

    Args:
        flops_per_token: the model's training FLOPs per token (`gptmini.model.flops`).
        peak_flops: one device's peak FLOP/s; None until measured (`gptmini.runtime`).
    """

    def __init__(self, flops_per_token: float, peak_flops: float | None = None):
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.restart()

    def restart(self) -> None:
        """Start a new interval (training starts, or validation ended)."""
        self._start, self._tokens = time.perf_counter(), 0

    def count(self, tokens: int) -> None:
        """Add a training batch's tokens to the interval."""
        self._tokens += tokens

    def window(self, world_size: int) -> dict[str, float]:
        """The interval's "tokens_per_sec" over every rank (each counts its own) and "mfu"
        when the peak is known; a new interval starts."""
        now = time.perf_counter()
        tokens_per_sec = self._tokens * world_size / (now - self._start)
        self._start, self._tokens = now, 0
        rates = {"tokens_per_sec": tokens_per_sec}
        if self.peak_flops:
            rates["mfu"] = self.flops_per_token * tokens_per_sec / (self.peak_flops * world_size)
        return rates

    def describe(self, dtype: torch.dtype, device: str) -> str:
        """How MFU is computed here, with the figures it uses (the peak's for `dtype`)."""
        peak = f"{self.peak_flops / 1e12:.3g} TFLOP/s" if self.peak_flops else "unknown"
        dtype = str(dtype).removeprefix("torch.")
        return (f"MFU: tokens/s x {self.flops_per_token / 1e6:.1f} MFLOP per token (6N + "
                "attention, gptmini.model.flops; N = matmul weights with the head) / peak "
                f"({peak} for {dtype} on {device})")
