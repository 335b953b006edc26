"""Local/global layer patterns (GPTConfig.layer_windows): each layer attends through its own
window, a windowed layer's KV cache holds only its window, and cache, engine and generation
equal a full recompute. transformers' Qwen3 is the whole-model oracle in
tests/convert/test_llama.py."""

from dataclasses import replace

import pytest
import torch

from gptmini.attention import AttentionContext, KVCache, MultiHeadAttention, WindowKVCache
from gptmini.generate.engine import Engine
from gptmini.generate.loop import generate, left_pad
from gptmini.generate.sampling import SamplingParams
from gptmini.model import ConfigError, GPTConfig, GPTModel, window_pattern
from tests.oracle import allowed, multi_head_attention

WINDOW = 3


def local_global(**overrides) -> GPTConfig:
    """4 layers alternating a window of 3 and full attention (gpt-oss's pattern), rotary."""
    fields = {"vocab_size": 64, "context_length": 40, "emb_dim": 16, "n_heads": 2,
              "n_layers": 4, "drop_rate": 0.0, "position": "rope",
              "layer_windows": window_pattern("1:1", window=WINDOW, n_layers=4)}
    return GPTConfig(**{**fields, **overrides})


def test_window_pattern_builds_gemma3_and_gpt_oss_patterns():
    gemma = window_pattern("5:1", window=512, n_layers=12)
    assert [i for i, w in enumerate(gemma) if w is None] == [5, 11]  # every sixth global
    assert set(gemma) == {512, None}
    assert window_pattern("1:1", window=128, n_layers=4) == [128, None, 128, None]
    assert window_pattern("0:1", window=8, n_layers=2) == [None, None]
    for spec in ("5", "a:b", "0:0", "-1:2", None):
        with pytest.raises(ValueError, match="window pattern .* use 'local:global'"):
            window_pattern(spec, window=8, n_layers=2)
    with pytest.raises(ValueError, match="window=0 is invalid"):
        window_pattern("1:1", window=0, n_layers=2)


@pytest.mark.parametrize("windows, field", [
    ([3, None, 3], "layer_windows"),  # 3 entries for 4 layers
    ([3, 0, None, None], "layer_windows"),
    ([True, None, 3, None], "layer_windows"),
    ("5:1", "layer_windows"),
])
def test_layer_windows_are_checked_naming_the_field(windows, field):
    with pytest.raises(ConfigError, match=f"GPTConfig.{field}=.*use a list of 4 entries"):
        local_global(layer_windows=windows)


def test_layer_windows_refuse_a_window_size_beside_them():
    with pytest.raises(ConfigError, match="window_size=4 is invalid: use None beside"):
        local_global(window_size=4)
    assert local_global(layer_windows=(3, None, 3, None)).layer_windows == [3, None, 3, None]


def test_each_layer_attends_through_its_own_window_as_the_oracle_does():
    """Layer by layer, the model's attention output equals the loop oracle's with that
    layer's window (a local layer's differs from a global one's on the same input)."""
    torch.manual_seed(0)
    model = GPTModel(local_global(position="learned")).double().eval()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    context = model.new_context(2, 9)
    for block, window in zip(model.trf_blocks, model.cfg.layer_windows, strict=True):
        att = block.att
        with torch.no_grad():
            got = att(x, context=context)
        want, _ = multi_head_attention(att, x, allowed(2, 9, 9, window=window))
        torch.testing.assert_close(got, want)
    with torch.no_grad():  # the pattern matters: all-global gives other logits
        glob = GPTModel(replace(model.cfg, layer_windows=None)).double().eval()
        glob.load_state_dict(model.state_dict())
        ids = torch.randint(0, 64, (1, 12))
        assert not torch.allclose(glob(ids), model(ids))


@pytest.mark.parametrize("prefill", [1, 5, 11])
def test_a_windowed_layers_cache_holds_only_its_window_and_equals_recompute(prefill):
    """Prompt in one call, then token by token (and one chunk of 3) past many windows,
    left-padded: the logits equal one pass over everything, and every windowed layer's
    cache holds window - 1 tokens while its len counts them all."""
    torch.manual_seed(1)
    model = GPTModel(local_global()).double().eval()
    ids = torch.randint(0, 64, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :2] = 0  # the second row is left-padded
    with torch.no_grad():
        want = model(ids, mask)
        caches = model.new_kv_caches()
        assert [type(c) for c in caches] == [WindowKVCache, KVCache] * 2
        got = [model(ids[:, :prefill], mask[:, :prefill], kv_caches=caches)]
        t = prefill
        while t < 30:
            step = 3 if t == 20 else 1
            got.append(model(ids[:, t:t + step], mask[:, :t + step], kv_caches=caches))
            t += step
    torch.testing.assert_close(torch.cat(got, dim=1), want)
    assert [len(c) for c in caches] == [30] * 4
    assert [c.num_held for c in caches[::2]] == [WINDOW - 1] * 2
    assert all(c.positions[:, -1].tolist() == [29, 27] for c in caches)


def test_a_window_cache_stays_window_sized_over_a_long_generation():
    """Its buffers stay within the window and a quarter more (16 tokens at least) whatever
    the length, where a full layer's grow with it."""
    torch.manual_seed(2)
    window = 40
    cfg = local_global(context_length=600, layer_windows=[window, None, window, None])
    model = GPTModel(cfg).eval()
    caches = model.new_kv_caches()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 300)), kv_caches=caches)  # a long prompt
        for _ in range(200):
            model(torch.randint(0, 64, (1, 1)), kv_caches=caches)
    per_token = 2 * 16 * 4  # keys and values, emb_dim float32 values each
    assert caches[0].nbytes <= (window - 1 + max((window - 1) // 4, 16)) * per_token
    assert caches[1].keys.shape[2] == 500


def test_generate_and_the_engine_equal_a_full_recompute():
    """Greedy tokens with the window caches, and from the engine (paged blocks, several
    requests at once), are those of recomputing every step without a cache (float64)."""
    torch.manual_seed(3)
    model = GPTModel(local_global(vocab_size=257, context_length=64)).double().eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [40, 41, 42, 43]]
    want = [generate(model, torch.tensor([p]), 14, use_cache=False)[0, len(p):].tolist()
            for p in prompts]
    cached = [generate(model, torch.tensor([p]), 14, use_cache=True)[0, len(p):].tolist()
              for p in prompts]
    assert cached == want
    engine = Engine(model, block_size=4, max_batch=8)
    requests = [engine.add_request(p, max_new_tokens=14) for p in prompts]
    while engine.has_work:
        engine.step()
    assert [r.tokens for r in requests] == want


def test_rolling_past_the_context_with_window_caches_is_one_pass_with_windows():
    """slide="roll" drops the oldest tokens of every cache (a window cache forgets what it
    no longer holds first): the tokens equal one pass over the whole sequence in a model of
    a longer context whose global layers see a window of the first model's context."""
    torch.manual_seed(4)
    model = GPTModel(local_global(context_length=12)).double().eval()
    with torch.no_grad():  # sharpened, so that a position or window bug flips a draw
        for weight in model.parameters():
            weight.mul_(6)
    oracle = GPTModel(local_global(context_length=64, layer_windows=[WINDOW, 12, WINDOW, 12])
                      ).double().eval()
    oracle.load_state_dict(model.state_dict())
    prompts, mask = left_pad([[5, 9, 2, 7, 1], [3, 8]])
    options = {"attention_mask": mask, "use_cache": True,
               "sampling": SamplingParams(temperature=1.0, seed=0)}
    got = generate(model, prompts, 30, slide="roll", **options)
    assert torch.equal(got, generate(oracle, prompts, 30, **options))


def test_a_layer_sees_a_context_of_other_layers_window_through_its_own():
    """A context built for a global layer, handed to a local one, is masked with the local
    layer's window (as a model hands one context to all its layers)."""
    torch.manual_seed(5)
    local = MultiHeadAttention(8, 8, 16, 0.0, 2, window_size=2).eval()
    x = torch.randn(1, 6, 8)
    glob = AttentionContext.build(1, 6)  # no window
    torch.testing.assert_close(local(x, context=glob), local(x))
    full = MultiHeadAttention(8, 8, 16, 0.0, 2).eval()
    full.load_state_dict(local.state_dict())
    assert not torch.allclose(full(x, context=glob), local(x))


@pytest.mark.parametrize("backend", ["sdpa", "flex", "tiled"])
def test_every_kernel_equals_explicit_with_layer_windows(backend):
    """Logits of a local/global model on each kernel equal the explicit path's, left-padded
    and with a KV cache's second call (each layer's own window in each kernel's form)."""
    torch.manual_seed(7)
    explicit = GPTModel(local_global(attention_backend="explicit")).eval()
    model = GPTModel(local_global(attention_backend=backend)).eval()
    model.load_state_dict(explicit.state_dict())
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask)[0, 3:], explicit(ids, mask)[0, 3:],
                                   atol=1e-5, rtol=1e-5)
        got, want = model.new_kv_caches(), explicit.new_kv_caches()
        model(ids[:, :7], mask[:, :7], kv_caches=got)
        explicit(ids[:, :7], mask[:, :7], kv_caches=want)
        torch.testing.assert_close(model(ids[:, 7:], mask, kv_caches=got),
                                   explicit(ids[:, 7:], mask, kv_caches=want),
                                   atol=1e-5, rtol=1e-5)
