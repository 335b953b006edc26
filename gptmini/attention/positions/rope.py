"""Rotary positions (Su et al., 2021): queries and keys are rotated by an angle proportional
to their position, so q·k depends only on the distance between them; no position embedding.

Rotary layout: each head's vector is split in two halves, and dimension i is rotated with
dimension i + head_dim / 2 (Hugging Face's `rotate_half` layout, which its Llama weights
use). Meta's original Llama weights rotate interleaved pairs (2i, 2i + 1) instead; the two
differ by a permutation of the query and key projections' rows (gptmini.convert.llama).
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gptmini.attention.errors import ArgumentError
from gptmini.attention.positions.base import ModelShape, PositionScheme

__all__ = ["RotaryPositions", "apply_rope", "rope_angles"]


@dataclass(frozen=True)
class RotaryPositions(PositionScheme):
    """Queries and keys rotated at their positions; the angles are computed once per
    forward pass and shared by every layer (the context keeps them)."""

    head_dim: int
    """The rotated vectors' size: even, as dimensions turn in pairs."""
    theta: float = 10000.0
    """The base: frequency i of a head is theta ** (-2i / head_dim)."""

    @staticmethod
    def check_theta(theta: float) -> None:
        """The rotary base's one rule (GPTConfig.rope_theta's too, whichever scheme a config
        has): a finite number above 1; at 1 every frequency is 1, below it they grow with i
        instead of falling.

        Raises:
            ArgumentError: naming rope_theta.
        """
        if (isinstance(theta, bool) or not isinstance(theta, int | float)
                or not math.isfinite(theta) or theta <= 1):
            raise ArgumentError("rope_theta", theta, "use a finite base above 1, such as 10000 "
                                "(Llama 3: 500000)")

    def __post_init__(self):
        if self.head_dim % 2:
            raise ArgumentError("head_dim", self.head_dim, "rotary positions turn dimensions "
                                f"in pairs, and a head's size of {self.head_dim} is odd: pick "
                                "a number of heads that leaves an even head size (the width / "
                                "the heads)")
        self.check_theta(self.theta)

    @classmethod
    def from_config(cls, cfg: ModelShape) -> "RotaryPositions":
        return cls(head_dim=cfg.emb_dim // cfg.n_heads, theta=cfg.rope_theta)

    def rotate(self, queries: Tensor, keys: Tensor, context) -> tuple[Tensor, Tensor]:
        cos, sin = context.once(
            ("rope", self.head_dim, self.theta, queries.dtype),
            lambda: rope_angles(context.positions, self.head_dim, self.theta, queries.dtype))
        return apply_rope(queries, cos, sin), apply_rope(keys, cos, sin)


def rope_angles(positions: Tensor, head_dim: int, theta: float = 10000.0,
                dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos and sin of every (position, frequency) pair, each repeated for both halves.

    Args:
        positions: (b, num_tokens) integer positions.
        head_dim: the rotated vectors' size (even: `RotaryPositions` checks it).
        theta: the base: frequency i is theta ** (-2i / head_dim).
        dtype: the queries' dtype: the angles are computed in float32 or wider, and their
            cos and sin given in `dtype` (as Hugging Face's Llama does under bf16).

    Returns:
        cos, sin, each (b, 1, num_tokens, head_dim): they broadcast over heads; dimension i
        and i + head_dim / 2 have the same angle.
    """
    wide = torch.promote_types(dtype, torch.float32)
    exponents = torch.arange(0, head_dim, 2, dtype=wide, device=positions.device) / head_dim
    inv_freq = 1.0 / theta ** exponents  # (head_dim / 2,)
    angles = positions.to(wide)[..., None] * inv_freq  # (b, num_tokens, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (b, 1, num_tokens, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each head's halves of `x` (b, heads, num_tokens, head_dim) by the angles:
    (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos), as x * cos + (-x2, x1) * sin."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin
