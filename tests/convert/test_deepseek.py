"""DeepSeek-V3's layout both ways (gptmini.convert.deepseek): a GPTModel of multi-head latent
attention exported is a directory transformers' own DeepseekV3ForCausalLM reads to our
logits, a DeepseekV3 that transformers saved loads to its logits, the round trip keeps every
weight, and what does not map is refused by name."""

import json

import pytest
import torch

from gptmini.checkpoint import load_checkpoint
from gptmini.convert import export_hf, load_hf
from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights
from gptmini.tokenizer import get_tokenizer

transformers = pytest.importorskip("transformers")

# transformers' DeepseekV3 runs its RMSNorms and rotary angles in float32 even in a float64
# model, so its logits are good to ~1e-7 here (tests/attention/test_latent.py); a wrong
# weight or rotary layout moves them by far more (checked below).
HF_ATOL = 2e-6


def tiny_config(**overrides) -> GPTConfig:
    fields = {"vocab_size": 257, "context_length": 32, "emb_dim": 32, "n_heads": 4,
              "n_layers": 2, "drop_rate": 0.0, "position": "rope", "norm": "rmsnorm",
              "norm_eps": 1e-6, "mlp": "swiglu", "mlp_hidden_dim": 48, "bias": False,
              "tie_weights": False, "rope_theta": 500.0, "layer_kinds": ["mla"] * 2}
    mla = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
           **overrides.pop("mla", {})}
    return GPTConfig(**{**fields, "mixer_options": {"mla": mla}, **overrides})


def random_model(cfg: GPTConfig) -> GPTModel:
    """float64, with random norm gains too, so that a swapped norm cannot pass unseen."""
    torch.manual_seed(1)
    model = init_gpt2_weights(GPTModel(cfg)).double().eval()  # a run's start: GPT-2's scales
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def transformers_model(directory) -> "transformers.DeepseekV3ForCausalLM":
    return transformers.DeepseekV3ForCausalLM.from_pretrained(
        directory, dtype=torch.float64, attn_implementation="eager").eval()


def token_ids() -> torch.Tensor:
    return torch.randint(0, 257, (2, 13), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("options", [{}, {"mla": {"q_lora_rank": 12}, "tie_weights": True}],
                         ids=["full-query", "query-latent-tied"])
def test_an_export_gives_transformers_deepseek_v3_our_logits(tmp_path, options):
    model = random_model(tiny_config(**options))
    export_hf(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["first_k_dense_replace"],
            config["rope_interleave"]) == ("deepseek_v3", 2, True)
    hf, ids = transformers_model(tmp_path), token_ids()
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=HF_ATOL)
    # The test can fail: read as halves (no reordering), the rotary rows turn wrong.
    config["rope_interleave"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        wrong = transformers_model(tmp_path)(ids).logits
    assert (wrong - expected).abs().max() > 100 * HF_ATOL


@pytest.mark.parametrize("interleave", [True, False])
def test_a_deepseek_v3_transformers_saved_loads_with_its_logits(tmp_path, interleave):
    hf_config = transformers.DeepseekV3Config(
        vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=12,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, first_k_dense_replace=2,
        max_position_embeddings=32, rms_norm_eps=1e-6, rope_interleave=interleave,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                    "rope_theta": 500.0})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(2)
    hf = transformers.DeepseekV3ForCausalLM(hf_config).double().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).double()
    assert ours.mixers[0].dims == {"kv_lora_rank": 16, "q_lora_rank": 12, "qk_nope_head_dim": 8,
                                 "qk_rope_head_dim": 4, "v_head_dim": 6}
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=HF_ATOL)


def test_the_round_trip_keeps_every_weight_and_the_greedy_tokens(tmp_path):
    model = random_model(tiny_config(mla={"q_lora_rank": 12})).float()
    export_hf(model, tmp_path, get_tokenizer("byte"))
    loaded = load_checkpoint(tmp_path)  # the model and the tokenizer, as any directory
    assert loaded.model.cfg == model.cfg
    theirs = loaded.model.state_dict()
    assert all(torch.equal(theirs[name], weight) for name, weight in model.state_dict().items())
    assert loaded.tokenizer.n_vocab == 257
    prompt = token_ids()[:1, :5]
    assert torch.equal(generate(loaded.model, prompt, 12, use_cache=True),
                       generate(model, prompt, 12, use_cache=True))


@pytest.mark.parametrize(("options", "named"), [
    ({"bias": True}, "bias=True"),
    ({"window_size": 8}, "window_size=8"),
    ({"norm_eps": 1e-5}, "norm_eps=1e-05"),
    ({"attn_softcap": 30.0}, "attn_softcap=30.0"),
    ({"position": "learned"}, "position='learned'"),
])
def test_an_export_of_what_deepseek_v3_lacks_is_refused_by_name(tmp_path, options, named):
    with pytest.raises(ValueError, match=f"DeepSeek-V3's layout .* this model has {named}"):
        export_hf(GPTModel(tiny_config(**options)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


DENSE = {"model_type": "deepseek_v3", "vocab_size": 257, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
         "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 4,
         "qk_nope_head_dim": 8, "v_head_dim": 6, "first_k_dense_replace": 2,
         "max_position_embeddings": 32, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize(("change", "named"), [
    ({"first_k_dense_replace": 1}, r"first_k_dense_replace=1 below num_hidden_layers=2 "
                                   r"\(mixture-of-experts"),
    ({"first_k_dense_replace": None}, r"first_k_dense_replace=None"),
    ({"attention_bias": True}, r"attention_bias"),
    ({"rms_norm_eps": 1e-5}, r"rms_norm_eps=1e-05"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 40.0}}, r"rope scaling 'yarn'"),
    ({"num_key_value_heads": 1}, r"num_key_value_heads=1"),
])
def test_a_deepseek_v3_config_gptmini_cannot_compute_is_named(tmp_path, change, named):
    (tmp_path / "config.json").write_text(json.dumps({**DENSE, **change}))
    with pytest.raises(ValueError, match="config.json: this DeepSeek-V3 config cannot be "
                                         f"loaded into GPTModel: .*{named}"):
        load_hf(tmp_path)
