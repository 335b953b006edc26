"""gpt-oss's mixture of experts as the blocks' feed-forward (the "oss_moe" entry of
gptmini.model.feedforward.MLPS): gptmini.variants.moe's routing and dispatch with two
differences, each from OpenAI's gpt-oss:

    the router has a bias, and its top k logits are softmaxed among themselves (the same
        weights as a softmax over all E renormalized over the k, moe's norm_topk_prob)
    each expert is a clamped SwiGLU with biases: with g = min(gate(x), limit) and
        u = clamp(up(x), -limit, limit), down((u + 1) * g * sigmoid(alpha * g))

Hugging Face stores the experts fused, gate and up interleaved column by column
(gptmini.convert.gptoss splits them into these per-expert projections).
"""

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import Tensor

from gptmini.model import is_finite_number
from gptmini.model.feedforward import SwiGLU
from gptmini.variants.moe import MixtureOfExperts, MoE

__all__ = ["ClampedSwiGLU", "OssMoE"]


class ClampedSwiGLU(SwiGLU):
    """gpt-oss's expert: down((clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)), g the gate
    clamped from above at `limit`."""

    def __init__(self, emb_dim: int, hidden_dim: int, bias: bool = True, *, alpha: float,
                 limit: float):
        super().__init__(emb_dim, hidden_dim, bias)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(-self.limit, self.limit)
        return self.down_proj((up + 1) * gate * torch.sigmoid(self.alpha * gate))


@dataclass(frozen=True)
class OssMoE(MoE):
    """gpt-oss's mixture of experts, from GPTConfig as the moe feed-forward (its experts'
    biases follow GPTConfig.bias), with these mlp_options:

        experts, top_k, aux_loss_coef   as moe's (the k weights always sum to 1)
        swiglu_alpha                    the sigmoid's gain (1.702, gpt-oss's)
        swiglu_limit                    the clamp (7.0, gpt-oss's)
    """

    options: ClassVar[tuple[str, ...]] = ("experts", "top_k", "aux_loss_coef",
                                          "swiglu_alpha", "swiglu_limit")
    hf_layout: ClassVar[str | None] = "gpt_oss"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def problems(cls, fields: dict) -> Iterator[tuple[str, str]]:
        yield from super().problems(fields)
        for name in ("swiglu_alpha", "swiglu_limit"):
            if not (is_finite_number(fields[name]) and fields[name] > 0):
                yield name, "a finite positive number"

    def make_module(self) -> MixtureOfExperts:
        expert = partial(ClampedSwiGLU, alpha=self.swiglu_alpha, limit=self.swiglu_limit)
        return MixtureOfExperts(self.emb_dim, self.hidden_dim, self.experts, self.top_k,
                                bias=self.bias, router_bias=True, expert=expert)
