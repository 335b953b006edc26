"""Rotary positions with the three options beyond the paper's that Hugging Face models
use: a frequency scaling (`scaling`, GPTConfig.rope_scaling: Llama 3.1's llama3, linear,
YaRN; see scaling.py), a base of its own for windowed layers (`local_theta`,
GPTConfig.rope_local_theta: Gemma 3's local layers rotate at 10,000 without scaling, its
global ones at 1,000,000 with it), and turning only each head's first dimensions
(`rotary_dim`, rope_scaling's partial_rotary_factor: Qwen3.5's quarter, as rotary
positions of that width, the rest passed through). The rotation itself is the core's
(gptmini.core.positions.RotaryPositions).

Meta's original Llama weights rotate interleaved pairs (2i, 2i + 1) instead of halves; the
two differ by a permutation of the query and key projections' rows (gptmini.convert.llama).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from gptmini.attention.positions.scaling import (
    PARTIAL,
    RopeScaling,
    rope_scaling,
    rotary_fraction,
)
from gptmini.core import positions as core
from gptmini.core.layers import ArgumentError
from gptmini.core.positions import apply_rope

__all__ = ["RotaryPositions", "apply_rope", "rope_angles"]


@dataclass(frozen=True)
class RotaryPositions(core.RotaryPositions):
    """The core's rotary positions, with a frequency scaling, a local layers' base and a
    share of each head that turns."""

    options = ("rope_theta", "rope_scaling", "rope_local_theta")
    scaling: RopeScaling | None = None
    """The frequencies' scaling (scaling.py), or None: theta's own."""
    local_theta: float | None = None
    """The base of a windowed layer (its context has a window), which rotates without
    scaling, as Gemma 3's local layers do; None: theta and scaling in every layer."""
    rotary_dim: int | None = None
    """The first dimensions of each head that turn, rotary positions of this width (their
    frequencies theta ** (-2i / rotary_dim)); the others pass through. None: all."""

    def __post_init__(self):
        super().__post_init__()
        if self.rotary_dim is not None and not (
                2 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ArgumentError("rope_scaling", {PARTIAL: self.rotary_dim / self.head_dim},
                                f"it turns {self.rotary_dim} of a head's {self.head_dim} "
                                "dimensions: rotary dimensions turn in pairs, so use a share "
                                "that leaves an even number of at least 2")
        if self.local_theta is not None:
            try:
                self.check_theta(self.local_theta)
            except ArgumentError as err:
                raise ArgumentError("rope_local_theta", self.local_theta, err.fix) from None

    @classmethod
    def from_config(cls, cfg) -> "RotaryPositions":
        share = rotary_fraction(cfg.rope_scaling)  # HF's int(): a share rounds down
        return cls(head_dim=cfg.head_size, theta=cfg.rope_theta,
                   scaling=rope_scaling(cfg.rope_scaling), local_theta=cfg.rope_local_theta,
                   rotary_dim=None if share == 1 else int(cfg.head_size * share))

    def angles(self, context, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        local = self.local_theta is not None and context.settings.window_size is not None
        theta, scaling = (self.local_theta, None) if local else (self.theta, self.scaling)
        width = self.rotary_dim or self.head_dim
        return context.once(
            ("rope", width, theta, scaling, dtype),
            lambda: rope_angles(context.positions, width, theta, dtype, scaling=scaling))

    def rotate(self, queries: Tensor, keys: Tensor, context) -> tuple[Tensor, Tensor]:
        if self.rotary_dim is None:
            return super().rotate(queries, keys, context)
        cos, sin = self.angles(context, queries.dtype)
        part = self.rotary_dim
        return tuple(torch.cat([apply_rope(x[..., :part], cos, sin), x[..., part:]], dim=-1)
                     for x in (queries, keys))


def rope_angles(positions: Tensor, head_dim: int, theta: float = 10000.0,
                dtype: torch.dtype = torch.float32, *, scaling: RopeScaling | None = None
                ) -> tuple[Tensor, Tensor]:
    """The core's `rope_angles` (cos and sin, each (b, 1, num_tokens, head_dim)) with a
    frequency `scaling`, whose magnitude (YaRN's attention factor) multiplies cos and sin."""
    if scaling is None:
        return core.rope_angles(positions, head_dim, theta, dtype)
    wide = torch.promote_types(dtype, torch.float32)
    inv_freq = scaling.inv_freq(head_dim, theta, wide, positions.device)
    cos, sin = core.rope_angles(positions, head_dim, theta, wide, inv_freq=inv_freq)
    if scaling.magnitude != 1.0:
        cos, sin = cos * scaling.magnitude, sin * scaling.magnitude
    return cos.to(dtype), sin.to(dtype)
