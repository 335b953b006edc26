"""What the checks share: their verdicts, the lengths they search, and how they say what
they saw (which positions moved, by how much, a vector in short)."""

from torch import Tensor

from gptmini.testing.subject import NotApplicable, one_line

PASSED, FAILED = "passed", "failed"
LENGTHS = (2, 3, 4, 5, 6, 7, 8, 16, 32)
"""Sequence lengths the searches try, shortest first (32 is the kit's context_length)."""


def where_differs(a: Tensor, b: Tensor, atol: float) -> Tensor:
    """(b, num_tokens): True where the two outputs differ (NaN against a number counts)."""
    differs = ((a - b).abs() > atol) | (a.isnan() ^ b.isnan())
    return differs.flatten(2).any(-1)


def gap(a: Tensor, b: Tensor) -> str:
    gap = (a - b).abs().nan_to_num(float("inf")).max().item()
    return "NaN" if gap != gap else f"{gap:.2g}"


def vec(v: Tensor) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in v.flatten()[:3].tolist()) + \
        (", ...]" if v.numel() > 3 else "]")


def refusal(err: Exception) -> NotApplicable:
    return NotApplicable(f"it refuses: {one_line(err, 100)}")
