"""Fine-tunes that would train something else than asked are refused before anything is
built or loaded, naming the flag and the fix (issue 48's hostile findings): LoRA settings
nothing reads, out of range or wider than a layer, a resume whose adapters differ, an empty
--model.init_from, a classifier as a language model's source."""

import hashlib

import pytest
import torch
from helpers import save_checkpoint, tiny_args

from gptmini.finetune import add_class_head
from gptmini.model import GPTConfig, GPTModel
from gptmini.train.adapters import LORA_DEFAULTS, LoRA, trained_weights
from gptmini.train.command import build_cli, main
from gptmini.train.module import GPTLitModule

TINY = dict(tokenizer="byte", context_length=8, emb_dim=16, n_heads=2, n_layers=1,
            drop_rate=0.0, peak_flops=1.0)
SOURCE = dict(vocab_size=50257, context_length=16, emb_dim=32, n_heads=2, n_layers=2,
              drop_rate=0.0)


@pytest.mark.parametrize(("settings", "message"), [
    (dict(rank=0, alpha=0.0, targets=None), "--model.lora_alpha 0.0: use a positive number"),
    (dict(rank=0, alpha=16.0, targets=["nope"]), r"--model.lora_targets=\['nope'\]: use some"),
    (dict(rank=0, alpha=32.0, targets=None),
     "--model.lora_alpha 32.0 set, but --model.lora_rank is 0"),
    (dict(rank=4, alpha=16.0, targets=[]), r"--model.lora_targets=\[\]: use some of"),
])
def test_lora_settings_are_checked_whatever_the_rank(settings, message):
    with pytest.raises(ValueError, match=message):
        trained_weights(dropout=0.0, init_from="base.ckpt", **settings)


def test_the_lora_defaults_are_the_modules():
    import inspect

    defaults = inspect.signature(GPTLitModule).parameters
    assert {name: defaults[name].default for name in LORA_DEFAULTS} == LORA_DEFAULTS


def test_a_rank_wider_than_a_layer_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"lora_rank=17 is wider than the W_query layers "
                                         r"\(16 in, 16 out\)"):
        GPTLitModule(**TINY, lora_rank=17, init_from="base.ckpt")
    GPTLitModule(**TINY, lora_rank=16, init_from="base.ckpt")  # full rank: allowed


@pytest.mark.parametrize(("saved", "message"), [
    (dict(rank=4), r"--model.lora_rank 2 \(the checkpoint's 4\); the adapters' shapes differ"),
    (dict(alpha=4.0), r"--model.lora_alpha 16.0 \(the checkpoint's 4.0\); the trained update "
                      "would be rescaled x4"),
    (dict(targets=["W_query"]), r"--model.lora_targets \['W_query', 'W_key', 'W_value', "
                                r"'out_proj'\] \(the checkpoint's \['W_query'\]\)"),
])
def test_resuming_adapters_with_other_settings_is_refused_before_they_load(saved, message):
    module = GPTLitModule(**TINY, lora_rank=2, init_from="base.ckpt")
    entry = {**module.weights.entries("base.ckpt", "f")["lora"], **saved}
    with pytest.raises(ValueError, match=message + ".*Resume with --model.lora_rank"):
        module.on_load_checkpoint({"lora": entry})


def test_a_full_run_and_an_adapter_run_do_not_resume_each_other():
    lora = LoRA(2, 16.0, 0.0, ("W_query",))
    with pytest.raises(ValueError, match="trained every weight, and this run would train "
                                         "LoRA adapters"):
        GPTLitModule(**TINY, lora_rank=2, init_from="b").on_load_checkpoint({})
    with pytest.raises(ValueError, match="holds LoRA adapters .* resume with --model.lora_rank "
                                         "2 --model.lora_alpha 16.0"):
        GPTLitModule(**TINY).on_load_checkpoint(lora.entries("b", "f"))


def test_adapters_name_their_base_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base.ckpt").write_bytes(b"")
    lora = LoRA(2, 16.0, 0.0, ("W_query",))
    assert lora.entries("base.ckpt", "f")["lora"]["base"] == str(tmp_path / "base.ckpt")


def test_an_empty_init_from_is_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match="--model.init_from '' names no model"):
        build_cli(tiny_args(tmp_path, corpus, "--model.init_from", ""))


def test_a_classifier_is_no_source_for_a_language_model(tmp_path, corpus):
    torch.manual_seed(0)
    classifier = add_class_head(GPTModel(GPTConfig(**SOURCE)), 2)
    path = save_checkpoint(classifier, tmp_path / "classifier.ckpt")
    saved = torch.load(path, weights_only=True)
    saved["hyper_parameters"]["classes"] = ["ham", "spam"]
    torch.save(saved, path)
    with pytest.raises(ValueError, match=f"--model.init_from {path} is a classifier \\(classes "
                                         "ham, spam\\): its head scores classes"):
        build_cli(tiny_args(tmp_path, corpus, "--model.init_from", str(path)))


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_lora_resume_with_another_rank_or_alpha_is_refused_and_damages_nothing(
        tmp_path, corpus, capsys):
    torch.manual_seed(0)
    base = save_checkpoint(GPTModel(GPTConfig(**SOURCE)), tmp_path / "base.ckpt")
    args = [a for a in tiny_args(tmp_path, corpus, "--model.init_from", str(base),
                                 "--model.lora_rank", "2", "--trainer.max_steps", "2",
                                 "--checkpoint_every", "2", "--trainer.val_check_interval",
                                 "2", "--trainer.limit_val_batches", "1")]
    assert main(args) == 0
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    before = digest(last)
    capsys.readouterr()
    for flag, value in (("--model.lora_rank", "4"), ("--model.lora_alpha", "64")):
        assert main([*args, "--trainer.max_steps", "4", flag, value, "--ckpt_path", "last"]) == 1
        said = capsys.readouterr().err
        assert f"{flag} {value}" in said and "Resume with --model.lora_rank 2" in said
        assert "Traceback" not in said and digest(last) == before
