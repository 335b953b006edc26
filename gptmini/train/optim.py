"""The optimizer and its schedule: AdamW with weight decay on matrices only, or Muon on the
hidden matrices beside it; a linear warmup then a cosine decay; and what a resumed run may
change of them.

The LightningModule builds them (`configure_optimizers`) from its hyperparameters; the
model's shape is not one of those, and a resume may not change it.
"""

import math
import warnings
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["MUON_ADJUST_LR", "MUON_TORCH", "OPTIMIZATION_FIELDS", "OPTIMIZERS", "MuonAdamW",
           "adamw", "apply_changed_settings", "check_optimizer", "lr_factor", "make_optimizer",
           "muon_adamw", "muon_class", "warmup_cosine"]

OPTIMIZERS = ("adamw", "muon")
OPTIMIZATION_FIELDS = ("learning_rate", "muon_learning_rate", "min_lr_ratio", "warmup_steps",
                       "weight_decay", "beta1", "beta2")
"""Settings a resumed run may change; the model's shape may not."""
MUON_TORCH = "2.9"
"""The first torch release with `torch.optim.Muon`."""
MUON_ADJUST_LR = "match_rms_adamw"
"""torch Muon's per-shape rate: 0.2 * sqrt(max(rows, cols)) x its lr, so that an update's
RMS is AdamW's (Moonshot's "Muon is Scalable"), and the AdamW weight decay carries over."""


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


def muon_class() -> type[torch.optim.Optimizer]:
    """`torch.optim.Muon`, or a clear error naming the torch that ships it."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise ValueError(
            f"model.optimizer=muon needs torch.optim.Muon, which torch {MUON_TORCH} first "
            f"ships; this is torch {torch.__version__}: pip install 'torch>={MUON_TORCH}', or "
            "use --model.optimizer adamw")
    return muon


class MuonAdamW(torch.optim.Optimizer):
    """torch's Muon on the hidden matrices and fused AdamW on the rest, as one optimizer.

    Lightning's automatic optimization steps one optimizer; as one, the warmup/cosine
    scheduler (each group keeps its own base rate), gradient clipping, accumulation,
    checkpoints and the non-finite skip work as they do for AdamW. The param groups are
    AdamW's (decayed, plain) then Muon's, shared with the two inner optimizers, as is the
    state, so `state_dict` has the usual layout. Muon cannot skip a step on the device: a
    non-finite step is skipped by clearing the gradients, which reads one flag off the
    device per step (free on a CPU).
    """

    def __init__(self, adamw_groups: list[dict], muon_params: list[nn.Parameter], *,
                 learning_rate: float, muon_learning_rate: float, weight_decay: float,
                 betas: tuple[float, float], fused: bool):
        self.adamw = torch.optim.AdamW(adamw_groups, lr=learning_rate, betas=betas,
                                       fused=fused)
        self.muon = muon_class()(muon_params, lr=muon_learning_rate, weight_decay=weight_decay,
                                 adjust_lr_fn=MUON_ADJUST_LR)
        super().__init__([*self.adamw.param_groups, *self.muon.param_groups], {})
        self._share()

    def _share(self) -> None:
        """The inner optimizers see this one's groups (the scheduler's rates) and state."""
        n = len(self.adamw.param_groups)
        self.adamw.param_groups, self.muon.param_groups = (self.param_groups[:n],
                                                           self.param_groups[n:])
        self.adamw.state = self.muon.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: share them again
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.adamw.step()
        self.muon.step()
        return loss


def muon_adamw(model: nn.Module, *, learning_rate: float, muon_learning_rate: float,
               weight_decay: float, betas: tuple[float, float],
               device: torch.device) -> MuonAdamW:
    """Muon for the 2-D weights inside `model.trf_blocks` (attention and MLP projections);
    AdamW for the embeddings and head (decayed) and the biases and norm gains (not)."""
    hidden = [p for p in model.trf_blocks.parameters() if p.requires_grad and p.dim() == 2]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    return MuonAdamW(groups, hidden, learning_rate=learning_rate,
                     muon_learning_rate=muon_learning_rate, weight_decay=weight_decay,
                     betas=betas, fused=device.type in ("cuda", "cpu"))


def check_optimizer(name: str) -> None:
    """Raise a ValueError unless `name` is one of OPTIMIZERS this torch can build."""
    if name not in OPTIMIZERS:
        raise ValueError(f"model.optimizer={name!r}: use one of {', '.join(OPTIMIZERS)}")
    if name == "muon":
        muon_class()


def make_optimizer(model: nn.Module, name: str, *, learning_rate: float,
                   muon_learning_rate: float, weight_decay: float, betas: tuple[float, float],
                   device: torch.device, sharded: bool = False) -> torch.optim.Optimizer:
    """`adamw` over all of `model`, or `muon_adamw` (`name` one of OPTIMIZERS); `sharded`:
    the model's parameters are FSDP shards, which Muon cannot orthogonalize."""
    check_optimizer(name)
    if name == "muon" and sharded:
        raise ValueError("model.optimizer=muon orthogonalizes whole matrices and FSDP shards "
                         "them: use --trainer.strategy ddp, or --model.optimizer adamw")
    if name == "muon":
        return muon_adamw(model, learning_rate=learning_rate,
                          muon_learning_rate=muon_learning_rate, weight_decay=weight_decay,
                          betas=betas, device=device)
    return adamw(model.parameters(), learning_rate=learning_rate, weight_decay=weight_decay,
                 betas=betas, device=device)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total_steps`, then flat."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                  min_ratio: float, asked_warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_factor` as a scheduler stepped once per optimizer step; warns when the run is
    shorter than the warmup it asked for (`asked_warmup`). Every param group follows it
    from its own base rate (Muon's and AdamW's)."""
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

    The restored optimizer and schedule would otherwise keep the old learning rates, weight
    decay and betas. The schedule is a function of the step, so it continues from the step
    reached as the new settings draw it. Returns the changed fields (printed if `announce`).
    Another optimizer than the checkpoint's is refused (ValueError).
    """
    saved, hp = checkpoint.get("hyper_parameters", {}), hparams
    if saved.get("optimizer", "adamw") != hp.optimizer:  # its state has other groups
        raise ValueError(
            f"the checkpoint was trained with --model.optimizer {saved.get('optimizer', 'adamw')}"
            f" and this run asks for {hp.optimizer}; resume with "
            f"--model.optimizer {saved.get('optimizer', 'adamw')}, or start a new --run_name")
    changed = [f for f in OPTIMIZATION_FIELDS if f in saved and saved[f] != hp[f]]
    if not changed:
        return changed
    if announce:
        diffs = ", ".join(f"{f} {saved[f]} -> {hp[f]}" for f in changed)
        print(f"resuming with changed settings: {diffs}", flush=True)
    for optimizer, schedule in zip(checkpoint.get("optimizer_states", []),
                                   checkpoint.get("lr_schedulers", []), strict=False):
        factor = lr_factor(schedule.get("last_epoch", 0), warmup_steps, total_steps,
                           hp.min_lr_ratio)
        groups = optimizer.get("param_groups", [])
        # Muon's groups have ns_steps; AdamW's first group is the decayed one.
        bases = [hp.muon_learning_rate if "ns_steps" in g else hp.learning_rate for g in groups]
        for i, (group, base) in enumerate(zip(groups, bases, strict=True)):
            group.update(lr=base * factor, initial_lr=base)
            if "ns_steps" in group or i == 0:
                group["weight_decay"] = hp.weight_decay
            if "betas" in group:
                group["betas"] = (hp.beta1, hp.beta2)
        schedule["base_lrs"] = bases
        schedule["_last_lr"] = [base * factor for base in bases]
    return changed
