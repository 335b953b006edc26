"""Position schemes, in one room: how a token's place enters attention.

    learned   the book's: a learned embedding of each position is added to the token's
              (GPTModel.pos_emb); attention itself sees no positions
    rope      rotary embeddings (Su et al., 2021): queries and keys are rotated by an angle
              proportional to their position, so q·k depends only on the distance between
              them; no position embedding
    alibi     ALiBi (Press et al., 2022): each head adds slope_h * (key - query position)
              to its scores, a penalty growing with distance (a score modifier, in
              gptmini.attention.masks); no position embedding
    none      no positions at all: a causal decoder can still tell order from the mask

Rotary layout: each head's vector is split in two halves, and dimension i is rotated with
dimension i + head_dim / 2 (Hugging Face's `rotate_half` layout, which its Llama weights
use). Meta's original Llama weights rotate interleaved pairs (2i, 2i + 1) instead; the two
differ by a permutation of the query and key projections' rows (see convert.py).
"""

import math

import torch
from torch import Tensor

__all__ = ["POSITIONS", "alibi_slopes", "apply_rope", "rope_angles"]

POSITIONS = ("learned", "rope", "alibi", "none")


def rope_angles(positions: Tensor, head_dim: int, theta: float = 10000.0,
                dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos and sin of every (position, frequency) pair, each repeated for both halves.

    Args:
        positions: (b, num_tokens) integer positions.
        head_dim: the rotated vectors' size (even).
        theta: the base: frequency i is theta ** (-2i / head_dim).
        dtype: the queries' dtype: the angles are computed in float32 or wider, and their
            cos and sin given in `dtype` (as Hugging Face's Llama does under bf16).

    Returns:
        cos, sin, each (b, 1, num_tokens, head_dim): they broadcast over heads; dimension i
        and i + head_dim / 2 have the same angle.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
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
