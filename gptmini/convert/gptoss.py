"""gpt-oss's Hugging Face layout (`GptOssForCausalLM`, model_type gpt_oss) to and from a
`GPTModel`.

gpt-oss is Llama's frame with these differences, each a GPTConfig option (`GPT_OSS` lists
them; none asks for gpt-oss by name):

    biases in q, k, v and o                       qkv_bias, bias
    a learned sink logit per head                 attn_sinks
    sliding and full layers alternating           layer_windows, from layer_types
    YaRN-scaled rotary positions                  rope_scaling
    clamped SwiGLU experts, a router with a bias  mlp "oss_moe" (gptmini.variants.oss_moe)

Its experts are stored fused: `mlp.experts.gate_up_proj` (E, d, 2h), the gate's and the
up projection's columns interleaved (gate at the even ones), `gate_up_proj_bias` (E, 2h),
`down_proj` (E, h, d) and `down_proj_bias` (E, d), each the transpose of a linear's weight;
they are split into each expert's projections and put back together on export. The
published checkpoints are MXFP4-quantized, refused by name: dequantize them first.
"""

from collections.abc import Mapping

import torch
from torch import Tensor

from gptmini.convert.rope import read_rope, rope_entries
from gptmini.convert.weights import (
    Layout,
    checked_config,
    config_integer,
    config_number,
    give_weights,
    model_from_weights,
    quantization_problem,
    take_weights,
    untaken,
    windows_of_types,
)
from gptmini.model import GPTConfig, GPTModel

__all__ = ["GPT_OSS", "LAYOUTS", "TABLE", "config_from_gptoss", "config_to_gptoss",
           "from_gptoss_state_dict", "to_gptoss_state_dict"]

TABLE: list[tuple[str, str]] = [  # (gptmini name, Hugging Face name); {i}: every layer
    ("tok_emb.weight", "model.embed_tokens.weight"),
    ("trf_blocks.{i}.norm1.weight", "model.layers.{i}.input_layernorm.weight"),
    *((f"trf_blocks.{{i}}.att.{ours}.{kind}", f"model.layers.{{i}}.self_attn.{theirs}.{kind}")
      for ours, theirs in (("W_query", "q_proj"), ("W_key", "k_proj"), ("W_value", "v_proj"),
                           ("out_proj", "o_proj"))
      for kind in ("weight", "bias")),
    ("trf_blocks.{i}.att.sinks", "model.layers.{i}.self_attn.sinks"),
    ("trf_blocks.{i}.norm2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("trf_blocks.{i}.ff.gate.weight", "model.layers.{i}.mlp.router.weight"),
    ("trf_blocks.{i}.ff.gate.bias", "model.layers.{i}.mlp.router.bias"),
    ("final_norm.weight", "model.norm.weight"),
    ("out_head.weight", "lm_head.weight"),
]
EXPERTS = "model.layers.{i}.mlp.experts."
"""The fused experts' tensors' prefix (gate_up_proj, gate_up_proj_bias, down_proj,
down_proj_bias)."""
GPT_OSS = {"position": "rope", "norm": "rmsnorm", "mlp": "oss_moe", "bias": True,
           "qkv_bias": True, "qk_norm": False, "attn_softcap": None, "window_size": None,
           "attn_sinks": True, "attn_gate": "none", "layer_kinds": None,
           "rope_local_theta": None, "attn_scale_dim": None,
           "post_norms": False, "scale_embeddings": False, "logit_softcap": None}
"""The GPTConfig options that make a model gpt-oss's architecture."""
OPTIONS = {"num_local_experts": "experts", "num_experts_per_tok": "top_k",
           "router_aux_loss_coef": "aux_loss_coef", "swiglu_alpha": "swiglu_alpha",
           "swiglu_limit": "swiglu_limit"}
"""gpt-oss's config.json fields -> the oss_moe feed-forward's mlp_options."""
ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
"""GptOssConfig's rope_parameters where a config.json has none."""


def config_from_gptoss(hf_config: Mapping) -> GPTConfig:
    """The GPTConfig of a gpt-oss `config.json` dict (GptOssConfig's defaults where a
    field is absent).

    Raises:
        ValueError: what the config asks for that GPTModel does not compute, named.
    """
    c = dict(hf_config)
    if all(c.get(key) is None for key in ("rope_parameters", "rope_scaling", "rope_theta")):
        c["rope_parameters"] = ROPE
    sizes = {name: config_integer(c, name, "gpt-oss", default) for name, default in (
        ("vocab_size", None), ("hidden_size", None), ("intermediate_size", None),
        ("num_hidden_layers", None), ("num_attention_heads", None),
        ("num_key_value_heads", None), ("head_dim", 64), ("max_position_embeddings", 131072),
        ("num_local_experts", 128), ("num_experts_per_tok", 4))}
    heads, layers = sizes["num_attention_heads"], sizes["num_hidden_layers"]
    problems = []
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (gpt-oss's experts are SiLU-gated)")
    if not c.get("attention_bias", True):
        problems.append("attention_bias=False (gptmini's gpt-oss layout has biases)")
    if c.get("quantization_config") is not None:
        problems.append(quantization_problem(c["quantization_config"]))
    theta, scaling = read_rope(c, "gpt-oss", problems)
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                     for i in range(layers)]  # GptOssConfig's default
    windows = windows_of_types(c, types, layers, "gpt-oss", problems)
    moe = {"num_local_experts": sizes["num_local_experts"],
           "num_experts_per_tok": sizes["num_experts_per_tok"],
           "router_aux_loss_coef": c.get("router_aux_loss_coef", 0.001),  # moe checks it
           **{name: config_number(c, name, "gpt-oss", default)
              for name, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0))}}
    if problems:
        raise ValueError("this gpt-oss config cannot be loaded into GPTModel: "
                         + "; ".join(problems))
    return checked_config(
        "gpt-oss", vocab_size=sizes["vocab_size"],
        context_length=sizes["max_position_embeddings"], emb_dim=sizes["hidden_size"],
        n_heads=heads, n_layers=layers, drop_rate=0.0, head_dim=sizes["head_dim"],
        n_kv_heads=None if sizes["num_key_value_heads"] == heads
        else sizes["num_key_value_heads"],
        tie_weights=bool(c.get("tie_word_embeddings", False)),
        norm_eps=config_number(c, "rms_norm_eps", "gpt-oss", 1e-5),
        rope_theta=theta, rope_scaling=scaling, layer_windows=windows,
        mlp_hidden_dim=sizes["intermediate_size"],
        mlp_options={ours: moe[theirs] for theirs, ours in OPTIONS.items()},
        **GPT_OSS)


def config_to_gptoss(cfg: GPTConfig) -> dict:
    """A `config.json` dict that `transformers.GptOssConfig` reads as `cfg`.

    Raises:
        ValueError: `cfg` is not gpt-oss's architecture (the options it lacks are named).
    """
    differ = [f"{k}={getattr(cfg, k)!r}" for k, v in GPT_OSS.items() if getattr(cfg, k) != v]
    sizes = sorted({w for w in cfg.layer_windows or [] if w is not None})
    if len(sizes) > 1:
        differ.append(f"layer windows of {len(sizes)} sizes {sizes} (gpt-oss has one)")
    if differ:
        raise ValueError(
            "gpt-oss's layout is rotary positions, RMSNorm, biased attention with sinks, "
            "gpt-oss's mixture of experts and one window size; this model has "
            f"{', '.join(differ)}. Export it with "
            + ", ".join(f"{k}={v!r}" for k, v in GPT_OSS.items()))
    moe = cfg.feed_forward()
    windows = cfg.layer_windows or [None] * cfg.n_layers
    return {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
        "vocab_size": cfg.vocab_width, "hidden_size": cfg.emb_dim,
        "intermediate_size": moe.hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size, "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps,
        **{theirs: getattr(moe, ours) for theirs, ours in OPTIONS.items()},
        "sliding_window": sizes[0] if sizes else cfg.context_length,
        "layer_types": ["full_attention" if w is None else "sliding_attention" for w in windows],
        **rope_entries(cfg.rope_theta, cfg.rope_scaling),
        "attention_bias": True, "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_weights, "output_router_logits": False,
        "initializer_range": 0.02, "use_cache": True,
    }


def _expand(n_layers: int) -> list[tuple[str, str]]:
    return [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in TABLE
            for i in (range(n_layers) if "{i}" in ours else [0])]


def from_gptoss_state_dict(state_dict: Mapping[str, Tensor], hf_config: Mapping) -> GPTModel:
    """A `GPTModel` (eval mode) holding a `GptOssForCausalLM`'s weights."""
    cfg = config_from_gptoss(hf_config)
    rows = _expand(cfg.n_layers) + _experts(cfg.n_layers)
    taken, seen = take_weights(state_dict, rows, cfg, "gpt-oss")
    ours = {name: w for name, w in taken.items() if "{e}" not in name}
    for pattern, hf_name in _experts(cfg.n_layers):
        for e, weights in enumerate(_split(hf_name, state_dict[hf_name])):
            ours.update({pattern.format(e=e, proj=proj): w for proj, w in weights.items()})
    return model_from_weights(cfg, ours, untaken(state_dict, seen), "gpt-oss")


def _experts(n_layers: int) -> list[tuple[str, str]]:
    """(gptmini's pattern, Hugging Face's fused tensor) per layer: `{e}` every expert and
    `{proj}` the projections the tensor holds (gate and up, or down)."""
    return [(f"trf_blocks.{i}.ff.experts.{{e}}.{{proj}}.{kind}", EXPERTS.format(i=i) + fused)
            for i in range(n_layers)
            for fused, kind in (("gate_up_proj", "weight"), ("gate_up_proj_bias", "bias"),
                                ("down_proj", "weight"), ("down_proj_bias", "bias"))]


def _split(hf_name: str, fused: Tensor) -> list[dict[str, Tensor]]:
    """Each expert's projections from one fused tensor, as linear layers hold them."""
    if hf_name.endswith(("down_proj", "down_proj_bias")):
        return [{"down_proj": w.T if w.dim() == 2 else w} for w in fused]
    return [{"gate_proj": w[..., 0::2].T if w.dim() == 2 else w[0::2],
             "up_proj": w[..., 1::2].T if w.dim() == 2 else w[1::2]} for w in fused]


def to_gptoss_state_dict(model: GPTModel) -> dict[str, Tensor]:
    """`GptOssForCausalLM` keys for `model`'s weights, the experts fused (contiguous
    copies; a tied head is left out, as `save_pretrained` does)."""
    config_to_gptoss(model.cfg)  # raises for what gpt-oss's layout cannot hold
    state = give_weights(model, _expand(model.cfg.n_layers))
    for i, block in enumerate(model.trf_blocks):
        experts = block.ff.experts
        gate, up, down = ([getattr(e, proj) for e in experts]
                          for proj in ("gate_proj", "up_proj", "down_proj"))
        prefix = EXPERTS.format(i=i)
        state[prefix + "gate_up_proj"] = _interleave(
            torch.stack([p.weight.T for p in gate]), torch.stack([p.weight.T for p in up]))
        state[prefix + "gate_up_proj_bias"] = _interleave(
            torch.stack([p.bias for p in gate]), torch.stack([p.bias for p in up]))
        state[prefix + "down_proj"] = torch.stack([p.weight.T for p in down])
        state[prefix + "down_proj_bias"] = torch.stack([p.bias for p in down])
    return {k: v.detach().contiguous() for k, v in state.items()}


def _interleave(gate: Tensor, up: Tensor) -> Tensor:
    """(..., h) and (..., h) -> (..., 2h), gate at the even columns."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


LAYOUTS = {"gpt_oss": Layout("gpt-oss", "GptOss", config_from_gptoss, from_gptoss_state_dict,
                             config_to_gptoss, to_gptoss_state_dict)}
"""The model_type this module reads and writes."""
