"""Scoring held-out preference pairs: how often a model ranks the chosen response first, and
by how much.

    python evaluate.py --checkpoint runs/dpo-shakespeare/checkpoints/last.ckpt --preference

A pair's margin is DPO's (gptmini.finetune.dpo): beta times the chosen response's log ratio
to the reference minus the rejected one's, the responses' log-probabilities summed (the
paper's) or averaged per token (the book's), as the run trained. The reference is the
weights a preference run started from (its --model.init_from), or `--reference`; with no
reference (`--reference none`, or a checkpoint that never had one) the margin is the
model's own log-probability of the chosen response minus the rejected one's, so any
checkpoint (one before DPO too) gets a score. Accuracy is the share of pairs whose margin
is above 0.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import tiktoken
import torch
from torch import nn

from gptmini.chat import ChatTemplate
from gptmini.checkpoint import load_checkpoint
from gptmini.data.chat import split_records
from gptmini.data.preference import (
    PreferencePairs,
    read_pairs,
    render_pairs,
    to_pairs,
)
from gptmini.finetune import grow_vocab
from gptmini.finetune.dpo import dpo_loss
from gptmini.finetune.reference import sequence_log_probs


@dataclass(frozen=True)
class PreferenceScore:
    accuracy: float
    """The share of pairs whose margin is above 0."""
    margin: float
    """The mean margin."""
    pairs: int
    """Pairs scored."""
    skipped: int
    """Pairs left out: longer than the context, or with the same chosen and rejected."""


@torch.inference_mode()
def score_preferences(model: nn.Module, pairs: PreferencePairs, *,
                      reference: nn.Module | None = None, beta: float = 0.1,
                      average: bool = False, batch_size: int = 8) -> tuple[float, float]:
    """(accuracy, mean margin) of `model` over `pairs` (see the module docstring): against
    `reference` with `beta`, or, without one, its own log-probability margins."""
    device = next(model.parameters()).device
    margins = []
    for start in range(0, len(pairs), batch_size):
        rows = pairs.collate([pairs[i] for i in range(start, min(start + batch_size,
                                                                  len(pairs)))])
        cx, cy, rx, ry = (t.to(device) for t in rows)
        policy = [sequence_log_probs(model, x, y, average=average) for x, y in ((cx, cy),
                                                                                (rx, ry))]
        if reference is None:
            margins.append(policy[0] - policy[1])
            continue
        ref = [sequence_log_probs(reference, x, y, average=average) for x, y in ((cx, cy),
                                                                                 (rx, ry))]
        margins.append(dpo_loss(*policy, *ref, beta=beta).margins)
    every = torch.cat(margins).double()
    return float((every > 0).double().mean()), float(every.mean())


def held_out_pairs(source: str, hparams: Mapping, tokenizer: tiktoken.Encoding,
                   template: ChatTemplate, context_length: int
                   ) -> tuple[PreferencePairs, int, str]:
    """(the rendered pairs --preference scores, how many were left out, their name): "auto"
    takes the test share of the run's preference records (the book's 1,100 for a run
    without them); a file is scored whole."""
    if source == "auto":
        settings = hparams.get("preference") or {}
        source = settings.get("records") or "book"
        split = tuple(settings.get("split") or (0.85, 0.05, 0.10))
        records = split_records(read_pairs(source), split)[2]
        if not records:
            raise ValueError(f"the run's split {list(split)} keeps no test pairs; pass "
                             "--preference FILE")
        name = f"the test split of {source} ({len(records)} pairs)"
    else:
        records, name = read_pairs(source), source
    pairs, identical = to_pairs(records, identical="drop")
    rendered, too_long = render_pairs(pairs, tokenizer, template, context_length, "drop")
    if not rendered:
        raise ValueError(f"every pair of {name} is longer than the model's context "
                         f"({context_length} tokens)")
    return PreferencePairs(rendered, tokenizer.eot_token), identical + too_long, name


def reference_model(asked: str | None, hparams: Mapping, model: nn.Module
                    ) -> tuple[nn.Module | None, str]:
    """(the reference model on `model`'s device, how it is named): `asked` ("none", or a
    checkpoint or Hugging Face directory), else a preference run's starting weights (its
    init_from), else None. A reference whose vocabulary a chat template grew in the run
    grows the same way (new rows count for no response token it scores)."""
    if asked == "none" or (asked is None and not hparams.get("dpo")):
        return None, "no reference: the model's own log-probability margins"
    path = asked or hparams.get("init_from")
    if not path:
        return None, "no reference: the run started from no checkpoint"
    device = next(model.parameters()).device
    reference = load_checkpoint(path, device).model
    if reference.cfg.vocab_size < model.cfg.vocab_size:
        grow_vocab(reference, model.cfg.vocab_size)
    return reference, f"rewards against {path}"
