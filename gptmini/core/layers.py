"""The block's feed-forwards, the book's GELU MLP and SwiGLU, and the error a layer raises
for an argument it refuses (`ArgumentError`). Norms are torch's (nn.LayerNorm, nn.RMSNorm;
a faster RMSNorm for CPUs attaches from gptmini.attention.norm)."""

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ArgumentError", "FeedForward", "SwiGLU"]


class ArgumentError(ValueError):
    """`argument`'s `value` refused, and the `fix`: the one error a layer, a setting or a
    scheme raises for an argument it refuses. A module used alone reports it as it is; a
    config that builds modules from its fields names its own field for it."""

    def __init__(self, argument: str, value: object, fix: str):
        super().__init__(f"{argument}={value!r} is invalid: {fix}")
        self.argument, self.value, self.fix = argument, value, fix


class FeedForward(nn.Module):
    """Position-wise MLP: emb_dim -> hidden_dim -> emb_dim with `activation` (the book's
    GELU with the tanh approximation, by default)."""

    def __init__(self, emb_dim: int, hidden_dim: int, bias: bool = True,
                 activation: nn.Module | None = None):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(emb_dim, hidden_dim, bias=bias),
            activation or nn.GELU(approximate="tanh"),
            nn.Linear(hidden_dim, emb_dim, bias=bias),
        )

    @property
    def proj_out(self) -> nn.Linear:
        """The projection that writes into the residual stream."""
        return self.layers[2]

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x)), Llama's (names as Hugging Face's)."""

    def __init__(self, emb_dim: int, hidden_dim: int, bias: bool = True):
        super().__init__()
        self.gate_proj = nn.Linear(emb_dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(emb_dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, emb_dim, bias=bias)

    @property
    def proj_out(self) -> nn.Linear:
        return self.down_proj

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
