"""Hugging Face directories gptmini cannot read are refused naming the file, the field and
what gptmini reads (issue 36 items 4, 10, 11): never a KeyError, never a model that
silently computes something else."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptmini.checkpoint import load_checkpoint
from gptmini.convert import config_from_llama, export_hf, load_hf
from gptmini.model import GPTConfig, GPTModel

GPT2 = {"model_type": "gpt2", "vocab_size": 64, "n_positions": 32, "n_embd": 32,
        "n_layer": 2, "n_head": 4}
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 1, "head_dim": 16}
DEEPSEEK_V3 = {  # DeepSeek-V3's own config.json, its sizes and what gptmini cannot compute
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_attention_heads": 128, "num_key_value_heads": 128,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}


def directory_with(tmp_path, config) -> str:
    """A directory holding `config` as config.json (text as it is) beside some weights."""
    text = config if isinstance(config, str | bytes) else json.dumps(config)
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    return tmp_path


CASES = {
    "a list": ([GPT2], r"config.json holds a JSON list, not an object"),
    "not JSON": (b"\x89PNG\r\n\x1a\n\x00binary", r"config.json is not JSON"),
    "text, not JSON": ("n_embd: 32", r"config.json is not JSON"),
    "GPT-2 without n_embd": ({k: v for k, v in GPT2.items() if k != "n_embd"},
                             r"config.json: the GPT-2 config has no 'n_embd'.*positive integer"),
    "n_embd a string": ({**GPT2, "n_embd": "32"}, r"'n_embd' is '32'; gptmini reads a positive"),
    "n_head 0": ({**GPT2, "n_head": 0}, r"'n_head' is 0"),
    "n_layer negative": ({**GPT2, "n_layer": -2}, r"'n_layer' is -2"),
    "vocab_size true": ({**GPT2, "vocab_size": True}, r"'vocab_size' is True"),
    "n_positions a float": ({**GPT2, "n_positions": 32.5}, r"'n_positions' is 32.5"),
    "layer_norm_epsilon NaN": ({**GPT2, "layer_norm_epsilon": float("nan")},
                               r"'layer_norm_epsilon' is nan; gptmini reads a finite positive"),
    "a quantized GPT-2": ({**GPT2, "quantization_config": {"quant_method": "bitsandbytes"}},
                          r"quantization_config \(quant_method='bitsandbytes'"),
    "Llama without hidden_size": ({k: v for k, v in LLAMA.items() if k != "hidden_size"},
                                  r"config.json: the Llama config has no 'hidden_size'"),
    "rope_scaling a string": ({**LLAMA, "rope_scaling": "linear"},
                              r"rope_scaling='linear' \(gptmini reads an object"),
    "linear scaling beside default rope_parameters": (
        {**LLAMA, "rope_parameters": DEFAULT_ROPE,
         "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        r"rope_parameters and rope_scaling that disagree .*: keep one"),
    "a factor without a type": ({**LLAMA, "rope_scaling": {"factor": 2.0}},
                                r"rope_scaling with factor=2.0 and rope_type None"),
    "rope_parameters of a type gptmini does not compute": (
        {**LLAMA, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0}},
        r"rope scaling 'dynamic' in rope_parameters \(gptmini computes linear, llama3, yarn"),
    "a partial rotary factor": (
        {**LLAMA, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
        r"rope_parameters with partial_rotary_factor=0.5"),
    "a yarn factor below 1": (
        {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 0.5}},
        r"rope_scaling=.*'yarn'.*factor is 0.5: .*factor of 1 or more"),
    "llama3 with a setting it does not read": (
        {**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "beta_fast": 32}},
        r"llama3 scaling reads .*; beta_fast is not one of them"),
    "rope_theta infinite": ({**LLAMA, "rope_theta": float("inf")},
                            r"'rope_theta' is inf; gptmini reads a finite positive number"),
    "two rope_theta": ({**LLAMA, "rope_parameters": {"rope_type": "default",
                                                     "rope_theta": 5e5}},
                       r"rope_theta values that differ \(\[10000.0, 500000.0\]\)"),
    "a quantized Llama": ({**LLAMA, "quantization_config": {"quant_method": "fp8"}},
                          r"quant_method='fp8'"),
    # gptmini reads a DeepSeek-V3 whose every layer is dense (gptmini.convert.deepseek)
    "DeepSeek-V3": (DEEPSEEK_V3, r"config.json: this DeepSeek-V3 config cannot be loaded into "
                                 r"GPTModel: first_k_dense_replace=3 below num_hidden_layers=61 "
                                 r"\(mixture-of-experts.*rope scaling 'yarn'.*"
                                 r"quant_method='fp8'"),
    "Gemma 3 with an attention soft-cap": (
        {**GEMMA3, "attn_logit_softcapping": 50.0},
        r"this Gemma 3 config cannot be loaded.*attn_logit_softcapping=50.0 \(transformers' "
        r"Gemma3 does not apply it"),
    "Gemma 3 with scaled local layers": (
        {**GEMMA3, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
        r"rope scaling 'yarn' on the sliding layers"),
    "the multimodal Gemma 3": ({"model_type": "gemma3",
                                "architectures": ["Gemma3ForConditionalGeneration"]},
                               r"model_type='gemma3'.*does not read"),
    "only architectures, another one": ({"architectures": ["MistralForCausalLM"]},
                                        r"'MistralForCausalLM'.*does not read"),
    "model_type a list": ({**GPT2, "model_type": ["gpt2"]}, r"model_type=\['gpt2'\]"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_config_gptmini_cannot_read_is_named(tmp_path, case):
    config, match = CASES[case]
    directory = directory_with(tmp_path, config)
    with pytest.raises(ValueError, match=match) as caught:
        load_hf(directory)
    assert str(tmp_path / "config.json") in str(caught.value)
    with pytest.raises(ValueError, match=match):  # every loader of a directory says the same
        load_checkpoint(directory)


def llama_directory(tmp_path):
    cfg = GPTConfig(vocab_size=64, context_length=32, emb_dim=32, n_heads=4, n_layers=1,
                    drop_rate=0.0, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                    norm_eps=1e-6)
    return export_hf(GPTModel(cfg), tmp_path / "llama")


def test_quantized_weights_are_refused_not_copied_without_their_scales(tmp_path):
    directory = llama_directory(tmp_path)
    weights = directory / "model.safetensors"
    state = load_file(weights)
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = torch.randint(-127, 127, state[name].shape, dtype=torch.int8)
    save_file(state, weights)
    with pytest.raises(ValueError, match=rf"quantized weights \({name} is torch.int8\)"):
        load_hf(directory)
    state[name] = state[name].to(torch.float8_e4m3fn)
    save_file(state, weights)
    with pytest.raises(ValueError, match=r"is torch.float8_e4m3fn"):
        load_hf(directory)


def test_a_tokenizer_json_that_is_not_json_names_the_file(tmp_path):
    directory = llama_directory(tmp_path)
    (directory / "tokenizer.json").write_bytes(b"\x00\x01 not json")
    with pytest.raises(ValueError, match=r"llama/tokenizer.json is not JSON"):
        load_checkpoint(directory)
    (directory / "tokenizer.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"tokenizer.json holds a JSON list, not an object"):
        load_checkpoint(directory)
    (directory / "tokenizer.json").write_text('{"model": "BPE"}')
    with pytest.raises(ValueError, match=r"tokenizer.json cannot be used"):
        load_checkpoint(directory)


def test_a_sharded_index_without_a_weight_map_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT2))
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"index.json has no 'weight_map'"):
        load_hf(tmp_path)


def test_the_default_rope_entries_transformers_writes_still_load():
    config = {**LLAMA, "rope_parameters": DEFAULT_ROPE, "rope_scaling": None}
    assert config_from_llama(config).rope_theta == 10000.0
    assert config_from_llama({**LLAMA, "rope_scaling": {"type": "default"}}).position == "rope"


BOOK = {"vocab_size": 64, "context_length": 32, "emb_dim": 32, "n_heads": 4, "n_layers": 1,
        "drop_rate": 0.0}
LLAMA_OPTIONS = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
                 "norm_eps": 1e-6}
EXPORT_CASES = {  # issue 45's options, each in a layout that has no place for it
    "GPT-2 with heads of their own size": ({"head_dim": 16}, r"head_dim=16 \(heads of their"),
    "GPT-2 with post-sublayer norms": ({"post_norms": True}, "post_norms=True"),
    "GPT-2 with a soft-capped head": ({"logit_softcap": 30.0}, "logit_softcap=30.0"),
    "Llama with scaled embeddings": ({**LLAMA_OPTIONS, "scale_embeddings": True},
                                     "scale_embeddings=True"),
    "Llama with a local rope base": ({**LLAMA_OPTIONS, "rope_local_theta": 1e4},
                                     "rope_local_theta=10000.0"),
    "Llama with a score scale": ({**LLAMA_OPTIONS, "attn_scale_dim": 16.0},
                                 "attn_scale_dim=16.0"),
    "DeepSeek-V3 with rope scaling": ({**LLAMA_OPTIONS, "layer_kinds": ["mla"],
                                       "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                      "rope_scaling=.*'linear'"),
}


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_an_option_a_layout_has_no_place_for_is_named_on_export(tmp_path, case):
    fields, match = EXPORT_CASES[case]
    with pytest.raises(ValueError, match=match):
        export_hf(GPTModel(GPTConfig(**{**BOOK, **fields})), tmp_path / "export")
