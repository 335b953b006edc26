"""Gated attention (Qwen3-Next): a sigmoid gate on each head's output, from the input.

Attention's output is a weighted mean of values, which cannot be zero where no key fits
(so heads learn to dump their weight on a first "sink" token) and which reaches out_proj
through two linear maps in a row (values, then out_proj), a low-rank product. Qiu et al.
(2025, "Gated Attention for Large Language Models") multiply each head's output by
sigmoid(x W_gate), computed from the same input x as the query, before out_proj: the gate
adds a nonlinearity there and lets a head shut itself off per token. Qwen3-Next ships the
elementwise form (its q_proj is twice as wide, each head's query followed by its gate);
the headwise form is the paper's cheaper variant, one gate per head:

    elementwise   W_gate: d_in -> d_out       out[h, i] *= sigmoid(gate[h * head_dim + i])
    headwise      W_gate: d_in -> num_heads   out[h, :] *= sigmoid(gate[h])

The gate acts per token after attention, so it changes no mask, no KV cache and no
kernel: every kernel runs it.
"""

import torch
from torch import Tensor, nn

from gptmini.core.layers import ArgumentError

__all__ = ["GATES", "OutputGate"]

GATES = ("none", "headwise", "elementwise")
"""The gate choices: GPTConfig.attn_gate, MultiHeadAttention(gate=...)."""


class OutputGate(nn.Module):
    """sigmoid(x W_gate) times each head's output (see the module docstring).

    Args:
        d_in: the input's width (the attention's input, which the queries are made from).
        num_heads, head_dim: the attention's heads.
        kind: "headwise" or "elementwise".
        bias: a bias in W_gate (as the query projection has: qkv_bias).
    """

    def __init__(self, d_in: int, num_heads: int, head_dim: int, kind: str, bias: bool = False):
        super().__init__()
        if kind not in GATES[1:]:
            raise ArgumentError("gate", kind, f"use one of {', '.join(GATES)}")
        self.kind, self.num_heads, self.head_dim = kind, num_heads, head_dim
        width = num_heads * head_dim if kind == "elementwise" else num_heads
        self.W_gate = nn.Linear(d_in, width, bias=bias)

    def forward(self, x: Tensor, heads_out: Tensor) -> Tensor:
        """x (b, num_tokens, d_in), heads_out (b, num_tokens, num_heads * head_dim) ->
        the gated heads_out, same shape."""
        gate = torch.sigmoid(self.W_gate(x))  # (b, num_tokens, width)
        if self.kind == "elementwise":
            return heads_out * gate
        b, n, _ = heads_out.shape
        # (b, num_tokens, num_heads, head_dim) * (b, num_tokens, num_heads, 1)
        return (heads_out.view(b, n, self.num_heads, self.head_dim) * gate[..., None]).view(
            b, n, -1)
