import json

import pytest
import torch

from gptmini.checkpoint import load_checkpoint
from gptmini.convert import (
    TABLE,
    config_from_hf,
    config_to_hf,
    export_hf,
    from_hf_state_dict,
    load_hf,
    to_hf_state_dict,
)
from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def hf_gpt2(**overrides):
    """A small randomly initialized GPT-2 (no download)."""
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        bos_token_id=None, eos_token_id=None, **overrides
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


def make_model(**overrides) -> GPTModel:
    cfg = {"vocab_size": 64, "context_length": 32, "emb_dim": 32, "n_heads": 4,
           "n_layers": 2, "drop_rate": 0.0, **overrides}
    return GPTModel(GPTConfig(**cfg)).eval()


def hf_greedy(hf, idx: torch.Tensor, n: int) -> torch.Tensor:
    return hf.generate(idx, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0, attention_mask=torch.ones_like(idx))


def assert_parity(ours: GPTModel, hf):
    idx = torch.randint(0, 64, (2, 12))
    with torch.inference_mode():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-5, rtol=1e-5)
    prompt = idx[:1, :4]
    expected = hf_greedy(hf, prompt, 20)
    assert torch.equal(generate(ours, prompt, 20), expected)
    assert torch.equal(generate(ours, prompt, 20, use_cache=True), expected)


# --- Hugging Face -> gptmini -------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_import_state_dict_matches_transformers(tied):
    hf = hf_gpt2(tie_word_embeddings=tied)
    ours = from_hf_state_dict(hf.state_dict(), hf.config)
    assert ours.cfg.qkv_bias and ours.cfg.tie_weights == tied
    assert_parity(ours, hf)


def test_import_save_pretrained_directory(tmp_path):
    hf = hf_gpt2()
    hf.save_pretrained(tmp_path)
    assert_parity(load_hf(tmp_path), hf)


def test_import_old_style_state_dict_without_prefix_and_with_mask_buffers():
    hf = hf_gpt2()
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()
             if k != "lm_head.weight"}
    for i in range(2):  # causal-mask buffers that checkpoints from older transformers carry
        state[f"h.{i}.attn.bias"] = torch.ones(1, 1, 32, 32)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    assert_parity(from_hf_state_dict(state, hf.config.to_dict()), hf)


def test_import_pytorch_model_bin(tmp_path):
    hf = hf_gpt2()
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert_parity(load_hf(tmp_path), hf)


# --- gptmini -> Hugging Face -------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{"qkv_bias": True, "tie_weights": True}, {}, {"qkv_bias": False, "tie_weights": True}],
)


def test_export_loads_in_transformers_with_the_same_outputs(tmp_path, overrides):
    ours = make_model(**overrides)
    with torch.no_grad():  # random biases, so the export of every bias is tested
        for name, p in ours.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    export_hf(ours, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert_parity(ours, hf)


@pytest.mark.parametrize("padded", [None, 50304])
def test_export_a_checkpoint_and_load_it_back(tmp_path, padded):
    ours = make_model(vocab_size=50257, padded_vocab_size=padded, qkv_bias=True,
                      tie_weights=True)
    torch.save(
        {"state_dict": {f"model.{k}": v for k, v in ours.state_dict().items()},
         "hyper_parameters": {**ours.cfg.to_dict(), "tokenizer": "gpt2"}},
        tmp_path / "run.ckpt",
    )
    directory = export_hf(load_checkpoint(tmp_path / "run.ckpt").model, tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    assert config["vocab_size"] == (padded or 50257)  # the embedding's rows
    back = load_checkpoint(directory).model
    assert back.cfg == ours.cfg  # padding is known as padding again
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ours.state_dict().items())


def test_table_covers_every_weight_both_ways():
    ours = make_model(qkv_bias=True, tie_weights=False)
    names = {entry[0].format(i=i) for entry in TABLE for i in range(2)}
    assert names == set(ours.state_dict())
    hf = hf_gpt2(tie_word_embeddings=False)
    exported = to_hf_state_dict(from_hf_state_dict(hf.state_dict(), hf.config))
    assert exported.keys() == hf.state_dict().keys()
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in exported.items())


def test_config_json_fields():
    cfg = config_to_hf(GPTConfig.from_preset("gpt2-124m"))
    assert (cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["n_positions"]) == (
        768, 12, 12, 1024)
    assert cfg["activation_function"] == "gelu_new" and cfg["layer_norm_epsilon"] == 1e-5
    assert cfg["eos_token_id"] == 50256 and cfg["tie_word_embeddings"]
    assert config_from_hf(transformers.GPT2Config()) == GPTConfig.from_preset(
        "gpt2-124m", drop_rate=0.0)


# --- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "match"),
    [({"n_heads": 4, "n_kv_heads": 2}, "grouped-query"), ({"window_size": 8}, "sliding-window")],
)


def test_export_refuses_what_gpt2_cannot_hold(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        export_hf(make_model(**overrides), tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"activation_function": "relu"}, "activation_function='relu'"),
        ({"n_inner": 100}, "n_inner=100"),
        ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon"),
        ({"scale_attn_by_inverse_layer_idx": True}, "attention scaling"),
    ],
)


def test_import_refuses_configs_gptmodel_does_not_compute(overrides, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(transformers.GPT2Config(**overrides))


def test_import_errors_for_missing_files_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf(tmp_path)
    hf = hf_gpt2()
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_hf(tmp_path)
    state = dict(hf.state_dict())
    del state["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match="h.1.mlp.c_fc.bias"):
        from_hf_state_dict(state, hf.config)
    state = dict(hf.state_dict())
    state["transformer.h.0.attn.c_attn.weight"] = torch.zeros(32, 90)
    with pytest.raises(ValueError, match="do not fit"):
        from_hf_state_dict(state, hf.config)


def test_a_fitted_vocabulary_exports_with_its_tokenizer_and_comes_back(tmp_path):
    from gptmini.tokenizer import get_tokenizer, tokenizer_fingerprint, train_bpe

    enc = train_bpe(["But soft, what light through yonder window breaks? " * 50], 280)
    ours = make_model(vocab_size=enc.n_vocab, qkv_bias=True, tie_weights=True)
    directory = export_hf(ours, tmp_path / "hf", enc)
    text = "what light breaks<|endoftext|> soft"
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    assert theirs.encode(text) == enc.encode(text, allowed_special="all")
    assert theirs.eos_token_id == enc.eot_token
    assert json.loads((directory / "config.json").read_text())["eos_token_id"] == enc.eot_token
    back = load_checkpoint(directory)
    assert tokenizer_fingerprint(back.tokenizer) == tokenizer_fingerprint(enc)
    idx = torch.tensor([enc.encode(text, allowed_special="all")])
    with torch.inference_mode():
        torch.testing.assert_close(back.model(idx), ours(idx))
    with pytest.raises(ValueError, match=f"'gpt2' has 50257 ids but the model {enc.n_vocab}"):
        export_hf(ours, tmp_path / "wrong", get_tokenizer("gpt2"))
