"""Qwen3-MoE's layout both ways (gptmini.convert.llama, the moe feed-forward): a GPTModel of
experts exported is a directory transformers' own Qwen3MoeForCausalLM reads to our logits
and our loss with its load-balancing part, a Qwen3MoeForCausalLM that transformers saved
(experts one by one, or fused) loads to its logits, the round trip keeps every weight and
the greedy tokens, and what does not map is refused by name."""

import json

import pytest
import torch
from safetensors import safe_open

from gptmini.checkpoint import load_checkpoint
from gptmini.convert import export_hf, load_hf
from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights, lm_loss
from gptmini.tokenizer import get_tokenizer
from gptmini.variants.moe import BALANCE

transformers = pytest.importorskip("transformers")

# transformers' Qwen3-MoE routes (softmax) and normalizes in float32 even in a float64 model,
# so its logits are good to ~1e-7 here; a wrong weight moves them by far more.
HF_ATOL = 1e-6


def tiny_config(**overrides) -> GPTConfig:
    options = overrides.pop("mlp_options", {})
    fields = {"vocab_size": 257, "context_length": 32, "emb_dim": 32, "n_heads": 4,
              "n_kv_heads": 2, "n_layers": 2, "drop_rate": 0.0, "position": "rope",
              "norm": "rmsnorm", "norm_eps": 1e-6, "bias": False, "qk_norm": True,
              "tie_weights": False, "rope_theta": 500.0, "mlp": "moe", "mlp_hidden_dim": 24,
              "mlp_options": {"experts": 6, "top_k": 2, "norm_topk_prob": True,
                              "aux_loss_coef": 0.01, **options}}
    return GPTConfig(**{**fields, **overrides})


def random_model(cfg: GPTConfig) -> GPTModel:
    """float64, with random norm gains and sharp routers, so that a swapped norm or expert
    cannot pass unseen."""
    torch.manual_seed(1)
    model = init_gpt2_weights(GPTModel(cfg)).double().eval()  # a run's start: GPT-2's scales
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("ff.gate.weight"):
                p.normal_(0, 0.5)
    return model


def transformers_model(directory) -> "transformers.Qwen3MoeForCausalLM":
    return transformers.Qwen3MoeForCausalLM.from_pretrained(
        directory, dtype=torch.float64, attn_implementation="eager",
        experts_implementation="eager").eval()  # their grouped matmul has no float64


def token_ids() -> torch.Tensor:
    return torch.randint(0, 257, (2, 13), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("options", [{}, {"mlp_options": {"norm_topk_prob": False},
                                          "tie_weights": True}],
                         ids=["normalized", "softmax-weights-tied"])
def test_an_export_gives_transformers_qwen3_moe_our_logits_and_loss(tmp_path, options):
    model = random_model(tiny_config(**options))
    export_hf(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"],
            config["moe_intermediate_size"], config["decoder_sparse_step"],
            config["router_aux_loss_coef"]) == ("qwen3_moe", 6, 2, 24, 1, 0.01)
    hf, ids = transformers_model(tmp_path), token_ids()
    # the same positions both ways: transformers shifts its labels, gptmini takes targets
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    with torch.no_grad():
        out = hf(ids, labels=ids, output_router_logits=True)
        torch.testing.assert_close(model(ids), out.logits, rtol=0, atol=HF_ATOL)
        parts = {}
        loss = lm_loss(model, ids, targets, aux_losses=parts) + parts[BALANCE]
    torch.testing.assert_close(parts[BALANCE].float(), 0.01 * out.aux_loss.float(),
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(loss.float(), out.loss.float(), rtol=1e-6, atol=0)  # with it
    # The test can fail: weighted the other way, the experts give other logits.
    config["norm_topk_prob"] = not config["norm_topk_prob"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        wrong = transformers_model(tmp_path)(ids).logits
    assert (wrong - out.logits).abs().max() > 100 * HF_ATOL


@pytest.mark.parametrize("original_format", [True, False], ids=["one-by-one", "fused"])
def test_a_qwen3_moe_transformers_saved_loads_with_its_logits(tmp_path, original_format):
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, router_aux_loss_coef=0.02,
        max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        experts_implementation="eager")
    hf_config._attn_implementation = "eager"
    torch.manual_seed(2)
    hf = transformers.Qwen3MoeForCausalLM(hf_config).double().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path, save_original_format=original_format)
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        one_by_one = "model.layers.0.mlp.experts.5.down_proj.weight" in saved.keys()
    assert one_by_one == original_format  # each file format is really the one tested
    ours = load_hf(tmp_path).double()
    ff = ours.feed_forward
    assert (ff.experts, ff.top_k, ff.hidden_dim, ff.norm_topk_prob, ff.aux_loss_coef) == (
        6, 3, 24, True, 0.02)
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=HF_ATOL)


def test_the_round_trip_keeps_every_weight_and_the_greedy_tokens(tmp_path):
    model = random_model(tiny_config()).float()
    export_hf(model, tmp_path, get_tokenizer("byte"))
    loaded = load_checkpoint(tmp_path)  # the model and the tokenizer, as any directory
    assert loaded.model.cfg == model.cfg
    theirs = loaded.model.state_dict()
    assert all(torch.equal(theirs[name], weight) for name, weight in model.state_dict().items())
    prompt = token_ids()[:1, :5]
    assert torch.equal(generate(loaded.model, prompt, 12, use_cache=True),
                       generate(model, prompt, 12, use_cache=True))


@pytest.mark.parametrize(("options", "named"), [
    ({"mlp_options": {"shared_hidden_dim": 16}}, "mlp_options=.*'shared_hidden_dim': 16"),
    ({"qk_norm": False}, "qk_norm=False"),
    ({"layer_windows": [8, None]}, r"layer_windows=\[8, None\]"),
])
def test_an_export_of_what_qwen3_moe_lacks_is_refused_by_name(tmp_path, options, named):
    with pytest.raises(ValueError, match=f"Qwen3-MoE's layout .* this model has .*{named}"):
        export_hf(GPTModel(tiny_config(**options)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_frames_refusals_still_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="Llama's layout .* this model has bias=True"):
        export_hf(GPTModel(tiny_config(bias=True)), tmp_path / "out")


SPARSE = {"model_type": "qwen3_moe", "vocab_size": 257, "hidden_size": 32,
          "intermediate_size": 64, "moe_intermediate_size": 24, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 6,
          "num_experts_per_tok": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize(("change", "named"), [
    ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] \(dense layers among the sparse ones"),
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2, "),
    ({"shared_expert_intermediate_size": 64}, r"shared_expert_intermediate_size"),
    ({"use_sliding_window": True, "sliding_window": 8}, r"use_sliding_window in a "
                                                        r"'qwen3_moe' config"),
    ({"router_aux_loss_coef": -1}, r"router_aux_loss_coef=-1"),
    ({"rms_norm_eps": 1e-5}, r"rms_norm_eps=1e-05 with QK-norm"),
    ({"num_experts": 0}, r"the Qwen3-MoE config's 'num_experts' is 0"),
])
def test_a_qwen3_moe_config_gptmini_cannot_compute_is_named(tmp_path, change, named):
    (tmp_path / "config.json").write_text(json.dumps({**SPARSE, **change}))
    with pytest.raises(ValueError, match=f"config.json: .*{named}"):
        load_hf(tmp_path)


@pytest.mark.parametrize(("architecture", "mlp", "qk_norm"), [
    ("Qwen3MoeForCausalLM", "moe", True), ("Qwen3ForCausalLM", "swiglu", True),
    ("LlamaForCausalLM", "swiglu", False)])
def test_a_config_without_model_type_is_read_as_its_architecture(tmp_path, architecture, mlp,
                                                                  qk_norm):
    from gptmini.convert.hub import directory_config

    config = {k: v for k, v in SPARSE.items() if k != "model_type"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    cfg = directory_config(tmp_path)
    assert (cfg.mlp, cfg.qk_norm) == (mlp, qk_norm)
