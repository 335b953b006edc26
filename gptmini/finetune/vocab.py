"""Vocabulary growth: room in a pretrained model for the tokens a chat template adds.

gptmini's chat template (`gptmini.chat.GPTMINI`) writes four special tokens a pretrained
vocabulary lacks (`gptmini.chat.add_template_tokens` adds them to the tokenizer); the model's
embedding and output head grow to match here, when a fine-tune loads its source.
"""

from dataclasses import replace

import torch
from torch import nn

from gptmini.model import GPTModel

__all__ = ["grow_vocab"]


@torch.no_grad()
def grow_vocab(model: GPTModel, n_vocab: int) -> GPTModel:
    """Make room for `n_vocab` ids in `model`'s embedding and output head, in place.

    New rows start at the mean of the rows the vocabulary had: a new token's embedding is
    an average token's, and its logit the average logit, so the pretrained model's
    predictions barely move until fine-tuning teaches the new tokens (Hewitt, "Initializing
    new word embeddings", 2021). Rows of a padded vocabulary (`padded_vocab_size`) are
    reused before the matrices grow. A tied head stays tied.

    Returns:
        `model`, whose `cfg.vocab_size` is now `n_vocab`.
    """
    cfg, old = model.cfg, model.cfg.vocab_size
    if n_vocab < old:
        raise ValueError(f"grow_vocab cannot shrink the vocabulary from {old} to {n_vocab}")
    if n_vocab == old:
        return model
    width = max(cfg.vocab_width, n_vocab)
    tied = model.out_head.weight is model.tok_emb.weight
    emb = _grown(model.tok_emb.weight, old, width)
    model.tok_emb = nn.Embedding.from_pretrained(emb, freeze=False)
    if tied:
        model.out_head.weight = model.tok_emb.weight
    else:
        head = nn.Linear(cfg.emb_dim, width, bias=False).to(emb.device, emb.dtype)
        head.weight = nn.Parameter(_grown(model.out_head.weight, old, width))
        model.out_head = head
    padded = width if width > n_vocab else None
    model.cfg = replace(cfg, vocab_size=n_vocab, padded_vocab_size=padded)
    return model


def _grown(weight: torch.Tensor, old: int, width: int) -> torch.Tensor:
    """`weight` (rows, emb) with `width` rows: its first `old` kept, the rest their mean."""
    rows = weight.new_empty(width, weight.shape[1])
    rows[:old] = weight[:old]
    rows[old:] = weight[:old].mean(dim=0)
    return rows
