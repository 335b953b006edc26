"""A mixture-of-experts model (GPTConfig.mlp "moe") through the commands: train.py trains it
with its options from the command line and logs its load-balancing loss as its own metrics,
and its checkpoint generates (the cache equal to recompute) and is served by the engine."""

import pytest
import torch
from helpers import column, read_metrics, tiny_args, write_corpus

from gptmini.checkpoint import load_checkpoint
from gptmini.generate.command import generate_main
from gptmini.generate.engine import Engine
from gptmini.generate.loop import generate

OPTIONS = '{"experts": 4, "top_k": 2, "aux_loss_coef": 0.01}'


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from gptmini.train.command import main

    tmp_path = tmp_path_factory.mktemp("moe")
    corpus = write_corpus(tmp_path / "corpus.txt", repeats=12)  # (the corpus fixture's)
    args = tiny_args(tmp_path, corpus, "--model.mlp", "moe", "--model.mlp_options", OPTIONS,
                     "--model.position", "rope", "--model.norm", "rmsnorm",
                     "--trainer.max_steps", "20")
    assert main(args) == 0
    return tmp_path / "runs" / "tiny"


@pytest.mark.slow
def test_trains_generates_and_is_served(trained, capsys):
    train = column(read_metrics(trained), "train/loss")
    assert train[-1] < train[0] - 1.0, train
    checkpoint = trained / "checkpoints" / "last.ckpt"
    model = load_checkpoint(checkpoint).model.double().eval()
    assert (model.cfg.mlp, model.feed_forward.experts, model.feed_forward.aux_loss_coef) == (
        "moe", 4, 0.01)
    prompt = torch.tensor([[464, 3290, 286]])
    plain = generate(model, prompt, 20, use_cache=False)
    assert torch.equal(generate(model, prompt, 20, use_cache=True), plain)
    served = Engine(model, block_size=4).generate([prompt[0].tolist()], max_new_tokens=20)
    assert served[0].tokens == plain[0, 3:].tolist()
    assert generate_main(["--checkpoint", str(checkpoint), "--prompt", "Romeo said",
                          "--max_new_tokens", "5", "--temperature", "0"]) == 0
    assert "Romeo said" in capsys.readouterr().out


@pytest.mark.slow
def test_the_load_balancing_loss_is_logged_as_its_own_metric(trained):
    rows = read_metrics(trained)
    balance = column(rows, "train/load_balance")
    assert len(balance) >= 10, sorted(rows[0])
    # 0.01 * E * sum_e f_e P_e: 0.01 * top_k when balanced, at most 0.01 * E * top_k
    assert all(0 < b <= 0.01 * 4 * 2 for b in balance) and len(set(balance)) > 1, balance
    assert column(rows, "val/load_balance"), "validation reports it too"
