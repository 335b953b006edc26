"""Preference pairs: Direct Preference Optimization (gptmini.finetune.dpo) against the frozen
weights the run started from."""

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from gptmini.finetune.dpo import DPO, dpo_loss
from gptmini.finetune.reference import sequence_log_probs
from gptmini.model import GPTModel
from gptmini.train.tasks.base import Metrics, Task


class DirectPreference(Task):
    """DPO's loss over pairs of responses.

    A batch is (chosen inputs, chosen targets, rejected inputs, rejected targets), each
    (b, num_tokens), right-padded, the targets -100 but on each response's tokens
    (gptmini.data.preference). Both responses run through the model in one pass, and
    through the reference (the starting weights: LoRA's base with its adapters off, else a
    frozen copy; see gptmini.finetune.reference) without gradients. Metrics, as train/ and
    val/<name>: loss, chosen_reward, rejected_reward, margin and accuracy (the share of
    pairs whose chosen response has the higher reward).

    Args:
        settings: beta and the variant (summed or averaged log-probabilities).
        loss_chunk_size: see GPTLitModule.
    """

    needs_reference = True

    def __init__(self, settings: DPO, loss_chunk_size: int | None = None):
        self.settings, self.loss_chunk_size = settings.check(), loss_chunk_size

    def tokens(self, batch) -> int:
        return batch[0].numel() + batch[2].numel()

    def _terms(self, model: GPTModel, batch):
        if self.reference is None:
            raise RuntimeError("DirectPreference.start was not called: the reference (the "
                               "starting weights) is kept there, before the first step")
        chosen_x, chosen_y, rejected_x, rejected_y = batch
        inputs, targets = torch.cat([chosen_x, rejected_x]), torch.cat([chosen_y, rejected_y])
        kwargs = {"average": self.settings.average, "loss_chunk_size": self.loss_chunk_size,
                  "loss_fn": self.lm_loss}
        policy = sequence_log_probs(model, inputs, targets, **kwargs)  # (2b,) chosen first
        reference = self.reference(model, sequence_log_probs, inputs, targets, **kwargs)
        b = len(chosen_x)
        return dpo_loss(policy[:b], policy[b:], reference[:b], reference[b:],
                        beta=self.settings.beta)

    def loss(self, model: GPTModel, batch) -> tuple[Tensor, Metrics]:
        terms = self._terms(model, batch)
        return terms.loss, terms.metrics()

    def validation_step(self, model: GPTModel, batch) -> Metrics:
        return self._terms(model, batch).metrics()

    def validation_end(self, reduce: Callable[[Tensor], Tensor],
                       logged: Mapping[str, Tensor]) -> Metrics:
        return {}
