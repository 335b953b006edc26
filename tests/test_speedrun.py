"""bench/speedrun.py and bench/lightning_costs.py at a tiny budget: they run, print each
recipe's statistics and where its time goes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import HANG_SECONDS

from gptmini.train.command import DEFAULT_CONFIG

ROOT = Path(__file__).resolve().parents[1]
TINY = '{"model": {"n_layers": 1, "emb_dim": 32, "n_heads": 2}, "warmup_steps": 2}'
TINY_FLAGS = ["--model.n_layers", "1", "--model.emb_dim", "32", "--model.n_heads", "2",
              "--trainer.limit_val_batches", "2", "--model.warmup_steps", "2",
              "--model.compile", "false"]  # the default run compiles: a minute of CI


def run_bench(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_speedrun_prints_statistics_and_where_the_time_goes(tmp_path):
    out = run_bench(["bench/speedrun.py", "--budget", "1", "--seeds", "1", "2", "--points", "1",
                     "--threads", "1", "--val_tokens", "3000", "--cache_dir", str(tmp_path),
                     "--recipes", "qwen3-torch", '+ns3{"batch_size": 4}', "--set", TINY,
                     "--step_cost"])
    assert out.startswith("machine: ")
    assert "step cost" in out and "optimizer.step" in out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("recipe"))
    header, table = lines[at], lines[at + 1:]
    for column in ("val bpb mean ± sd", "vs qwen3-torch", "p", "forwa", "backw", "optim",
                   "loop", "first s", "val s"):
        assert column in header
    row = next(line for line in table if line.startswith("+ns3{"))
    p = float(row.split("|")[0].split()[-1])  # the t-test's p against the baseline
    assert 0.0 <= p <= 1.0
    assert "claim a gain at p < 0.01 with at least 5 seeds (2 here)" in out


@pytest.mark.slow
def test_lightning_costs_splits_a_train_py_run(tmp_path):
    out = run_bench(["bench/lightning_costs.py", "--steps", "3", "--cache_dir", str(tmp_path),
                     "--", *TINY_FLAGS])
    assert "median step forward" in out and "loop" in out
    assert "a validation" in out and "a checkpoint" in out
    default = yaml.safe_load(DEFAULT_CONFIG.read_text())["trainer"]["max_steps"]
    assert f"over the default run ({default} steps" in out and "the first step" in out


def test_the_speedruns_default_recipe_is_the_shipped_default_run(monkeypatch):
    """The recipe the docs compare as "default" trains what `train.py` with no arguments
    trains (the same blocks, shape, optimizer, rates, batch and compiling)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("speedrun", ROOT / "bench" / "speedrun.py")
    speedrun = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speedrun)
    recipe = speedrun.recipe_settings("default")
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    model = shipped["model"]
    for field, value in recipe["model"].items():
        assert model.get(field, value) == value, field  # unset in the YAML: GPTConfig's
    for field in ("optimizer", "learning_rate", "muon_learning_rate", "warmup_steps",
                  "min_lr_ratio", "weight_decay", "compile"):
        assert model[field] == recipe[field], field
    assert shipped["data"]["loader"]["batch_size"] == recipe["batch_size"]
