"""Gemma 3's layout (issue 45 item 3) both ways against transformers' own Gemma3ForCausalLM,
in float64, on a config where every one of its pieces bites: windows of 4 over 40 tokens on
the five local layers of six, their own rope base, linear scaling on the global layer only,
query_pre_attn_scalar other than the head size, a soft-capped head, random norm weights;
and what Gemma 3 has that gptmini does not compute is refused by name."""

import json

import pytest
import torch
from helpers import assert_engine_serves_as_generate

from gptmini.convert import export_hf, load_hf
from gptmini.convert.gemma import config_from_gemma3
from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel, window_pattern

transformers = pytest.importorskip("transformers")

GEMMA = {"model_type": "gemma3_text", "vocab_size": 97, "hidden_size": 48,
         "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 128,
         "sliding_window": 4, "query_pre_attn_scalar": 24, "final_logit_softcapping": 5.0,
         "rope_theta": 1e6, "rope_local_base_freq": 1e4,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}}


def hf_gemma(**overrides):
    fields = {k: v for k, v in {**GEMMA, **overrides}.items() if k != "model_type"}
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **fields, attn_implementation="eager"))
    with torch.no_grad():  # Gemma's norms start at 0 (a gain of 1): move them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    # float32 numbers in float64: load_hf reads weights as float32, so both models compute
    # in float64 from the very same weights and greedy tokens cannot part at a near tie
    return model.float().double().eval()


def relative(ours, theirs) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def test_a_transformers_gemma3_loads_with_its_logits_and_greedy_tokens(tmp_path):
    hf = hf_gemma()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).double()
    cfg = ours.cfg
    assert (cfg.layer_windows, cfg.rope_local_theta, cfg.rope_theta, cfg.attn_scale_dim,
            cfg.logit_softcap, cfg.head_size, cfg.tie_weights) == (
        [4, 4, 4, 4, 4, None], 1e4, 1e6, 24.0, 5.0, 32, True)
    ids = torch.randint(0, 97, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0  # left padding
    with torch.no_grad():
        assert relative(ours(ids), hf(ids).logits) <= 1e-6
        # a left-padded row is the sequence alone (transformers' own eager Gemma3 gives NaN
        # for every token of a left-padded row in float64, so it is run on the row alone)
        assert relative(ours(ids, mask)[1, 7:], hf(ids[1:, 7:]).logits[0]) <= 1e-6
        # each piece bites: without it, transformers' model computes something else
        plain = hf_gemma(sliding_window=64, query_pre_attn_scalar=32,
                         final_logit_softcapping=None, rope_local_base_freq=1e6,
                         rope_scaling=None)
        plain.load_state_dict(hf.state_dict())
        assert relative(plain(ids).logits, hf(ids).logits) > 1e-2
    prompt = ids[:1, :6]
    # greedy by transformers' full forward: its generate() over its sliding-window cache
    # parted from its own forward on some prompts (seen with transformers 5.24)
    want = prompt
    with torch.no_grad():
        for _ in range(30):
            want = torch.cat([want, hf(want).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generate(ours, prompt, 30, use_cache=True), want)
    # the engine, its local layers' pool dropping blocks behind their window of 4
    assert_engine_serves_as_generate(ours, [ids[0, :9].tolist(), ids[1, 20:33].tolist()],
                                     block_size=4, num_blocks=48, max_batch=2)


def gemma_config(**overrides) -> GPTConfig:
    return GPTConfig(**{
        "vocab_size": 97, "context_length": 128, "emb_dim": 48, "n_heads": 4, "n_kv_heads": 1,
        "head_dim": 32, "n_layers": 6, "drop_rate": 0.0, "position": "rope",
        "rope_theta": 1e6, "rope_local_theta": 1e4, "norm": "rmsnorm1p", "norm_eps": 1e-6,
        "mlp": "geglu", "mlp_hidden_dim": 96, "qk_norm": True, "bias": False,
        "post_norms": True, "scale_embeddings": True, "tie_weights": True,
        "layer_windows": window_pattern("5:1", 4, 6), "attn_scale_dim": 24.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 32},
        "logit_softcap": 5.0, **overrides})


@pytest.mark.parametrize("tied", [True, False])
def test_a_gptmini_gemma_exports_to_transformers_with_equal_logits(tmp_path, tied):
    torch.manual_seed(1)
    ours = GPTModel(gemma_config(tie_weights=tied)).double().eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    export_hf(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["model_type"], written["query_pre_attn_scalar"], written["layer_types"],
            written["rope_local_base_freq"]) == (
        "gemma3_text", 24, ["sliding_attention"] * 5 + ["full_attention"], 1e4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, attn_implementation="eager").eval()
    assert isinstance(hf, transformers.Gemma3ForCausalLM)
    ids = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        assert relative(ours(ids), hf(ids).logits) <= 1e-6
    assert load_hf(tmp_path).cfg == ours.cfg  # and back, the same config


def test_gemma3_1bs_config_without_layer_types_reads_its_pattern():
    """Gemma 3 1B's config.json names sliding_window_pattern 6, not layer_types: every sixth
    layer is global, as transformers reads it; rope_parameters nested by layer type (what
    transformers 5 writes) reads as the published spelling does."""
    legacy = {**GEMMA, "num_hidden_layers": 8, "sliding_window_pattern": 6}
    cfg = config_from_gemma3(legacy)
    assert cfg.layer_windows == [4, 4, 4, 4, 4, None, 4, 4]
    nested = {k: v for k, v in legacy.items()
              if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    nested["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert config_from_gemma3(nested) == cfg


@pytest.mark.parametrize(("fields", "match"), [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 \\(transformers' Gemma3 "
                                       "does not apply it"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05 \\(Gemma uses it in its QK-norm too"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope scaling 'linear' on the sliding layers"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 3}, "layer_types="),
])
def test_what_gemma3_has_that_gptmini_does_not_compute_is_refused(fields, match):
    with pytest.raises(ValueError, match="this Gemma 3 config cannot be loaded into GPTModel: "
                                         f".*{match}"):
        config_from_gemma3({**GEMMA, **fields})


def test_a_model_that_is_not_gemmas_is_refused_naming_what_differs(tmp_path):
    cfg = gemma_config(post_norms=False, layer_windows=[4, 4, 8, 4, 4, None])
    with pytest.raises(ValueError, match=r"post_norms=False, layer windows of 2 sizes \[4, 8\]"):
        export_hf(GPTModel(cfg), tmp_path / "export")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3",
                                                      "architectures": ["Gemma3ForConditional"
                                                                        "Generation"]}))
    with pytest.raises(ValueError, match="model_type='gemma3'.*does not read.*'gemma3_text' "
                                         r"\(Gemma 3\)"):
        load_hf(tmp_path)


def test_the_pieces_equal_transformers_own():
    """Gemma's zero-centred RMSNorm and GeGLU, and the embedding scale as transformers keeps
    it (sqrt(640) rounds to 25.25 in bf16)."""
    from transformers.models.gemma3 import modeling_gemma3 as theirs

    from gptmini.attention.norm import ZeroCenteredRMSNorm
    from gptmini.variants.geglu import GeGLU

    torch.manual_seed(0)
    x = torch.randn(3, 5, 48)
    norm, their_norm = ZeroCenteredRMSNorm(48, eps=1e-6), theirs.Gemma3RMSNorm(48, eps=1e-6)
    assert torch.equal(norm.weight, torch.zeros(48))  # a gain of 1 to start
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
        their_norm.weight.copy_(norm.weight)
    torch.testing.assert_close(norm(x), their_norm(x))
    mlp = GeGLU(48, 96, bias=False)
    their_mlp = theirs.Gemma3MLP(transformers.Gemma3TextConfig(
        hidden_size=48, intermediate_size=96, num_attention_heads=4))
    their_mlp.load_state_dict(mlp.state_dict())
    torch.testing.assert_close(mlp(x), their_mlp(x))
    model = GPTModel(gemma_config(emb_dim=640, n_layers=1, layer_windows=None,
                                  rope_local_theta=None)).to(torch.bfloat16)
    assert float(model.emb_scale) == 25.25
