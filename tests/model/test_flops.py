"""Parameter and FLOP counts, and the CPU's measured matmul rate (the halves of MFU).

The FLOP counts are checked against torch's own FlopCounterMode (it counts every matmul and
convolution autograd runs), on a training step of tiny models of each kind of layer.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gptmini.model import GPT_CONFIG_124M, GPTConfig, GPTModel, lm_loss
from gptmini.model.flops import flops_per_token
from gptmini.runtime import measure_matmul_flops


def test_flops_per_token_counts_every_matmul_weight_six_times():
    cfg = GPTConfig(**GPT_CONFIG_124M, n_kv_heads=4)
    with torch.device("meta"):
        model = GPTModel(cfg)
    matmul_weights = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    attention = 12 * cfg.n_layers * cfg.emb_dim * 256
    assert flops_per_token(cfg, seq_len=256) == 6 * matmul_weights + attention


TINY = {"vocab_size": 64, "context_length": 128, "emb_dim": 16, "n_heads": 2, "n_layers": 2,
        "drop_rate": 0.0, "attention_backend": "explicit"}  # explicit: its scores are matmuls


def counted_flops_per_token(cfg: GPTConfig, seq_len: int, backward: bool = True) -> float:
    """FLOPs per token FlopCounterMode sees in a forward (and backward) pass of 2 rows."""
    torch.manual_seed(0)
    model = GPTModel(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, seq_len))
    with FlopCounterMode(display=False) as counter:
        loss = lm_loss(model, tokens, tokens)
        if backward:
            loss.backward()
    return counter.get_total_flops() / tokens.numel()


@pytest.mark.parametrize("options", [
    {},
    {"n_kv_heads": 1, "mlp": "swiglu", "attn_gate": "headwise", "mlp_hidden_dim": 40},
    {"attn_gate": "elementwise", "position": "rope", "tie_weights": True},
    # multi-head latent attention: default sizes, then every size its own and a query latent
    {"layer_kinds": ["mla"] * 2, "mixer_options": {"mla": {"kv_lora_rank": 12}},
     "position": "rope"},
    {"layer_kinds": ["mla"] * 2, "mixer_options": {"mla": {
        "kv_lora_rank": 12, "q_lora_rank": 10, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4,
        "v_head_dim": 5}}, "position": "rope", "mlp": "swiglu"},
    # heads of their own size (36 wide together in a width of 16), Gemma's blocks
    {"n_heads": 3, "head_dim": 12, "n_kv_heads": 1, "attn_gate": "elementwise",
     "position": "rope", "mlp": "geglu", "post_norms": True, "norm": "rmsnorm1p"},
], ids=["book", "gqa-gate-swiglu", "elementwise-gate", "mla", "mla-q-latent", "head-dim"])
def test_attention_flops_equal_a_counted_training_step(options):
    cfg = GPTConfig(**{**TINY, **options})
    assert flops_per_token(cfg, seq_len=96) == counted_flops_per_token(cfg, 96)


@pytest.mark.parametrize("seq_len", [128, 96])  # 96: a last chunk padded to 64 tokens
@pytest.mark.parametrize("options", [{}, {"num_heads": 4, "num_key_heads": 2, "head_dim": 6,
                                          "value_head_dim": 10, "conv_kernel": 3}],
                         ids=["n_heads", "own-sizes"])
def test_deltanet_flops_equal_a_counted_forward_and_its_solves_times_three(seq_len, options):
    """FlopCounterMode does not count triangular solves: the test adds them by hand. Each
    value head of the one Gated DeltaNet layer solves, per chunk of 64 tokens, two
    unit-lower-triangular 64 x 64 systems, one with k and one with v right-hand columns
    (by default 2 heads and k = v = 16 // 2 = 8), 64^2 FLOPs per column (the BLAS trsm
    count). Training costs 3 forwards."""
    cfg = GPTConfig(**TINY, layer_kinds=["deltanet", "attention"],
                    mixer_options={"deltanet": options} if options else None)
    heads, k, v = (options.get(name, default) for name, default in (
        ("num_heads", 2), ("head_dim", 8), ("value_head_dim", options.get("head_dim", 8))))
    chunks = -(-seq_len // 64)
    solves_per_token = heads * chunks * 64 * 64 * (k + v) / seq_len
    forward = counted_flops_per_token(cfg, seq_len, backward=False) + solves_per_token
    assert flops_per_token(cfg, seq_len=seq_len) == pytest.approx(3 * forward, rel=1e-12)


def test_deltanets_options_are_checked_by_name():
    kinds = {"layer_kinds": ["deltanet", "attention"]}
    with pytest.raises(ValueError, match="deltanet's num_key_heads=3 must divide its "
                                         "num_heads=4"):
        GPTConfig(**TINY, **kinds, mixer_options={"deltanet": {"num_heads": 4,
                                                               "num_key_heads": 3}})
    with pytest.raises(ValueError, match="deltanet's head_dim is 0: use a positive integer"):
        GPTConfig(**TINY, **kinds, mixer_options={"deltanet": {"head_dim": 0}})
    with pytest.raises(ValueError, match="the deltanet mixer has no option heads; it reads "
                                         "num_heads, num_key_heads"):
        GPTConfig(**TINY, **kinds, mixer_options={"deltanet": {"heads": 4}})


def test_matmul_measurement_is_plausible_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    flops = measure_matmul_flops(size=256, seconds=0.05)
    assert torch.equal(state, torch.get_rng_state())
    assert 1e8 < flops < 1e14
