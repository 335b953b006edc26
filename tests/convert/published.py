"""The published config.json of each model docs/weights.md says loads, as the Hugging Face
Hub serves it (the fields that shape the model; tokenizer ids and dtypes left out), and how
tests/convert/test_published_shapes.py shrinks each to run on a CPU in seconds.

What a shrunk config keeps: the head size, query and key/value heads, rope type and every
rope setting, rope_theta (and Gemma's local base), the norms and their epsilon, the
activation, tie_word_embeddings, the sliding window and layer pattern, query_pre_attn_scalar.
What it changes: fewer layers (Gemma keeps six, one whole 5:1 period, so a global layer is
among them); a smaller intermediate_size; a vocabulary of 256 rows (the published 128k-262k
rows in float64 weigh 1-2 GB and check nothing more: tying, Gemma's scaled embeddings and
the head are the same code at any size); and, where the head size is the model's own
(Qwen3's and Gemma's head_dim differs from hidden_size / heads), a width of 64. Llama's
head size is its width / its heads, so its width stays the published one.
"""

import copy

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "use_cache": True,
    "vocab_size": 128256}

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "use_cache": True,
    "vocab_size": 128256}

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
    "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 40960,
    "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}

QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
"""Qwen3's long-context setting, as its model cards tell a user to add it (131,072 tokens)."""

GEMMA_3_270M = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "_sliding_window_pattern": 6, "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640, "initializer_range": 0.02,
    "intermediate_size": 2048,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 18,
    "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": 512, "use_bidirectional_attention": False, "use_cache": True,
    "vocab_size": 262144}

GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
    "sliding_window_pattern": 6, "use_cache": True, "vocab_size": 262144}

PUBLISHED = {
    "Llama 3.2 1B": LLAMA_3_2_1B,
    "Llama 3.1 8B": LLAMA_3_1_8B,
    "Qwen3-0.6B": QWEN3_0_6B,
    "Qwen3-4B": QWEN3_4B,
    "Qwen3-4B + YaRN": {**QWEN3_4B, "rope_scaling": QWEN3_YARN,
                        "max_position_embeddings": 131072},
    "Gemma 3 270M": GEMMA_3_270M,
    "Gemma 3 1B": GEMMA_3_1B,
}
"""Every published config docs/weights.md lists, by the name it has there."""

SHRINK = {  # name: the fields changed (see the module docstring)
    "Llama 3.2 1B": {"num_hidden_layers": 2},
    "Llama 3.1 8B": {"num_hidden_layers": 1},  # 4096 wide: one layer is 42M weights
    "Qwen3-0.6B": {"num_hidden_layers": 2, "hidden_size": 64},
    "Qwen3-4B": {"num_hidden_layers": 2, "hidden_size": 64},
    "Qwen3-4B + YaRN": {"num_hidden_layers": 2, "hidden_size": 64},
    "Gemma 3 270M": {"num_hidden_layers": 6, "hidden_size": 64,
                     "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
    "Gemma 3 1B": {"num_hidden_layers": 6, "hidden_size": 64},
}


def shrunk(name: str) -> dict:
    """The published config of `name`, shrunk to run on a CPU in float64 in seconds (a
    copy: transformers' configs write into the rope dicts they are given)."""
    return copy.deepcopy({**PUBLISHED[name], "intermediate_size": 128, "vocab_size": 256,
                          **SHRINK[name]})
