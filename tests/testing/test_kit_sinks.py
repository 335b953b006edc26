"""The kit learns sinks and gates: gptmini's pass it declared, and a reader's sink or gate
with one mistake fails the check that names it."""

import functools

import pytest
import torch
from torch import nn

from gptmini.attention import MultiHeadAttention
from gptmini.testing import AttentionSpec, check_attention


class ReaderSinkMHA(nn.Module):
    """Listing 3.5 with gpt-oss's sink column and Qwen3-Next's elementwise gate, as a reader
    types them from transformers' eager code; `bug` picks one mistake (None: none)."""

    bug = None

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.sinks = nn.Parameter(torch.zeros(num_heads))
        self.W_gate = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        b, n, _ = x.shape
        split = (b, n, self.num_heads, self.head_dim)
        q, k, v = (w(x).view(split).transpose(1, 2)
                   for w in (self.W_query, self.W_key, self.W_value))
        scores = q @ k.transpose(2, 3) / self.head_dim ** 0.5  # (b, heads, n, n)
        sink = self.sinks.view(1, -1, 1, 1).expand(b, -1, n, 1)
        if self.bug == "sink from the row's scores":  # a sink that reads every key
            sink = sink + scores.amax(dim=-1, keepdim=True)
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, -torch.inf)
        if self.bug == "sinks ignored":
            weights = torch.softmax(scores, dim=-1)
        else:
            weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        weights = self.dropout(weights)
        heads = (weights @ v).transpose(1, 2).reshape(b, n, self.d_out)
        gate_from = heads if self.bug == "gate from the heads' output" else x
        return self.out_proj(heads * torch.sigmoid(self.W_gate(gate_from)))


def reader(bug=None):
    return type(f"ReaderSinkMHA[{bug}]", (ReaderSinkMHA,), {"bug": bug})


SPEC = AttentionSpec(sinks="sinks", gate="W_gate")


def test_gptmini_with_sinks_and_a_gate_passes_every_check_it_declares():
    for options, gate in (({"sinks": True}, None), ({"gate": "elementwise"}, "gate.W_gate"),
                          ({"sinks": True, "gate": "headwise"}, "gate.W_gate")):
        spec = AttentionSpec(padding="attention_mask", window=3, sinks=(
            "sinks" if options.get("sinks") else None), gate=gate)
        report = check_attention(functools.partial(MultiHeadAttention, **options), spec,
                                 time_budget=None)
        assert report.passed, str(report)
        assert report["equals_gptmini"].status == "passed"  # compared with its sinks and its gate


def test_a_readers_correct_sinks_and_gate_pass():
    report = check_attention(reader(), SPEC, time_budget=None)
    assert report.passed, str(report)
    assert report["identical_tokens"].status == report["equals_gptmini"].status == "passed"


@pytest.mark.parametrize(("bug", "check"), [
    ("sinks ignored", "equals_gptmini"),
    ("sink from the row's scores", "causality"),
    ("gate from the heads' output", "equals_gptmini"),
])
def test_each_mistake_fails_the_check_that_names_it(bug, check):
    report = check_attention(reader(bug), SPEC, time_budget=None)
    assert report[check].status == "failed", str(report)


def test_undeclared_sinks_fail_identical_tokens_as_weights_not_summing_to_one():
    """Without AttentionSpec(sinks=...) the kit cannot know that the weights sum below 1 by
    design: it says so, and the report points at the softmax."""
    module = functools.partial(MultiHeadAttention, sinks=True)

    def with_sinks(*args, **kwargs):
        built = module(*args, **kwargs)
        with torch.no_grad():
            built.sinks.fill_(1.0)
        return built

    report = check_attention(with_sinks, AttentionSpec(num_heads=2), time_budget=None)
    assert report["identical_tokens"].status == "failed"
    assert "do not sum to 1" in report["identical_tokens"].detail
