"""Relative positions: attention whose positions enter only as distances (rotary, ALiBi)
gives the same outputs for the same tokens wherever they sit. A rotation applied to the
values, to the queries but not the keys, or with different halves for the two, breaks it."""

import torch

from gptmini.testing.outcomes import FAILED, PASSED, gap, where_differs
from gptmini.testing.subject import NotApplicable, Subject

SHIFTS = (1, 2, 5, 17, 100)


def relative_positions(s: Subject):
    if s.spec.positions is None:
        raise NotApplicable("no positions keyword declared (AttentionSpec(positions=...)): "
                            "declare it for rotary or ALiBi attention")
    module = s.build()
    for n in (2, 3, 4, 5, 6, 8):
        x = s.inputs(2, n, seed=n, scale=3.0)  # scaled: distances matter in sharp attention
        at_zero = torch.arange(n).expand(2, n)
        base = s.call(module, x, positions=at_zero)
        for shift in SHIFTS:
            shifted = s.call(module, x, positions=at_zero + shift)
            differs = where_differs(shifted, base, s.atol)
            if differs.any():
                row, i = (int(t) for t in differs.nonzero()[0])
                return FAILED, (
                    f"length {n}: the same tokens at positions {shift}..{shift + n - 1} "
                    f"instead of 0..{n - 1} change the output at token {i} by "
                    f"{gap(shifted[row, i], base[row, i])}: positions enter absolutely, not "
                    "as distances (rotated values? queries and keys rotated differently?)")
    for n in (2, 3, 4, 6, 8):
        x = s.inputs(2, n, seed=n, scale=3.0)
        at_zero = torch.arange(n).expand(2, n)
        spread = s.call(module, x, positions=at_zero * 7)
        if where_differs(spread, s.call(module, x, positions=at_zero), s.atol).any():
            return PASSED, (f"moving every token by {', '.join(map(str, SHIFTS))} positions "
                            "changes nothing (lengths 2-8), and distances do change outputs")
    return FAILED, ("the declared positions never change the output (distances 1 and 7 "
                    "apart give the same): are they applied at all?")
