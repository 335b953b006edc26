"""What a position scheme is (gptmini.core.positions.PositionScheme, here beside the other
schemes), and the sizes a scheme is built from."""

from typing import Protocol

from gptmini.core.positions import PositionScheme

__all__ = ["ModelShape", "PositionScheme"]


class ModelShape(Protocol):
    """The sizes a scheme is built for (`GPTConfig` is one; attention imports no model)."""

    emb_dim: int
    n_heads: int
    head_size: int
    context_length: int
    rope_theta: float
    rope_scaling: dict | None
    rope_local_theta: float | None
