"""Every attention backend computes what the explicit path computes, for every mask.

sdpa, flex and tiled against the book's explicit path (and all of them against the loop
oracle of tests/oracle.py), over causal, full, window, padding and document masks and
their combinations, with and without grouped-query attention: outputs and gradients within
1e-5 in float32. FlexAttention has no backward on CPU, so its gradients are left to
`pytest -m gpu`.
"""

import oracle
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gptmini.attention.multihead as attention
from gptmini.attention import KVCache, MultiHeadAttention
from gptmini.attention.context import AttentionContext, AttentionSettings
from gptmini.attention.kernels.tiled import tiled_attention
from gptmini.model import GPTConfig, GPTModel

B, N, D_IN = 3, 21, 16


def make(backend, *, causal=True, window=None, kv_heads=None, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    mha = MultiHeadAttention(D_IN, 16, 64, dropout, num_heads=4, num_kv_heads=kv_heads,
                             window_size=window, causal=causal, backend=backend)
    if backend == "tiled":
        mha.kernel.tile = 4  # many tiles, some partial, on these short inputs
    return mha


def left_right_padding() -> torch.Tensor:
    real = torch.ones(B, N, dtype=torch.bool)
    real[0, :6] = False  # left padding: the first queries see nothing at all
    real[1, N - 5:] = False  # right padding
    return real


def three_documents() -> torch.Tensor:
    doc = torch.zeros(B, N, dtype=torch.long)
    doc[:, 7:] = 1
    doc[:, 15:] = 2
    doc[2, 3:] += 5  # another split in the last row
    return doc


MASKS = {  # name: (module options, attention_mask, document_ids)
    "causal": ({}, None, None),
    "full": ({"causal": False}, None, None),
    "window": ({"window": 5}, None, None),
    "full+window": ({"causal": False, "window": 4}, None, None),
    "padding": ({}, left_right_padding, None),
    "document": ({}, None, three_documents),
    "document+window": ({"window": 4}, None, three_documents),
    "padding+document+window": ({"window": 6}, left_right_padding, three_documents),
}


def run(mha, x, pad, doc):
    return mha(x, None if pad is None else pad(), document_ids=None if doc is None else doc())


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("backend", ["sdpa", "flex", "tiled"])
def test_each_backend_equals_the_explicit_path(backend, mask, kv_heads):
    options, pad, doc = MASKS[mask]
    reference, other = make("explicit", kv_heads=kv_heads, **options), make(
        backend, kv_heads=kv_heads, **options)
    x = torch.randn(B, N, D_IN, requires_grad=backend != "flex")
    want = run(reference, x, pad, doc)
    with torch.set_grad_enabled(backend != "flex"):  # forward only on CPU
        got = run(other, x, pad, doc)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if pad is not None:  # left padding: queries with nothing to attend are zero
        assert (got[0, :6] == 0).all() and not got.isnan().any()
    if backend == "flex":
        return
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x, *reference.parameters()], grad)
    got_grads = torch.autograd.grad(got, [x, *other.parameters()], grad)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), n=st.integers(1, 24), window=st.one_of(st.none(), st.integers(1, 10)),
       causal=st.booleans(), tile=st.sampled_from([1, 3, 8, 32]))
def test_every_backend_equals_the_loop_oracle(data, n, window, causal, tile):
    """Random lengths, windows, document splits and paddings, against oracle.py."""
    b = 2
    cuts = [sorted(data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3)))
            for _ in range(b)]
    doc = torch.tensor([[sum(i >= c for c in row) for i in range(n)] for row in cuts])
    lefts = data.draw(st.lists(st.integers(0, n), min_size=b, max_size=b))
    real = torch.tensor([[i >= left for i in range(n)] for left in lefts])
    x = torch.randn(b, n, D_IN)
    torch.manual_seed(1)
    modules = [MultiHeadAttention(D_IN, 16, 64, 0.0, num_heads=4, num_kv_heads=2,
                                  window_size=window, causal=causal, backend=backend)
               for backend in attention.BACKENDS]
    for mha in modules[1:]:
        mha.load_state_dict(modules[0].state_dict())
        if mha.backend == "tiled":
            mha.kernel.tile = tile
    mask = oracle.allowed(b, n, n, causal=causal, window=window, real=real.tolist(),
                          documents=doc.tolist())
    expected, _ = oracle.multi_head_attention(modules[0], x, mask)
    for mha in modules:
        with torch.no_grad():
            got = mha(x, real, document_ids=doc)
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5,
                                   msg=mha.backend)


@pytest.mark.parametrize("mask", ["causal", "document+window", "padding"])
def test_skipping_tiles_changes_nothing_but_the_time(mask):
    options, pad, doc = MASKS[mask]
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, 4, N, 8, requires_grad=True) for _ in range(3))
    settings = AttentionSettings(window_size=options.get("window"))
    allowed = AttentionContext.build(B, N, settings=settings,
                                     attention_mask=None if pad is None else pad(),
                                     document_ids=None if doc is None else doc()).mask
    outs = [tiled_attention(q, k, v, allowed, tile=4, skip_tiles=skip) for skip in (True, False)]
    assert torch.equal(outs[0], outs[1])
    grads = [torch.autograd.grad(out.sum(), (q, k, v)) for out in outs]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("backend", ["flex", "tiled"])
def test_decoding_with_a_kv_cache_equals_full_attention(backend):
    """tiled decodes with its own kernel; flex hands a cached decode to sdpa."""
    mha = make(backend, window=5).eval().requires_grad_(False)
    x = torch.randn(2, 12, D_IN)
    cache = KVCache()
    pieces = [mha(x[:, :5], kv_cache=cache)] + [mha(x[:, t:t + 1], kv_cache=cache)
                                                for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(pieces, 1), make("explicit", window=5)(x),
                               atol=1e-5, rtol=1e-5)


def test_flex_training_on_cpu_and_dropout_in_flex_or_tiled_are_refused_clearly():
    with pytest.raises(ValueError, match="no backward pass on CPU.*train with the sdpa"):
        make("flex")(torch.randn(1, 4, D_IN, requires_grad=True))
    for backend in ("flex", "tiled"):
        with pytest.raises(ValueError, match=f"the {backend} attention backend has no "
                                             "attention dropout.*attn_drop_rate 0"):
            make(backend, dropout=0.1).train()(torch.randn(1, 4, D_IN))
        with torch.no_grad():
            make(backend, dropout=0.1).eval()(torch.randn(1, 4, D_IN))  # none in eval


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="backend must be one of sdpa, explicit, flex, tiled"):
        MultiHeadAttention(4, 4, 8, 0.0, 2, backend="fast")
    with pytest.raises(ValueError, match="attention_backend='fast' is invalid: use one of"):
        GPTConfig(attention_backend="fast")


def test_a_document_never_sees_its_neighbours_and_starts_at_position_zero(tiny_config):
    model = GPTModel(GPTConfig(**{**tiny_config.to_dict(), "attention_backend": "tiled"}))
    model.eval()
    idx = torch.randint(0, 64, (2, 12))
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    out = model(idx, document_ids=doc)
    changed = idx.clone()
    changed[0, :5] = torch.randint(0, 64, (5,))  # the first document of row 0 changes
    changed[0, 5] = idx[0, 5]
    torch.testing.assert_close(model(changed, document_ids=doc)[0, 5:], out[0, 5:])
    alone = model(idx[:1, 5:])  # the second document on its own, from position 0
    torch.testing.assert_close(out[0, 5:], alone[0], atol=1e-5, rtol=1e-5)


COMPILED_SHAPES = ["causal", "document+window", "padding"]


@pytest.mark.slow
def test_compiled_flex_equals_explicit_and_new_documents_do_not_recompile(monkeypatch):
    """FlexAttention compiled, on three fixed shapes; a second batch of other document ids
    and paddings reuses the compiled kernel."""
    torch._dynamo.reset()  # as a fresh process: nothing compiled yet
    monkeypatch.setenv("GPTMINI_COMPILE_FLEX", "1")
    compiles = []
    for mask in COMPILED_SHAPES:
        options, pad, doc = MASKS[mask]
        reference, flex = make("explicit", **options).eval(), make("flex", **options).eval()
        for step in range(2):
            x = torch.randn(B, N, D_IN)
            ids = None if doc is None else (doc() + step) % 4
            real = None if pad is None else pad().roll(step, dims=1)
            with torch.no_grad():
                got = flex(x, real, document_ids=ids)
                want = reference(x, real, document_ids=ids)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            compiles.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # one graph per shape of mask: the second batch of each found the first one's kernel
    assert 0 < compiles[0] < compiles[2] < compiles[4]
    assert compiles[1] == compiles[0] and compiles[3] == compiles[2]
    assert compiles[5] == compiles[4]
    torch._dynamo.reset()
