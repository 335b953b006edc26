"""Qwen3.5's text model (issue 53 item 7: a family added without editing gptmini/core) both
ways against transformers' own Qwen3_5ForCausalLM in float64, on a config where each of its
pieces bites: three Gated DeltaNet layers per gated attention layer, DeltaNet heads of their
own (4 value heads, 2 key heads, widths 8 and 12), a quarter of each attention head turning,
zero-centred norms; its state equal to recompute, the engine refusing it by name, train.py;
and what gptmini does not compute refused by name."""

import json

import pytest
import torch
from helpers import column, read_metrics, tiny_args

from gptmini.convert import export_hf, load_hf
from gptmini.convert.qwen3_5 import config_from_qwen3_5
from gptmini.generate.engine import Engine
from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel

transformers = pytest.importorskip("transformers")

QWEN = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "max_position_embeddings": 64}
ATOL = 1e-6
"""transformers' Qwen3.5 computes its norms and rotary angles in float32 whatever the
model's dtype, so float64 logits of the two agree to ~1e-7; a wrong weight moves them by far
more."""


def hf_qwen(**overrides) -> "transformers.Qwen3_5ForCausalLM":
    config = transformers.Qwen3_5TextConfig(**{**QWEN, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config)
    with torch.no_grad():  # the zero-centred norms start at 0 (a gain of 1): move them
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # DeltaNet's gated norm: a gain
                p.uniform_(0.5, 1.5)
            elif "norm" in name:
                p.uniform_(-0.5, 0.5)
    return model.float().double().eval()  # float32 numbers: what load_hf reads


def ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))


def test_a_transformers_qwen3_5_loads_with_its_logits_and_greedy_tokens(tmp_path):
    hf = hf_qwen()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).double()
    cfg = ours.cfg
    assert (cfg.layer_kinds, cfg.attn_gate, cfg.norm, cfg.rope_scaling) == (
        ["deltanet"] * 3 + ["attention"], "elementwise", "rmsnorm1p",
        {"rope_type": "default", "partial_rotary_factor": 0.25})
    assert cfg.mixer_options == {"deltanet": {"num_heads": 4, "num_key_heads": 2,
                                              "head_dim": 8, "value_head_dim": 12,
                                              "conv_kernel": 4}}
    x = ids()
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x), want, rtol=0, atol=ATOL)
        # the test can fail: every dimension turning gives other logits
        whole = GPTModel(GPTConfig(**{**vars(cfg), "rope_scaling": None})).double().eval()
        whole.load_state_dict(ours.state_dict())
        assert (whole(x) - want).abs().max() > 1000 * ATOL
    prompt = x[:1, :6]
    greedy = prompt
    with torch.no_grad():  # transformers' full forward, one token at a time
        for _ in range(12):
            greedy = torch.cat([greedy, hf(greedy).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generate(ours, prompt, 12, use_cache=True), greedy)  # the state
    assert torch.equal(generate(ours, prompt, 12, use_cache=False), greedy)
    with pytest.raises(ValueError, match="engine cannot serve Gated DeltaNet"):
        Engine(ours)


def test_an_export_gives_transformers_our_logits_and_every_weight_back(tmp_path):
    hf_qwen(tie_word_embeddings=True).save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").double()
    assert ours.cfg.tie_weights
    export_hf(ours, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["linear_num_value_heads"],
            config["rope_parameters"]["partial_rotary_factor"]) == ("qwen3_5_text", 4, 0.25)
    theirs = transformers.Qwen3_5ForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float64, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids()).logits, ours(ids()), rtol=0, atol=ATOL)
    back = load_hf(tmp_path / "out")
    assert back.cfg == ours.cfg
    assert all(torch.equal(back.state_dict()[k], v.float())
               for k, v in ours.state_dict().items())


def test_a_config_without_layer_types_or_a_rotary_share_reads_qwen3_5s_defaults():
    cfg = config_from_qwen3_5({**QWEN, "num_hidden_layers": 8})
    assert cfg.layer_kinds == (["deltanet"] * 3 + ["attention"]) * 2  # full every fourth
    assert cfg.rope_scaling == {"rope_type": "default", "partial_rotary_factor": 0.25}
    m_rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
              "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    assert config_from_qwen3_5({**QWEN, "rope_parameters": m_rope}).rope_theta == 1e7


@pytest.mark.parametrize(("fields", "match"), [
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "layer_types="),
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8'"),
])
def test_what_gptmini_does_not_compute_is_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        config_from_qwen3_5({**QWEN, **fields})


def test_a_model_a_layout_cannot_hold_is_refused_naming_what_differs(tmp_path):
    cfg = GPTConfig(vocab_size=97, context_length=32, emb_dim=32, n_heads=4, n_layers=1,
                    position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                    rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="turns only part of each head"):
        export_hf(GPTModel(cfg), tmp_path / "llama")
    with pytest.raises(ValueError, match="Qwen3.5's layout .* this model has "
                                         "attn_gate='none'"):  # DeltaNet's layout picks it
        export_hf(GPTModel(GPTConfig(**{**vars(config_from_qwen3_5(QWEN)),
                                        "attn_gate": "none"})), tmp_path / "plain")


@pytest.mark.slow
def test_train_py_trains_a_qwen3_5_that_transformers_reads(tmp_path, corpus):
    from gptmini.checkpoint import load_checkpoint
    from gptmini.train.command import main

    args = tiny_args(tmp_path, corpus, "--model.position", "rope", "--model.norm", "rmsnorm1p",
                     "--model.norm_eps", "1e-6", "--model.mlp", "swiglu",
                     "--model.bias", "false", "--model.qk_norm", "true",
                     "--model.attn_gate", "elementwise",
                     "--model.layer_kinds", "[deltanet, attention]",
                     "--model.mixer_options", "{deltanet: {num_heads: 4, num_key_heads: 2}}",
                     "--model.rope_scaling",
                     "{rope_type: default, partial_rotary_factor: 0.5}",
                     "--trainer.max_steps", "20")
    assert main(args) == 0
    train = column(read_metrics(tmp_path / "runs" / "tiny"), "train/loss")
    assert train[-1] < train[0] - 1.0, train
    model = load_checkpoint(tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt").model
    export_hf(model, tmp_path / "hf")
    theirs = transformers.Qwen3_5ForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float64, attn_implementation="eager").eval()
    x = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(x).logits
        assert (model.double()(x) - want).abs().max() <= ATOL * want.abs().max()
