"""GeGLU, Gemma's feed-forward: down(gelu(gate(x)) * up(x)) with GELU's tanh approximation,
SwiGLU's shape with GELU in SiLU's place (Shazeer, 2020). The "geglu" entry of
gptmini.model.feedforward.MLPS, loaded when a config names it; a model of it exports in
Gemma 3's layout (gptmini.convert.gemma), the only Hugging Face layout gptmini writes that
has one.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from gptmini.model.feedforward import SwiGLU, SwiGLUMLP

__all__ = ["GeGLU", "GeGLUMLP"]


class GeGLU(SwiGLU):
    """Gated MLP: down(gelu_tanh(gate(x)) * up(x)), with Hugging Face's names (Gemma's
    hidden_activation "gelu_pytorch_tanh")."""

    def forward(self, x: Tensor) -> Tensor:
        gate = F.gelu(self.gate_proj(x), approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


@dataclass(frozen=True)
class GeGLUMLP(SwiGLUMLP):
    """Gemma's gated feed-forward, sized as SwiGLU's (mlp_hidden_dim, or 8/3 * emb_dim
    rounded up to a multiple of 64)."""

    hf_layout: ClassVar[str | None] = "gemma3_text"

    def make_module(self) -> GeGLU:
        return GeGLU(self.emb_dim, self.hidden_dim, self.bias)
