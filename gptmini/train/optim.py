"""The optimizer and its schedule: AdamW with weight decay on matrices only, or Muon on the
hidden matrices beside it; a linear warmup then a cosine decay; and what a resumed run may
change of them.

Muon itself (Newton-Schulz, the batched and sharded step) is gptmini.train.muon. The
LightningModule builds them (`configure_optimizers`) from its `OptimizerSettings`, read
once from its hyperparameters; the model's shape is not one of those, and a resume may not
change it.
"""

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields

import torch
from torch import nn

from gptmini.model import is_finite_number
from gptmini.train.muon import (
    NS_SET,
    NS_STEPS,
    check_muon_settings,
    is_muon_group,
    muon_adamw,
    muon_class,
)

__all__ = ["OPTIMIZATION_FIELDS", "OPTIMIZERS", "SETTINGS", "OptimizerSettings", "adamw",
           "apply_changed_settings", "check_optimizer", "check_settings", "configure",
           "lr_factor", "make_optimizer", "skips_on_device", "warmup_cosine", "warmup_for"]

OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class OptimizerSettings:
    """A run's optimizer and its schedule, typed and checked when made (a ValueError naming
    the flag): GPTLitModule's --model.<field> flags, whose docstring says what each does
    and whose signature holds their defaults."""

    optimizer: str
    learning_rate: float
    muon_learning_rate: float
    weight_decay: float
    beta1: float
    beta2: float
    warmup_steps: int
    min_lr_ratio: float
    muon_ns_steps: int = NS_STEPS
    muon_ns_coefficients: str = NS_SET

    def __post_init__(self):
        check_settings(**{f.name: getattr(self, f.name) for f in fields(self)
                          if f.name in SETTINGS})
        check_optimizer(self.optimizer)
        check_muon_settings(self.muon_ns_steps, self.muon_ns_coefficients)

    @classmethod
    def of(cls, hparams: Mapping) -> "OptimizerSettings":
        """The settings among a module's hyperparameters (a checkpoint's from before Muon's
        Newton-Schulz settings: their defaults)."""
        return cls(**{f.name: hparams[f.name] for f in fields(cls) if f.name in hparams})

    @property
    def betas(self) -> tuple[float, float]:
        return self.beta1, self.beta2


OPTIMIZATION_FIELDS = tuple(f.name for f in fields(OptimizerSettings) if f.name != "optimizer")
"""Settings a resumed run may change (its optimizer's state fits one optimizer only); the
model's shape may not."""


def adamw(params: Iterable[nn.Parameter], *, learning_rate: float, weight_decay: float,
          betas: tuple[float, float], device: torch.device) -> torch.optim.AdamW:
    """AdamW decaying matrices and embeddings (group 0), not biases and norm gains (group 1)."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # Fused: one kernel for all tensors, and it can skip a non-finite step on the device
    # (see GPTLitModule.configure_gradient_clipping). CUDA and CPU have it.
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas,
                             fused=device.type in ("cuda", "cpu"))


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` skips a step on the device when its `found_inf` is nonzero (what a
    grad scaler sets): torch's fused optimizers, and MuonAdamW with fused AdamW."""
    own = getattr(optimizer, "skips_on_device", None)
    return bool(own if own is not None else optimizer.defaults.get("fused"))


SETTINGS = {  # name: (the range it must be in, what to use)
    "learning_rate": (lambda x: x > 0, "a positive number such as 1e-3"),
    "muon_learning_rate": (lambda x: x > 0, "a positive number such as 2e-3"),
    "min_lr_ratio": (lambda x: 0 <= x <= 1, "a number in [0, 1]"),
    "warmup_steps": (lambda x: x >= 0, "an integer, 0 or more"),
    "weight_decay": (lambda x: x >= 0, "a number, 0 or more, such as 0.1"),
    # A beta of 1 never forgets: the moment estimates stay at their start.
    "beta1": (lambda x: 0 <= x < 1, "a number in [0, 1), such as 0.9"),
    "beta2": (lambda x: 0 <= x < 1, "a number in [0, 1), such as 0.95"),
    "peak_flops": (lambda x: x > 0, "a positive number of FLOP/s, or None to measure it"),
    "loss_chunk_size": (lambda x: x >= 1, "an integer, 1 or more, or None for all at once"),
}
"""GPTLitModule's optimization settings: each a finite number in its range."""


def check_settings(**values) -> None:
    """Refuse a setting of `SETTINGS` that is not a finite number in its range (None where
    the setting allows it), naming its flag.

    Raises:
        ValueError: e.g. "--model.beta1 1.5 is invalid: use a number in [0, 1), such as 0.9".
    """
    for name, value in values.items():
        in_range, what = SETTINGS[name]
        if value is None and "None" in what:
            continue
        kind_ok = isinstance(value, int) if what.startswith("an integer") else True
        if not (is_finite_number(value) and kind_ok and in_range(value)):
            raise ValueError(f"--model.{name} {value!r} is invalid: use {what}")


def check_optimizer(name: str) -> None:
    """Raise a ValueError unless `name` is one of OPTIMIZERS this torch can build."""
    if name not in OPTIMIZERS:
        raise ValueError(f"model.optimizer={name!r}: use one of {', '.join(OPTIMIZERS)}")
    if name == "muon":
        muon_class()


def make_optimizer(model: nn.Module, settings: OptimizerSettings,
                   device: torch.device) -> torch.optim.Optimizer:
    """`adamw` over all of `model`, or `muon_adamw`, as `settings.optimizer` names. `model`'s
    parameters may be FSDP2 shards (DTensors): Muon then orthogonalizes whole matrices
    (`sharded_orthogonalize`)."""
    s = settings
    if s.optimizer == "muon":
        return muon_adamw(model, learning_rate=s.learning_rate,
                          muon_learning_rate=s.muon_learning_rate, weight_decay=s.weight_decay,
                          betas=s.betas, device=device, ns_steps=s.muon_ns_steps,
                          ns_coefficients=s.muon_ns_coefficients)
    return adamw(model.parameters(), learning_rate=s.learning_rate,
                 weight_decay=s.weight_decay, betas=s.betas, device=device)


def configure(model: nn.Module, settings: OptimizerSettings, *, device: torch.device,
              total_steps: int, say: Callable[[str], None] = print) -> dict:
    """The optimizer and its warmup-cosine schedule, as Lightning's `configure_optimizers`
    returns them. A warm-up cut to half the run (`warmup_for`) is said through `say`, naming
    the flags."""
    optimizer = make_optimizer(model, settings, device)
    warmup = warmup_for(settings.warmup_steps, total_steps)
    if warmup < settings.warmup_steps:  # a short trial run (fast_dev_run, a few max_steps)
        say(f"--model.warmup_steps {settings.warmup_steps} is more than half of this run's "
            f"{total_steps} optimizer steps (--trainer.max_steps or --trainer.max_epochs): "
            f"warming up over {warmup} and decaying over the other {total_steps - warmup}, so "
            f"the run still ends at the low rate; give --model.warmup_steps {warmup} or "
            "less to choose yourself")
    schedule = warmup_cosine(optimizer, warmup_steps=warmup, total_steps=total_steps,
                             min_ratio=settings.min_lr_ratio)
    return {"optimizer": optimizer,
            "lr_scheduler": {"scheduler": schedule, "interval": "step", "frequency": 1}}


def warmup_for(asked: int, total_steps: int) -> int:
    """The warm-up a run of `total_steps` optimizer steps gets: the `asked` one, at most half
    the run. A run shorter than its warm-up (train.py's `--trainer.max_steps 100` under the
    default's 100 warm-up steps) would otherwise end at the peak rate without decaying; every
    shipped recipe asks for well under half, so it keeps its own. Resume computes the same."""
    return min(asked, total_steps // 2)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total_steps`, then flat."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                  min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_factor` as a scheduler stepped once per optimizer step. Every param group follows
    it from its own base rate (Muon's and AdamW's)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, min_ratio))


def apply_changed_settings(checkpoint: dict, settings: OptimizerSettings, *,
                           warmup_steps: int, total_steps: int, announce: bool) -> list[str]:
    """Make a checkpoint being resumed carry this run's optimization settings.

    The restored optimizer and schedule would otherwise keep the old learning rates, weight
    decay and betas. The schedule is a function of the step, so it continues from the step
    reached as the new settings draw it. Returns the changed fields (printed if `announce`).
    Another optimizer than the checkpoint's is refused (ValueError).
    """
    saved, hp = checkpoint.get("hyper_parameters", {}), settings
    if saved.get("optimizer", "adamw") != hp.optimizer:  # its state has other groups
        raise ValueError(
            f"the checkpoint was trained with --model.optimizer {saved.get('optimizer', 'adamw')}"
            f" and this run asks for {hp.optimizer}; resume with "
            f"--model.optimizer {saved.get('optimizer', 'adamw')}, or start a new --run_name")
    changed = [f for f in OPTIMIZATION_FIELDS if f in saved and saved[f] != getattr(hp, f)]
    if not changed:
        return changed
    if announce:
        diffs = ", ".join(f"{f} {saved[f]} -> {getattr(hp, f)}" for f in changed)
        print(f"resuming with changed settings: {diffs}", flush=True)
    for optimizer, schedule in zip(checkpoint.get("optimizer_states", []),
                                   checkpoint.get("lr_schedulers", []), strict=False):
        factor = lr_factor(schedule.get("last_epoch", 0), warmup_steps, total_steps,
                           hp.min_lr_ratio)
        groups = optimizer.get("param_groups", [])
        muon = [is_muon_group(g) for g in groups]  # AdamW's first group is the decayed one
        bases = [hp.muon_learning_rate if m else hp.learning_rate for m in muon]
        for i, (group, base) in enumerate(zip(groups, bases, strict=True)):
            group.update(lr=base * factor, initial_lr=base)
            if muon[i] or i == 0:
                group["weight_decay"] = hp.weight_decay
            if muon[i]:
                group.update(ns_steps=hp.muon_ns_steps, ns_coefficients=hp.muon_ns_coefficients)
            if "betas" in group:
                group["betas"] = hp.betas
        schedule["base_lrs"] = bases
        schedule["_last_lr"] = [base * factor for base in bases]
    return changed
