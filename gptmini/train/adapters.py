"""Which weights a run trains: all of them, or LoRA's adapters on a frozen base (the book's
appendix E). The LightningModule asks one of these objects, built once from its settings,
instead of branching on the rank: what to do to the model, which optimizer, what a
checkpoint keeps."""

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from gptmini.finetune import DEFAULT_TARGETS, add_lora, check_targets, count_parameters

LORA_DEFAULTS = {"lora_alpha": 16.0, "lora_dropout": 0.0, "lora_targets": None}
"""The LoRA settings' defaults (GPTLitModule's): with lora_rank 0 each must stay at its
default, since nothing would read it."""


class AllWeights:
    """Every weight trains: a run from scratch, or a full fine-tune."""

    keeps_base = False
    """Whether a checkpoint leaves the base's weights out (then the base is read on resume)."""

    def apply(self, model: nn.Module, task_keys: set[str]) -> nn.Module:
        """`model` as it trains (here, as it is)."""
        return model

    def optimizer(self, name: str, say: Callable[[str], None]) -> str:
        """The optimizer (--model.optimizer) the trained weights take; `say` prints why
        another is taken."""
        return name

    def saved(self, state: dict, model: nn.Module) -> dict:
        """The state a checkpoint keeps of `state` (a LightningModule's): all of it."""
        return state

    def entries(self, base: str | None, fingerprint: str | None) -> dict:
        """What a checkpoint carries beside the weights to rebuild them: nothing more."""
        return {}

    def summary(self, model: nn.Module) -> str | None:
        """A line saying what trains, printed when training starts; None: nothing to say."""
        return None

    def check_resume(self, checkpoint: dict) -> None:
        """Refuse to resume a checkpoint whose weights these settings would not train alike
        (here: one of LoRA adapters), before anything of it is loaded.

        Raises:
            ValueError: naming the flags to resume with.
        """
        saved = checkpoint.get("lora")
        if saved:
            raise ValueError(
                f"the checkpoint holds LoRA adapters ({_settings(saved)}) and this run trains "
                f"every weight (--model.lora_rank 0): resume with {_flags(saved)}, or start a "
                "new --run_name")


@dataclass(frozen=True)
class LoRA:
    """LoRA adapters on the `targets` layers of a frozen base; they train (with what the
    task made new, a class head), and a checkpoint holds them alone, with the base's path
    and fingerprint (see `gptmini.checkpoint.load_checkpoint`)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    keeps_base = True

    def apply(self, model: nn.Module, task_keys: set[str]) -> nn.Module:
        add_lora(model, rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                 targets=self.targets)
        for name, parameter in model.named_parameters():
            if name in task_keys:  # a class head trains
                parameter.requires_grad_(True)
        return model

    def optimizer(self, name: str, say: Callable[[str], None]) -> str:
        # Muon would orthogonalize each adapter's update: every singular value of a rank-r
        # step set to one, whatever the gradient's spectrum, at a rate scaled by the wide
        # side. LoRA is an AdamW method (the paper, the book's appendix E).
        if name == "muon":
            say("LoRA: the adapters train with AdamW (--model.optimizer muon applies to full "
                "fine-tuning)")
        return "adamw"

    def saved(self, state: dict, model: nn.Module) -> dict:
        trainable = {f"model.{n}" for n, p in model.named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in trainable}

    def entries(self, base: str | None, fingerprint: str | None) -> dict:
        # The base as an absolute path: the adapters load onto it from any directory.
        where = Path(str(base))
        base = where.resolve() if where.exists() else base
        return {"lora": {"base": str(base), "base_fingerprint": fingerprint, "rank": self.rank,
                         "alpha": self.alpha, "dropout": self.dropout,
                         "targets": list(self.targets)}}

    def summary(self, model: nn.Module) -> str:
        trainable, total = count_parameters(model)
        return (f"LoRA rank {self.rank} on {', '.join(self.targets)}: {trainable:,} of "
                f"{total:,} parameters train ({trainable / total:.2%})")

    def check_resume(self, checkpoint: dict) -> None:
        # Another rank or targets would not load (torch's size mismatch, or the optimizer's
        # "parameter group doesn't match"); another alpha would load and silently rescale
        # the trained update by alpha / rank. Dropout may change, as drop_rate may.
        saved = checkpoint.get("lora")
        if not saved:
            raise ValueError(
                "the checkpoint trained every weight, and this run would train LoRA adapters "
                f"(--model.lora_rank {self.rank}): resume without the --model.lora_* "
                "settings, or start a new --run_name to adapt it (--model.init_from it)")
        mine = {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}
        differ = [k for k, v in mine.items() if saved.get(k) != v]
        if not differ:
            return
        said = ", ".join(f"--model.lora_{k} {mine[k]} (the checkpoint's {saved.get(k)})"
                         for k in differ)
        why = ("the adapters' shapes differ" if {"rank", "targets"} & set(differ) else
               f"the trained update would be rescaled x{self.alpha / saved['alpha']:g}")
        raise ValueError(f"resuming LoRA adapters with other settings: {said}; {why}. "
                         f"Resume with {_flags(saved)}, or start a new --run_name")


def trained_weights(*, rank: int, alpha: float, dropout: float, targets: list[str] | None,
                    init_from: str | None) -> AllWeights | LoRA:
    """The weights a run's settings train: LoRA's adapters for a rank above 0, else all.
    Every LoRA setting is checked whatever the rank, and one set with rank 0 is refused:
    nothing would read it.

    Raises:
        ValueError: a LoRA setting out of range, LoRA settings without a rank, or LoRA
            without a pretrained model to adapt (--model.init_from), naming the flag.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"--model.lora_rank {rank!r}: use a positive integer such as 8, or "
                         "0 to train every weight")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not (
            math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"--model.lora_alpha {alpha!r}: use a positive number (the update "
                         "is scaled by alpha / rank), such as 16")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not (
            0.0 <= dropout < 1.0):
        raise ValueError(f"--model.lora_dropout {dropout!r}: use a probability in [0, 1)")
    if targets is not None:
        try:
            targets = list(check_targets(targets))
        except ValueError as err:
            raise ValueError(f"--model.{err}") from None
    if not rank:
        given = {"lora_alpha": alpha, "lora_dropout": dropout, "lora_targets": targets}
        unread = [f"--model.{k} {v}" for k, v in given.items() if v != LORA_DEFAULTS[k]]
        if unread:
            raise ValueError(f"{', '.join(unread)} set, but --model.lora_rank is 0 (no LoRA: "
                             "every weight trains and nothing reads them): set "
                             "--model.lora_rank (e.g. 8) to train adapters, or drop them")
        return AllWeights()
    if not init_from:
        raise ValueError(f"model.lora_rank={rank} adapts a pretrained model: name it with "
                         "--model.init_from (a .ckpt or a Hugging Face directory)")
    return LoRA(rank, float(alpha), float(dropout), tuple(targets or DEFAULT_TARGETS))


def _settings(saved: dict) -> str:
    return (f"rank {saved.get('rank')}, alpha {saved.get('alpha')}, on "
            f"{', '.join(saved.get('targets') or ())}")


def _flags(saved: dict) -> str:
    """The flags that resume a checkpoint's adapters as they were trained."""
    return (f"--model.lora_rank {saved.get('rank')} --model.lora_alpha {saved.get('alpha')} "
            f"--model.lora_targets [{','.join(saved.get('targets') or ())}]")


def check_base(checkpoint: dict, fingerprint: str | None, init_from: str | None) -> None:
    """Refuse to resume adapters on a base other than the one they were trained on.

    Raises:
        ValueError: naming both bases and the fix.
    """
    saved = checkpoint.get("lora")
    if saved and fingerprint not in (None, saved["base_fingerprint"]):
        raise ValueError(
            f"the checkpoint's adapters were trained on {saved['base']} (weights "
            f"{saved['base_fingerprint']}), and model.init_from={init_from} holds other "
            f"weights ({fingerprint}): resume with the base they were trained on")
