"""Position schemes: how a token's place enters the model, one object per scheme, built
once from the model's shape (`from_config`) and handed to every layer. A scheme acts in up
to three places, each a method of `PositionScheme` that does nothing until overridden:
`make_embedding` (the book's learned embedding), `rotate` (rotary queries and keys) and
`score_mod` (ALiBi's penalty, gptmini.attention.positions). Schemes are dataclasses of
their parameters, so two alike compare equal.
"""

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gptmini.core.layers import ArgumentError

__all__ = ["LearnedPositions", "NoPositions", "PositionScheme", "RotaryPositions",
           "apply_rope", "plain_inv_freq", "rope_angles"]


class PositionScheme:
    """How a token's place enters the model; this base adds nothing anywhere. `relative`:
    positions enter only as distances, so generation may slide a cache past the context;
    `options`: the config's fields of its own that it reads (refused without it)."""

    relative: ClassVar[bool] = True
    options: ClassVar[tuple[str, ...]] = ()
    embedding: nn.Module | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> "PositionScheme":
        """This scheme for a model of `cfg`'s shape (a GPTConfig's sizes)."""
        return cls()

    def make_embedding(self) -> nn.Module | None:
        """A new module of position embeddings, or None; `GPTModel` holds it as `pos_emb`."""
        return None

    def embed(self, x: Tensor, context) -> Tensor:
        """x (b, num_tokens, emb_dim), the token embeddings, with positions added."""
        return x

    def rotate(self, queries: Tensor, keys: Tensor, context) -> tuple[Tensor, Tensor]:
        """Queries and keys (b, heads, num_tokens, head_dim) at the context's positions."""
        return queries, keys

    def score_mod(self, device) -> Any:
        """A score modifier `(score, b, h, q_idx, kv_idx) -> score` for a pass, or None."""
        return None


@dataclass(frozen=True)
class NoPositions(PositionScheme):
    """Nothing added, rotated or modified: a causal decoder reads order from its mask."""


@dataclass
class LearnedPositions(PositionScheme):
    """The book's: one learned vector per position, added to the token's embedding."""

    relative = False  # each position has its own vector: a token's place counts
    context_length: int
    emb_dim: int
    embedding: nn.Embedding | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: Any) -> "LearnedPositions":
        return cls(context_length=cfg.context_length, emb_dim=cfg.emb_dim)

    def make_embedding(self) -> nn.Embedding:
        self.embedding = nn.Embedding(self.context_length, self.emb_dim)
        return self.embedding

    def embed(self, x: Tensor, context) -> Tensor:
        positions = context.positions  # (b, num_tokens)
        if context.rows_alike:
            positions = positions[:1]  # one lookup broadcast over the batch, as the book's
        return x + self.embedding(positions)


@dataclass(frozen=True)
class RotaryPositions(PositionScheme):
    """Rotary positions (Su et al., 2021): queries and keys turned by an angle proportional
    to their position, so q·k depends only on their distance. Dimension i turns with
    i + head_dim / 2 (Hugging Face's `rotate_half` layout, which its Llama weights use).
    The angles are computed once per pass and shared by the layers (`context.once`)."""

    options = ("rope_theta",)
    head_dim: int
    theta: float = 10000.0
    """The base: frequency i of a head is theta ** (-2i / head_dim)."""

    @staticmethod
    def check_theta(theta: float) -> None:
        """A finite base above 1 (at 1 every frequency is 1, below it they grow with i)."""
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
    def from_config(cls, cfg: Any) -> "RotaryPositions":
        return cls(head_dim=cfg.head_size, theta=cfg.rope_theta)

    def angles(self, context, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin at the context's positions (see `rope_angles`), made once a pass."""
        return context.once(("rope", self.head_dim, self.theta, dtype),
                            lambda: rope_angles(context.positions, self.head_dim, self.theta,
                                                dtype))

    def rotate(self, queries: Tensor, keys: Tensor, context) -> tuple[Tensor, Tensor]:
        cos, sin = self.angles(context, queries.dtype)
        return apply_rope(queries, cos, sin), apply_rope(keys, cos, sin)


def rope_angles(positions: Tensor, head_dim: int, theta: float = 10000.0,
                dtype: torch.dtype = torch.float32, *, inv_freq: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """cos and sin, each (b, 1, num_tokens, head_dim), of every position (b, num_tokens)
    and frequency, repeated for both halves; computed in float32 or wider and given in the
    queries' `dtype` (as Hugging Face's Llama does under bf16). `inv_freq` (head_dim / 2,):
    scaled frequencies (gptmini.attention.positions.scaling); None: theta's own."""
    wide = torch.promote_types(dtype, torch.float32)
    if inv_freq is None:
        inv_freq = plain_inv_freq(head_dim, theta, wide, positions.device)
    angles = positions.to(wide)[..., None] * inv_freq  # (b, num_tokens, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (b, 1, num_tokens, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def plain_inv_freq(head_dim: int, theta: float, dtype: torch.dtype, device=None) -> Tensor:
    """Rotary positions' own frequencies: theta ** (-2i / head_dim), (head_dim / 2,)."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=dtype, device=device) / head_dim)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each head's halves of `x` (b, heads, num_tokens, head_dim) by the angles:
    (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos), as x * cos + (-x2, x1) * sin."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin
