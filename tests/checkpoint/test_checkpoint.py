import argparse
import os

import pytest
import torch

from gptmini.checkpoint import load_checkpoint
from gptmini.convert import export_hf
from gptmini.model import GPTConfig, GPTModel


def make_model(**overrides) -> GPTModel:
    cfg = {"vocab_size": 50257, "context_length": 16, "emb_dim": 16, "n_heads": 2,
           "n_layers": 2, "drop_rate": 0.0, **overrides}
    return GPTModel(GPTConfig(**cfg))


def lightning_dict(model: GPTModel, **hparams) -> dict:
    """The layout of a Lightning checkpoint of gptmini's training module."""
    return {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "hyper_parameters": {**model.cfg.to_dict(), "tokenizer": "gpt2", "learning_rate": 3e-4,
                             "warmup_steps": 10, **hparams},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(120.0)}},
                              "param_groups": [{"lr": 3e-4, "params": [0]}]}],
        "lr_schedulers": [{"last_epoch": 120}],
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 3}}}},
        "callbacks": {"ModelCheckpoint{}": {"best_model_path": "/tmp/x.ckpt",
                                            "best_model_score": torch.tensor(1.5)}},
    }


def assert_same_weights(a: GPTModel, b: GPTModel):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"n_heads": 4, "n_kv_heads": 2}, {"window_size": 4}, {"tie_weights": True},
     {"qkv_bias": True}],
)


def test_roundtrip_rebuilds_model_tokenizer_and_hyper_parameters(tmp_path, overrides):
    model = make_model(**overrides)
    path = tmp_path / "run.ckpt"
    torch.save(lightning_dict(model), path)
    loaded, tokenizer, hparams = load_checkpoint(path)
    assert_same_weights(loaded, model)
    assert loaded.cfg == model.cfg and not loaded.training
    assert tokenizer.name == "gpt2" and hparams["learning_rate"] == 3e-4
    idx = torch.randint(0, 50257, (1, 5))
    torch.testing.assert_close(loaded(idx), model.eval()(idx))
    if model.cfg.tie_weights:
        assert loaded.out_head.weight is loaded.tok_emb.weight


def test_tied_head_stored_once_and_compiled_prefix(tmp_path):
    model = make_model(tie_weights=True)
    ckpt = lightning_dict(model)
    state = {k.replace("model.", "model._orig_mod."): v for k, v in ckpt["state_dict"].items()}
    del state["model._orig_mod.out_head.weight"]
    ckpt["state_dict"] = state
    torch.save(ckpt, tmp_path / "c.ckpt")
    assert_same_weights(load_checkpoint(tmp_path / "c.ckpt")[0], model)


def test_map_location_and_hf_directory(tmp_path):
    model = make_model(qkv_bias=True, tie_weights=True)
    torch.save(lightning_dict(model), tmp_path / "c.ckpt")
    loaded, _, _ = load_checkpoint(tmp_path / "c.ckpt", map_location=torch.device("cpu"))
    assert loaded.tok_emb.weight.device.type == "cpu"
    hf_model, tokenizer, hparams = load_checkpoint(export_hf(model, tmp_path / "hf"))
    assert_same_weights(hf_model, model)
    assert tokenizer.name == "gpt2" and hparams["emb_dim"] == 16


def test_checkpoint_from_a_real_lightning_trainer(tmp_path):
    import lightning as L  # noqa: N812 - Lightning's own convention

    class Module(L.LightningModule):
        def __init__(self, vocab_size=50257, context_length=16, emb_dim=16, n_heads=2,
                     n_layers=2, drop_rate=0.0, tokenizer="gpt2", learning_rate=1e-3):
            super().__init__()
            self.save_hyperparameters()
            self.model = make_model()

        def training_step(self, batch, _):
            (x,) = batch
            logits = self.model(x[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 9))), batch_size=4
    )
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, accelerator="cpu")
    module = Module()
    trainer.fit(module, data)
    trainer.save_checkpoint(tmp_path / "real.ckpt")
    loaded, tokenizer, hparams = load_checkpoint(tmp_path / "real.ckpt")
    assert_same_weights(loaded, module.model)
    assert tokenizer.name == "gpt2" and hparams["learning_rate"] == 1e-3


# --- bad input ---------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "missing.ckpt")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file(tmp_path, damage):
    path = tmp_path / "c.ckpt"
    torch.save(lightning_dict(make_model()), path)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"not a checkpoint",
                      "empty": b""}[damage])
    with pytest.raises(ValueError, match="corrupt, truncated or not a PyTorch checkpoint"):
        load_checkpoint(path)


def test_refuses_a_checkpoint_that_needs_arbitrary_unpickling(tmp_path):
    ckpt = lightning_dict(make_model())
    ckpt["hyper_parameters"]["args"] = argparse.Namespace(lr=1.0)  # an arbitrary object
    torch.save(ckpt, tmp_path / "c.ckpt")
    with pytest.raises(ValueError, match=r"refusing to load .* needs arbitrary code to load "
                                         r"\(argparse\.Namespace\)"):
        load_checkpoint(tmp_path / "c.ckpt")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c["state_dict"], "expected a dict with 'state_dict'"),
        (lambda c: {"state_dict": c["state_dict"]}, "expected a dict with 'state_dict'"),
        (lambda c: {**c, "hyper_parameters": {"learning_rate": 1.0}}, "lack the GPTConfig"),
        (lambda c: {**c, "state_dict": {k[6:]: v for k, v in c["state_dict"].items()}},
         "no 'model.' weights"),
        (lambda c: {**c, "hyper_parameters": {**c["hyper_parameters"], "n_heads": 3}},
         "do not make a GPTConfig"),
    ],
)


def test_not_a_gptmini_checkpoint(tmp_path, edit, match):
    torch.save(edit(lightning_dict(make_model())), tmp_path / "c.ckpt")
    with pytest.raises(ValueError, match=match):
        load_checkpoint(tmp_path / "c.ckpt")


def test_weights_that_do_not_fit_the_config(tmp_path):
    ckpt = lightning_dict(make_model(), emb_dim=32)  # hyper_parameters say 32, weights are 16
    torch.save(ckpt, tmp_path / "c.ckpt")
    with pytest.raises(ValueError, match="do not match the model .* size mismatch"):
        load_checkpoint(tmp_path / "c.ckpt")


def test_a_checkpoint_with_a_wide_vocab_size_loads_as_padded(tmp_path):
    """Before padded_vocab_size, configs padded vocab_size itself (50304 for gpt2)."""
    model = make_model(vocab_size=50304)
    torch.save(lightning_dict(model), tmp_path / "old.ckpt")
    loaded, tokenizer, _ = load_checkpoint(tmp_path / "old.ckpt")
    assert (loaded.cfg.vocab_size, loaded.cfg.padded_vocab_size) == (tokenizer.n_vocab, 50304)
    assert_same_weights(loaded, model)
    assert loaded(torch.zeros(1, 3, dtype=torch.long)).shape[-1] == 50257


def test_a_model_with_fewer_ids_than_its_tokenizer_is_refused(tmp_path):
    torch.save(lightning_dict(make_model(vocab_size=64)), tmp_path / "c.ckpt")
    with pytest.raises(ValueError, match="vocab_size=64 but its tokenizer has 50257 ids"):
        load_checkpoint(tmp_path / "c.ckpt")


def test_a_malicious_pickle_is_refused_as_needing_arbitrary_code(tmp_path):
    """Before: torch 2.13 words this case differently, and the message called the file corrupt."""

    class RunsACommand:
        def __reduce__(self):
            return (os.system, ("echo this would run",))

    ckpt = lightning_dict(make_model())
    ckpt["hyper_parameters"]["payload"] = RunsACommand()
    torch.save(ckpt, tmp_path / "evil.ckpt")
    with pytest.raises(ValueError, match=r"refusing to load .*evil\.ckpt: it needs arbitrary "
                                         r"code to load \(posix\.system\)") as refused:
        load_checkpoint(tmp_path / "evil.ckpt")
    assert "corrupt" not in str(refused.value)
