"""The checks of what masks and caches promise: padding (either side), queries with nothing
to attend, a sliding window, and a KV cache equal to recomputing."""

import torch
from torch import Tensor

from gptmini.testing.outcomes import FAILED, PASSED, gap, vec, where_differs
from gptmini.testing.subject import NotApplicable, Subject, one_line


def _padded(s: Subject, side: str, real: int, pad: int) -> tuple[Tensor, Tensor, slice]:
    """Two rows of real + pad tokens: row 0 padded on `side`, row 1 all real."""
    width = real + pad
    x = s.inputs(2, width, seed=10 * real + pad)
    is_real = torch.ones(2, width, dtype=torch.bool)
    cols = slice(pad, width) if side == "left" else slice(0, real)
    is_real[0] = False
    is_real[0, cols] = True
    return x, is_real, cols


def _no_padding_declared() -> NotApplicable:
    return NotApplicable("no padding mask declared (AttentionSpec(padding='attention_mask', "
                         "padding_marks='real' or 'pad'))")


def padding(s: Subject):
    if s.spec.padding is None:
        raise _no_padding_declared()
    module = s.build()
    for real, pad in ((1, 1), (2, 1), (1, 2), (3, 2), (2, 3)):
        for side in ("left", "right"):
            x, is_real, cols = _padded(s, side, real, pad)
            out = s.call(module, x, is_real)
            alone = s.call(module, x[:1, cols])
            moved = where_differs(out[:1, cols], alone, s.atol)[0]
            if moved.any():
                i = int(moved.nonzero()[0])
                return FAILED, (f"{side} padding, {real} real + {pad} pad token(s): real token "
                                f"{i} differs from the sequence alone by "
                                f"{gap(out[0, cols][i], alone[0, i])}: it attends to padding "
                                "(a mask on the queries instead of the keys, or the wrong "
                                "polarity?)")
            full = s.call(module, x[1:])
            if where_differs(out[1:], full, s.atol).any():
                return FAILED, (f"{side} padding, {real} real + {pad} pad token(s): the unpadded "
                                "row beside the padded one differs from itself alone")
    return PASSED, ("left and right padding, 1-3 real + 1-3 pad tokens: real tokens equal each "
                    "sequence alone")


def fully_padded_queries(s: Subject):
    if s.spec.padding is None:
        raise _no_padding_declared()
    module = s.build()
    x = s.inputs(3, 4)
    is_real = torch.tensor([[False] * 4, [False, False, True, True], [True, False, False, True]])
    out = s.call(module, x, is_real)
    bad = ~out.isfinite().flatten(2).all(-1)
    if bad.any():
        row, i = (int(t) for t in bad.nonzero()[0])
        what = "an all-padding row" if row == 0 else "a row padded on the left"
        return FAILED, (f"{what}: position {i} gives {vec(out[row, i])}; a query with no real "
                        "key to attend must give a finite output (softmax over only -inf is "
                        "NaN)")
    try:
        x.requires_grad_(True)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
        (s.call(module, x, is_real, grad=True) * weights.to(x)).sum().backward()
    except (ValueError, NotImplementedError) as err:
        return PASSED, f"outputs finite (gradients not tested: {one_line(err, 80)})"
    grads = {"the input": x.grad, **{n: p.grad for n, p in module.named_parameters()}}
    for name, grad in grads.items():
        if grad is not None and not grad.isfinite().all():
            return FAILED, (f"outputs finite, but {name}'s gradient is not: a masked row's "
                            "NaN flows back (torch.where keeps the NaN branch's gradient)")
    return PASSED, "an all-padding row and left padding: outputs and gradients finite"


def window(s: Subject):
    w = s.spec.window
    if w is None:
        hint = next((f": it takes {name!r}, declare AttentionSpec(window=..., window_kwarg="
                     f"{name!r})" for name in sorted(s.accepts) if "window" in name), "")
        raise NotApplicable(f"no window declared{hint}")
    reach = w - 1 if s.spec.window_counts_self else w  # the farthest key a query sees
    convention = f"keys i-{reach}..i" if s.spec.causal else f"keys i-{reach}..i+{reach}"
    module = s.build()
    for n in range(2, reach + 5):
        x = s.inputs(1, n)
        out = s.call(module, x)
        for j in range(n):
            changed = x.clone()
            changed[:, j] = s.inputs(1, 1, seed=200 + j)[:, 0]
            moved = where_differs(out, s.call(module, changed), s.atol)[0]
            for i in range(n):
                if i == j or (s.spec.causal and j > i):  # its own token; causality's matter
                    continue
                inside = abs(i - j) <= reach
                if inside and not moved[i]:
                    return FAILED, (f"length {n}: key {j} is {abs(i - j)} position(s) from "
                                    f"query {i}, inside the window of {w} ({convention}), and "
                                    "does not move its output: the window is too small")
                if moved[i] and not inside:
                    return FAILED, (f"length {n}: key {j} is {abs(i - j)} position(s) from "
                                    f"query {i}, outside the window of {w} ({convention}), and "
                                    "moves its output: the window is too large")
    return PASSED, (f"window {w} ({convention}): every key inside moves the output, none "
                    f"outside does (lengths 2-{reach + 4})")


def kv_cache(s: Subject):
    step = s.spec.kv_step
    if step is None:
        raise NotApplicable("no KV cache declared (AttentionSpec(kv_step=...))")
    module = s.build()
    for n in range(2, max(8, (s.spec.window or 0) + 4) + 1):
        x = s.inputs(2, n)
        full = s.call(module, x)
        for prefill in range(1, n):
            with torch.no_grad():
                pieces, state = [], None
                for start, end in [(0, prefill)] + [(t, t + 1) for t in range(prefill, n)]:
                    out, state = step(module, x[:, start:end], state)
                    pieces.append(out)
            got = torch.cat(pieces, dim=1)
            if got.shape != full.shape:
                return FAILED, (f"length {n}, prefill {prefill} then one token at a time: "
                                f"outputs of shape {tuple(got.shape)}, expected "
                                f"{tuple(full.shape)}")
            moved = where_differs(got, full, s.atol)
            if moved.any():
                row, i = (int(t) for t in moved.nonzero()[0])
                return FAILED, (f"length {n}, prefill {prefill} then one token at a time: "
                                f"position {i} differs from the full recompute by "
                                f"{gap(got[row, i], full[row, i])}")
    return PASSED, "every prefill length, then one token at a time, equals full recompute (2-8)"
