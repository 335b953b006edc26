"""The attention context: built once per forward pass, its positions, its forms, and the
KV-cache interface both caches implement."""

import importlib
from dataclasses import replace

import pytest
import torch

from gptmini.attention import BaseKVCache, KVCache, MultiHeadAttention, masks
from gptmini.attention.context import (
    AttentionContext,
    AttentionSettings,
    positions_in_documents,
)
from gptmini.attention.positions import AlibiPositions
from gptmini.core import masks as core_masks
from gptmini.generate.engine.paged import KVPool, PagedView
from gptmini.model import GPTModel


def counting(monkeypatch, name, module=core_masks):
    """Count the calls of module.<name> (the core's masks: made through the context)."""
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


FORMS = {  # backend: the form of the mask its kernel reads, and the module that makes it
    "sdpa": ("dense", "gptmini.core.masks"),
    "explicit": ("dense", "gptmini.core.masks"),
    "tiled": ("tile_plan", "gptmini.attention.kernels.tiled"),
    "flex": ("block_mask", "gptmini.attention.kernels.flex"),
}


@pytest.mark.parametrize("backend", FORMS)
def test_a_forward_pass_builds_its_mask_once_not_once_per_layer(backend, tiny_config,
                                                                  monkeypatch):
    model = GPTModel(replace(tiny_config, n_layers=4, attention_backend=backend)).eval()
    name, module = FORMS[backend]
    calls = counting(monkeypatch, name, importlib.import_module(module))
    idx = torch.randint(0, 64, (2, 10))
    documents = torch.tensor([[0] * 4 + [1] * 6, [0] * 10])
    with torch.no_grad():
        model(idx, document_ids=documents)
    assert len(calls) == 1, f"{backend}: the mask was built {len(calls)} times for 4 layers"
    with torch.no_grad():
        model(idx, document_ids=documents)  # the next pass builds its own: no state kept
    assert len(calls) == 2


def test_padding_builds_its_dense_mask_once_and_finds_empty_rows_from_it(tiny_config,
                                                                          monkeypatch):
    model = GPTModel(replace(tiny_config, n_layers=3)).eval()
    dense = counting(monkeypatch, "dense")
    rows = counting(monkeypatch, "rows_with_keys", masks)  # (gptmini.attention's)
    real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        out = model(torch.randint(0, 64, (2, 5)), real)
    assert len(dense) == 1 and len(rows) == 0
    assert not out.isnan().any()


def test_positions_count_from_each_rows_first_real_token_and_each_documents_start():
    real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    context = AttentionContext.build(2, 5, attention_mask=real)
    assert context.positions.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    documents = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    context = AttentionContext.build(2, 2, 4, document_ids=documents)  # 4 cached, 2 new
    assert context.positions.tolist() == [[2, 0], [4, 5]]
    assert positions_in_documents(documents).tolist() == [[0, 1, 0, 1, 2, 0],
                                                           [0, 1, 2, 3, 4, 5]]
    plain = AttentionContext.build(3, 2, 7)
    assert plain.positions.tolist() == [[7, 8]] * 3 and plain.rows_alike


def test_the_contexts_mask_is_the_loop_definition():
    """Causal, window and padding, evaluated densely, against a loop over positions."""
    real = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1] * 7])
    context = AttentionContext.build(2, 3, 4, settings=AttentionSettings(window_size=3),
                                     attention_mask=real)
    allowed = context.dense()[:, 0]  # (b, num_tokens, num_keys)
    for b in range(2):
        for i in range(3):
            q = 4 + i
            want = [q >= k and q - k < 3 and bool(real[b, k]) for k in range(7)]
            assert allowed[b, i].tolist() == want


def test_a_context_built_for_another_layer_or_shape_is_refused():
    mha = MultiHeadAttention(8, 8, 16, 0.0, 2, window_size=4)
    x = torch.randn(1, 5, 8)
    # a context of other layers' window is seen through this layer's own (local/global
    # models: GPTConfig.layer_windows)
    torch.testing.assert_close(mha(x, context=AttentionContext.build(1, 5)), mha(x))
    windowed = AttentionSettings(window_size=4)
    with pytest.raises(ValueError, match=r"built for \(batch, num_tokens, num_keys\) = "
                                         r"\(1, 6, 6\)"):
        mha(x, context=AttentionContext.build(1, 6, settings=windowed))
    with pytest.raises(ValueError, match="not beside a context that holds them"):
        mha(x, torch.ones(1, 5), context=AttentionContext.build(1, 5, settings=windowed))
    context = AttentionContext.build(1, 5, settings=windowed)
    torch.testing.assert_close(mha(x, context=context), mha(x))
    alibi = MultiHeadAttention(8, 8, 16, 0.0, 2, window_size=4, alibi=True)
    with pytest.raises(ValueError, match="position_scheme=NoPositions.*"
                                         r"position_scheme=AlibiPositions\(num_heads=2\)"):
        alibi(x, context=context)  # its scores would miss ALiBi's penalties
    same = AttentionSettings(window_size=4, position_scheme=AlibiPositions(num_heads=2))
    torch.testing.assert_close(alibi(x, context=AttentionContext.build(1, 5, settings=same)),
                               alibi(x))


def test_both_caches_are_one_interface_and_hold_their_tokens_positions(tiny_config):
    """KVCache and the engine's paged view: same keys, values and positions for the same
    left-padded decode."""
    model = GPTModel(tiny_config).eval()
    prompts = torch.randint(0, 64, (2, 6))
    real = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    caches = model.new_kv_caches()
    assert all(isinstance(c, BaseKVCache) for c in caches)
    with torch.no_grad():
        model(prompts, real, kv_caches=caches)
        model(prompts[:, -1:], torch.cat([real, torch.ones(2, 1)], 1).long(), kv_caches=caches)
    assert caches[0].positions.tolist() == [[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6]]

    pool = KVPool(tiny_config, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu")
    read = torch.tensor([[0, 1, 2, 3, 4], [8, 9, 10, 11, 12]])
    views = pool.views(read, read, 0)
    assert all(isinstance(v, PagedView) and isinstance(v, BaseKVCache) for v in views)
    keys = torch.randn(2, 2, 5, 8)
    positions = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])
    got_keys, _ = views[0].update(keys, keys + 1, positions)
    torch.testing.assert_close(got_keys, keys)
    assert torch.equal(views[0].positions, positions)
    later = pool.views(torch.tensor([[2, 3, 4]]), torch.tensor([[4]]), 2)
    assert later[1].positions.tolist() == [[2, 3, 4]] and len(later[1]) == 2


def test_a_contiguous_cache_forgets_positions_it_was_not_given():
    cache = KVCache()
    keys = torch.randn(1, 2, 3, 4)
    cache.update(keys, keys, torch.tensor([[5, 6, 7]]))
    cache.update(keys[:, :, :1], keys[:, :, :1], torch.tensor([[8]]))
    assert cache.positions.tolist() == [[5, 6, 7, 8]]
    cache.update(keys[:, :, :1], keys[:, :, :1])  # no positions: none are known any more
    assert cache.positions is None and len(cache) == 5
