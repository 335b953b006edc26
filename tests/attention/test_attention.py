import functools

import oracle
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptmini.attention import AttentionContext, KVCache, MultiHeadAttention, WindowKVCache
from gptmini.attention.book import (
    CausalAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)
from gptmini.testing import AttentionSpec, assert_attention

# "Your journey starts with one step", embedded in 3 dimensions (book section 3.3).
INPUTS = torch.tensor(
    [
        [0.43, 0.15, 0.89],
        [0.55, 0.87, 0.66],
        [0.57, 0.85, 0.64],
        [0.22, 0.58, 0.33],
        [0.77, 0.25, 0.10],
        [0.05, 0.80, 0.55],
    ]
)
BATCH = torch.stack((INPUTS, INPUTS), dim=0)


def make_mha(*args, seed=0, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(seed)
    mha = MultiHeadAttention(*args, **kwargs).eval()
    # FlexAttention runs forward only on CPU: no autograd through it here.
    return mha.requires_grad_(False) if kwargs.get("backend") == "flex" else mha


def both_paths(mha: MultiHeadAttention, x, attention_mask=None):
    mha.backend = "sdpa"
    fast = mha(x, attention_mask)
    mha.backend = "explicit"
    explicit = mha(x, attention_mask)
    mha.backend = "sdpa"
    return fast, explicit


# --- the book's printed numbers ---------------------------------------------------------


def test_parameter_names_and_order_are_the_books():
    mha = MultiHeadAttention(768, 768, 1024, 0.0, num_heads=12)
    names = [name for name, _ in mha.named_parameters()]
    assert names == [
        "W_query.weight",
        "W_key.weight",
        "W_value.weight",
        "out_proj.weight",
        "out_proj.bias",
    ]
    # Exercise 3.3: a GPT-2 sized module has 2,360,064 parameters.
    assert sum(p.numel() for p in mha.parameters()) == 2_360_064


def test_reference_variants_print_the_books_numbers():
    torch.manual_seed(789)
    sa_v2 = SelfAttention_v2(3, 2)
    expected_v2 = torch.tensor(
        [[-0.0739, 0.0713], [-0.0748, 0.0703], [-0.0749, 0.0702],
         [-0.0760, 0.0685], [-0.0763, 0.0679], [-0.0754, 0.0693]]
    )
    torch.testing.assert_close(sa_v2(INPUTS), expected_v2, atol=1e-4, rtol=0)

    torch.manual_seed(123)
    wrapper = MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    expected_wrapper = torch.tensor(
        [[-0.4519, 0.2216, 0.4772, 0.1063], [-0.5874, 0.0058, 0.5891, 0.3257],
         [-0.6300, -0.0632, 0.6202, 0.3860], [-0.5675, -0.0843, 0.5478, 0.3589],
         [-0.5526, -0.0981, 0.5321, 0.3428], [-0.5299, -0.1081, 0.5077, 0.3493]]
    )
    torch.testing.assert_close(wrapper(BATCH)[1], expected_wrapper, atol=1e-4, rtol=0)


def test_self_attention_v1_equals_v2_with_transposed_weights():
    """Exercise 3.1: nn.Linear stores its weight transposed."""
    torch.manual_seed(123)
    sa_v2 = SelfAttention_v2(3, 2)
    sa_v1 = SelfAttention_v1(3, 2)
    with torch.no_grad():
        sa_v1.W_query.copy_(sa_v2.W_query.weight.T)
        sa_v1.W_key.copy_(sa_v2.W_key.weight.T)
        sa_v1.W_value.copy_(sa_v2.W_value.weight.T)
    torch.testing.assert_close(sa_v1(INPUTS), sa_v2(INPUTS))


# --- the two paths and the seed's variants agree ----------------------------------------


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize(("b", "num_tokens", "d_in", "d_out", "heads"),
                         [(1, 1, 4, 4, 1), (2, 7, 8, 8, 2), (3, 16, 12, 24, 4), (2, 33, 32, 32, 8)])


def test_fast_path_equals_explicit_path(qkv_bias, b, num_tokens, d_in, d_out, heads):
    mha = make_mha(d_in, d_out, 64, 0.0, heads, qkv_bias)
    fast, explicit = both_paths(mha, torch.randn(b, num_tokens, d_in))
    torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize(("num_tokens", "heads", "head_dim"), [(5, 1, 3), (6, 2, 2), (9, 4, 3)])
def test_multihead_equals_wrapper_of_causal_heads(qkv_bias, num_tokens, heads, head_dim):
    """Weight splitting (3.6.2) computes what stacking CausalAttention heads (3.6.1) does."""
    d_in = 5
    wrapper = MultiHeadAttentionWrapper(d_in, head_dim, 16, 0.0, heads, qkv_bias).eval()
    mha = make_mha(d_in, heads * head_dim, 16, 0.0, heads, qkv_bias)
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            getattr(mha, name).weight.copy_(
                torch.cat([getattr(h, name).weight for h in wrapper.heads], dim=0)
            )
            if qkv_bias:
                getattr(mha, name).bias.copy_(
                    torch.cat([getattr(h, name).bias for h in wrapper.heads], dim=0)
                )
        mha.out_proj.weight.copy_(torch.eye(heads * head_dim))  # the wrapper has no out_proj
        mha.out_proj.bias.zero_()
    x = torch.randn(2, num_tokens, d_in)
    for out in both_paths(mha, x):
        torch.testing.assert_close(out, wrapper(x), atol=1e-5, rtol=1e-5)


def test_single_head_equals_causal_attention():
    ca = CausalAttention(3, 2, 6, 0.0).eval()
    mha = make_mha(3, 2, 6, 0.0, 1)
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            getattr(mha, name).weight.copy_(getattr(ca, name).weight)
        mha.out_proj.weight.copy_(torch.eye(2))
        mha.out_proj.bias.zero_()
    torch.testing.assert_close(mha(BATCH), ca(BATCH), atol=1e-6, rtol=1e-6)


# --- the conformance kit: causality, dropout, padding, windows, cache, the book's numbers --


def gptmini_kv_step(module, x, cache):
    cache = cache or KVCache()
    return module(x, kv_cache=cache), cache


def window_kv_step(module, x, cache):
    """A cache holding only the window (WindowKVCache), as a local layer's does."""
    cache = cache or WindowKVCache(module.settings.window_size)
    return module(x, kv_cache=cache), cache


KIT_VARIANTS = {
    "plain": ({}, AttentionSpec(padding="attention_mask", kv_step=gptmini_kv_step)),
    "gqa": ({"num_kv_heads": 2},
            AttentionSpec(padding="attention_mask", kv_step=gptmini_kv_step, num_heads=4)),
    "mqa": ({"num_kv_heads": 1},
            AttentionSpec(padding="attention_mask", kv_step=gptmini_kv_step, num_heads=4)),
    "window": ({}, AttentionSpec(padding="attention_mask", kv_step=window_kv_step, window=3)),
    "bidirectional": ({"causal": False}, AttentionSpec(causal=False, padding="attention_mask")),
    "bidirectional window": ({"causal": False},
                             AttentionSpec(causal=False, padding="attention_mask", window=2)),
    "rotary": ({"rope_theta": 10000.0},
               AttentionSpec(padding="attention_mask", kv_step=gptmini_kv_step,
                             positions="positions")),
}


@pytest.mark.parametrize("variant", KIT_VARIANTS)
@pytest.mark.parametrize("backend", ["sdpa", "explicit", "flex", "tiled"])
def test_every_backend_passes_every_applicable_check_of_the_kit(backend, variant):
    """The properties gptmini promises, proved by gptmini.testing (float64): outputs never
    depend on later tokens, dropout off in eval and on in training, padded batches equal each
    sequence alone, windows exact, cached decoding equal to recompute, the book's numbers."""
    options, spec = KIT_VARIANTS[variant]
    report = assert_attention(functools.partial(MultiHeadAttention, backend=backend, **options),
                              spec)
    expected = set()
    if spec.window is None:
        expected.add("window")
    if spec.kv_step is None:
        expected.add("kv_cache")
    if spec.positions is None:
        expected.add("relative_positions")
    if backend in ("flex", "tiled"):  # no attention dropout: they refuse it, with a ValueError
        expected.add("dropout_in_training")
    if backend == "flex":  # no backward on CPU: refused
        expected.add("gradients_reach_all_parameters")
    if variant == "rotary":  # positions move queries and keys: not the book's attention
        expected.update({"equals_gptmini", "book_numbers"})
    if variant.startswith("bidirectional") or variant == "mqa":  # not the book's example
        expected.add("book_numbers")  # (with the book's 2 heads, 2 kv heads is plain)
    if variant in ("gqa", "mqa", "rotary"):  # grouped keys or rotated ones: identity
        expected.add("scale")  # projections no longer give a known output
    assert {r.name for r in report.results if r.status == "not applicable"} == expected, report
    if backend in ("flex", "tiled"):
        assert "it refuses: ValueError" in report["dropout_in_training"].detail


@pytest.mark.parametrize("backend", ["sdpa", "explicit", "flex", "tiled"])
def test_left_padding_queries_give_exactly_zero(backend):
    mha = make_mha(8, 8, 16, 0.0, 2, backend=backend)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = mha(torch.randn(2, 5, 8), mask)
    assert (out[0, :2] == 0).all() and (out[0, 2:] != 0).any()


# --- padding -----------------------------------------------------------------------------


def test_fully_masked_rows_are_zero_weights_and_finite_gradients():
    mha = make_mha(8, 8, 16, 0.0, 2, backend="explicit")
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    x = torch.randn(2, 4, 8, requires_grad=True)
    out, weights = mha(x, mask, return_weights=True)
    assert (weights[0, :, :2] == 0).all()
    assert (out[0, :2] == 0).all()
    for backend in ("sdpa", "explicit", "tiled"):  # flex: no backward on CPU
        mha.backend = backend
        mha.train()
        x.grad = None
        mha(x, mask).sum().backward()
        assert torch.isfinite(x.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in mha.parameters())


# --- sliding window ----------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 5])
def test_sliding_window_weights_outside_window_are_exactly_zero(window):
    mha = make_mha(8, 8, 16, 0.0, 2, window_size=window)
    _, weights = mha(torch.randn(2, 9, 8), return_weights=True)
    q = torch.arange(9)[:, None]
    k = torch.arange(9)[None, :]
    inside = (k <= q) & (k > q - window)
    assert (weights[..., ~inside] == 0).all()
    assert (weights[..., inside] > 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 9))
    fast, explicit = both_paths(mha, torch.randn(2, 9, 8))
    torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=1e-5)


def test_window_at_least_the_length_equals_full_causal_attention():
    x = torch.randn(2, 9, 8)
    full = make_mha(8, 8, 16, 0.0, 2, seed=3)
    for window in (9, 16):
        windowed = make_mha(8, 8, 16, 0.0, 2, seed=3, window_size=window)
        torch.testing.assert_close(windowed(x), full(x))


# --- grouped-query attention -------------------------------------------------------------


def test_gqa_with_as_many_kv_heads_as_heads_is_plain_mha():
    x = torch.randn(2, 6, 8)
    plain = make_mha(8, 8, 16, 0.0, 4, seed=5)
    gqa = make_mha(8, 8, 16, 0.0, 4, seed=5, num_kv_heads=4)
    torch.testing.assert_close(gqa(x), plain(x))


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa_equals_mha_with_each_kv_head_repeated_for_its_group(kv_heads):
    heads, head_dim, d_in = 4, 3, 6
    gqa = make_mha(d_in, heads * head_dim, 16, 0.0, heads, True, num_kv_heads=kv_heads)
    mha = make_mha(d_in, heads * head_dim, 16, 0.0, heads, True)
    group = heads // kv_heads
    with torch.no_grad():
        mha.load_state_dict(
            {
                **gqa.state_dict(),
                **{
                    f"{name}.{p}": getattr(getattr(gqa, name), p)
                    .view(kv_heads, head_dim, -1)
                    .repeat_interleave(group, dim=0)
                    .reshape(heads * head_dim, -1)
                    .squeeze(-1)
                    for name in ("W_key", "W_value")
                    for p in ("weight", "bias")
                },
            }
        )
    x = torch.randn(2, 7, d_in)
    for out in both_paths(gqa, x):
        torch.testing.assert_close(out, mha(x), atol=1e-5, rtol=1e-5)


def test_multi_query_attention_runs_and_is_causal():
    mqa = make_mha(8, 8, 16, 0.0, 4, num_kv_heads=1)
    assert mqa.W_key.weight.shape == (2, 8)  # one head of head_dim 2
    fast, explicit = both_paths(mqa, torch.randn(2, 9, 8))
    torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=1e-5)  # and the kit, below


# --- KV cache ----------------------------------------------------------------------------


def test_kv_cache_appends_into_buffers_that_grow_by_doubling():
    cache = KVCache()
    steps = [torch.randn(2, 1, 1, 4) for _ in range(300)]
    reallocations, pointer = 0, None
    with torch.no_grad():
        for step in steps:
            keys, values = cache.update(step, -step)
            # the keys are a view of the cache's buffer: its storage moves when it grows
            storage = cache.keys.untyped_storage().data_ptr()
            if storage != pointer:
                reallocations, pointer = reallocations + 1, storage
    expected = torch.cat(steps, dim=2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    assert len(cache) == 300 and cache.keys.shape == (2, 1, 300, 4)
    # first token, then capacities 64, 128, 256, 512: not one copy per token
    assert reallocations <= 5


def test_kv_cache_with_autograd_concatenates_so_gradients_reach_earlier_keys():
    first = torch.randn(1, 1, 3, 4, requires_grad=True)
    second = torch.randn(1, 1, 1, 4, requires_grad=True)
    cache = KVCache()
    cache.update(first, first)
    keys, values = cache.update(second, second)
    (keys.sum() + 2 * values.sum()).backward()
    assert torch.equal(first.grad, torch.full_like(first, 3.0))
    assert torch.equal(second.grad, torch.full_like(second, 3.0))


# --- bad input ---------------------------------------------------------------------------


def test_a_window_cache_holds_window_minus_one_keys_where_the_books_holds_the_window():
    """The book's sliding-window KV cache keeps `window_size` keys after a prefill; ours keeps
    the window - 1 a next query can see beside its own key (docs/attention.md says so
    beside the book's): 3 for a window of 4, and the same outputs as no cache at all."""
    torch.manual_seed(0)
    mha = make_mha(3, 4, 16, 0.0, 2, window_size=4).double()
    x = torch.cat([BATCH, torch.rand(2, 1, 3)], dim=1).double()  # the book's 6 words, 1 more
    cache = WindowKVCache(4)
    with torch.no_grad():
        prefill = mha(x[:, :6], kv_cache=cache)
        assert (cache.num_held, len(cache)) == (3, 6)
        step = mha(x[:, 6:], kv_cache=cache)
        whole = mha(x)
    torch.testing.assert_close(torch.cat([prefill, step], dim=1), whole, atol=1e-12, rtol=0)


def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="num_heads=.* is invalid: it must divide the width"):
        MultiHeadAttention(8, 10, 16, 0.0, num_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads=.* is invalid: use a divisor of the"):
        MultiHeadAttention(8, 8, 16, 0.0, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="window_size"):
        MultiHeadAttention(8, 8, 16, 0.0, num_heads=4, window_size=0)
    mha = MultiHeadAttention(8, 8, 16, 0.0, num_heads=2)
    with pytest.raises(ValueError, match="context_length is 16; crop"):
        mha(torch.randn(1, 17, 8))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        mha(torch.randn(2, 5, 8), torch.ones(2, 4))


# --- mask invariants, over random shapes ---------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_tokens=st.integers(1, 12),
    window=st.one_of(st.none(), st.integers(1, 14)),
    heads=st.sampled_from([1, 2, 4]),
    kv_heads_div=st.sampled_from([1, 2, 4]),
)


def test_both_paths_equal_the_loop_oracle_for_random_lengths_paddings_windows(
    data, num_tokens, window, heads, kv_heads_div
):
    """Against tests/oracle.py: masks written from their definitions, a loop per position."""
    kv_heads = max(1, heads // kv_heads_div)
    b = 3
    lefts = data.draw(st.lists(st.integers(0, num_tokens), min_size=b, max_size=b))
    rights = [data.draw(st.integers(0, num_tokens - left)) for left in lefts]
    mask = torch.ones(b, num_tokens, dtype=torch.bool)
    for row, (left, right) in enumerate(zip(lefts, rights, strict=True)):
        mask[row, :left] = False
        mask[row, num_tokens - right :] = False

    mha = make_mha(8, 8, 16, 0.0, heads, num_kv_heads=kv_heads, window_size=window)
    x = torch.randn(b, num_tokens, 8)
    expected_mask = oracle.allowed(b, num_tokens, num_tokens, window=window, real=mask.tolist())
    expected, expected_weights = oracle.multi_head_attention(mha, x, expected_mask)

    out, weights = mha(x, mask, return_weights=True)  # the explicit path
    fast = mha(x, mask)  # scaled_dot_product_attention
    torch.testing.assert_close(weights.double(), expected_weights, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.double(), expected, atol=1e-5, rtol=1e-5)


# --- each value checked once -------------------------------------------------------------


def test_a_module_with_sinks_builds_its_kernel_once(monkeypatch):
    import gptmini.attention.multihead as multihead

    built = []
    original = multihead.make_kernel
    monkeypatch.setattr(multihead, "make_kernel", lambda b: built.append(b) or original(b))
    MultiHeadAttention(8, 8, 16, 0.0, 2, sinks=True, gate="headwise")
    assert built == ["sdpa"]


def test_context_length_is_checked_where_the_pass_is_built_not_again_per_layer():
    module = MultiHeadAttention(8, 8, 4, 0.0, 2)  # context_length 4
    x = torch.randn(1, 6, 8)
    with pytest.raises(ValueError, match="got 6 positions but context_length is 4"):
        module(x)  # called alone, it builds (and checks) its own context
    context = AttentionContext.build(1, 6)  # a pass's, checked by whoever built it
    assert module(x, context=context).shape == (1, 6, 8)
