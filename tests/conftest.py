import pytest
import torch

from gptmini.model import GPTConfig


@pytest.fixture
def tiny_config() -> GPTConfig:
    """2 layers, 2 heads, emb_dim 16, vocab 64: the smallest model that exercises everything."""
    return GPTConfig(
        vocab_size=64, context_length=32, emb_dim=16, n_heads=2, n_layers=2, drop_rate=0.0
    )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
