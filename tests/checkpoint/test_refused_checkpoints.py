"""Checkpoints that would load into wrong numbers are refused by name wherever they are
loaded (issue 36 items 2, 8, 11): a tokenizer that is not the model's, weights holding NaN,
a device this torch does not have."""

import pytest
import torch

from gptmini.checkpoint import load_checkpoint, load_on_device, write_model_entries
from gptmini.convert import export_hf
from gptmini.finetune import add_class_head
from gptmini.generate.command import generate_main
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import get_tokenizer, train_bpe

TEXT = ["But soft, what light through yonder window breaks? It is the east. " * 30]


def model_of(vocab_size: int) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(GPTConfig(vocab_size=vocab_size, context_length=16, emb_dim=16, n_heads=2,
                              n_layers=1, drop_rate=0.0))


def saved(path, model: GPTModel, tokenizer, trained_with: str, precision="32-true"):
    """A checkpoint as train.py writes it (the model config and vocabulary included)."""
    ckpt = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {**{k: v for k, v in model.cfg.to_dict().items()
                                    if k != "vocab_size"}, "tokenizer": trained_with}}
    write_model_entries(ckpt, model.cfg, tokenizer, precision)
    torch.save(ckpt, path)
    return path


def test_a_model_beside_a_tokenizer_with_fewer_ids_is_refused(tmp_path):
    bpe = train_bpe(TEXT, 300)
    path = saved(tmp_path / "a.ckpt", model_of(bpe.n_vocab), bpe, "runs/r/tokenizer.json")
    load_checkpoint(path)  # as train.py saved it: loads
    ckpt = torch.load(path, weights_only=True)
    ckpt["tokenizer"] = {"format": ckpt["tokenizer"]["format"], "name": "byte"}
    torch.save(ckpt, path)  # the byte vocabulary (257 ids) once looked like padding
    with pytest.raises(ValueError, match=rf"a.ckpt: its model was trained for {bpe.n_vocab} "
                                         r"token ids \(model_config.vocab_size\) but the "
                                         r"tokenizer it carries, 'byte', has 257"):
        load_checkpoint(path)


def test_a_byte_model_carrying_another_vocabulary_is_refused(tmp_path):
    """An older checkpoint (no model_config): the name the run was given pins it."""
    bpe = train_bpe(TEXT, 257)  # as many ids as bytes: the count alone cannot tell
    model = model_of(257)
    ckpt = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {**model.cfg.to_dict(), "tokenizer": "byte"}}
    write_model_entries(ckpt, model.cfg, bpe, "32-true")
    del ckpt["model_config"]
    torch.save(ckpt, tmp_path / "old.ckpt")
    with pytest.raises(ValueError, match=r"trained with --model.tokenizer byte but the "
                                         r"tokenizer it carries is 'bpe257'"):
        load_checkpoint(tmp_path / "old.ckpt")


def poisoned(path, values):
    model = model_of(257)
    with torch.no_grad():
        model.trf_blocks[0].att.W_query.weight.view(-1)[: len(values)] = torch.tensor(values)
    return saved(path, model, get_tokenizer("byte"), "byte")


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    path = poisoned(tmp_path / "nan.ckpt", [float("nan"), float("inf"), float("-inf")])
    with pytest.raises(ValueError, match=r"nan.ckpt: its state_dict holds non-finite weights "
                                         r"\(NaN or infinity\): trf_blocks.0.att.W_query.weight"
                                         r" \(3 of 256 values\).*earlier checkpoint"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="non-finite"):  # serve.py's and generate.py's path
        load_on_device(path, "cpu", "float32")


def test_generate_py_says_so_in_one_line(tmp_path, capsys):
    path = poisoned(tmp_path / "nan.ckpt", [float("nan")])
    with pytest.raises(SystemExit) as stop:
        generate_main(["--checkpoint", str(path), "--max_new_tokens", "2"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "W_query.weight (1 of 256 values)" in err and "Traceback" not in err


def test_a_classifier_writes_no_text_and_says_what_scores_it(tmp_path, capsys):
    """Its head scores 2 classes: sampling from it gave class ids as text ('\\x00\\x01')
    in generate.py and serve.py's /v1/completions (issue 48); both load through here."""
    path = saved(tmp_path / "spam.ckpt", add_class_head(model_of(257), 2),
                 get_tokenizer("byte"), "byte")
    ckpt = torch.load(path, weights_only=True)
    ckpt["hyper_parameters"]["classes"] = ["ham", "spam"]
    torch.save(ckpt, path)
    assert load_checkpoint(path).model.out_head.out_features == 2  # evaluate.py reads it
    with pytest.raises(ValueError, match=r"spam.ckpt is a classifier \(classes ham, spam\): "
                                         r"its head scores classes, not tokens.*evaluate.py"):
        load_on_device(path, "cpu", "float32")
    with pytest.raises(SystemExit):
        generate_main(["--checkpoint", str(path), "--max_new_tokens", "2"])
    assert "is a classifier" in capsys.readouterr().err


def test_a_hugging_face_directory_with_nan_weights_is_refused(tmp_path):
    model = model_of(257)
    with torch.no_grad():
        model.final_norm.weight[0] = float("nan")
    directory = export_hf(model, tmp_path / "hf", get_tokenizer("byte"))
    with pytest.raises(ValueError, match=r"the directory .*hf holds non-finite weights.*"
                                         r"transformer.ln_f.weight \(1 of 16 values\)"):
        load_checkpoint(directory)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_torch_lacks_is_named_not_blamed_on_the_checkpoint(tmp_path):
    path = saved(tmp_path / "ok.ckpt", model_of(257), get_tokenizer("byte"), "byte")
    with pytest.raises(ValueError, match=r"--device cuda is not available") as caught:
        load_checkpoint(path, torch.device("cuda"))
    assert "corrupt" not in str(caught.value)
    if torch.version.cuda is None:
        assert "CPU-only build" in str(caught.value) and "install a CUDA build" in str(caught.value)
