"""Classification, the book's chapter 6: a class head in place of the output head, read at
each sequence's last real token (`gptmini.finetune.classify`)."""

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from gptmini.finetune import accuracy_and_confusion, add_class_head, class_logits
from gptmini.model import GPTModel
from gptmini.train.tasks.base import Metrics, Task


class Classification(Task):
    """The cross-entropy of the class logits.

    A batch is (ids, attention mask, labels): ids and mask (b, num_tokens), right-padded;
    labels (b,), indices into `classes`. Metrics: train/loss, val/loss and val/acc (over the
    whole validation split, every rank's examples).
    """

    generates_text = False  # its head scores classes: evaluate.py is what it is for

    def __init__(self, classes: Sequence[str]):
        self.classes = tuple(classes)
        self._confusion: Tensor | None = None  # validation counts, true x predicted

    def prepare(self, model: GPTModel) -> set[str]:
        add_class_head(model, len(self.classes))
        return {k for k in model.state_dict() if k.startswith("out_head.")}

    def _logits_loss(self, model: GPTModel, batch) -> tuple[Tensor, Tensor]:
        ids, mask, labels = batch
        logits = class_logits(model, ids, mask).float()  # (b, num_classes)
        return torch.nn.functional.cross_entropy(logits, labels), logits.argmax(-1)

    def loss(self, model: GPTModel, batch) -> tuple[Tensor, Metrics]:
        loss = self._logits_loss(model, batch)[0]
        return loss, {"loss": loss}

    def validation_step(self, model: GPTModel, batch) -> Metrics:
        loss, predicted = self._logits_loss(model, batch)
        counts = accuracy_and_confusion(predicted, batch[2], len(self.classes))[1]
        counts = counts.to(predicted.device)  # where ranks can sum it
        self._confusion = counts if self._confusion is None else self._confusion + counts
        return {"loss": loss}

    def validation_end(self, reduce: Callable[[Tensor], Tensor],
                       logged: Mapping[str, Tensor]) -> Metrics:
        if self._confusion is None:
            return {}
        confusion, self._confusion = reduce(self._confusion), None
        return {"acc": confusion.diag().sum() / confusion.sum().clamp(min=1)}
