"""gpt-oss's layout (issue 53 item 7: a family added without editing gptmini/core) both
ways against transformers' own GptOssForCausalLM in float64, on a config where each of its
pieces bites: sinks, biases, windows of 4 over 20 tokens on alternate layers, YaRN, clamped
SwiGLU experts behind a biased router; its cache, the engine and train.py; and what gptmini
does not compute refused by name."""

import json

import pytest
import torch
from helpers import assert_engine_serves_as_generate, column, read_metrics, tiny_args

from gptmini.convert import export_hf, load_hf
from gptmini.convert.gptoss import config_from_gptoss
from gptmini.generate.loop import generate
from gptmini.model import ConfigError, GPTConfig, GPTModel
from gptmini.variants.oss_moe import OssMoE

transformers = pytest.importorskip("transformers")

OSS = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
       "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
       "max_position_embeddings": 64, "swiglu_limit": 1.5,
       "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                           "beta_slow": 1.0, "truncate": False,
                           "original_max_position_embeddings": 16, "rope_theta": 1000.0}}
ATOL = 1e-6
"""transformers' gpt-oss rotates in float32 whatever the model's dtype, so float64 logits
of the two agree to ~1e-7; a wrong weight moves them by far more."""


def hf_oss(**overrides) -> "transformers.GptOssForCausalLM":
    config = transformers.GptOssConfig(**{**OSS, **overrides},
                                       experts_implementation="eager")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # every piece away from its starting value, so that each bites
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "sinks" in name or "bias" in name or "router" in name:
                p.normal_(0, 0.5)
            elif "experts" in name:
                p.normal_(0, 0.3)
    return model.float().double().eval()  # float32 numbers: what load_hf reads, computed in float64


def ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))


def test_a_transformers_gpt_oss_loads_with_its_logits_cache_and_engine(tmp_path):
    hf = hf_oss()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).double()
    cfg = ours.cfg
    assert (cfg.mlp, cfg.attn_sinks, cfg.layer_windows, cfg.rope_scaling["rope_type"],
            cfg.qkv_bias, cfg.bias) == ("oss_moe", True, [4, None], "yarn", True, True)
    x = ids()
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x), want, rtol=0, atol=ATOL)
        # the test can fail: gate and up swapped in every expert give other logits
        swapped = load_hf(tmp_path).double()
        for block in swapped.trf_blocks:
            for expert in block.ff.experts:
                expert.gate_proj, expert.up_proj = expert.up_proj, expert.gate_proj
        assert (swapped(x) - want).abs().max() > 1000 * ATOL
    prompt = x[:1, :6]
    greedy = prompt
    with torch.no_grad():  # transformers' full forward, one token at a time
        for _ in range(16):
            greedy = torch.cat([greedy, hf(greedy).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generate(ours, prompt, 16, use_cache=True), greedy)
    assert torch.equal(generate(ours, prompt, 16, use_cache=False), greedy)
    assert_engine_serves_as_generate(ours, [x[0, :9].tolist(), x[1, 5:18].tolist()],
                                     block_size=4, num_blocks=48, max_batch=2)


def test_an_export_gives_transformers_our_logits_and_every_weight_back(tmp_path):
    hf_oss().save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").double()
    export_hf(ours, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["swiglu_limit"],
            config["layer_types"]) == ("gpt_oss", 4, 1.5, ["sliding_attention",
                                                           "full_attention"])
    theirs = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float64, attn_implementation="eager",
        experts_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids()).logits, ours(ids()), rtol=0, atol=ATOL)
    back = load_hf(tmp_path / "out")
    assert back.cfg == ours.cfg
    assert all(torch.equal(back.state_dict()[k], v.float())
               for k, v in ours.state_dict().items())


def test_a_config_without_layer_types_or_rope_reads_gpt_oss_defaults():
    fields = {k: v for k, v in OSS.items() if k != "rope_parameters"}
    cfg = config_from_gptoss({**fields, "num_hidden_layers": 4})
    assert cfg.layer_windows == [4, None, 4, None]  # the first layer local, as GptOssConfig's
    assert (cfg.rope_theta, cfg.rope_scaling["factor"]) == (150000.0, 32.0)


@pytest.mark.parametrize(("fields", "match"), [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method='mxfp4'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": False}, "attention_bias=False"),
    ({"swiglu_alpha": -1}, "'swiglu_alpha' is -1"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
])
def test_what_gptmini_does_not_compute_is_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        config_from_gptoss({**OSS, **fields})


def test_a_model_that_is_not_gpt_oss_is_refused_naming_what_differs(tmp_path):
    cfg = config_from_gptoss(OSS)
    with pytest.raises(ValueError, match="gpt-oss's layout .* this model has attn_sinks=False"):
        export_hf(GPTModel(GPTConfig(**{**vars(cfg), "attn_sinks": False})), tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_the_feed_forwards_options_are_checked_by_name():
    cfg = config_from_gptoss(OSS)
    assert cfg.feed_forward() == OssMoE(32, 24, experts=4, top_k=2, bias=True, n_layers=2,
                                        swiglu_limit=1.5)
    with pytest.raises(ConfigError, match="oss_moe feed-forward's swiglu_limit is 0"):
        GPTConfig(**{**vars(cfg), "mlp_options": {**cfg.mlp_options, "swiglu_limit": 0}})
    with pytest.raises(ConfigError, match="oss_moe feed-forward has no option norm_topk_prob"):
        GPTConfig(**{**vars(cfg), "mlp_options": {"norm_topk_prob": False}})


@pytest.mark.slow
def test_train_py_trains_a_gpt_oss_that_transformers_reads(tmp_path, corpus):
    from gptmini.checkpoint import load_checkpoint
    from gptmini.train.command import main

    args = tiny_args(tmp_path, corpus, "--model.position", "rope", "--model.norm", "rmsnorm",
                     "--model.mlp", "oss_moe", "--model.mlp_options",
                     "{experts: 4, top_k: 2}", "--model.mlp_hidden_dim", "32",
                     "--model.attn_sinks", "true", "--model.qkv_bias", "true",
                     "--model.bias", "true", "--model.qk_norm", "false",
                     "--model.layer_windows", "[4, null]", "--model.rope_scaling",
                     "{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 8}",
                     "--trainer.max_steps", "20")
    assert main(args) == 0
    train = column(read_metrics(tmp_path / "runs" / "tiny"), "train/loss")
    assert train[-1] < train[0] - 1.0, train
    model = load_checkpoint(tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt").model
    export_hf(model, tmp_path / "hf")
    theirs = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float64, attn_implementation="eager",
        experts_implementation="eager").eval()
    x = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(x).logits
        assert (model.double()(x) - want).abs().max() <= ATOL * want.abs().max()
