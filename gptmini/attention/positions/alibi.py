"""ALiBi (Press et al., 2022): each head adds slope_h * (key - query position) to its
scores, a penalty growing with distance (a score modifier: gptmini.attention.masks.alibi);
no position embedding."""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gptmini.attention import masks
from gptmini.attention.positions.base import ModelShape, PositionScheme

__all__ = ["AlibiPositions", "alibi_slopes"]


@dataclass(frozen=True)
class AlibiPositions(PositionScheme):
    """ALiBi's per-head distance penalties on the scores."""

    num_heads: int
    """Query heads: each has its own slope."""

    @classmethod
    def from_config(cls, cfg: ModelShape) -> "AlibiPositions":
        return cls(num_heads=cfg.n_heads)

    def score_mod(self, device: torch.device | str | None) -> masks.ScoreMod:
        return masks.alibi(alibi_slopes(self.num_heads).to(device))


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's per-head slopes: a geometric sequence starting at 2 ** (-8 / n) for the
    nearest power of two n >= num_heads; other head counts interleave the next power's
    slopes, as the paper's reference code does. (num_heads,) float32."""
    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)
