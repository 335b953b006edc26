"""The optimizer and its schedule: AdamW with weight decay on matrices only, a linear warmup
then a cosine decay, and what a resumed run may change of them.

The LightningModule builds them (`configure_optimizers`) from its hyperparameters; the
model's shape is not one of those, and a resume may not change it.
"""

import math
import warnings
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["OPTIMIZATION_FIELDS", "adamw", "apply_changed_settings", "lr_factor",
           "warmup_cosine"]

OPTIMIZATION_FIELDS = ("learning_rate", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1",
                       "beta2")
"""Settings a resumed run may change; the model's shape may not."""


def adamw(params: Iterable[nn.Parameter], *, learning_rate: float, weight_decay: float,
          betas: tuple[float, float], device: torch.device) -> torch.optim.AdamW:
    """AdamW decaying matrices and embeddings (group 0), not biases and norm gains (group 1)."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # Fused: one kernel for all tensors, and it can skip a non-finite step on the device
    # (GPTLitModule._skip_if_not_finite). CUDA and CPU have it.
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas,
                             fused=device.type in ("cuda", "cpu"))


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total_steps`, then flat."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                  min_ratio: float, asked_warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_factor` as a scheduler stepped once per optimizer step; warns when the run is
    shorter than the warmup it asked for (`asked_warmup`)."""
    if warmup_steps < asked_warmup:  # a short trial run (fast_dev_run, a few max_steps)
        warnings.warn(
            f"model.warmup_steps={asked_warmup} is longer than the run ({total_steps} "
            f"optimizer steps); warming up over all {total_steps} instead",
            stacklevel=3,
        )
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, min_ratio))


def apply_changed_settings(checkpoint: dict, hparams, *, warmup_steps: int, total_steps: int,
                           announce: bool) -> list[str]:
    """Make a checkpoint being resumed carry this run's optimization settings.

    The restored optimizer and schedule would otherwise keep the old learning rate, weight
    decay and betas. The schedule is a function of the step, so it continues from the step
    reached as the new settings draw it. Returns the changed fields (printed if `announce`).
    """
    saved, hp = checkpoint.get("hyper_parameters", {}), hparams
    changed = [f for f in OPTIMIZATION_FIELDS if f in saved and saved[f] != hp[f]]
    if not changed:
        return changed
    if announce:
        diffs = ", ".join(f"{f} {saved[f]} -> {hp[f]}" for f in changed)
        print(f"resuming with changed settings: {diffs}", flush=True)
    for schedule in checkpoint.get("lr_schedulers", []):
        step = schedule.get("last_epoch", 0)
        lr = hp.learning_rate * lr_factor(step, warmup_steps, total_steps, hp.min_lr_ratio)
        schedule["base_lrs"] = [hp.learning_rate] * len(schedule.get("base_lrs", []))
        schedule["_last_lr"] = [lr] * len(schedule.get("_last_lr", []))
    for optimizer in checkpoint.get("optimizer_states", []):
        for i, group in enumerate(optimizer.get("param_groups", [])):
            group.update(lr=lr, initial_lr=hp.learning_rate, betas=(hp.beta1, hp.beta2))
            if i == 0:  # adamw's first group is the decayed one
                group["weight_decay"] = hp.weight_decay
    return changed
