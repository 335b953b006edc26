"""A model with Gated DeltaNet layers (GPTConfig.layer_kinds) through the commands: train.py
trains it, generate.py continues a prompt from its checkpoint (the cache equal to
recompute), and what cannot serve it yet (the engine: serve.py, --chat, --batch_file)
refuses it by name."""

import pytest
import torch
from helpers import column, read_metrics, tiny_args

from gptmini.checkpoint import load_checkpoint
from gptmini.generate.command import generate_main
from gptmini.generate.engine import Engine
from gptmini.generate.loop import generate
from gptmini.serve.command import serve_main


@pytest.fixture
def trained(tmp_path, corpus):
    from gptmini.train.command import main

    args = tiny_args(tmp_path, corpus, "--model.layer_kinds", "[deltanet, attention]",
                     "--model.position", "rope", "--trainer.max_steps", "20",
                     "--sample_every", "10", "--attention_every", "10")
    with pytest.warns(UserWarning, match="Gated DeltaNet layers"):  # no maps, no crash
        assert main(args) == 0
    return tmp_path / "runs" / "tiny"


@pytest.mark.slow
def test_trains_generates_and_is_refused_by_the_engine(trained, capsys):
    train = column(read_metrics(trained), "train/loss")
    assert train[-1] < train[0] - 1.0, train
    checkpoint = trained / "checkpoints" / "last.ckpt"
    model = load_checkpoint(checkpoint).model.double().eval()
    assert model.cfg.layer_kinds == ["deltanet", "attention"]
    prompt = torch.tensor([[464, 3290, 286]])
    assert torch.equal(generate(model, prompt, 20, use_cache=True),
                       generate(model, prompt, 20, use_cache=False))

    assert generate_main(["--checkpoint", str(checkpoint), "--prompt", "Romeo said",
                          "--max_new_tokens", "5", "--temperature", "0"]) == 0
    assert "Romeo said" in capsys.readouterr().out
    with pytest.raises(ValueError, match="engine cannot serve Gated DeltaNet"):
        Engine(model)
    for main, argv in ((generate_main, ["--chat"]), (serve_main, ["--port", "0"])):
        with pytest.raises(SystemExit) as exc:
            main(["--checkpoint", str(checkpoint), *argv])
        assert exc.value.code == 2
        assert "engine cannot serve Gated DeltaNet" in capsys.readouterr().err
