"""Llama-layout weights both ways: a GPTModel with Llama's options against transformers'
own LlamaForCausalLM, logits within 1e-5 in float32 and identical greedy tokens."""

import json
from dataclasses import replace

import pytest
import torch

from gptmini.attention.positions import apply_rope, rope_angles
from gptmini.checkpoint import load_checkpoint
from gptmini.convert import export_hf, load_hf
from gptmini.convert.llama import config_from_llama, interleaved_to_halves
from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import get_tokenizer

transformers = pytest.importorskip("transformers")

LLAMA = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6, "rope_theta": 500.0, "tie_word_embeddings": False}


def hf_llama(**overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**LLAMA, **overrides})
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms too, so a swapped norm cannot pass unseen
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_a_transformers_llama_loads_with_equal_logits_and_greedy_tokens(tmp_path):
    hf = hf_llama()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    cfg = ours.cfg
    assert (cfg.position, cfg.norm, cfg.mlp, cfg.bias, cfg.n_kv_heads, cfg.rope_theta,
            cfg.norm_eps, cfg.tie_weights) == ("rope", "rmsnorm", "swiglu", False, 2, 500.0,
                                               1e-6, False)
    ids = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)
    prompt = ids[:1, :5]
    want = hf.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20,
                       pad_token_id=0)
    assert torch.equal(generate(ours, prompt, 20, use_cache=True), want)


def test_a_gptmini_llama_exports_to_transformers_with_equal_logits(tmp_path):
    cfg = GPTConfig(vocab_size=257, context_length=64, emb_dim=32, n_heads=4, n_kv_heads=1,
                    n_layers=2, drop_rate=0.0, position="rope", norm="rmsnorm", mlp="swiglu",
                    bias=False, tie_weights=False, rope_theta=1000.0)
    torch.manual_seed(1)
    ours = GPTModel(cfg).eval()
    export_hf(ours, tmp_path, get_tokenizer("byte"))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 257, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-5, rtol=1e-5)
    prompt = ids[:1, :4]
    want = hf.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16,
                       pad_token_id=0)
    assert torch.equal(generate(ours, prompt, 16, use_cache=True), want)
    loaded = load_checkpoint(tmp_path)  # and back, with its vocabulary
    assert loaded.tokenizer.encode("to be") == get_tokenizer("byte").encode("to be")
    torch.testing.assert_close(loaded.model(ids), ours(ids))


def test_metas_interleaved_rotation_is_ours_after_permuting_the_rows():
    """Meta's layout rotates pairs (2i, 2i + 1); permuting each head's query rows makes our
    halves rotation compute the same vectors."""
    heads, head_dim, d_in = 2, 8, 6
    weight = torch.randn(heads * head_dim, d_in, dtype=torch.float64)
    x = torch.randn(5, d_in, dtype=torch.float64)
    positions = torch.arange(5)
    # Meta's: each head's vector as complex pairs (2i, 2i + 1), turned by position * w_i
    meta = (x @ weight.T).view(5, heads, head_dim // 2, 2)
    w = torch.tensor([10000.0 ** (-2 * i / head_dim) for i in range(head_dim // 2)],
                     dtype=torch.float64)
    turn = torch.polar(torch.ones(5, 1, head_dim // 2, dtype=torch.float64),
                       positions[:, None, None] * w)
    meta = torch.view_as_real(torch.view_as_complex(meta.contiguous()) * turn)  # (5,h,d/2,2)
    meta_halves = meta.transpose(-1, -2).reshape(5, heads, head_dim)  # reals, then imags
    ours = (x @ interleaved_to_halves(weight, heads).T).view(5, heads, head_dim)
    cos, sin = rope_angles(positions[None], head_dim, dtype=torch.float64)
    rotated = apply_rope(ours.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    torch.testing.assert_close(rotated, meta_halves)


def test_what_gptmini_cannot_load_is_named(tmp_path):
    with pytest.raises(ValueError, match="rope scaling 'longrope' in rope_scaling"):
        config_from_llama({**LLAMA, "rope_scaling": {"rope_type": "longrope", "factor": 8.0}})
    with pytest.raises(ValueError, match=r"Llama config cannot be loaded.*rope_scaling=.*llama3 "
                                         r"scaling.*low_freq_factor, high_freq_factor missing"):
        config_from_llama({**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="attention_bias/mlp_bias"):
        config_from_llama({**LLAMA, "attention_bias": True})
    hf_llama().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer.json: a Llama directory brings its own"):
        load_checkpoint(tmp_path)
    sentencepiece = {"model": {"type": "Unigram", "vocab": [["<unk>", 0.0]]},
                     "pre_tokenizer": {"type": "Metaspace"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(sentencepiece))
    with pytest.raises(ValueError, match="tiktoken, which represents byte-level BPE.*a Unigram "
                                         "model.*SentencePiece vocabularies such as Llama 2's"):
        load_checkpoint(tmp_path)


def test_qk_norm_exports_as_qwen3_and_a_transformers_qwen3_loads_back(tmp_path):
    """Qwen3 is Llama's layout with RMSNorm on each head's queries and keys before the
    rotation, as gptmini's qk_norm; transformers' own Qwen3 is the oracle both ways."""
    cfg = GPTConfig(vocab_size=257, context_length=64, emb_dim=32, n_heads=4, n_layers=2,
                    drop_rate=0.0, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                    qk_norm=True, norm_eps=1e-6, tie_weights=True, rope_theta=1000.0)
    torch.manual_seed(2)
    ours = GPTModel(cfg).eval()
    with torch.no_grad():  # random QK-norm gains, so unexported ones cannot pass unseen
        for block in ours.trf_blocks:
            block.att.q_norm.weight.uniform_(0.5, 1.5)
            block.att.k_norm.weight.uniform_(0.5, 1.5)
    export_hf(ours, tmp_path / "qwen3")
    assert json.loads((tmp_path / "qwen3" / "config.json").read_text())["model_type"] == "qwen3"
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "qwen3").eval()
    ids = torch.randint(0, 257, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-5, rtol=1e-5)
    # what docs/weights.md tells a user to call, whatever the layout the export took
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3").eval()
    assert isinstance(auto, transformers.Qwen3ForCausalLM)
    with torch.no_grad():
        assert torch.equal(auto(ids).logits, hf(ids).logits)
    hf.save_pretrained(tmp_path / "saved")
    back = load_hf(tmp_path / "saved")
    assert back.cfg.qk_norm and back.cfg.tie_weights
    with torch.no_grad():
        torch.testing.assert_close(back(ids), ours(ids), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="norm_eps=1e-05. Train with --model.norm_eps 1e-06"):
        export_hf(GPTModel(replace(cfg, norm_eps=1e-5)), tmp_path / "other")


def test_qwen3_layer_types_load_and_export_with_transformers_logits(tmp_path):
    """Qwen3's per-layer sliding windows (layer_types, sliding_window) are gptmini's
    layer_windows: transformers' own Qwen3 with a window of 5 on layers 0 and 2 is the
    oracle, loaded from it and exported back (config.json's layer_types), over 24 tokens
    (several windows), left-padded too."""
    torch.manual_seed(6)
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    config = transformers.Qwen3Config(**{**LLAMA, "num_hidden_layers": 3}, head_dim=8,
                                      use_sliding_window=True, sliding_window=5,
                                      layer_types=types, attn_implementation="eager")
    hf = transformers.Qwen3ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    assert ours.cfg.layer_windows == [5, None, 5]
    ids = torch.randint(0, 300, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        torch.testing.assert_close(ours(ids, mask)[1, 3:], want[1, 3:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours(ids)[0], hf(ids).logits[0], atol=1e-5, rtol=1e-5)
        full = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **{**LLAMA, "num_hidden_layers": 3}, head_dim=8)).eval()
        full.load_state_dict(hf.state_dict())
        assert not torch.allclose(full(ids).logits, hf(ids).logits, atol=1e-3)  # windows bite
    export_hf(ours, tmp_path / "ours")
    exported = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (exported["layer_types"], exported["sliding_window"]) == (types, 5)
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids), atol=1e-5, rtol=1e-5)
    mixed = GPTModel(replace(ours.cfg, layer_windows=[5, None, 3]))
    with pytest.raises(ValueError, match=r"one sliding_window for every windowed layer.*"
                                         r"windows \[3, 5\]"):
        export_hf(mixed, tmp_path / "mixed")
