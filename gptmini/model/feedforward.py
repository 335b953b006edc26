"""Feed-forwards as a table: every block's position-wise network, one object per kind,
built once from the config (GPTConfig.mlp names it), which the model, FLOP counts and
conversion ask instead of branching on a name.

    gelu     the book's FeedForward: emb_dim -> 4 * emb_dim -> emb_dim, GELU (tanh)
    relu2    the same with squared ReLU (modded-nanogpt's)
    swiglu   gated SiLU, Llama's: down(silu(gate(x)) * up(x))
    geglu    gated GELU, Gemma's (gptmini.variants.geglu, loaded when named)
    moe      a top-k routed mixture of SwiGLU experts, Qwen3-MoE's (gptmini.variants.moe)
    oss_moe  gpt-oss's: clamped SwiGLU experts, a router with a bias (variants.oss_moe)

A new one is its own file (a `FeedForwardKind` and its module) and one entry in `MLPS`; one
of your own needs none: name it 'package.module:ClassName' in GPTConfig.mlp, its options in
mlp_options. Its module is called as `module(x)`, with `aux_losses=` if its `aux_loss` is True.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

import torch.nn.functional as F
from torch import Tensor, nn

from gptmini.attention.table import Table
from gptmini.core.layers import FeedForward, SwiGLU

__all__ = ["MLPS", "FeedForward", "FeedForwardKind", "GeluMLP", "SquaredReLU", "SquaredReluMLP",
           "SwiGLU", "SwiGLUMLP"]

Config = Any
"""A GPTConfig (gptmini.model.config imports this module, so it is not imported here)."""


class SquaredReLU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x).square()


class FeedForwardKind:
    """What the model, FLOP counts and conversion ask of a block's feed-forward; each
    built-in answers for itself. Write one as a dataclass built by `from_config`, which checks
    the config fields it reads, its own options in GPTConfig.mlp_options (ConfigError)."""

    options: ClassVar[tuple[str, ...]] = ()
    """The keys it reads from GPTConfig.mlp_options (the config refuses any other)."""
    aux_loss: ClassVar[bool] = False
    """Its module takes `aux_losses=` (see gptmini.model.mixers.TokenMixer.aux_loss)."""
    hf_layout: ClassVar[str | None] = None
    """The Hugging Face model_type a model of it exports as, or None: the frame's."""

    @classmethod
    def from_config(cls, cfg: Config) -> "FeedForwardKind":
        """This feed-forward for `cfg`, its own fields checked."""
        raise NotImplementedError

    def make_module(self) -> nn.Module:
        """A new module (one per block)."""
        raise NotImplementedError

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward and backward; see gptmini.model.flops)."""
        raise NotImplementedError

    def residual_weights(self, module: nn.Module) -> list[nn.Parameter]:
        """The weights that write into the residual stream (GPT-2 scales their init)."""
        return [module.proj_out.weight]

    def finish_aux_losses(self, parts: dict[str, Tensor]) -> dict[str, Tensor]:
        """The parts once every layer added its own (the moe's statistics -> its loss)."""
        return parts


@dataclass(frozen=True)
class GeluMLP(FeedForwardKind):
    """The book's feed-forward: two matmuls around a GELU, 4x wide by default."""

    emb_dim: int
    hidden_dim: int
    bias: bool = True

    @classmethod
    def from_config(cls, cfg: Config) -> "GeluMLP":
        return cls(cfg.emb_dim, cfg.mlp_hidden_dim or 4 * cfg.emb_dim, cfg.bias)

    def make_module(self) -> FeedForward:
        return FeedForward(self.emb_dim, self.hidden_dim, self.bias)

    def flops_per_token(self) -> float:
        return 6 * 2 * self.emb_dim * self.hidden_dim  # 6 * N, N = two d x hidden weights


@dataclass(frozen=True)
class SquaredReluMLP(GeluMLP):
    """The book's feed-forward with squared ReLU in GELU's place."""

    def make_module(self) -> FeedForward:
        return FeedForward(self.emb_dim, self.hidden_dim, self.bias, SquaredReLU())


@dataclass(frozen=True)
class SwiGLUMLP(GeluMLP):
    """Llama's gated feed-forward; by default 8/3 * emb_dim wide, rounded up to a multiple
    of 64 (about the parameters of the book's 4x GELU)."""

    @classmethod
    def from_config(cls, cfg: Config) -> "SwiGLUMLP":
        hidden = cfg.mlp_hidden_dim or -(-8 * cfg.emb_dim // 3 // 64) * 64
        return cls(cfg.emb_dim, hidden, cfg.bias)

    def make_module(self) -> SwiGLU:
        return SwiGLU(self.emb_dim, self.hidden_dim, self.bias)

    def flops_per_token(self) -> float:
        return 6 * 3 * self.emb_dim * self.hidden_dim  # gate, up and down


MLPS = Table("feed-forward", {
    "gelu": GeluMLP,
    "swiglu": SwiGLUMLP,
    "relu2": SquaredReluMLP,
    "geglu": "gptmini.variants.geglu:GeGLUMLP",
    "moe": "gptmini.variants.moe:MoE",
    "oss_moe": "gptmini.variants.oss_moe:OssMoE",
})
"""Every feed-forward by the name GPTConfig.mlp gives it (read-only)."""
