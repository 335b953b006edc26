"""A GPT as a classifier, the book's chapter 6: the output head becomes a `num_classes`-wide
linear layer, and a sequence's class is read at its last real token, the one position
whose causal attention has seen the whole text.

Padding is told by the attention mask (1 at real tokens, 0 at padding, the model's own
convention), on either side: right padding (training's batches) puts the last real token
before the pads, left padding (a prompt batch) at the end; `last_real_token` finds it both
ways.
"""

import torch
from torch import Tensor, nn

__all__ = ["accuracy_and_confusion", "add_class_head", "class_logits", "last_real_token"]


def add_class_head(model: nn.Module, num_classes: int) -> nn.Module:
    """Replace `model.out_head` (a GPTModel's) with a fresh `nn.Linear(emb_dim, num_classes)`,
    as the book does (Listing 6.x: `model.out_head = torch.nn.Linear(...)`). A tied head is
    untied: the token embedding keeps its weights. In place; returns `model`.

    Raises:
        ValueError: fewer than 2 classes.
    """
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"a classifier needs at least 2 classes, got {num_classes!r}")
    weight = model.tok_emb.weight
    model.out_head = nn.Linear(model.cfg.emb_dim, num_classes, device=weight.device,
                               dtype=weight.dtype)
    return model


def last_real_token(attention_mask: Tensor) -> Tensor:
    """The index of each row's last real token, (b,), from an attention mask (b, num_tokens)
    of 1 (real) and 0 (padding), padded on either side.

    Raises:
        ValueError: a row with no real token.
    """
    real = attention_mask.bool()
    if not bool(real.any(dim=-1).all()):
        raise ValueError("a sequence in the batch has no real token (its mask is all 0)")
    positions = torch.arange(real.shape[-1], device=real.device)
    return torch.where(real, positions, -1).amax(dim=-1)  # (b,)


def class_logits(model: nn.Module, idx: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """The class logits (b, num_classes) of each sequence of `idx` (b, num_tokens), read at
    its last real token (the last position without a mask)."""
    logits = model(idx, attention_mask)  # (b, num_tokens, num_classes)
    if attention_mask is None:
        return logits[:, -1, :]
    last = last_real_token(attention_mask)
    return logits[torch.arange(len(idx), device=idx.device), last]  # (b, num_classes)


def accuracy_and_confusion(predicted: Tensor, labels: Tensor, num_classes: int
                           ) -> tuple[float, Tensor]:
    """(accuracy, confusion) of class predictions: confusion[i, j] counts the examples of
    true class i predicted as j, (num_classes, num_classes)."""
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)
    pairs = labels.long().cpu() * num_classes + predicted.long().cpu()
    confusion += torch.bincount(pairs, minlength=num_classes ** 2).view(num_classes, -1)
    accuracy = float(confusion.diag().sum()) / max(1, len(labels))
    return accuracy, confusion
