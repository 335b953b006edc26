"""The properties, one function each: subject -> ("passed" | "failed", what it saw). The
padding, window and KV-cache checks are in masking.py, relative positions in positions.py.

A check searches small sizes in a fixed order (shortest length first, then the earliest
token) and stops at the first input that breaks the property, so a failure names the
smallest counterexample it found. Inputs come from seeded generators: a run is repeatable.
A check raises NotApplicable when what it needs is neither detectable nor declared.
"""

import torch
from torch import Tensor, nn

from gptmini.testing.masking import fully_padded_queries, kv_cache, padding, window
from gptmini.testing.outcomes import FAILED, LENGTHS, PASSED, gap, refusal, vec, where_differs
from gptmini.testing.positions import relative_positions
from gptmini.testing.subject import NotApplicable, Subject, attribute, one_line

BOOK_NAMES = ("W_query", "W_key", "W_value", "out_proj")
BOOK_INPUTS = [  # "Your journey starts with one step" in 3 dimensions (book section 3.3)
    [0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
    [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55],
]
BOOK_OUTPUT = [  # what Listing 3.5 prints under torch.manual_seed(123), for each batch row
    [0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593],
    [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028],
]


def output_shape(s: Subject):
    module = s.build()
    for n in (1, 2, 5, s.context_length):
        for b in (1, 2, 3):
            out = s.call(module, s.inputs(b, n))
            if not isinstance(out, Tensor):
                return FAILED, f"input ({b}, {n}, {s.d_in}) gave a {type(out).__name__}"
            if tuple(out.shape) != (b, n, s.d_out):
                hint = ""
                if out.shape[-1] == s.d_out * s.num_heads:
                    hint = (f" (num_heads outputs of d_out side by side, as the book's "
                            f"MultiHeadAttentionWrapper: give it d_out={s.d_out // s.num_heads} "
                            "through a factory)")
                return FAILED, (f"input ({b}, {n}, {s.d_in}) gave {tuple(out.shape)}, expected "
                                f"({b}, {n}, {s.d_out}){hint}")
    return PASSED, f"(b, n, {s.d_out}) for batch 1-3, length 1, 2, 5, {s.context_length}"


def causality(s: Subject):
    module = s.build()
    if not s.spec.causal:
        return _attends_both_ways(s, module)
    for n in LENGTHS:
        x = s.inputs(1, n)
        out, heads = s.call_seeing_heads(module, x)
        for j in range(1, n):  # the token changed; outputs before it must stay
            changed = x.clone()
            changed[:, j] = s.inputs(1, 1, seed=100 + j)[:, 0]
            out2, heads2 = s.call_seeing_heads(module, changed)
            moved = where_differs(out[:, :j], out2[:, :j], s.atol)[0]
            if moved.any():
                i = int(moved.nonzero()[0])
                cause = _what_it_sees(s, module, n)
                where = ""
                if heads is not None and heads2 is not None and s.heads_known:
                    size = heads.shape[-1] // s.num_heads
                    leaking = [h for h in range(s.num_heads) if where_differs(
                        heads[:, i:i + 1, h * size:(h + 1) * size],
                        heads2[:, i:i + 1, h * size:(h + 1) * size], s.atol).any()]
                    if leaking:
                        where = (f", in head{'s' if len(leaking) > 1 else ''} "
                                 f"{' and '.join(map(str, leaking))}")
                return FAILED, (f"length {n}: changing token {j} moves the output at position "
                                f"{i}{where} by {gap(out[:, i], out2[:, i])}: {cause}")
    return PASSED, f"changing token j never moves outputs before j (lengths 2-{LENGTHS[-1]})"


def _what_it_sees(s: Subject, module: nn.Module, n: int) -> str:
    """Which later tokens move each earlier output, at a length long enough to tell "every
    later token" (no mask) from "the next k" (a mask shifted by k): a length-2 counterexample
    cannot, and the two bugs have different fixes."""
    m = max(n, 6)
    x = s.inputs(1, m, seed=7)
    out = s.call(module, x)
    seen: dict[int, list[int]] = {i: [] for i in range(m)}
    for j in range(1, m):
        changed = x.clone()
        changed[:, j] = s.inputs(1, 1, seed=300 + j)[:, 0]
        moved = where_differs(out[:, :j], s.call(module, changed)[:, :j], s.atol)[0]
        for i in moved.nonzero().flatten().tolist():
            seen[i].append(j)
    changed = x.clone()
    changed[:, 0] = s.inputs(1, 1, seed=300)[:, 0]
    if not where_differs(out[:, -1:], s.call(module, changed)[:, -1:], s.atol).any():
        return (f"at length {m} the last position does not see token 0: it attends to later "
                "tokens instead of earlier ones (a mask reversed, tril for triu, or the "
                "sequence flipped?)")
    shifts = {len(js) for i, js in seen.items() if i < m - 1}
    if len(shifts) == 1 and all(js == list(range(i + 1, min(m, i + 1 + len(seen[0]))))
                                for i, js in seen.items()):
        k = shifts.pop()
        if 0 < k < m - 1:
            return (f"at length {m} each position sees the next {k} token(s) and none after "
                    f"(position 0 sees token {k}, not token {k + 1}): a causal mask off by "
                    f"{k}, as torch.triu(ones, diagonal={k + 1}) makes (the causal mask is "
                    "diagonal=1: it hides every later key)")
    if all(js == list(range(i + 1, m)) for i, js in seen.items()):
        return (f"at length {m} every position sees every later token: no causal mask applied "
                "(masked_fill without its underscore; a softmax over the queries; heads merged "
                "without a transpose?)")
    return (f"it sees a later token (at length {m}, position 0 sees tokens "
            f"{', '.join(map(str, seen[0])) or 'none'}: a mask applied to some positions only, "
            "or heads merged without a transpose?)")


def _attends_both_ways(s: Subject, module: nn.Module):
    if s.spec.window == 1:
        raise NotApplicable("declared bidirectional with a window of 1: nothing to see")
    x = s.inputs(1, 2)
    changed = x.clone()
    changed[:, 1] = s.inputs(1, 1, seed=101)[:, 0]
    if not where_differs(s.call(module, x)[:, :1], s.call(module, changed)[:, :1], s.atol).any():
        return FAILED, ("declared bidirectional (causal=False), but changing token 1 of 2 does "
                        "not move the output at position 0: it is causal")
    return PASSED, "declared bidirectional: a later token moves an earlier output"


def sees_itself(s: Subject):
    module = s.build()
    a, b = s.inputs(1, 1, seed=2), s.inputs(1, 1, seed=3)
    out_a, out_b = s.call(module, a), s.call(module, b)
    if not out_a.isfinite().all():
        # Say what was seen: NaN at position 0 only is its own key masked (position 1 still
        # has key 0); NaN everywhere is the computation itself, whatever the mask.
        two = s.call(module, s.inputs(1, 2, seed=2))
        if two[:, 1].isfinite().all():
            return FAILED, (f"a single token gives {vec(out_a)}, and of two tokens only the "
                            "first is not finite: its own key is masked, so it has nothing to "
                            "attend (a mask that hides the diagonal, as triu(..., diagonal=0) "
                            "does?)")
        return FAILED, (f"a single token gives {vec(out_a)}, and two tokens give "
                        f"{vec(two[:, 1])} at position 1, which has a key to attend: the "
                        "module returns non-finite values for finite inputs (a NaN or inf "
                        "in its computation, not a mask)")
    if not where_differs(out_a, out_b, s.atol).any():
        return FAILED, ("a single token's output does not depend on the token: it attends to "
                        "no key, itself included")
    return PASSED, "a single token attends to itself: finite, and moves with the token"


def identical_tokens(s: Subject):
    if not s.spec.softmax:
        raise NotApplicable("declared linear attention (softmax=False): a repeated token "
                            "writes its state again, so no mean to compare with")
    module = s.build(sinks=False)  # a sink takes weight by design: at -inf it is none
    one = s.inputs(1, 1)
    single = s.call(module, one)
    if not single.isfinite().all():
        return FAILED, f"a single token gives {vec(single)}: nothing to compare with"
    for n in LENGTHS[:7]:
        out = s.call(module, one.expand(1, n, s.d_in).contiguous())
        moved = where_differs(out, single.expand_as(out), s.atol)[0]
        if moved.any():
            i = int(moved.nonzero()[0])
            return FAILED, (f"one token repeated {n} times gives {vec(out[0, i])} at position "
                            f"{i}, not the single token's {vec(single[0, 0])}: attention "
                            "weights that do not sum to 1 over the keys (softmax over the "
                            "wrong dimension?), or heads or positions mixed up")
    sinks = " (sinks at -inf)" if s.spec.sinks is not None else ""
    return PASSED, ("a repeated token gives the single token's output everywhere (weights sum "
                    f"to 1 over the keys), lengths 2-8{sinks}")


def batch_rows_independent(s: Subject):
    module = s.build()
    for n in (1, 3, 6):
        for b in (2, 3):
            x = s.inputs(b, n)
            out = s.call(module, x)
            for row in range(b):
                alone = s.call(module, x[row:row + 1])
                moved = where_differs(out[row:row + 1], alone, s.atol)[0]
                if moved.any():
                    i = int(moved.nonzero()[0])
                    return FAILED, (f"batch of {b}, length {n}: row {row} differs from the same "
                                    f"sequence alone at position {i} by "
                                    f"{gap(out[row, i], alone[0, i])}: rows see each other")
    return PASSED, "each row of batches of 2 and 3 equals its sequence alone, lengths 1, 3, 6"


def eval_deterministic(s: Subject):
    x = s.inputs(2, 6)
    if not s.takes("dropout"):
        module = s.build()
        first, second = s.call(module, x), s.call(module, x)
        if where_differs(first, second, s.atol).any():
            return FAILED, "two calls in eval mode differ: randomness in eval mode"
        return PASSED, "two eval calls agree (it takes no dropout argument: only that tested)"
    module, without = s.build(dropout=0.5), s.build(dropout=0.0)
    first, second = s.call(module, x), s.call(module, x)
    if where_differs(first, second, s.atol).any():
        return FAILED, f"two calls in eval mode differ by {gap(first, second)}"
    if where_differs(first, s.call(without, x), s.atol).any():
        return FAILED, ("built with dropout 0.5, its eval output differs from dropout 0's: "
                        "dropout is still on after .eval() (a functional dropout that ignores "
                        "self.training?)")
    return PASSED, "eval mode: repeated calls agree, and dropout 0.5 gives dropout 0's output"


def dropout_in_training(s: Subject):
    module = s.build(dropout=0.5)
    x = s.inputs(2, 6)
    reference = s.call(module, x)
    module.train()
    try:
        first, second = s.call(module, x), s.call(module, x)
    except (ValueError, NotImplementedError) as err:
        raise refusal(err) from err
    if (not where_differs(first, second, s.atol).any()
            or not where_differs(first, reference, s.atol).any()):
        return FAILED, ("built with dropout 0.5, training mode gives the eval output: dropout "
                        "is never applied")
    return PASSED, "training mode with dropout 0.5: calls differ from each other and from eval"


def _book_linears(module: nn.Module) -> dict[str, nn.Module]:
    found = {name: getattr(module, name, None) for name in BOOK_NAMES}
    if all(isinstance(getattr(m, "weight", None), Tensor) for m in found.values()):
        return found
    return {}


def equals_gptmini(s: Subject):
    from gptmini.attention import MultiHeadAttention

    if not s.spec.softmax:
        raise NotApplicable("declared linear attention (softmax=False): not the book's "
                            "softmax attention, which this compares with")
    if s.spec.positions is not None:
        raise NotApplicable("positions declared: attention that moves its queries and keys by "
                            "position is not the book's, which this compares with (the scale "
                            "is still checked by identical_tokens and relative_positions)")
    module = s.build()
    linears = _book_linears(module)
    if not linears:
        raise _not_comparable(s, module, "it has no W_query, W_key, W_value, out_proj (the "
                                         "book's names) to copy into gptmini's "
                                         "MultiHeadAttention")
    if not s.heads_known:
        raise NotApplicable("its number of heads is unknown: declare AttentionSpec(num_heads=)",
                            loud=True)
    q, k, v, o = (linears[name] for name in BOOK_NAMES)
    head_dim = q.weight.shape[0] // s.num_heads
    shapes_fit = (q.weight.shape == (s.d_out, s.d_in) and o.weight.shape == (s.d_out, s.d_out)
                  and k.weight.shape == v.weight.shape and k.weight.shape[1] == s.d_in
                  and head_dim > 0 and k.weight.shape[0] % head_dim == 0
                  and (q.bias is None) == (k.bias is None) == (v.bias is None))
    if not shapes_fit:
        raise _not_comparable(s, module, "W_query, W_key, W_value, out_proj do not have the "
                                         "book's shapes")
    window = s.spec.window
    if window is not None and not s.spec.window_counts_self:
        window += 1  # gptmini counts the query itself in its window
    gate = None if s.spec.gate is None else attribute(module, s.spec.gate)
    reference = MultiHeadAttention(
        s.d_in, s.d_out, s.context_length, 0.0, s.num_heads, qkv_bias=q.bias is not None,
        num_kv_heads=k.weight.shape[0] // head_dim, window_size=window, causal=s.spec.causal,
        backend="explicit", sinks=s.spec.sinks is not None,
        gate="none" if gate is None else
        "elementwise" if gate.weight.shape[0] == s.d_out else "headwise")
    reference = reference.to(device=s.device, dtype=s.dtype).eval()
    for name in BOOK_NAMES:
        getattr(reference, name).load_state_dict(linears[name].state_dict())
    with torch.no_grad():  # declared sinks and gate: the same values in gptmini's
        if s.spec.sinks is not None:
            reference.sinks.copy_(attribute(module, s.spec.sinks))
        if gate is not None:
            reference.gate.W_gate.weight.copy_(gate.weight)
            if gate.bias is not None:
                reference.gate.W_gate.bias.copy_(gate.bias)
    for b, n in ((1, 1), (1, 2), (1, 3), (2, 5), (2, 8), (2, s.context_length)):
        x = s.inputs(b, n)
        out, expected = s.call(module, x), reference(x)
        moved = where_differs(out, expected, s.atol)
        if moved.any():
            row, i = (int(t) for t in moved.nonzero()[0])
            return FAILED, (f"batch {b}, length {n}: position {i} gives {vec(out[row, i])}, "
                            f"gptmini's MultiHeadAttention with the same weights "
                            f"{vec(expected[row, i])}{_why_it_differs(n, moved)}")
    return PASSED, ("same weights, same outputs as gptmini's MultiHeadAttention (the explicit "
                    f"path), lengths 1-{s.context_length}")


def _not_comparable(s: Subject, module: nn.Module, why: str) -> NotApplicable:
    """equals_gptmini cannot run: loud unless `scale` checks the scale and head split."""
    if s.heads_known and s.d_out == s.d_in and _identity_blocks(module, s.d_in) is not None:
        return NotApplicable(f"{why}; the scale and head split are checked by `scale` "
                             "(identity projections)")
    return NotApplicable(f"{why}, so a wrong scale or head split would go unseen", loud=True)


def _why_it_differs(n: int, moved: Tensor) -> str:
    """What the first length where outputs differ says. One token attends to itself alone
    whatever the mask and scale; the last of n sees every key under any causal mask."""
    if n == 1:
        return (": a single token differs, which neither the scale nor a mask can change (the "
                "values or the output projection?)")
    if not moved[:, -1].any():
        return (": the last position agrees and an earlier one does not, so the mask differs, "
                "not the scale (see causality)")
    return " (a scale other than 1/sqrt(head_dim), softmax over the wrong dimension, or heads " \
           "split wrong?)"


SCALES = {"1/sqrt(head_dim)": lambda d, h: (d // h) ** -0.5, "1/head_dim": lambda d, h: h / d,
          "1/d_out": lambda d, h: 1 / d, "1/sqrt(d_out)": lambda d, h: d ** -0.5,
          "no scale (1)": lambda d, h: 1.0}
"""Scales a reader may write; `scale` names the one a module uses (the first the right one)."""


def _identity_blocks(module: nn.Module, d: int) -> int | None:
    """How many (d, d) projections the module's matrices hold, when every parameter is a
    matrix of such stacked blocks (a fused qkv is 3) or a bias vector, and there are 3 (q, k,
    v) or 4 (and the output's); else None: other parameters (norms, an MLP, grouped keys)."""
    blocks = 0
    for p in module.parameters():
        if p.dim() == 2 and p.shape[1] == d and p.shape[0] % d == 0:
            blocks += p.shape[0] // d
        elif not (p.dim() == 1 and p.shape[0] % d == 0):
            return None
    return blocks if blocks in (3, 4) else None


def _identity_attention(s: Subject, x: Tensor, scale: float) -> Tensor:
    """Attention with queries = keys = values = x and no output projection, written out:
    softmax(scale * x_h x_h^T, masked) x_h for each head's slice x_h of the features."""
    b, n, d = x.shape
    h = x.view(b, n, s.num_heads, d // s.num_heads).transpose(1, 2)  # (b, heads, n, head_dim)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= i) if s.spec.causal else torch.ones(n, n, dtype=torch.bool)
    if s.spec.window is not None:
        reach = s.spec.window - 1 if s.spec.window_counts_self else s.spec.window
        allowed = allowed & ((i - j).abs() <= reach)
    scores = (h @ h.transpose(-1, -2) * scale).masked_fill(~allowed.to(x.device), -torch.inf)
    return (torch.softmax(scores, dim=-1) @ h).transpose(1, 2).reshape(b, n, d)


def scale(s: Subject):
    """The scale of the scores, whatever the module's layout (a fused qkv as nanoGPT's, two
    projections, torch's MultiheadAttention): with every projection set to the identity and
    every bias to 0, queries, keys and values are the input itself, and the output is known."""
    if s.spec.positions is not None:
        raise NotApplicable("positions declared: queries and keys move by position")
    if not s.heads_known:
        raise NotApplicable("its number of heads is unknown: declare AttentionSpec(num_heads=)",
                            loud=True)
    module, d = s.build(), s.d_in
    blocks = _identity_blocks(module, d) if s.d_out == d else None
    if blocks is None or d % s.num_heads:
        raise NotApplicable("its parameters are not projections of width d_in (matrices of "
                            "stacked (d_in, d_in) blocks, 3 or 4 in all, and biases), so they "
                            "cannot all be set to the identity")
    with torch.no_grad():
        for p in module.parameters():
            eye = torch.eye(d, dtype=p.dtype, device=p.device)
            p.copy_(eye.repeat(p.shape[0] // d, 1) if p.dim() == 2 else torch.zeros_like(p))
    # Causal: only the last query, which sees every key under any causal mask (right, off
    # by one, or none): the scale is then told apart from the mask, which causality checks.
    seen = slice(-1, None) if s.spec.causal and s.spec.window is None else slice(None)
    for b, n in ((1, 2), (2, 3), (2, 8)):
        x = s.inputs(b, n, seed=11)
        out = s.call(module, x)[:, seen]
        wanted = {name: _identity_attention(s, x, f(d, s.num_heads))[:, seen]
                  for name, f in SCALES.items()}
        if where_differs(out, wanted["1/sqrt(head_dim)"], s.atol).any():
            used = next((name for name, w in wanted.items()
                         if not where_differs(out, w, s.atol).any()), None)
            says = (f"it scales the scores by {used}" if used else
                    "its output matches no usual scale, so more than the scale differs (the "
                    "mask: see causality; heads split wrong; a softmax over another dimension?)")
            return FAILED, (f"every projection the identity, biases 0 (queries = keys = values "
                            f"= the input), batch {b}, length {n}: {says}, not 1/sqrt(head_dim) "
                            f"= 1/sqrt({d // s.num_heads})")
    return PASSED, (f"with identity projections ({blocks} blocks of {d} x {d}): scores scaled by "
                    "1/sqrt(head_dim), whatever the layout")


def book_numbers(s: Subject):
    if not s.book_constructor:
        raise NotApplicable("not the book's constructor (d_in, d_out, context_length, dropout, "
                            "num_heads), so the book's seeded example cannot be rebuilt and a "
                            "wrong scale could go unseen", loud=True)
    if not s.spec.causal:
        raise NotApplicable("the book's numbers are for causal attention")
    if s.spec.positions is not None:
        raise NotApplicable("positions declared: the book's numbers are for attention without "
                            "positions (and its heads of size 1 cannot be rotated)")
    if s.spec.gate is not None:
        raise NotApplicable("a gate declared: the book's attention has none, and a gate "
                            "changes its numbers by design (equals_gptmini checks it)")
    module = s.build(d_in=3, d_out=2, context_length=6, num_heads=2, seed=123, window=False,
                     dtype=torch.float32, sinks=False)
    order = [name.rsplit(".", 1)[0] for name, _ in module.named_parameters()
             if name != s.spec.sinks]  # declared sinks, at -inf: no sinks
    if list(dict.fromkeys(order)) != list(BOOK_NAMES):
        raise NotApplicable(f"its parameters are created in another order ({', '.join(order)}) "
                            "than the book's W_query, W_key, W_value, out_proj, so "
                            "torch.manual_seed(123) does not give the book's weights", loud=True)
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()
              if name != s.spec.sinks}
    book_shapes = {"W_query.weight": (2, 3), "W_key.weight": (2, 3), "W_value.weight": (2, 3),
                   "out_proj.weight": (2, 2), "out_proj.bias": (2,)}
    if shapes != book_shapes:
        raise NotApplicable(f"its parameters are not the book's ({shapes}; grouped-query "
                            "attention?), so torch.manual_seed(123) does not give the book's "
                            "weights")
    book = torch.tensor(BOOK_INPUTS, device=s.device)
    with torch.no_grad():
        out = module(torch.stack((book, book)))
    expected = torch.tensor(BOOK_OUTPUT, device=s.device).expand(2, 6, 2)
    moved = where_differs(out.float(), expected, 1e-4)
    if moved.any():
        row, i = (int(t) for t in moved.nonzero()[0])
        return FAILED, (f"Listing 3.5's example (torch.manual_seed(123), d_in=3, d_out=2, 2 "
                        f"heads, the book's six tokens) gives {vec(out[row, i])} at position "
                        f"{i}; the book prints {vec(expected[row, i])}")
    return PASSED, "Listing 3.5's seeded example prints the book's numbers (to 1e-4, float32)"


def large_scale(dtype: torch.dtype) -> float:
    """How far `large_inputs_finite` scales its inputs: 1e3, or less where the scores of
    inputs that large would not fit the dtype at all (float16 stops at 65504: inputs x 1e3
    give scores near 1e6, which overflow before any softmax). sqrt(max) / 16 (16 for float16)
    keeps its scores in the hundreds: still far past where exp overflows without the row's
    maximum subtracted (about 11 in float16, 88 in float32)."""
    return float(min(1e3, round(torch.finfo(dtype).max ** 0.5 / 16)))


def large_inputs_finite(s: Subject):
    module = s.build()
    large = large_scale(s.dtype)
    for scale in (1.0, large):
        x = s.inputs(2, 6, scale=scale)
        out = s.call(module, x)
        bad = ~out.isfinite().flatten(2).all(-1)
        if bad.any():
            row, i = (int(t) for t in bad.nonzero()[0])
            if scale == 1.0:
                return FAILED, (f"not finite even at scale 1: {vec(out[row, i])} at position "
                                f"{i} (row {row})")
            most = torch.finfo(s.dtype).max
            dtype = str(s.dtype).removeprefix("torch.")
            return FAILED, (f"inputs scaled by {scale:g} give {vec(out[row, i])} at position "
                            f"{i}: the softmax overflows (exp of large scores; subtract each "
                            "row's maximum, as torch.softmax does)" + (
                                f", or a step before it leaves {dtype}'s range (at most "
                                f"{most:g})" if most < 1e6 else ""))  # float16's is narrow
    try:
        x.requires_grad_(True)
        (s.call(module, x, grad=True) ** 2).mean().backward()
    except (ValueError, NotImplementedError) as err:
        return PASSED, f"outputs finite (gradients not tested: {one_line(err, 80)})"
    if not x.grad.isfinite().all() or not all(
            p.grad.isfinite().all() for p in module.parameters() if p.grad is not None):
        return FAILED, f"inputs scaled by {large:g} give finite outputs but non-finite gradients"
    return PASSED, f"inputs scaled by {large:g}: outputs and gradients finite"


def gradients_reach_all_parameters(s: Subject):
    module = s.build()
    x = s.inputs(2, 6).requires_grad_(True)
    try:
        out = s.call(module, x, grad=True)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        (out * weights.to(out)).sum().backward()
    except (ValueError, NotImplementedError) as err:
        raise refusal(err) from err
    trained = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    none = [name for name, p in trained if p.grad is None]
    zero = [name for name, p in trained if p.grad is not None and not p.grad.any()]
    if none:
        return FAILED, f"no gradient reaches {', '.join(none)} (detached somewhere?)"
    if zero:
        return FAILED, f"the gradient of {', '.join(zero)} is zero"
    if x.grad is None or not x.grad.any():
        return FAILED, "no gradient reaches the input"
    return PASSED, f"all {len(trained)} trainable parameters and the input get a gradient"


CHECKS = [
    ("output_shape", output_shape),
    ("causality", causality),
    ("sees_itself", sees_itself),
    ("identical_tokens", identical_tokens),
    ("batch_rows_independent", batch_rows_independent),
    ("eval_deterministic", eval_deterministic),
    ("dropout_in_training", dropout_in_training),
    ("equals_gptmini", equals_gptmini),
    ("scale", scale),
    ("book_numbers", book_numbers),
    ("padding", padding),
    ("fully_padded_queries", fully_padded_queries),
    ("window", window),
    ("kv_cache", kv_cache),
    ("relative_positions", relative_positions),
    ("large_inputs_finite", large_inputs_finite),
    ("gradients_reach_all_parameters", gradients_reach_all_parameters),
]
"""Every check, in the report's order."""
