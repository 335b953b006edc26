"""Gated DeltaNet: both forms equal a token-by-token oracle written here, the layer equals
transformers' Qwen3NextGatedDeltaNet with the same weights, and its state is its cache."""

import pytest
import torch

from gptmini.model import GPTConfig
from gptmini.variants.deltanet import (
    DeltaNetState,
    GatedDeltaNet,
    chunked_delta_rule,
    recurrent_delta_rule,
)


def oracle_delta_rule(q, k, v, g, beta):
    """The gated delta rule as the paper writes it, one head and one token at a time, with
    explicit matrices: S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T and
    o_t = S_t^T q_t. Shapes as recurrent_delta_rule's."""
    b, h, n, k_dim = k.shape
    out = torch.zeros(b, h, n, v.shape[-1], dtype=q.dtype)
    for i in range(b):
        for j in range(h):
            S = torch.zeros(k_dim, v.shape[-1], dtype=q.dtype)
            eye = torch.eye(k_dim, dtype=q.dtype)
            for t in range(n):
                kt, vt = k[i, j, t][:, None], v[i, j, t][:, None]  # columns
                alpha, bt = torch.exp(g[i, j, t]), beta[i, j, t]
                S = alpha * (eye - bt * kt @ kt.T) @ S + bt * kt @ vt.T
                out[i, j, t] = S.T @ q[i, j, t]
    return out


def random_rule_inputs(b=2, h=3, n=13, k_dim=4, v_dim=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, k_dim, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(b, h, n, k_dim, generator=gen,
                                                  dtype=torch.float64), dim=-1)
    v = torch.randn(b, h, n, v_dim, generator=gen, dtype=torch.float64)
    g = -torch.rand(b, h, n, generator=gen, dtype=torch.float64)  # log-decay in (-1, 0]
    beta = torch.rand(b, h, n, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 13, 64])
def test_both_forms_equal_the_oracle(chunk_size):
    q, k, v, g, beta = random_rule_inputs()
    expected = oracle_delta_rule(q, k, v, g, beta)
    recurrent, state_r = recurrent_delta_rule(q, k, v, g, beta)
    chunked, state_c = chunked_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)
    torch.testing.assert_close(recurrent, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(chunked, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state_c, state_r, rtol=1e-10, atol=1e-10)


def test_a_state_carries_across_calls():
    """Splitting the sequence anywhere and handing the state over changes nothing."""
    q, k, v, g, beta = random_rule_inputs(n=11)
    expected = oracle_delta_rule(q, k, v, g, beta)
    first, state = chunked_delta_rule(q[:, :, :6], k[:, :, :6], v[:, :, :6], g[:, :, :6],
                                      beta[:, :, :6], chunk_size=4)
    rest, _ = chunked_delta_rule(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], g[:, :, 6:],
                                 beta[:, :, 6:], state, chunk_size=4)
    torch.testing.assert_close(torch.cat([first, rest], dim=2), expected,
                               rtol=1e-10, atol=1e-10)


def make_layer(seed=0, **kwargs):
    torch.manual_seed(seed)
    options = {"d_in": 16, "num_heads": 4, "head_dim": 8, "chunk_size": 4} | kwargs
    return GatedDeltaNet(**options).double()


def test_the_layer_is_causal():
    layer = make_layer()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    changed = x.clone()
    changed[:, 6:] = torch.randn(2, 4, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(changed)[:, :6], layer(x)[:, :6], rtol=0, atol=0)
    assert not torch.allclose(layer(changed)[:, 6:], layer(x)[:, 6:])


def test_the_state_as_cache_equals_recompute():
    """Prefill, then one token at a time (the recurrent form) through a DeltaNetState,
    equals one pass over everything."""
    layer = make_layer(num_key_heads=2)
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    full = layer(x)
    state = DeltaNetState()
    pieces = [layer(x[:, :7], state=state)]
    pieces += [layer(x[:, t : t + 1], state=state) for t in range(7, 11)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-12)
    assert len(state) == 11
    # The state's size does not grow with the tokens seen: heads x k_dim x v_dim + the tail.
    assert state.nbytes == 8 * 2 * (4 * 8 * 8 + (2 * 2 * 8 + 4 * 8) * 3)


def test_left_padding_is_exact():
    layer = make_layer()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    padded = torch.cat([torch.randn(1, 3, 16, dtype=torch.float64), x], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    torch.testing.assert_close(layer(padded, mask)[:, 3:], layer(x), rtol=1e-12, atol=1e-12)


def test_right_padding_leaves_the_state_as_the_real_tokens_left_it():
    layer = make_layer(conv_kernel=1)  # (a padded input still fills a convolution's window)
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    padded, alone = DeltaNetState(), DeltaNetState()
    layer(x[:, :6], state=alone)
    layer(torch.cat([x[:, :6], torch.randn(1, 3, 16, dtype=torch.float64)], dim=1),
          torch.tensor([[1] * 6 + [0] * 3]), state=padded)
    torch.testing.assert_close(padded.recurrent, alone.recurrent, rtol=1e-12, atol=1e-12)


def test_the_state_refuses_to_drop_tokens():
    with pytest.raises(ValueError, match="slide='recompute'"):
        DeltaNetState().drop_oldest(1)


def test_a_window_on_a_deltanet_layer_is_refused_not_stored():
    """Gated DeltaNet applies no window: one given to its layer would be kept in the config
    and never applied (issue 48); layer_windows gives it None instead."""
    shape = dict(vocab_size=64, context_length=16, emb_dim=32, n_heads=2, n_layers=2,
                 layer_kinds=["deltanet", "attention"])
    with pytest.raises(ValueError, match=r"window_size=4 is invalid: layer 0 is Gated DeltaNet"
                                         r".*layer_windows=\[None, 4\] and window_size None"):
        GPTConfig(**shape, window_size=4)
    with pytest.raises(ValueError, match="layer_windows=\\[4, 4\\] is invalid: layer 0"):
        GPTConfig(**shape, layer_windows=[4, 4])
    assert GPTConfig(**shape, layer_windows=[None, 4]).window_of(1) == 4


# --- transformers' own implementation ------------------------------------------------------

def load_from_qwen3_next(ours: GatedDeltaNet, theirs) -> None:
    """Our separate projections from Qwen3-Next's fused in_proj_qkvz and in_proj_ba, whose
    rows are grouped by key head: [q, k, v of the group, z of the group] per key head."""
    hk, hv = ours.num_key_heads, ours.num_heads
    dk, dv = ours.head_dim, ours.value_head_dim
    group = hv // hk
    qkvz = theirs.in_proj_qkvz.weight.view(hk, 2 * dk + 2 * group * dv, -1)
    q, k, v, z = qkvz.split([dk, dk, group * dv, group * dv], dim=1)
    ba = theirs.in_proj_ba.weight.view(hk, 2 * group, -1)
    b, a = ba.split([group, group], dim=1)
    with torch.no_grad():
        for linear, rows in ((ours.W_query, q), (ours.W_key, k), (ours.W_value, v),
                             (ours.W_gate, z), (ours.W_beta, b), (ours.W_decay, a)):
            linear.weight.copy_(rows.reshape(-1, rows.shape[-1]))
        ours.conv1d.weight.copy_(theirs.conv1d.weight)
        ours.A_log.copy_(theirs.A_log)
        ours.dt_bias.copy_(theirs.dt_bias)
        ours.norm_weight.copy_(theirs.norm.weight)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)


@pytest.mark.parametrize("key_heads", [4, 2])
def test_equals_transformers_qwen3_next_gated_deltanet(key_heads):
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=32, linear_num_value_heads=4, linear_num_key_heads=key_heads,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
        num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(0)
    theirs = modeling.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():  # away from the init's ones, so a swapped weight would show
        theirs.norm.weight.uniform_(0.5, 1.5)
        theirs.dt_bias.uniform_(-1.0, 1.0)
    ours = GatedDeltaNet(32, num_heads=4, head_dim=8, value_head_dim=6, num_key_heads=key_heads,
                         conv_kernel=4, chunk_size=64, norm_eps=1e-6)
    load_from_qwen3_next(ours, theirs)
    x = torch.randn(2, 70, 32)  # more than one of their chunks of 64
    with torch.no_grad():
        expected = theirs(x)
        torch.testing.assert_close(ours(x), expected, rtol=1e-4, atol=1e-5)
        state = DeltaNetState()  # and decoding through our recurrent form
        steps = [ours(x[:, :65], state=state)]
        steps += [ours(x[:, t : t + 1], state=state) for t in range(65, 70)]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-4, atol=1e-5)


# --- the conformance kit ---------------------------------------------------------------------

def kit_step(module, x, state):
    state = state or DeltaNetState()
    return module(x, state=state), state


def test_the_kit_passes_it_as_linear_attention():
    from gptmini.testing import AttentionSpec, check_attention

    spec = AttentionSpec(d_in=8, num_heads=2, padding="attention_mask", kv_step=kit_step,
                         softmax=False)
    report = check_attention(lambda: GatedDeltaNet(8, 2, 4, chunk_size=4), spec, time_budget=None)
    assert report.passed, str(report)
    for name in ("causality", "padding", "kv_cache", "batch_rows_independent"):
        assert report[name].status == "passed", str(report)
    assert report["identical_tokens"].status == "not applicable"  # no softmax mean
    # a state that is not handed on between calls is caught
    forgetful = AttentionSpec(d_in=8, num_heads=2, softmax=False,
                              kv_step=lambda m, x, s: kit_step(m, x, None))
    report = check_attention(lambda: GatedDeltaNet(8, 2, 4, chunk_size=4), forgetful,
                             time_budget=None)
    assert report["kv_cache"].status == "failed", str(report)
