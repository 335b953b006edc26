"""Rotary positions (Su et al., 2021): queries and keys are rotated by an angle proportional
to their position, so q·k depends only on the distance between them; no position embedding.

Rotary layout: each head's vector is split in two halves, and dimension i is rotated with
dimension i + head_dim / 2 (Hugging Face's `rotate_half` layout, which its Llama weights
use). Meta's original Llama weights rotate interleaved pairs (2i, 2i + 1) instead; the two
differ by a permutation of the query and key projections' rows (gptmini.convert.llama).

Two options beyond the paper's, both as Hugging Face models use them: a frequency scaling
(`scaling`, GPTConfig.rope_scaling: Llama 3.1's llama3, linear, YaRN; see scaling.py), and a
base of its own for windowed layers (`local_theta`, GPTConfig.rope_local_theta: Gemma 3's
local layers rotate at 10,000 without scaling, its global ones at 1,000,000 with it).
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gptmini.attention.errors import ArgumentError
from gptmini.attention.positions.base import ModelShape, PositionScheme
from gptmini.attention.positions.scaling import RopeScaling, plain_inv_freq, rope_scaling

__all__ = ["RotaryPositions", "apply_rope", "rope_angles"]


@dataclass(frozen=True)
class RotaryPositions(PositionScheme):
    """Queries and keys rotated at their positions; the angles are computed once per
    forward pass and shared by every layer that turns alike (the context keeps them)."""

    options = ("rope_theta", "rope_scaling", "rope_local_theta")
    head_dim: int
    """The rotated vectors' size: even, as dimensions turn in pairs."""
    theta: float = 10000.0
    """The base: frequency i of a head is theta ** (-2i / head_dim)."""
    scaling: RopeScaling | None = None
    """The frequencies' scaling (scaling.py), or None: theta's own."""
    local_theta: float | None = None
    """The base of a windowed layer (its context has a window), which rotates without
    scaling, as Gemma 3's local layers do; None: theta and scaling in every layer."""

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
        if self.local_theta is not None:
            try:
                self.check_theta(self.local_theta)
            except ArgumentError as err:
                raise ArgumentError("rope_local_theta", self.local_theta, err.fix) from None

    @classmethod
    def from_config(cls, cfg: ModelShape) -> "RotaryPositions":
        return cls(head_dim=cfg.head_size, theta=cfg.rope_theta,
                   scaling=rope_scaling(cfg.rope_scaling), local_theta=cfg.rope_local_theta)

    def rotate(self, queries: Tensor, keys: Tensor, context) -> tuple[Tensor, Tensor]:
        local = self.local_theta is not None and context.settings.window_size is not None
        theta, scaling = (self.local_theta, None) if local else (self.theta, self.scaling)
        cos, sin = context.once(
            ("rope", self.head_dim, theta, scaling, queries.dtype),
            lambda: rope_angles(context.positions, self.head_dim, theta, queries.dtype,
                                scaling=scaling))
        return apply_rope(queries, cos, sin), apply_rope(keys, cos, sin)


def rope_angles(positions: Tensor, head_dim: int, theta: float = 10000.0,
                dtype: torch.dtype = torch.float32, *, scaling: RopeScaling | None = None
                ) -> tuple[Tensor, Tensor]:
    """cos and sin of every (position, frequency) pair, each repeated for both halves.

    Args:
        positions: (b, num_tokens) integer positions.
        head_dim: the rotated vectors' size (even: `RotaryPositions` checks it).
        theta: the base: frequency i is theta ** (-2i / head_dim).
        dtype: the queries' dtype: the angles are computed in float32 or wider, and their
            cos and sin given in `dtype` (as Hugging Face's Llama does under bf16).
        scaling: the frequencies' scaling (scaling.py), whose magnitude (YaRN's attention
            factor) multiplies cos and sin; None: theta's own frequencies.

    Returns:
        cos, sin, each (b, 1, num_tokens, head_dim): they broadcast over heads; dimension i
        and i + head_dim / 2 have the same angle.
    """
    wide = torch.promote_types(dtype, torch.float32)
    if scaling is None:
        inv_freq = plain_inv_freq(head_dim, theta, wide, positions.device)  # (head_dim / 2,)
    else:
        inv_freq = scaling.inv_freq(head_dim, theta, wide, positions.device)
    angles = positions.to(wide)[..., None] * inv_freq  # (b, num_tokens, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (b, 1, num_tokens, head_dim)
    cos, sin = angles.cos(), angles.sin()
    if scaling is not None and scaling.magnitude != 1.0:
        cos, sin = cos * scaling.magnitude, sin * scaling.magnitude
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each head's halves of `x` (b, heads, num_tokens, head_dim) by the angles:
    (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos), as x * cos + (-x2, x1) * sin."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin
