"""Test your own attention: the properties gptmini proves for its attention, for yours.

    from gptmini.testing import check_attention
    print(check_attention(MyMultiHeadAttention))

`check_attention` takes a class with the book's constructor `(d_in, d_out, context_length,
dropout, num_heads, qkv_bias=False)`, or any factory returning an `nn.Module` that maps
(b, num_tokens, d_in) to (b, num_tokens, d_out), and runs every check that applies: output
shapes, causality, independent batch rows, dropout off in eval and on in training, equality
with gptmini's MultiHeadAttention and the book's printed numbers, padding, sliding windows,
KV caching, large inputs and gradients. Each row of the report says passed, failed (with the
smallest input that shows it) or not applicable (and why). What a signature cannot reveal
is declared in an `AttentionSpec`; what is neither detectable nor declared is not guessed.

Also `assert_attention` (raises AssertionError with the report), `python -m gptmini.testing
mypkg.mod:MyAttention`, and `pytest -p gptmini.testing.pytest_plugin --attention
mypkg.mod:MyAttention`. Imports only torch.
"""

from gptmini.testing.kit import CheckResult, Report, assert_attention, check_attention, load_target
from gptmini.testing.subject import AttentionSpec

__all__ = [
    "AttentionSpec",
    "CheckResult",
    "Report",
    "assert_attention",
    "check_attention",
    "load_target",
]
