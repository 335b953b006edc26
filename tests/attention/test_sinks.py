"""Attention sinks (gpt-oss) and gated attention (Qwen3-Next): every kernel equal to the
explicit path, and the explicit path equal to transformers' own layers with the same
weights (GptOssAttention, Qwen3NextAttention: layer-level, as both models' blocks hold
mixture-of-experts MLPs gptmini does not have)."""

import pytest
import torch

from gptmini.attention import MultiHeadAttention
from gptmini.attention.positions import RotaryPositions
from gptmini.model import GPTConfig, GPTModel

transformers = pytest.importorskip("transformers")

B, N, D, H = 2, 9, 16, 4

# (options, padded): every mask and modifier a sink meets
CASES = {
    "causal": ({}, False),
    "window": ({"window_size": 3}, False),
    "padding": ({}, True),
    "window+padding": ({"window_size": 4}, True),
    "gqa": ({"num_kv_heads": 2}, True),
    "alibi": ({"alibi": True}, False),
    "softcap": ({"softcap": 3.0}, True),
    "rope": ({"rope_theta": 10000.0}, True),
}


def _module(options: dict, backend: str = "explicit", **kw) -> MultiHeadAttention:
    torch.manual_seed(0)
    module = MultiHeadAttention(D, D, 32, 0.0, H, backend=backend, sinks=True, **options, **kw)
    with torch.no_grad():
        module.sinks.normal_(0.0, 2.0)  # some heads mostly sink, some barely
    return module.double()


def _inputs(padded: bool):
    torch.manual_seed(1)
    x = torch.randn(B, N, D, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(B, N, dtype=torch.long)
    if padded:
        mask[1, :3] = 0  # left padding: three queries with no key at all
    return x, (mask if padded else None)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "tiled"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_kernel_adds_sinks_as_the_explicit_path_does(backend, case):
    options, padded = CASES[case]
    reference = _module(options)
    module = _module(options, backend)
    if backend == "tiled":
        module.kernel.tile = 4  # tiles skipped, whole and masked at these lengths
    x, mask = _inputs(padded)
    expected = reference(x, attention_mask=mask)
    if backend == "flex":  # forward only on CPU
        with torch.no_grad():
            torch.testing.assert_close(module(x, attention_mask=mask), expected)
        return
    out = module(x, attention_mask=mask)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, module.sinks, module.W_query.weight), grad)
    want = torch.autograd.grad(expected, (x, reference.sinks, reference.W_query.weight), grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert want[1].abs().min() > 0  # every head's sink learns


def test_a_sink_takes_weight_and_a_sink_at_minus_infinity_is_none():
    module = _module({})
    x, _ = _inputs(False)
    _, weights = module(x, return_weights=True)
    sums = weights.sum(-1)  # (b, h, n)
    assert (sums < 1).all() and (sums > 0).all()
    # a sink is one more term exp(sink) in each row's denominator: with s the allowed scores,
    # sum(weights) = Z / (Z + exp(sink))
    plain = MultiHeadAttention(D, D, 32, 0.0, H, backend="explicit").double()
    plain.load_state_dict(module.state_dict(), strict=False)
    with torch.no_grad():
        module.sinks.fill_(-torch.inf)
        torch.testing.assert_close(module(x), plain(x))


def test_a_kernel_that_cannot_add_sinks_is_refused_by_name():
    class NoSinks:
        has_dropout = True

        def __call__(self, queries, keys, values, context, dropout_p=0.0):
            raise AssertionError("never called")

    with pytest.raises(ValueError, match="NoSinks attention backend cannot add attention sinks"):
        MultiHeadAttention(D, D, 32, 0.0, H, sinks=True, backend=NoSinks)
    module = MultiHeadAttention(D, D, 32, 0.0, H, sinks=True)
    with pytest.raises(ValueError, match="cannot add attention sinks"):
        module.backend = NoSinks
    MultiHeadAttention(D, D, 32, 0.0, H, backend=NoSinks)  # without sinks it is fine


def _hf_mask(n: int, window: int | None, dtype) -> torch.Tensor:
    """(1, 1, n, n) additive causal (and banded) mask, built from the definitions."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    return torch.zeros(1, 1, n, n, dtype=dtype).masked_fill(~allowed, -torch.inf)


@pytest.mark.parametrize("layer", [0, 1])  # gpt-oss alternates banded-window and full layers
def test_gpt_oss_attention_equals_transformers(layer):
    from transformers.models.gpt_oss.modeling_gpt_oss import (
        GptOssAttention,
        GptOssConfig,
        GptOssRotaryEmbedding,
    )

    window = 4
    config = GptOssConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=2,
                          head_dim=D // H, sliding_window=window, num_hidden_layers=2,
                          layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "eager"
    torch.manual_seed(2)
    theirs = GptOssAttention(config, layer_idx=layer).double().eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.5)
    ours = MultiHeadAttention(
        D, D, 32, 0.0, H, qkv_bias=True, num_kv_heads=2,
        window_size=window if layer == 0 else None, sinks=True,
        position_scheme=RotaryPositions(head_dim=D // H, theta=10000.0)).double().eval()
    for mine, hf in (("W_query", "q_proj"), ("W_key", "k_proj"), ("W_value", "v_proj"),
                     ("out_proj", "o_proj")):
        getattr(ours, mine).load_state_dict(getattr(theirs, hf).state_dict())
    ours.sinks.data.copy_(theirs.sinks.data)

    x = torch.randn(1, N, D, dtype=torch.float64)
    position_ids = torch.arange(N)[None]
    cos_sin = GptOssRotaryEmbedding(config)(x, position_ids)
    expected, hf_weights = theirs(x, cos_sin, _hf_mask(N, theirs.sliding_window, x.dtype))
    # transformers computes the rotary angles in float32 even for float64 inputs
    close = {"atol": 1e-6, "rtol": 1e-6}
    for backend in ("explicit", "sdpa", "tiled"):
        ours.backend = backend
        torch.testing.assert_close(ours(x), expected, **close)
    _, weights = ours(x, return_weights=True)
    torch.testing.assert_close(weights, hf_weights, **close)


def test_qwen3_next_gated_attention_equals_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextAttention,
        Qwen3NextConfig,
        Qwen3NextRotaryEmbedding,
    )

    config = Qwen3NextConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=2,
                             head_dim=D // H, partial_rotary_factor=1.0, num_hidden_layers=1)
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    theirs = Qwen3NextAttention(config, layer_idx=0).double().eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.5)
    ours = MultiHeadAttention(
        D, D, 32, 0.0, H, num_kv_heads=2, qk_norm=True, out_bias=False, gate="elementwise",
        position_scheme=RotaryPositions(head_dim=D // H, theta=config.rope_parameters[
            "rope_theta"])).double().eval()
    # Qwen3-Next's q_proj holds, per head, the head's query rows and then its gate rows.
    q_and_gate = theirs.q_proj.weight.view(H, 2, D // H, D)
    ours.W_query.weight.data.copy_(q_and_gate[:, 0].reshape(D, D))
    ours.gate.W_gate.weight.data.copy_(q_and_gate[:, 1].reshape(D, D))
    ours.W_key.weight.data.copy_(theirs.k_proj.weight)
    ours.W_value.weight.data.copy_(theirs.v_proj.weight)
    ours.out_proj.weight.data.copy_(theirs.o_proj.weight)
    # Its RMSNorm gains are stored around 0 and applied as 1 + weight.
    ours.q_norm.weight.data.copy_(1.0 + theirs.q_norm.weight)
    ours.k_norm.weight.data.copy_(1.0 + theirs.k_norm.weight)

    x = torch.randn(1, N, D, dtype=torch.float64)
    cos_sin = Qwen3NextRotaryEmbedding(config)(x, torch.arange(N)[None])
    expected, _ = theirs(x, cos_sin, _hf_mask(N, None, x.dtype))
    # Qwen3-Next's norms compute in float32 even for float64 inputs: float32's tolerance
    for backend in ("explicit", "sdpa", "tiled"):
        ours.backend = backend
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)


def test_a_headwise_gate_scales_each_heads_output_by_one_sigmoid():
    torch.manual_seed(4)
    module = MultiHeadAttention(D, D, 32, 0.0, H, gate="headwise").double()
    x = torch.randn(B, N, D, dtype=torch.float64)
    captured = {}
    module.out_proj.register_forward_hook(lambda m, args, out: captured.update(heads=args[0]))
    module(x)
    plain = MultiHeadAttention(D, D, 32, 0.0, H).double()
    plain.load_state_dict(module.state_dict(), strict=False)
    plain.out_proj.register_forward_hook(lambda m, args, out: captured.update(plain=args[0]))
    plain(x)
    gate = torch.sigmoid(x @ module.gate.W_gate.weight.T)  # (b, n, heads), by the definition
    expected = captured["plain"].view(B, N, H, D // H) * gate[..., None]
    torch.testing.assert_close(captured["heads"], expected.view(B, N, D))
    assert module.gate.W_gate.weight.shape == (H, D)


def test_an_unknown_gate_names_the_choices():
    with pytest.raises(ValueError, match="none, headwise, elementwise"):
        MultiHeadAttention(D, D, 32, 0.0, H, gate="sigmoid")
    with pytest.raises(ValueError, match="attn_gate"):
        GPTConfig(attn_gate="yes")
    with pytest.raises(ValueError, match="attn_sinks"):
        GPTConfig(attn_sinks="yes")


def _model(**options) -> GPTModel:
    cfg = GPTConfig(vocab_size=64, context_length=24, emb_dim=16, n_heads=4, n_layers=2,
                    drop_rate=0.0, position="rope", norm="rmsnorm", bias=False, **options)
    torch.manual_seed(5)
    model = GPTModel(cfg).double().eval()
    with torch.no_grad():
        for block in model.trf_blocks:
            if block.att.sinks is not None:
                block.att.sinks.normal_(0.0, 2.0)
    return model


@pytest.mark.parametrize("options", [
    {"attn_sinks": True},
    {"attn_sinks": True, "window_size": 4, "n_kv_heads": 2},
    {"attn_gate": "elementwise"},
    {"attn_sinks": True, "attn_gate": "headwise", "window_size": 3},
])
def test_kv_cache_with_padding_equals_recompute(options):
    model = _model(**options)
    idx = torch.randint(0, 64, (2, 14))
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[0, :4] = 0  # a left-padded prompt
    with torch.no_grad():
        full = model(idx, mask)
        caches = model.new_kv_caches()
        pieces = [model(idx[:, :6], mask[:, :6], kv_caches=caches)]
        pieces += [model(idx[:, t:t + 1], mask[:, :t + 1], kv_caches=caches)
                   for t in range(6, 14)]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real])


def test_the_options_off_leave_the_model_and_its_weights_as_before():
    torch.manual_seed(6)
    before = GPTModel(GPTConfig(vocab_size=64, context_length=8, emb_dim=16, n_heads=2,
                                n_layers=1))
    torch.manual_seed(6)
    with_sinks = GPTModel(GPTConfig(vocab_size=64, context_length=8, emb_dim=16, n_heads=2,
                                    n_layers=1, attn_sinks=True))
    state = with_sinks.state_dict()
    assert {k for k in state if "sinks" in k} == {"trf_blocks.0.att.sinks"}
    for name, value in before.state_dict().items():  # sinks draw no random numbers
        torch.testing.assert_close(state[name], value)
