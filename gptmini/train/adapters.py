"""Which weights a run trains: all of them, or LoRA's adapters on a frozen base (the book's
appendix E). The LightningModule asks one of these objects, built once from its settings,
instead of branching on the rank: what to do to the model, which optimizer, what a
checkpoint keeps."""

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from gptmini.finetune import DEFAULT_TARGETS, add_lora, count_parameters


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
        return {"lora": {"base": str(base), "base_fingerprint": fingerprint, "rank": self.rank,
                         "alpha": self.alpha, "dropout": self.dropout,
                         "targets": list(self.targets)}}

    def summary(self, model: nn.Module) -> str:
        trainable, total = count_parameters(model)
        return (f"LoRA rank {self.rank} on {', '.join(self.targets)}: {trainable:,} of "
                f"{total:,} parameters train ({trainable / total:.2%})")


def trained_weights(*, rank: int, alpha: float, dropout: float, targets: list[str] | None,
                    init_from: str | None) -> AllWeights | LoRA:
    """The weights a run's settings train: LoRA's adapters for a rank above 0, else all.

    Raises:
        ValueError: LoRA without a pretrained model to adapt (--model.init_from).
    """
    if not rank:
        return AllWeights()
    if not init_from:
        raise ValueError(f"model.lora_rank={rank} adapts a pretrained model: name it with "
                         "--model.init_from (a .ckpt or a Hugging Face directory)")
    return LoRA(rank, alpha, dropout, tuple(targets or DEFAULT_TARGETS))


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
