from pathlib import Path

import pytest
import torch
from helpers import write_metrics

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


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run stopped after step 30, resumed from its step-20 checkpoint, up to step 50."""
    run = tmp_path / "runs" / "demo"
    first, second = [], []
    for step in range(10, 31, 10):
        first.append({"epoch": 0, "step": step, "train/loss": 9 - step / 10, "train/lr": 1e-3})
    first.append({"epoch": 0, "step": 20, "val/loss": 8.5, "val/ppl": 4914.8})
    for step in range(20, 51, 10):  # steps 20 and 30 run again after the resume
        second.append({"epoch": 0, "step": step, "train/loss": 5 - step / 100, "train/lr": 5e-4})
    second.append({"epoch": 1, "step": 40, "val/loss": 4.0, "val/ppl": 54.6})
    write_metrics(run / "logs" / "version_0" / "metrics.csv", first)
    write_metrics(run / "logs" / "version_1" / "metrics.csv", second)
    return run
