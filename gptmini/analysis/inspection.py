"""What the web page shows of a text, from one forward pass on the explicit attention path:
every layer's and head's attention weights, the mask each query attends under, and the
model's next-token candidates at every position; and their compact form for the wire.

Weights travel as base64 of the lower triangle only (a causal model's keys after a query
are always masked), row after row, in float16 by default: for 256 tokens and the default
run's shape (4 layers x 4 heads) that is 1.4 MB against 11.6 MB as JSON lists of numbers,
which alone took 1.4 s to arrive and parse (bench/bench_inspection.py measures both).
"""

import base64
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from gptmini.tokenizer import token_text

__all__ = ["ENCODINGS", "TextInspection", "inspect_text", "pack"]

ENCODINGS = ("float16", "uint8", "json")
"""How `pack` writes the weights: base64 of float16, base64 of round(255 * w), or lists."""


@dataclass(frozen=True)
class TextInspection:
    """One text as the model sees it."""

    ids: list[int]
    weights: Tensor
    """(n_layers, n_heads, num_tokens, num_tokens) float32: query i's weights in row i."""
    allowed: Tensor
    """(num_tokens, num_tokens) bool: True where the mask lets query i see key j (with
    local/global layers: where some layer's does)."""
    top_ids: Tensor
    """(num_tokens, top) the most likely next tokens after each position, most likely first."""
    top_logprobs: Tensor
    """(num_tokens, top) their log-probabilities (temperature 1)."""
    token_logprobs: list[float | None]
    """The log-probability of each token given the ones before it (None for the first)."""


def _allowed(model: nn.Module, num_tokens: int, device) -> Tensor | None:
    """(1, 1, num_tokens, num_tokens) where the mask lets a query see a key, or None for
    every key; with local/global layers (GPTConfig.layer_windows), where some layer may (a
    local layer's weights are 0 past its window)."""
    context = model.new_context(1, num_tokens, device=device)
    if model.cfg.layer_windows is None:
        return context.dense()
    per_layer = [context.for_layer(block.att.settings).dense() for block in model.trf_blocks]
    if any(allowed is None for allowed in per_layer):
        return None
    return torch.stack(per_layer).any(dim=0)


@torch.no_grad()
def inspect_text(model: nn.Module, ids: list[int], *, top: int = 10) -> TextInspection:
    """Run `model` once on `ids` (eval mode, restored after) and keep what the page shows.

    Args:
        model: a `GPTModel`.
        ids: the text's token ids, at most context_length of them.
        top: next-token candidates kept per position (0 to vocab_size).
    """
    if not ids:
        raise ValueError("ids is empty: a text has at least one token (<|endoftext|>)")
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        idx = torch.tensor([ids], device=device)  # (1, num_tokens)
        weights = []  # one pass gives both: the weights, and the logits of its last states
        logits = model.logits(model.hidden_states(idx, weights=weights))
        allowed = _allowed(model, len(ids), device)
    finally:
        model.train(was_training)
    num_tokens = len(ids)
    if allowed is None:  # every key (no mask at all)
        allowed = torch.ones(num_tokens, num_tokens, dtype=torch.bool)
    allowed = allowed.reshape(-1, num_tokens, num_tokens)[0].cpu()  # (num_tokens, num_keys)
    logp = torch.log_softmax(logits[0].float(), dim=-1).cpu()  # (num_tokens, vocab_size)
    best = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
    following = torch.tensor(ids[1:], dtype=torch.long)
    chosen = logp[:-1].gather(-1, following[:, None])[:, 0].tolist()
    # (n_layers, n_heads, num_tokens, num_tokens)
    stacked = torch.stack([w[0].float().cpu() for w in weights])
    return TextInspection(list(ids), stacked, allowed, best.indices, best.values,
                          [None, *chosen])


def pack(seen: TextInspection, tokenizer, encoding: str = "float16") -> dict:
    """`seen` as JSON-ready values for the page (see /gptmini/attention in docs/serving.md).

    The weights and the mask cover the lower triangle only, row by row: row i is keys
    0..i, at offset i * (i + 1) / 2 of each head's block; heads follow each other layer by
    layer. The mask's bits are numpy's `packbits`, most significant bit first.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    n_layers, n_heads, num_tokens, _ = seen.weights.shape
    rows, cols = torch.tril_indices(num_tokens, num_tokens)
    triangle = seen.weights[:, :, rows, cols].numpy()  # (n_layers, n_heads, num_cells)
    if encoding == "json":
        weights = {"encoding": "json", "data": triangle.tolist()}
    else:
        array = (triangle.astype(np.float16) if encoding == "float16"
                 else np.rint(triangle * 255).astype(np.uint8))
        weights = {"encoding": encoding,
                   "data": base64.b64encode(array.astype(array.dtype.newbyteorder("<"))
                                            .tobytes()).decode()}
    mask = np.packbits(seen.allowed[rows, cols].numpy())
    names = {int(t): token_text(tokenizer, int(t))
             for t in {*seen.ids, *seen.top_ids.flatten().tolist()}}
    return {
        "object": "gptmini.attention", "n_layers": n_layers, "n_heads": n_heads,
        "num_tokens": num_tokens, "token_ids": seen.ids,
        "tokens": [names[t] for t in seen.ids], "token_logprobs": seen.token_logprobs,
        "weights": weights, "mask": base64.b64encode(mask.tobytes()).decode(),
        "top_logprobs": [[[int(i), names[int(i)], float(v)] for i, v in zip(ids, values,
                                                                          strict=True)]
                         for ids, values in zip(seen.top_ids.tolist(),
                                                seen.top_logprobs.tolist(), strict=True)],
    }
