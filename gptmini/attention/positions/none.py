"""No positions at all: a causal decoder can still tell order from its mask."""

from dataclasses import dataclass

from gptmini.attention.positions.base import PositionScheme

__all__ = ["NoPositions"]


@dataclass(frozen=True)
class NoPositions(PositionScheme):
    """Nothing added, rotated or modified (and so trivially relative)."""
