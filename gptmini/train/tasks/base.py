"""The task interface: what a run teaches the model, as the LightningModule asks it.

The module owns what every run shares (the optimizer, its schedule, non-finite steps,
throughput, checkpoints, exact resume); a `Task` owns what differs: how the model is shaped
for it, the loss of a batch, the metrics, and what a batch holds. The module logs what the
task returns under `train/<name>` and `val/<name>`.

Preference pairs (DPO) fit the same way: a batch holds the chosen and the rejected rows
with their response-only targets (-100 elsewhere, as chat fine-tuning renders them); `loss`
sums each response's log-probabilities under the model and under the frozen reference (the
starting weights: the same model with LoRA's adapters off, else a copy taken when training
starts) and returns the DPO loss with its rewards, margin and accuracy as metrics.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from gptmini.finetune.reference import Reference
from gptmini.model import GPTModel, lm_loss

Metrics = dict[str, Tensor]
"""Scalars by name ("loss", "acc", an auxiliary loss's name), logged as train/ or val/<name>."""


class Task(ABC):
    """What a run teaches the model (language modelling, classification, ...).

    A batch is whatever the task's data module yields (a tuple of tensors here); the task
    alone reads it, so a new task brings its own batch layout with its own data.
    """

    generates_text = True
    """The trained model writes text (generate.py, serve.py): a run's report suggests them."""

    def prepare(self, model: GPTModel) -> set[str]:
        """Shape `model` for the task, in place, before any weight is loaded (a class head).

        Returns:
            The state keys it made new: they start fresh rather than from a fine-tune's
            source, and they train (and are saved) beside LoRA's adapters.
        """
        return set()

    needs_reference = False
    """Whether the loss compares the model with the weights the run started from (DPO; RL's
    KL term): the module then loads --model.init_from before `start`, on a resume too."""
    reference: Reference | None = None
    """Those weights, frozen (gptmini.finetune.reference), once `start` has kept them."""

    def start(self, model: GPTModel) -> None:
        """Called once `model` holds the weights the run starts from, before the first
        step: a task that `needs_reference` keeps them here."""
        if self.needs_reference and self.reference is None:
            self.reference = Reference(model)

    def batch_size(self, batch) -> int:
        """Examples in `batch` (what validation averages over)."""
        return len(batch[0])

    def tokens(self, batch) -> int:
        """Tokens the model reads for `batch` (training throughput counts them)."""
        return batch[0].numel()

    lm_loss = staticmethod(lm_loss)
    """The language-modelling loss (gptmini.model.lm_loss), compiled by `compile`."""

    def compile(self, model: GPTModel) -> None:
        """torch.compile what a step runs, in place: the model's forward (logits) and the
        loss, which compiled as one function fuses the head and the cross-entropy."""
        model.compile()
        self.lm_loss = torch.compile(lm_loss)

    @abstractmethod
    def loss(self, model: GPTModel, batch) -> tuple[Tensor, Metrics]:
        """(the loss to backpropagate, the metrics of the step, "loss" among them)."""

    @abstractmethod
    def validation_step(self, model: GPTModel, batch) -> Metrics:
        """The metrics of one validation batch (averaged over the epoch, every rank's), and
        whatever the task gathers for `validation_end`."""

    @abstractmethod
    def validation_end(self, reduce: Callable[[Tensor], Tensor],
                       logged: Mapping[str, Tensor]) -> Metrics:
        """The epoch's metrics from what `validation_step` gathered (then forgotten).

        Args:
            reduce: sums a tensor (on the model's device) over every rank.
            logged: the epoch's averaged metrics so far ("val/loss", ...).
        """
