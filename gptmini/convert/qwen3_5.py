"""Qwen3.5's Hugging Face layout, its text model (`Qwen3_5ForCausalLM`, model_type
qwen3_5_text), to and from a `GPTModel`.

Qwen3.5 is Qwen3's frame with these differences, each a GPTConfig option (`QWEN3_5` lists
them; none asks for Qwen3.5 by name):

    three Gated DeltaNet layers per attention layer    layer_kinds, from layer_types
    DeltaNet's own head counts and sizes                mixer_options["deltanet"]
    a sigmoid gate on each attention output channel     attn_gate "elementwise"
    RMSNorm's gain 1 + weight (QK-norm's too)           norm "rmsnorm1p"
    a quarter of each head turns                        rope_scaling's partial_rotary_factor

Its attention's query projection holds each head's query and gate rows one after the
other, and a DeltaNet layer's `in_proj_qkv` its queries', keys' and values' rows: both are
split into gptmini's projections and put back together on export. Its rotary positions are
M-RoPE, which for text (the same position in every section) is plain RoPE: mrope_section
and mrope_interleaved are read and set aside. The published Qwen3.5 checkpoints are the
multimodal model (model_type qwen3_5, the text model under `text_config`), another layout.
"""

from collections.abc import Mapping

import torch
from torch import Tensor

from gptmini.convert.llama import QK_NORM_EPS
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
)
from gptmini.model import GPTConfig, GPTModel

__all__ = ["DELTANET", "LAYOUTS", "QWEN3_5", "config_from_qwen3_5", "config_to_qwen3_5",
           "from_qwen3_5_state_dict", "to_qwen3_5_state_dict"]

FRAME: list[tuple[str, str]] = [  # (gptmini name, Hugging Face name); {i}: every layer
    ("tok_emb.weight", "model.embed_tokens.weight"),
    ("trf_blocks.{i}.norm1.weight", "model.layers.{i}.input_layernorm.weight"),
    ("trf_blocks.{i}.norm2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    *((f"trf_blocks.{{i}}.ff.{proj}.weight", f"model.layers.{{i}}.mlp.{proj}.weight")
      for proj in ("gate_proj", "up_proj", "down_proj")),
    ("final_norm.weight", "model.norm.weight"),
    ("out_head.weight", "lm_head.weight"),
]
ATTENTION = [  # a full-attention layer's rows ({a}: trf_blocks.{i}.att, {h}: its HF module)
    ("{a}.W_key.weight", "{h}.k_proj.weight"), ("{a}.W_value.weight", "{h}.v_proj.weight"),
    ("{a}.out_proj.weight", "{h}.o_proj.weight"), ("{a}.q_norm.weight", "{h}.q_norm.weight"),
    ("{a}.k_norm.weight", "{h}.k_norm.weight"),
]
DELTANET_ROWS = [  # a Gated DeltaNet layer's rows, the same way
    ("{a}.W_gate.weight", "{h}.in_proj_z.weight"), ("{a}.W_beta.weight", "{h}.in_proj_b.weight"),
    ("{a}.W_decay.weight", "{h}.in_proj_a.weight"), ("{a}.conv1d.weight", "{h}.conv1d.weight"),
    ("{a}.A_log", "{h}.A_log"), ("{a}.dt_bias", "{h}.dt_bias"),
    ("{a}.norm_weight", "{h}.norm.weight"), ("{a}.out_proj.weight", "{h}.out_proj.weight"),
]
LAYER_TYPES = {"linear_attention": "deltanet", "full_attention": "attention"}
"""Qwen3.5's layer_types -> gptmini's token mixers (layer_kinds)."""
HF_MODULE = {"deltanet": "linear_attn", "attention": "self_attn"}
DELTANET = {"linear_num_value_heads": ("num_heads", 32), "linear_num_key_heads":
            ("num_key_heads", 16), "linear_key_head_dim": ("head_dim", 128),
            "linear_value_head_dim": ("value_head_dim", 128),
            "linear_conv_kernel_dim": ("conv_kernel", 4)}
"""Qwen3.5's config.json fields -> the deltanet mixer's options (and Qwen3_5TextConfig's
defaults)."""
QWEN3_5 = {"position": "rope", "norm": "rmsnorm1p", "mlp": "swiglu", "bias": False,
           "qkv_bias": False, "qk_norm": True, "attn_gate": "elementwise",
           "attn_softcap": None, "window_size": None, "layer_windows": None,
           "attn_sinks": False, "rope_local_theta": None, "attn_scale_dim": None,
           "post_norms": False, "scale_embeddings": False, "logit_softcap": None,
           "norm_eps": QK_NORM_EPS}
"""The GPTConfig options that make a model Qwen3.5's architecture (its one rms_norm_eps
gptmini's QK-norm's)."""
M_ROPE = ("mrope_section", "mrope_interleaved")


def config_from_qwen3_5(hf_config: Mapping) -> GPTConfig:
    """The GPTConfig of a Qwen3.5 text `config.json` dict (Qwen3_5TextConfig's defaults
    where a field is absent).

    Raises:
        ValueError: what the config asks for that GPTModel does not compute, named.
    """
    c = dict(hf_config)
    sizes = {name: config_integer(c, name, "Qwen3.5", default) for name, default in (
        ("vocab_size", None), ("hidden_size", None), ("intermediate_size", None),
        ("num_hidden_layers", None), ("num_attention_heads", None),
        ("num_key_value_heads", None), ("head_dim", 256), ("max_position_embeddings", 32768))}
    heads, layers = sizes["num_attention_heads"], sizes["num_hidden_layers"]
    problems = []
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (SwiGLU here is SiLU-gated)")
    if c.get("attention_bias"):
        problems.append("attention_bias (gptmini's Qwen3.5 layout has no biases)")
    if c.get("quantization_config") is not None:
        problems.append(quantization_problem(c["quantization_config"]))
    eps = config_number(c, "rms_norm_eps", "Qwen3.5", 1e-6)
    if eps != QK_NORM_EPS:
        problems.append(f"rms_norm_eps={eps} (Qwen3.5 uses it in its QK-norm too, and "
                        f"gptmini's QK-norm uses {QK_NORM_EPS})")
    rope = {k: v for k, v in (c.get("rope_parameters") or {}).items() if k not in M_ROPE}
    rope.setdefault("partial_rotary_factor", 0.25)  # Qwen3_5TextConfig's
    theta, scaling = read_rope({**c, "rope_parameters": rope}, "Qwen3.5", problems,
                               partial=True)
    types = c.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0
                                     else "linear_attention" for i in range(layers)]
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in LAYER_TYPES for t in types)):
        problems.append(f"layer_types={types!r} (gptmini reads a list of num_hidden_layers="
                        f"{layers} entries, each one of {', '.join(LAYER_TYPES)})")
    deltanet = {ours: config_integer(c, theirs, "Qwen3.5", default)
                for theirs, (ours, default) in DELTANET.items()}
    if problems:
        raise ValueError("this Qwen3.5 config cannot be loaded into GPTModel: "
                         + "; ".join(problems))
    kinds = [LAYER_TYPES[t] for t in types]
    return checked_config(
        "Qwen3.5", vocab_size=sizes["vocab_size"],
        context_length=sizes["max_position_embeddings"], emb_dim=sizes["hidden_size"],
        n_heads=heads, n_layers=layers, drop_rate=0.0, head_dim=sizes["head_dim"],
        n_kv_heads=None if sizes["num_key_value_heads"] == heads
        else sizes["num_key_value_heads"],
        tie_weights=bool(c.get("tie_word_embeddings", False)), rope_theta=theta,
        rope_scaling=scaling, mlp_hidden_dim=sizes["intermediate_size"], layer_kinds=kinds,
        mixer_options={"deltanet": deltanet} if "linear_attention" in types else None,
        **QWEN3_5)


def config_to_qwen3_5(cfg: GPTConfig) -> dict:
    """A `config.json` dict that `transformers.Qwen3_5TextConfig` reads as `cfg`.

    Raises:
        ValueError: `cfg` is not Qwen3.5's architecture (the options it lacks are named).
    """
    differ = [f"{k}={getattr(cfg, k)!r}" for k, v in QWEN3_5.items() if getattr(cfg, k) != v]
    kinds = _kinds(cfg)
    if any(kind not in HF_MODULE for kind in kinds):
        differ.append(f"layer_kinds={kinds!r}")
    if differ:
        raise ValueError(
            "Qwen3.5's layout is Gated DeltaNet and gated attention layers, rotary positions "
            "turning part of each head, zero-centred RMSNorm with QK-norm, SwiGLU and no "
            f"biases; this model has {', '.join(differ)}. Export it with layer_kinds of "
            "deltanet and attention, " + ", ".join(f"{k}={v!r}" for k, v in QWEN3_5.items()))
    sizes = next((m.sizes for m in cfg.mixers() if hasattr(m, "sizes")), {})
    deltanet = {theirs: sizes.get(ours, default)
                for theirs, (ours, default) in DELTANET.items()}
    rope = rope_entries(cfg.rope_theta, cfg.rope_scaling, partial=True)
    rope["rope_parameters"].setdefault("partial_rotary_factor", 1.0)  # not Qwen3.5's 0.25
    return {
        "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": cfg.vocab_width, "hidden_size": cfg.emb_dim,
        "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size, "hidden_act": "silu",
        "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps,
        "layer_types": [next(t for t, k in LAYER_TYPES.items() if k == kind) for kind in kinds],
        **deltanet, "rope_parameters": rope["rope_parameters"], "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_weights,
        "initializer_range": 0.02, "use_cache": True,
    }


def _rows(cfg: GPTConfig) -> list[tuple[str, str]]:
    """Every weight that maps one to one: the frame's, and each layer's mixer's."""
    rows = [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in FRAME
            for i in (range(cfg.n_layers) if "{i}" in ours else [0])]
    for i, kind in enumerate(_kinds(cfg)):
        where = {"a": f"trf_blocks.{i}.att", "h": f"model.layers.{i}.{HF_MODULE[kind]}"}
        rows += [(ours.format(**where), theirs.format(**where)) for ours, theirs in ROWS[kind]]
    return rows


def _kinds(cfg: GPTConfig) -> list[str]:
    return cfg.layer_kinds or ["attention"] * cfg.n_layers


def _query_and_gate(cfg: GPTConfig, i: int) -> tuple[str, list[str], None]:
    """Attention's q_proj: each head's query rows, then its gate rows (None: per head)."""
    a = f"trf_blocks.{i}.att"
    return "q_proj", [f"{a}.W_query.weight", f"{a}.gate.W_gate.weight"], None


def _qkv(cfg: GPTConfig, i: int) -> tuple[str, list[str], list[int]]:
    """DeltaNet's in_proj_qkv: the queries', keys' and values' rows, one after the other."""
    a, sizes = f"trf_blocks.{i}.att", cfg.mixers()[i].sizes
    keys = sizes["num_key_heads"] * sizes["head_dim"]
    return ("in_proj_qkv", [f"{a}.W_query.weight", f"{a}.W_key.weight", f"{a}.W_value.weight"],
            [keys, keys, sizes["num_heads"] * sizes["value_head_dim"]])


ROWS = {"attention": ATTENTION, "deltanet": DELTANET_ROWS}
FUSED = {"attention": _query_and_gate, "deltanet": _qkv}
"""Each mixer's fused tensor: its name in the layer's module, the gptmini weights it holds,
and how many rows each (None: per head, alternating)."""


def _fused(cfg: GPTConfig, i: int) -> tuple[str, list[str], list[int] | None]:
    kind = _kinds(cfg)[i]
    proj, names, rows = FUSED[kind](cfg, i)
    return f"model.layers.{i}.{HF_MODULE[kind]}.{proj}.weight", names, rows


def from_qwen3_5_state_dict(state_dict: Mapping[str, Tensor], hf_config: Mapping) -> GPTModel:
    """A `GPTModel` (eval mode) holding a `Qwen3_5ForCausalLM`'s weights."""
    cfg = config_from_qwen3_5(hf_config)
    ours, seen = take_weights(state_dict, _rows(cfg), cfg, "Qwen3.5")
    for i in range(cfg.n_layers):
        hf_name, names, rows = _fused(cfg, i)
        if hf_name not in state_dict:
            raise ValueError(f"the Qwen3.5 state dict has no {hf_name!r} (needed for "
                             f"{', '.join(names)})")
        seen.add(hf_name)
        fused = state_dict[hf_name]
        parts = (fused.split(rows) if rows is not None else  # (H * 2 * hd, d): per head
                 fused.view(cfg.n_heads, 2, cfg.head_size, -1).unbind(1))
        ours.update({name: part.reshape(-1, fused.shape[-1])
                     for name, part in zip(names, parts, strict=True)})
    return model_from_weights(cfg, ours, untaken(state_dict, seen), "Qwen3.5")


def to_qwen3_5_state_dict(model: GPTModel) -> dict[str, Tensor]:
    """`Qwen3_5ForCausalLM` keys for `model`'s weights, the query and gate, and DeltaNet's
    queries, keys and values, fused as Qwen3.5 stores them (contiguous copies; a tied head
    is left out, as `save_pretrained` does)."""
    cfg = model.cfg
    config_to_qwen3_5(cfg)  # raises for what Qwen3.5's layout cannot hold
    ours, state = model.state_dict(), give_weights(model, _rows(cfg))
    for i in range(cfg.n_layers):
        hf_name, names, rows = _fused(cfg, i)
        weights = [ours[name].detach() for name in names]
        state[hf_name] = (torch.cat(weights) if rows is not None else torch.stack(
            [w.view(cfg.n_heads, cfg.head_size, -1) for w in weights], dim=1
        ).reshape(-1, cfg.emb_dim)).contiguous()
    return state


LAYOUTS = {"qwen3_5_text": Layout("Qwen3.5 (text)", "Qwen3_5", config_from_qwen3_5,
                                  from_qwen3_5_state_dict, config_to_qwen3_5,
                                  to_qwen3_5_state_dict)}
"""The model_type this module reads and writes: Qwen3.5's text model."""
