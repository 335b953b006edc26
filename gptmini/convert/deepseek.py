"""DeepSeek-V3's Hugging Face layout to and from a `GPTModel` of multi-head latent attention.

A GPTConfig with multi-head latent attention in every layer (layer_kinds "mla"), rotary
positions, RMSNorm, SwiGLU and no biases is a DeepSeek-V3 whose every layer is dense:
`first_k_dense_replace = num_hidden_layers`, so that no layer has a mixture of experts
(gptmini's, gptmini.variants.moe, is Qwen3-MoE's: it has none of DeepSeek's shared experts
or grouped, biased routing). Its attention
parameters already carry DeepSeek's names (gptmini.variants.latent), so the table below is
the block's frame (norms, MLP, embeddings) plus `o_proj`, gptmini's `out_proj`.

Rotary layout: DeepSeek's checkpoints rotate interleaved pairs (2i, 2i + 1) of the rotary
part (`rope_interleave`, true by default in transformers); gptmini rotates halves (i,
i + rope_dim / 2). Loading reorders the rotary rows of the query projection and of the
rotary key's rows in `kv_a_proj_with_mqa` into halves (a config with rope_interleave false
loads as it is); exporting writes the interleaved layout, DeepSeek's, with rope_interleave
true, so a reader that assumes DeepSeek's layout reads it too.

What does not map is refused by name: mixture-of-experts layers, attention biases, rope
scaling (DeepSeek-V3's own YaRN), another activation, an RMSNorm epsilon other than 1e-6
(gptmini normalizes MLA's latents with DeepSeek's 1e-6, so the model's norms must use it
too), quantized weights.
"""

from collections.abc import Mapping

import torch
from torch import Tensor

from gptmini.convert.llama import TABLE as LLAMA_TABLE
from gptmini.convert.llama import interleaved_to_halves
from gptmini.convert.rope import rope_base
from gptmini.convert.weights import (
    Layout,
    config_integer,
    config_number,
    model_from_weights,
    quantization_problem,
    take_weights,
    untaken,
)
from gptmini.model import GPTConfig, GPTModel

__all__ = ["DEEPSEEK", "LATENT_NORM_EPS", "LAYOUTS", "config_from_deepseek", "config_to_deepseek",
           "from_deepseek_state_dict", "latent_dims", "to_deepseek_state_dict"]

LATENT_NORM_EPS = 1e-6
"""The epsilon of MLA's latent RMSNorms (MultiHeadLatentAttention's default, DeepSeek's);
DeepSeek-V3 uses its one rms_norm_eps everywhere, so a model maps only with norm_eps equal
to it."""
DEEPSEEK = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
            "qkv_bias": False, "qk_norm": False, "attn_softcap": None, "window_size": None,
            "layer_windows": None, "attn_sinks": False, "attn_gate": "none",
            "n_kv_heads": None, "norm_eps": LATENT_NORM_EPS,
            "rope_scaling": None, "rope_local_theta": None, "post_norms": False,
            "scale_embeddings": False, "logit_softcap": None}
"""The GPTConfig options a dense DeepSeek-V3 has, beside MLA in every layer."""

# (gptmini name, Hugging Face name); {i}: every layer. A dense DeepSeek-V3 is Llama's
# frame (embedding, norms, output projection, SwiGLU, head) around MLA's projections.
_FRAME = tuple(row for row in LLAMA_TABLE if ".att.W_" not in row[0]) + (
    ("trf_blocks.{i}.att.kv_a_proj_with_mqa.weight",
     "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"),
    ("trf_blocks.{i}.att.kv_a_layernorm.weight",
     "model.layers.{i}.self_attn.kv_a_layernorm.weight"),
    ("trf_blocks.{i}.att.kv_b_proj.weight", "model.layers.{i}.self_attn.kv_b_proj.weight"),
)
_FULL_QUERY = (("trf_blocks.{i}.att.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),)
_QUERY_LATENT = (  # with q_lora_rank: the query through its own latent
    ("trf_blocks.{i}.att.q_a_proj.weight", "model.layers.{i}.self_attn.q_a_proj.weight"),
    ("trf_blocks.{i}.att.q_a_layernorm.weight",
     "model.layers.{i}.self_attn.q_a_layernorm.weight"),
    ("trf_blocks.{i}.att.q_b_proj.weight", "model.layers.{i}.self_attn.q_b_proj.weight"),
)


def _expand(cfg: GPTConfig) -> list[tuple[str, str]]:
    table = _FRAME + (_FULL_QUERY if latent_dims(cfg)["q_lora_rank"] is None
                      else _QUERY_LATENT)
    return [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in table
            for i in (range(cfg.n_layers) if "{i}" in ours else [0])]


def latent_dims(cfg: GPTConfig) -> dict:
    """The sizes of `cfg`'s multi-head latent attention, defaults filled in, under DeepSeek's
    names (what its first layer's mixer works out: gptmini.variants.latent)."""
    return cfg.mixers()[0].dims


def config_from_deepseek(hf_config: Mapping) -> GPTConfig:
    """The GPTConfig of a DeepSeek-V3 `config.json` dict whose every layer is dense.

    Absent fields take transformers' DeepseekV3Config defaults, as transformers reads them
    (q_lora_rank 1536, first_k_dense_replace 3, ...).

    Raises:
        ValueError: naming what the config asks for that GPTModel does not have.
    """
    c = dict(hf_config)
    sizes = {name: config_integer(c, name, "DeepSeek-V3") for name in (
        "vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers",
        "intermediate_size", "max_position_embeddings")}
    heads, layers = sizes["num_attention_heads"], sizes["num_hidden_layers"]
    latent = {name: config_integer(c, name, "DeepSeek-V3", default) for name, default in (
        ("kv_lora_rank", 512), ("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64),
        ("v_head_dim", 128))}
    q_rank = c.get("q_lora_rank", 1536)
    if q_rank is not None:
        q_rank = config_integer(c, "q_lora_rank", "DeepSeek-V3")
    problems = []
    dense = c.get("first_k_dense_replace", 3)
    if not isinstance(dense, int) or dense < layers:
        problems.append(f"first_k_dense_replace={dense!r} below num_hidden_layers={layers} "
                        "(mixture-of-experts layers of DeepSeek's, which gptmini does not "
                        "compute: only a DeepSeek-V3 with first_k_dense_replace >= "
                        "num_hidden_layers loads)")
    theta, rope_problems = rope_base(c, "DeepSeek-V3")
    problems += rope_problems
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (SwiGLU here is SiLU-gated)")
    if c.get("attention_bias"):
        problems.append("attention_bias (gptmini's DeepSeek-V3 layout has no biases)")
    if c.get("num_key_value_heads") not in (None, heads):
        problems.append(f"num_key_value_heads={c['num_key_value_heads']!r} (MLA expands "
                        f"its latent into every one of the {heads} heads)")
    norm_eps = config_number(c, "rms_norm_eps", "DeepSeek-V3", 1e-6)
    if norm_eps != LATENT_NORM_EPS:
        problems.append(f"rms_norm_eps={norm_eps} (gptmini normalizes MLA's latents with "
                        f"{LATENT_NORM_EPS})")
    if latent["qk_rope_head_dim"] % 2:
        problems.append(f"qk_rope_head_dim={latent['qk_rope_head_dim']} (rotary dimensions "
                        "turn in pairs)")
    if c.get("quantization_config") is not None:
        problems.append(quantization_problem(c["quantization_config"]))
    if problems:
        raise ValueError("this DeepSeek-V3 config cannot be loaded into GPTModel: "
                         + "; ".join(problems))
    return GPTConfig(
        vocab_size=sizes["vocab_size"], context_length=sizes["max_position_embeddings"],
        emb_dim=sizes["hidden_size"], n_heads=heads, n_layers=layers, drop_rate=0.0,
        tie_weights=bool(c.get("tie_word_embeddings", False)), rope_theta=theta,
        mlp_hidden_dim=sizes["intermediate_size"], layer_kinds=["mla"] * layers,
        mixer_options={"mla": {**latent, "q_lora_rank": q_rank}}, **DEEPSEEK)


def config_to_deepseek(cfg: GPTConfig) -> dict:
    """A `config.json` dict that `transformers.DeepseekV3Config` reads as `cfg`: every layer
    dense, the rotary part interleaved (DeepSeek's layout).

    Raises:
        ValueError: `cfg` has no multi-head latent attention, or options DeepSeek-V3 lacks
            (each named, with the value it needs).
    """
    mixers = cfg.mixers()
    if any(mixer.hf_layout != "deepseek_v3" for mixer in mixers):
        raise ValueError("DeepSeek-V3's layout holds multi-head latent attention in every "
                         f"layer; this model has {', '.join(sorted({m.title for m in mixers}))} "
                         "(GPTConfig.layer_kinds: mla in every layer)")
    differ = [f"{k}={getattr(cfg, k)!r}" for k, v in DEEPSEEK.items() if getattr(cfg, k) != v]
    if differ:
        raise ValueError(
            "DeepSeek-V3's layout is multi-head latent attention with rotary positions, "
            "RMSNorm (epsilon 1e-6, its latents' too), SwiGLU, no biases, no soft-cap, window, "
            f"sinks or gate; this model has {', '.join(differ)}. Export it with "
            + ", ".join(f"{k}={v!r}" for k, v in DEEPSEEK.items()))
    dims = mixers[0].dims
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": cfg.vocab_width,
        "hidden_size": cfg.emb_dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "first_k_dense_replace": cfg.n_layers,  # every layer dense: no experts
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        **{name: dims[name] for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                         "qk_rope_head_dim", "v_head_dim")},
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "rope_interleave": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_weights,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _rotary_rows(cfg: GPTConfig, dims: dict, name: str) -> tuple[int, int, int] | None:
    """For a weight whose rows hold a rotary part: (groups, rows per group, where the
    rotary part starts in a group), or None. The query has one group per head, each
    [nope | rope]; kv_a_proj_with_mqa one group, [latent | rotary key]."""
    if name.endswith(("att.q_proj.weight", "att.q_b_proj.weight")):
        return cfg.n_heads, dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"], \
            dims["qk_nope_head_dim"]
    if name.endswith("att.kv_a_proj_with_mqa.weight"):
        return 1, dims["kv_lora_rank"] + dims["qk_rope_head_dim"], dims["kv_lora_rank"]
    return None


def _reorder_rotary(weight: Tensor, cfg: GPTConfig, dims: dict, name: str, to_halves: bool
                    ) -> Tensor:
    """`weight` with the rotary rows of every group turned from interleaved pairs into
    halves (`to_halves`) or back; other weights as they are."""
    found = _rotary_rows(cfg, dims, name)
    if found is None:
        return weight
    groups, per_group, start = found
    rope = per_group - start
    grouped = weight.reshape(groups, per_group, -1)  # (groups, rows per group, in)
    rotary = grouped[:, start:].reshape(groups * rope, -1)
    if to_halves:
        rotary = interleaved_to_halves(rotary, groups)
    else:  # (groups, 2, rope / 2, in) -> (groups, rope / 2, 2, in): pairs again
        rotary = rotary.view(groups, 2, rope // 2, -1).transpose(1, 2).reshape(groups * rope, -1)
    return torch.cat([grouped[:, :start], rotary.view(groups, rope, -1)], dim=1).reshape(
        weight.shape)


def from_deepseek_state_dict(state_dict: Mapping[str, Tensor], hf_config: Mapping) -> GPTModel:
    """A `GPTModel` (eval mode) holding a dense `DeepseekV3ForCausalLM`'s weights."""
    cfg = config_from_deepseek(hf_config)
    interleaved = hf_config.get("rope_interleave", True)  # transformers' default
    ours, seen = take_weights(state_dict, _expand(cfg), cfg, "DeepSeek-V3")
    if interleaved:
        dims = latent_dims(cfg)
        ours = {name: _reorder_rotary(weight, cfg, dims, name, to_halves=True)
                for name, weight in ours.items()}
    return model_from_weights(cfg, ours, untaken(state_dict, seen), "DeepSeek-V3")


def to_deepseek_state_dict(model: GPTModel) -> dict[str, Tensor]:
    """`DeepseekV3ForCausalLM` keys for `model`'s weights, the rotary rows interleaved as
    `config_to_deepseek` says (contiguous copies; a tied head is left out, as
    `save_pretrained` does)."""
    cfg = model.cfg
    config_to_deepseek(cfg)  # raises for what DeepSeek-V3's layout cannot hold
    ours, dims = model.state_dict(), latent_dims(cfg)
    return {hf_name: _reorder_rotary(ours[name].detach(), cfg, dims, name, to_halves=False)
            .clone().contiguous()
            for name, hf_name in _expand(cfg)
            if not (name == "out_head.weight" and cfg.tie_weights)}


LAYOUTS = {"deepseek_v3": Layout("DeepSeek-V3, every layer dense", "DeepseekV3",
                                 config_from_deepseek, from_deepseek_state_dict,
                                 config_to_deepseek, to_deepseek_state_dict)}
"""The model_type this module reads and writes (gptmini.convert.weights.Layout)."""
