"""Parameter and FLOP counts, and the CPU's measured matmul rate (the halves of MFU)."""

import torch

from gptmini.model import GPT_CONFIG_124M, GPTConfig, GPTModel
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


def test_matmul_measurement_is_plausible_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    flops = measure_matmul_flops(size=256, seconds=0.05)
    assert torch.equal(state, torch.get_rng_state())
    assert 1e8 < flops < 1e14
