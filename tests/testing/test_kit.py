"""The conformance kit: it passes correct attention and names the property each bug breaks.

The buggy modules are Listing 3.5 as a reader types it, with one mistake each (`bug`),
and a window and a padding mask as a reader would add them.
"""

import functools
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import HANG_SECONDS
from torch import nn

from gptmini.attention import MultiHeadAttention, WindowKVCache
from gptmini.attention.book import CausalAttention, MultiHeadAttentionWrapper
from gptmini.testing import AttentionSpec, assert_attention, check_attention
from gptmini.testing.checks import CHECKS

ROOT = Path(__file__).resolve().parents[2]


class ReaderMHA(nn.Module):
    """Listing 3.5 as a reader types it, plus a window and a padding mask; `bug` picks one
    mistake (None: none)."""

    bug = None

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False,
                 window_size=None, causal=True):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        ones = torch.ones(context_length, context_length)
        diagonal = {"triu diagonal=0": 0, "triu diagonal=2": 2}.get(self.bug, 1)
        mask = torch.triu(ones, diagonal=diagonal)
        if not causal:
            mask = torch.zeros_like(ones)
        if window_size is not None:  # hide keys window_size or more positions away
            reach = {"window too large": 1, "window too small": -1}.get(self.bug, 0)
            mask = mask + torch.tril(ones, diagonal=-window_size - reach)
            if not causal and self.bug != "window forgets later keys":
                mask = mask + torch.triu(ones, diagonal=window_size + reach)
        self.register_buffer("mask", mask)

    def forward(self, x, attention_mask=None):
        b, num_tokens, d_in = x.shape
        split = (b, num_tokens, self.num_heads, self.head_dim)
        keys = self.W_key(x).view(split).transpose(1, 2)  # (b, num_heads, num_tokens, head_dim)
        if self.bug == "keys detached":
            keys = keys.detach()
        queries = self.W_query(x).view(split).transpose(1, 2)
        values = self.W_value(x).view(split).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_tokens, num_tokens)
        hidden = self.mask.bool()[:num_tokens, :num_tokens]
        if self.bug == "mask only up to 4 tokens" and num_tokens > 4:
            hidden = torch.zeros_like(hidden)
        if self.bug == "head 1 unmasked":
            hidden = hidden.repeat(self.num_heads, 1, 1)  # (num_heads, num_tokens, num_tokens)
            hidden[1] = False
        if attention_mask is not None:
            pad = ~attention_mask.bool()
            if self.bug == "first row's mask for every row":
                pad = pad[:1]
            on = pad[:, None, :, None] if self.bug == "padding on queries" else pad[:, None, None]
            hidden = hidden | on
        empty = None
        if attention_mask is not None and self.bug != "additive mask, nan_to_num":
            empty = hidden.all(dim=-1, keepdim=True)  # queries with no key (left padding)
            hidden = hidden & ~empty  # let them see every key, then zero their weights
        if self.bug == "masked_fill":  # seed 001's exercise: returns a new tensor, unused
            attn_scores.masked_fill(hidden, -torch.inf)
        elif self.bug == "additive mask, nan_to_num":  # the -inf's gradient path stays open
            attn_scores = attn_scores + torch.zeros_like(attn_scores).masked_fill(hidden,
                                                                                  -torch.inf)
        else:
            attn_scores.masked_fill_(hidden, -torch.inf)
        scale = self.d_out if self.bug == "scale by d_out" else keys.shape[-1] ** 0.5
        scaled = attn_scores / scale
        if self.bug == "exp without the max":
            attn_weights = scaled.exp() / scaled.exp().sum(dim=-1, keepdim=True)
        else:
            dim = {"softmax dim=-2": -2, "softmax dim=1": 1, "softmax dim=0": 0}.get(self.bug, -1)
            attn_weights = torch.softmax(scaled, dim=dim)
        if self.bug == "additive mask, nan_to_num":
            attn_weights = attn_weights.nan_to_num(0.0)
        elif empty is not None:
            attn_weights = attn_weights.masked_fill(empty, 0.0)
        if self.bug == "dropout always on":
            attn_weights = F.dropout(attn_weights, self.dropout.p, training=True)
        elif self.bug != "dropout never on":
            attn_weights = self.dropout(attn_weights)
        context_vec = attn_weights @ values  # (b, num_heads, num_tokens, head_dim)
        if self.bug != "view without transpose":
            context_vec = context_vec.transpose(1, 2)  # (b, num_tokens, num_heads, head_dim)
        return self.out_proj(context_vec.contiguous().view(b, num_tokens, self.d_out))


def reader(bug=None):
    return type(f"ReaderMHA[{bug}]", (ReaderMHA,), {"bug": bug})


READER_SPEC = AttentionSpec(padding="attention_mask")
WINDOW_SPEC = AttentionSpec(window=3)
BOTH_WAYS_WINDOW = AttentionSpec(causal=False, window=2)


def both_ways(bug=None):
    return functools.partial(reader(bug), causal=False)


# --- clean modules pass ------------------------------------------------------------------


def not_applicable(report) -> set[str]:
    return {r.name for r in report.results if r.status == "not applicable"}


def test_the_books_variants_pass_where_they_apply():
    report = assert_attention(reader(), READER_SPEC)
    assert not_applicable(report) == {"window", "kv_cache", "relative_positions"}
    assert report["book_numbers"].status == "passed"
    for target, spec in ((reader(), WINDOW_SPEC), (both_ways(), BOTH_WAYS_WINDOW)):
        assert assert_attention(target, spec)["window"].status == "passed"
    # Listing 3.3 (one head) and 3.4 (heads side by side): no out_proj, nothing to compare with
    for factory in (
        lambda d_in, context_length, dropout: CausalAttention(d_in, d_in, context_length,
                                                              dropout),
        lambda d_in, context_length, dropout: MultiHeadAttentionWrapper(
            d_in, d_in // 2, context_length, dropout, num_heads=2),
    ):
        report = assert_attention(factory)
        assert {"equals_gptmini", "book_numbers"} <= not_applicable(report)
        assert report["equals_gptmini"].loud and report["book_numbers"].loud
        assert "WARNING: equals_gptmini not tested" in str(report)


# --- each bug is caught by the property named --------------------------------------------


BUGS = {
    # (a) seed 001's exercise solution: masked_fill without the underscore
    "masked_fill": (READER_SPEC, ["causality"],
                    "length 2: changing token 1 moves the output at position 0"),
    # (b) a mask that hides the token itself
    "triu diagonal=0": (READER_SPEC, ["sees_itself"], "a single token gives [nan"),
    # (c) the wrong scale: only a reference with the same weights sees it
    "scale by d_out": (READER_SPEC, ["equals_gptmini", "scale", "book_numbers"],
                       "batch 1, length 2"),
    # a mask off by one: each token sees the next one
    "triu diagonal=2": (READER_SPEC, ["causality"],
                        "length 2: changing token 1 moves the output at position 0"),
    # (d) softmax over the wrong dimension
    "softmax dim=-2": (READER_SPEC, ["identical_tokens", "causality", "equals_gptmini"],
                       "one token repeated 2 times"),
    "softmax dim=1": (READER_SPEC, ["identical_tokens", "equals_gptmini"],
                      "one token repeated 2 times"),
    "softmax dim=0": (READER_SPEC, ["batch_rows_independent"], "batch of 2, length 1: row 0"),
    # (e) a window off by one in each direction
    "window too large": (WINDOW_SPEC, ["window"],
                         "length 4: key 0 is 3 position(s) from query 3, outside the window"),
    "window too small": (WINDOW_SPEC, ["window"],
                         "length 3: key 0 is 2 position(s) from query 2, inside the window"),
    "window forgets later keys": (BOTH_WAYS_WINDOW, ["window"],
                                  "length 3: key 2 is 2 position(s) from query 0, outside"),
    # (f) heads merged with view, no transpose first
    "view without transpose": (READER_SPEC, ["causality", "equals_gptmini"],
                               "length 2: changing token 1 moves the output at position 0"),
    # (g) a padding mask on the queries instead of the keys
    "padding on queries": (READER_SPEC, ["padding"],
                           "left padding, 1 real + 1 pad token(s): real token 0 differs"),
    "first row's mask for every row": (READER_SPEC, ["padding"],
                                       "left padding, 1 real + 1 pad token(s): the unpadded"),
    # and the other properties' bugs
    "additive mask, nan_to_num": (READER_SPEC, ["fully_padded_queries"],
                                  "outputs finite, but the input's gradient is not"),
    "mask only up to 4 tokens": (READER_SPEC, ["causality"],
                                 "length 5: changing token 1 moves the output at position 0"),
    "exp without the max": (READER_SPEC, ["large_inputs_finite"], "inputs scaled by 1000"),
    "keys detached": (READER_SPEC, ["gradients_reach_all_parameters"],
                      "no gradient reaches W_key.weight"),
    "dropout always on": (READER_SPEC, ["eval_deterministic"], "two calls in eval mode differ"),
    "dropout never on": (READER_SPEC, ["dropout_in_training"],
                         "built with dropout 0.5, training mode gives the eval output"),
}


@pytest.mark.parametrize("bug", BUGS)
def test_each_bug_fails_the_property_it_breaks_with_the_smallest_input(bug):
    spec, properties, counterexample = BUGS[bug]
    target = reader(bug) if spec.causal else both_ways(bug)
    report = check_attention(target, spec, time_budget=None)
    failed = {r.name for r in report.failed}
    assert set(properties) <= failed, report
    assert report[properties[0]].detail.startswith(counterexample), report
    assert report["output_shape"].status == "passed"  # the search reached the bug's property
    with pytest.raises(AssertionError, match=f"FAIL {properties[0]}"):
        assert_attention(target, spec)


def test_a_causality_leak_names_the_head_it_leaks_in():
    report = check_attention(reader("head 1 unmasked"), time_budget=None)
    assert report["causality"].detail.startswith(
        "length 2: changing token 1 moves the output at position 0, in head 1 by")


def test_a_wrong_kv_cache_is_caught():
    def forgets_the_past(module, x, state):  # attends over the new tokens only
        return module(x), state

    report = check_attention(MultiHeadAttention, AttentionSpec(kv_step=forgets_the_past),
                             time_budget=None)
    assert report["kv_cache"].status == "failed"
    assert report["kv_cache"].detail.startswith("length 2, prefill 1 then one token at a time: "
                                                "position 1 differs")


def test_bidirectional_declared_but_causal_fails():
    report = check_attention(MultiHeadAttention, AttentionSpec(causal=False), time_budget=None)
    assert report["causality"].status == "failed"
    assert "it is causal" in report["causality"].detail


def test_report_says_what_it_tested_and_what_it_could_not():
    report = check_attention(MultiHeadAttention, time_budget=None)
    assert report.tested.startswith("the book's constructor, d_in=8, d_out=8, num_heads=2")
    assert "declared: no padding mask, window or KV cache" in report.tested
    assert not_applicable(report) == {"padding", "fully_padded_queries", "window", "kv_cache",
                                      "relative_positions"}
    assert "declare AttentionSpec(window=" in report["window"].detail  # it takes window_size
    assert [r.name for r in report.results] == [name for name, _ in CHECKS]
    text = str(report)
    assert text.splitlines()[0] == "attention conformance: MultiHeadAttention"
    assert "12 passed, 0 failed, 5 not applicable" in text


def test_a_factory_without_the_books_names_is_told_the_scale_goes_unchecked():
    def factory(d_in, context_length, dropout):
        return nn.MultiheadAttention(d_in, 2, dropout=dropout, batch_first=True)

    class Wrapped(nn.Module):
        def __init__(self, d_in, context_length, dropout):
            super().__init__()
            self.attn = factory(d_in, context_length, dropout)
            self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length,
                                                               dtype=torch.bool), 1))

        def forward(self, x):
            n = x.shape[1]
            return self.attn(x, x, x, attn_mask=self.mask[:n, :n], need_weights=False)[0]

    report = assert_attention(Wrapped, AttentionSpec(num_heads=2))
    assert report["book_numbers"].loud
    # torch's fused in_proj_weight cannot be copied into the book's names, but the scale and
    # head split are still checked, with identity projections
    assert not report["equals_gptmini"].loud and report["scale"].status == "passed"
    assert "checked by `scale`" in report["equals_gptmini"].detail


class FusedQKV(nn.Module):
    """nanoGPT's layout: one projection for queries, keys and values; `d_out_scale` divides
    the scores by d_out instead of sqrt(head_dim)."""

    d_out_scale = False

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads, self.d_out, self.dropout = num_heads, d_out, dropout
        self.c_attn = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.c_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.num_heads, -1).transpose(1, 2)
                   for t in self.c_attn(x).split(self.d_out, dim=2))
        scale = 1 / self.d_out if self.d_out_scale else q.shape[-1] ** -0.5
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(out.transpose(1, 2).reshape(b, n, self.d_out))


def test_a_wrong_scale_fails_whatever_the_layout():
    """Before: a fused qkv projection (nanoGPT's) scaled by 1/d_out passed 8 of 8 checks,
    with only a warning that the scale went unchecked."""
    assert assert_attention(FusedQKV)["scale"].status == "passed"
    wrong = check_attention(type("FusedQKV[1/d_out]", (FusedQKV,), {"d_out_scale": True}),
                            time_budget=None)
    assert [r.name for r in wrong.failed] == ["scale"], wrong
    assert "it scales the scores by 1/d_out, not 1/sqrt(head_dim) = 1/sqrt(4)" in (
        wrong["scale"].detail)


def test_a_mask_off_by_one_is_named_for_what_it_is():
    """Before: the length-2 counterexample could not tell "sees every later token" from
    "sees the next one", its hint named three causes none of which was the bug, and the
    knock-on equals_gptmini failure suggested a wrong scale."""
    report = check_attention(reader("triu diagonal=2"), READER_SPEC, time_budget=None)
    causality = report["causality"].detail
    assert "each position sees the next 1 token(s) and none after" in causality
    assert "off by 1, as torch.triu(ones, diagonal=2) makes" in causality
    assert "masked_fill" not in causality
    assert "the mask differs, not the scale" in report["equals_gptmini"].detail
    assert report["scale"].status == "passed"  # the scale is right: the mask is not
    assert "no causal mask applied" in check_attention(reader("masked_fill"), time_budget=None)[
        "causality"].detail


def test_errors_are_one_line_and_name_the_target():
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        check_attention("no_such_module:Attention", time_budget=None)
    with pytest.raises(ValueError, match="is not 'package.module:Name'"):
        check_attention("gptmini.attention.MultiHeadAttention", time_budget=None)
    with pytest.raises(ValueError, match="gptmini.attention has no 'Nope'"):
        check_attention("gptmini.attention:Nope", time_budget=None)
    with pytest.raises(ValueError, match=r"cannot build and run .*: ValueError: backend must"):
        check_attention(functools.partial(MultiHeadAttention, backend="fast"), time_budget=None)


def test_a_constructor_of_its_own_is_told_to_pass_a_factory():
    """Before: a bare "mat1 and mat2 shapes cannot be multiplied"."""

    class Mine(nn.Module):
        def __init__(self, hidden: int = 16, heads: int = 2):
            super().__init__()
            self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)

        def forward(self, x):
            n = x.shape[1]
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]

    with pytest.raises(ValueError, match=r"Mine: RuntimeError: .* It was built as Mine\(\) and "
                                         r"given inputs of width d_in=8: .* pass a factory"):
        check_attention(Mine, time_budget=None)
    report = check_attention(lambda: Mine(hidden=8, heads=2), AttentionSpec(d_in=8, num_heads=2),
                             time_budget=None)
    assert report["causality"].status == "passed"


class ReturnsNaN(MultiHeadAttention):
    def forward(self, x):
        return super().forward(x) * float("nan")


class MutatesItsInput(MultiHeadAttention):
    def forward(self, x):
        out = super().forward(x)
        x.mul_(2)  # a reader's in-place shortcut on the input
        return out


class Slow(MultiHeadAttention):
    calls = 0

    def forward(self, x):
        Slow.calls += 1
        import time

        time.sleep(0.02)
        return super().forward(x)


def test_what_was_seen_is_diagnosed_not_guessed():
    """Before: a module returning NaN was told "its own key is masked", and one that
    changed its input in place "a mask not applied"."""
    nan = check_attention(ReturnsNaN, time_budget=None)
    assert "returns non-finite values for finite inputs" in nan["sees_itself"].detail
    assert "masked" not in nan["sees_itself"].detail
    assert "its own key is masked" in check_attention(reader("triu diagonal=0"), time_budget=None)[
        "sees_itself"].detail
    mutated = check_attention(MutatesItsInput, time_budget=None)
    assert mutated["causality"].detail.startswith("InputMutated: it changed its input tensor")
    assert "mask not applied" not in str(mutated)


def test_a_slow_module_is_stopped_by_the_time_budget():
    """Before: no budget (76 s for a module taking 0.5 s per call)."""
    Slow.calls = 0
    report = check_attention(Slow, time_budget=0.5)
    # Every call sleeps 0.02 s and none starts after the budget (plus the trial call before
    # it): a bound that holds on any machine, where a wall-clock limit failed a loaded one.
    assert Slow.calls <= 0.5 / 0.02 + 2
    unfinished = [r for r in report.results if "time budget of 0.5 s ran out" in r.detail]
    assert unfinished and all(r.loud and r.status == "not applicable" for r in unfinished)
    assert "WARNING" in str(report)


def test_large_inputs_stay_in_float16s_range_so_correct_attention_passes():
    """Before: inputs x 1e3 overflowed float16 in the scores themselves (max 65504), so the
    book's attention failed and was told to subtract each row's maximum, which it does."""
    correct = check_attention(reader(), READER_SPEC, dtype=torch.float16, time_budget=None)
    assert correct["large_inputs_finite"].status == "passed", correct
    assert "scaled by 16" in correct["large_inputs_finite"].detail
    naive = check_attention(reader("exp without the max"), READER_SPEC, dtype=torch.float16,
                            time_budget=None)
    assert naive["large_inputs_finite"].status == "failed"  # still caught at the fair scale
    assert "subtract each row's maximum" in naive["large_inputs_finite"].detail


@pytest.mark.parametrize("budget", [-1.0, 0.0, float("nan")])
def test_a_budget_that_would_check_nothing_is_refused(budget):
    with pytest.raises(ValueError, match="time_budget must be a positive number of seconds"):
        check_attention(reader(), time_budget=budget)


def test_checks_the_budget_did_not_reach_leave_the_report_unfinished():
    assert check_attention(reader(), READER_SPEC, time_budget=None).finished
    report = check_attention(Slow, time_budget=0.5)
    assert report.passed and not report.finished  # nothing failed, yet not all checked


# --- the command line and the pytest plugin ----------------------------------------------

MODULES = """
import torch
from gptmini.attention import MultiHeadAttention


class Leaky(MultiHeadAttention):
    def forward(self, x):
        return super().forward(x.flip(1)).flip(1)  # sees everything, backwards
"""


def run(args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=HANG_SECONDS)


@pytest.mark.slow
def test_command_line_prints_the_table_and_exits_non_zero_on_a_failure(tmp_path):
    (tmp_path / "mine.py").write_text(MODULES)
    good = run(["-m", "gptmini.testing", "gptmini.attention:MultiHeadAttention"], tmp_path)
    assert good.returncode == 0, good.stderr
    assert "ok   causality" in good.stdout
    bad = run(["-m", "gptmini.testing", "mine:Leaky"], tmp_path)
    assert bad.returncode == 1
    assert "FAIL causality" in bad.stdout
    missing = run(["-m", "gptmini.testing", "mine:Nope"], tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip() == "gptmini.testing: error: mine has no 'Nope'"


def test_a_gate_that_checked_nothing_does_not_pass(capsys):
    """Before: --time_budget -1 ran almost no check and exited 0."""
    from gptmini.testing.__main__ import main

    target = "gptmini.attention:MultiHeadAttention"
    for budget in ("-1", "nan"):
        assert main([target, "--time_budget", budget]) == 2
        assert f"--time_budget {budget} must be 0 (no limit)" in capsys.readouterr().err
    assert main([target, "--time_budget", "1e-9"]) == 1
    assert "not a pass" in capsys.readouterr().err


@pytest.mark.slow
def test_pytest_plugin_runs_each_check_as_a_named_test(tmp_path):
    (tmp_path / "mine.py").write_text(MODULES)
    result = run(["-m", "pytest", "-p", "gptmini.testing.pytest_plugin", "-p", "no:cacheprovider",
                  "--attention", "mine:Leaky", "-rA", "-q", "-m", "attention"], tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"FAILED .*mine:Leaky::causality", result.stdout), result.stdout
    assert re.search(r"PASSED .*mine:Leaky::output_shape", result.stdout), result.stdout
    assert re.search(r"SKIPPED \[1\] .*: no window declared", result.stdout), result.stdout
    assert "4 failed, 8 passed, 5 skipped" in result.stdout, result.stdout


# --- the README shows a real report ------------------------------------------------------


def readme_section() -> str:
    text = (ROOT / "docs" / "testing.md").read_text()
    start = text.index("## Test your own attention")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_listing_prints_the_report_the_readme_shows():
    blocks = re.findall(r"```(\w*)\n(.*?)```", readme_section(), flags=re.S)
    code = [body for lang, body in blocks if lang == "python"]
    shown = [body for lang, body in blocks if lang == "text"]
    namespace = {"__name__": "readme"}
    exec(compile(code[0], "README.md", "exec"), namespace)  # the listing a reader typed
    printed = []
    namespace["print"] = lambda *args: printed.append(" ".join(map(str, args)))
    exec(compile(code[1], "README.md", "exec"), namespace)  # the one call
    assert printed and printed[0].strip() == shown[0].strip()
    # the typo the README shows next: masked_fill without its underscore
    typo = code[0].replace("attn_scores.masked_fill_(", "attn_scores.masked_fill(")
    assert typo != code[0]
    exec(compile(typo, "README.md", "exec"), namespace)
    printed.clear()
    exec(compile(code[1], "README.md", "exec"), namespace)
    fail_lines = [line for line in printed[0].splitlines() if line.startswith("FAIL")]
    assert "\n".join(fail_lines) == textwrap.dedent(shown[1]).strip()
    exec(compile(code[2], "README.md", "exec"), {})  # the spec for gptmini's module passes


def test_the_kit_and_the_model_import_only_torch():
    """Model, attention, masks, flash and the kit load in any loop: no Lightning, no pytest."""
    code = ("import sys, gptmini.model, gptmini.testing, gptmini.attention.kernels.tiled; "
            "print(sorted({m.split('.')[0] for m in sys.modules}))")
    loaded = run(["-c", code], ROOT).stdout
    for heavy in ("lightning", "pytest", "datasets", "wandb", "jsonargparse", "tiktoken"):
        assert f"'{heavy}'" not in loaded
    assert "'torch'" in loaded


def rotary_readme() -> tuple[str, str]:
    """The README's rotary example (with its bug) and the report line it shows."""
    text = (ROOT / "docs" / "testing.md").read_text()
    start = text.index("Rotary attention depends only on distances")
    code = re.search(r"```python\n(.*?)```", text[start:], flags=re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", text[start:], flags=re.S).group(1)
    return code, shown.strip()


def test_relative_positions_catches_rotated_values_as_the_readme_shows():
    code, shown = rotary_readme()
    printed = []
    namespace = {"__name__": "readme", "print": lambda *a: printed.append(" ".join(map(str, a)))}
    exec(compile(code, "README.md", "exec"), namespace)
    assert printed == [shown]
    assert shown.startswith("failed - length 2: the same tokens at positions 1..2")
    fixed = code.replace("rotate(v, positions)", "v")
    assert fixed != code
    printed.clear()
    exec(compile(fixed, "README.md", "exec"), namespace)
    assert printed[0].startswith("passed")


def test_relative_positions_passes_ours_and_fails_keys_rotated_in_other_pairs():
    spec = AttentionSpec(positions="positions")
    ours = check_attention(functools.partial(MultiHeadAttention, rope_theta=10000.0), spec,
                           time_budget=None)
    assert ours["relative_positions"].status == "passed", ours["relative_positions"].detail
    assert check_attention(MultiHeadAttention,
                           time_budget=None)["relative_positions"].status == "not applicable"
    code, _ = rotary_readme()
    namespace = {"__name__": "readme", "print": lambda *a: None}
    exec(compile(code.replace("rotate(v, positions)", "v"), "README.md", "exec"), namespace)

    def interleaved(x, positions, base=10000.0):  # pairs (2i, 2i + 1), Meta's layout
        half = x.shape[-1] // 2
        freq = base ** (-torch.arange(half, dtype=x.dtype) / half)
        angle = positions[:, None, :, None] * freq
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * angle.cos() - x2 * angle.sin(),
                            x1 * angle.sin() + x2 * angle.cos()], dim=-1).flatten(-2)

    class KeysInOtherPairs(namespace["RotaryAttention"]):
        def forward(self, x, positions=None):
            b, n, _ = x.shape
            if positions is None:
                positions = torch.arange(n).expand(b, n)
            q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(
                2, 0, 3, 1, 4)
            q, k = namespace["rotate"](q, positions), interleaved(k, positions)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))

    broken = check_attention(KeysInOtherPairs, spec, time_budget=None)["relative_positions"]
    assert broken.status == "failed" and "positions enter absolutely" in broken.detail


def test_a_window_cache_that_forgets_a_key_inside_the_window_is_caught():
    """A local layer's cache holds only its window; the kit's kv_cache check runs past the
    window, so one that holds a token too few (window 2 for a module of window 3) fails,
    and the right one passes."""
    def short_cache(module, x, cache):
        cache = cache or WindowKVCache(module.settings.window_size - 1)
        return module(x, kv_cache=cache), cache

    def window_cache(module, x, cache):
        cache = cache or WindowKVCache(module.settings.window_size)
        return module(x, kv_cache=cache), cache

    report = check_attention(MultiHeadAttention, AttentionSpec(window=3, kv_step=short_cache),
                             time_budget=None)
    assert report["kv_cache"].status == "failed"
    assert "differs from the full recompute" in report["kv_cache"].detail
    report = check_attention(MultiHeadAttention, AttentionSpec(window=3, kv_step=window_cache),
                             time_budget=None)
    assert report["kv_cache"].status == "passed"
