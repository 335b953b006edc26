"""Language modelling: the next token's cross-entropy, over a corpus's windows or, for a chat
fine-tune, over the assistant's tokens alone (the data masks the rest with -100)."""

import math
from collections.abc import Callable, Mapping

import tiktoken
import torch
from torch import Tensor

from gptmini.model import GPTModel
from gptmini.tokenizer import token_byte_lengths
from gptmini.train.tasks.base import Metrics, Task


class LanguageModelling(Task):
    """The next token, everywhere a target is not -100.

    A batch is (inputs, targets) or, with document masks, (inputs, targets, document ids),
    each (b, num_tokens). Metrics: train/loss and val/loss (the mean cross-entropy of the
    targets), val/ppl, val/bpb (bits per byte of the text the targets stand for, which
    compares tokenizers), and each auxiliary loss the model adds (a mixture of experts'
    balance), as train/<name> and val/<name>: `lm_loss(..., aux_losses=parts)` hands them
    over, and the loss trained on adds them. train/loss stays the language model's own.

    Args:
        tokenizer: the run's, for the bytes of text each id stands for.
        loss_chunk_size: see GPTLitModule.
    """

    def __init__(self, tokenizer: tiktoken.Encoding, loss_chunk_size: int | None = None):
        self.tokenizer, self.loss_chunk_size = tokenizer, loss_chunk_size
        self._token_bytes: Tensor | None = None  # bytes of text per id, for val/bpb
        self._nats: Tensor | None = None
        self._bytes: Tensor | None = None

    def _forward(self, model: GPTModel, batch, reduction: str = "mean"
                 ) -> tuple[Tensor, Metrics]:
        inputs, targets, *documents = batch
        parts = {}
        loss = self.lm_loss(model, inputs, targets, reduction, chunk_size=self.loss_chunk_size,
                            document_ids=documents[0] if documents else None, aux_losses=parts)
        return loss, parts

    def loss(self, model: GPTModel, batch) -> tuple[Tensor, Metrics]:
        loss, parts = self._forward(model, batch)
        return (loss + sum(parts.values()) if parts else loss), {"loss": loss, **parts}

    def validation_step(self, model: GPTModel, batch) -> Metrics:
        targets = batch[1]
        # A compiled model would compile a second graph for this (no gradients, per-token
        # losses, the last batch's shape): on a CPU that costs more than a run's validations.
        with torch.compiler.set_stance("force_eager"):
            nats, parts = self._forward(model, batch, reduction="none")
        counted = targets != -100  # cross_entropy's ignore_index
        # Bits per byte compares tokenizers: the nats of the targets over the bytes of text
        # they stand for. Special tokens stand for no text: they leave both sums.
        num_bytes = self._bytes_of(targets.device)[targets.clamp(min=0)] * counted
        nats_of_text = (nats * (num_bytes > 0)).sum()
        if self._nats is None:
            self._nats, self._bytes = nats_of_text.float(), num_bytes.sum()
        else:
            self._nats, self._bytes = self._nats + nats_of_text, self._bytes + num_bytes.sum()
        return {"loss": nats.sum() / counted.sum(), **parts}

    def validation_end(self, reduce: Callable[[Tensor], Tensor],
                       logged: Mapping[str, Tensor]) -> Metrics:
        metrics = {}
        if "val/loss" in logged:
            metrics["ppl"] = torch.exp(logged["val/loss"])
        if self._nats is not None:
            nats, num_bytes = reduce(self._nats), reduce(self._bytes)
            metrics["bpb"] = nats / num_bytes.clamp(min=1) / math.log(2)
        self._nats = self._bytes = None
        return metrics

    def _bytes_of(self, device: torch.device) -> Tensor:
        if self._token_bytes is None or self._token_bytes.device != device:
            self._token_bytes = torch.tensor(token_byte_lengths(self.tokenizer), device=device)
        return self._token_bytes

