"""Hugging Face's GPT-2, Llama and Qwen3 layouts hold no sinks and no gate: an export of a
model with either is refused, naming the option, never written without it."""

import pytest

from gptmini.convert.gpt2 import config_to_hf
from gptmini.convert.llama import config_to_llama
from gptmini.model import GPTConfig

LLAMA = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}


@pytest.mark.parametrize("option", [{"attn_sinks": True}, {"attn_gate": "headwise"}])
def test_a_model_with_sinks_or_a_gate_is_not_exported_without_them(option):
    field = next(iter(option))
    with pytest.raises(ValueError, match=f"{field}="):
        config_to_hf(GPTConfig(vocab_size=64, context_length=8, emb_dim=16, n_heads=2,
                               n_layers=1, **option))
    cfg = GPTConfig(vocab_size=64, context_length=8, emb_dim=16, n_heads=2, n_layers=1,
                    **LLAMA, **option)
    with pytest.raises(ValueError, match=f"{field}="):
        config_to_llama(cfg)
