"""A tiny run with attention sinks and gated attention: it trains (the sinks and gates
learn), checkpoints, and generate.py continues from the checkpoint alone."""

import torch
from helpers import column, read_metrics, tiny_args

from gptmini.train.command import main


def test_sinks_and_a_gate_train_and_generate_from_the_checkpoint(tmp_path, corpus, capsys):
    from gptmini.generate.command import generate_main

    args = tiny_args(tmp_path, corpus, "--model.attn_sinks", "true", "--model.attn_gate",
                     "elementwise", "--model.drop_rate", "0.0", "--trainer.max_steps", "12",
                     "--trainer.val_check_interval", "6", "--checkpoint_every", "6")
    assert main(args) == 0
    run = tmp_path / "runs" / "tiny"
    train = column(read_metrics(run), "train/loss")
    assert train[-1] < train[0]
    last = run / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True)["state_dict"]
    sinks = [v for k, v in state.items() if k.endswith("att.sinks")]
    assert len(sinks) == 2 and all(s.abs().sum() > 0 for s in sinks)  # moved from 0
    assert any(k.endswith("att.gate.W_gate.weight") for k in state)
    capsys.readouterr()
    assert generate_main(["--checkpoint", str(last), "--prompt", "Romeo said",
                          "--max_new_tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("Romeo said")
