"""Llama's Hugging Face layout to and from `GPTModel` (and Qwen3's: Llama's with QK-norm; and
Qwen3-MoE's: Qwen3's with a mixture of experts in every layer's SwiGLU's place).

RoPE + RMSNorm + SwiGLU + no biases + an untied head (+ grouped-query attention) is Llama's
architecture: a `GPTConfig` with those options is one, and its weights map one to one onto
`transformers`' `LlamaForCausalLM` (`TABLE`). Both store `nn.Linear` weights as
(out_features, in_features), so nothing is transposed.

Rotary layout: gptmini rotates each head's dimension i with dimension i + head_dim / 2,
as `transformers` does (`rotate_half`), so Hugging Face Llama weights load as they are.
Meta's original checkpoints rotate interleaved pairs (2i, 2i + 1) instead; their query and
key projections become ours by permuting each head's rows (`interleaved_to_halves`), which
is what `transformers`' own conversion script does.

A Qwen3-MoE's experts are stored one by one (`mlp.experts.{e}.gate_proj.weight`, as its
checkpoints and transformers' save_pretrained write them; the 3-D `mlp.experts.gate_up_proj`
and `down_proj` that transformers 5 keeps in memory, saved with save_original_format=False,
are read too), the router as `mlp.gate.weight` (gptmini.variants.moe names them alike). Only
an all-sparse one maps (decoder_sparse_step 1, no mlp_only_layers) and no shared expert.

A directory is read and written without importing `transformers`: `config.json` and
`model.safetensors`, by gptmini.convert's `load_hf` and `export_hf`, which use this layout
for `model_type: llama` and for a model of Llama's architecture.
"""

from collections.abc import Mapping
from dataclasses import replace

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
from gptmini.model import GPTConfig, GPTModel, is_finite_number

__all__ = ["LAYOUTS", "MOE_TABLE", "TABLE", "config_from_llama", "config_to_llama",
           "config_to_qwen3_moe", "from_llama_state_dict", "interleaved_to_halves",
           "is_llama_architecture", "to_llama_state_dict", "to_qwen3_moe_state_dict"]

TABLE: list[tuple[str, str]] = [  # (gptmini name, Hugging Face name); {i}: every layer
    ("tok_emb.weight", "model.embed_tokens.weight"),
    ("trf_blocks.{i}.norm1.weight", "model.layers.{i}.input_layernorm.weight"),
    ("trf_blocks.{i}.att.W_query.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("trf_blocks.{i}.att.W_key.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("trf_blocks.{i}.att.W_value.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("trf_blocks.{i}.att.out_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("trf_blocks.{i}.norm2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("trf_blocks.{i}.ff.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("trf_blocks.{i}.ff.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("trf_blocks.{i}.ff.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("final_norm.weight", "model.norm.weight"),
    ("out_head.weight", "lm_head.weight"),
]
QK_NORM_TABLE: list[tuple[str, str]] = [  # Qwen3's additions: RMSNorm of each head's q, k
    ("trf_blocks.{i}.att.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("trf_blocks.{i}.att.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
]
MOE_TABLE: list[tuple[str, str]] = [  # Qwen3-MoE's, in the ff rows' place; {e}: every expert
    ("trf_blocks.{i}.ff.gate.weight", "model.layers.{i}.mlp.gate.weight"),
    *((f"trf_blocks.{{i}}.ff.experts.{{e}}.{proj}.weight",
       f"model.layers.{{i}}.mlp.experts.{{e}}.{proj}.weight")
      for proj in ("gate_proj", "up_proj", "down_proj")),
]
MOE_FIELDS = {"num_experts": "experts", "num_experts_per_tok": "top_k",
              "norm_topk_prob": "norm_topk_prob", "router_aux_loss_coef": "aux_loss_coef"}
"""Qwen3-MoE's config.json fields -> the moe feed-forward's mlp_options."""
QK_NORM_EPS = 1e-6
"""gptmini's QK-norm epsilon; Qwen3 uses its one rms_norm_eps there too, so a model exports
as Qwen3 only with norm_eps equal to it."""
LLAMA = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
         "qkv_bias": False, "qk_norm": False, "attn_softcap": None, "window_size": None,
         "attn_sinks": False, "attn_gate": "none", "layer_kinds": None,
         "rope_local_theta": None, "attn_scale_dim": None,
         "post_norms": False, "scale_embeddings": False, "logit_softcap": None}
"""The GPTConfig options that make a model Llama's architecture (with qk_norm: Qwen3's);
one with multi-head latent attention is DeepSeek-V3's (gptmini.convert.deepseek)."""


def is_llama_architecture(cfg: GPTConfig) -> bool:
    """Whether `cfg` has Llama's position scheme and MLP, and so goes to and comes from
    Hugging Face in Llama's layout (whose checks then name whatever else does not fit)
    rather than GPT-2's."""
    return all(getattr(cfg, field) == LLAMA[field] for field in ("position", "mlp"))


def _expand(cfg: GPTConfig) -> list[tuple[str, str]]:
    """Every weight's (gptmini name, Hugging Face name) for `cfg`: the frame, QK-norm's,
    and SwiGLU's rows or a mixture of experts' for each of its experts."""
    moe = _moe(cfg)
    experts = moe.experts if moe else 0
    table = [row for row in TABLE if not (experts and ".ff." in row[0])]
    table += (QK_NORM_TABLE if cfg.qk_norm else []) + (MOE_TABLE if experts else [])
    return [(ours.format(i=i, e=e), theirs.format(i=i, e=e)) for ours, theirs in table
            for i in (range(cfg.n_layers) if "{i}" in ours else [0])
            for e in (range(experts) if "{e}" in ours else [0])]


def _moe(cfg: GPTConfig):
    """`cfg`'s feed-forward if it exports in Qwen3-MoE's layout (a mixture of experts), else
    None."""
    feed_forward = cfg.feed_forward()
    return feed_forward if feed_forward.hf_layout == "qwen3_moe" else None


def config_from_llama(hf_config: Mapping) -> GPTConfig:
    """The GPTConfig of a Llama, Qwen3 or Qwen3-MoE `config.json` dict.

    Raises:
        ValueError: what the config asks for that GPTModel does not have (biases, a rope
            scaling it does not compute, another activation; a Qwen3-MoE's dense layers or
            shared expert).
    """
    c = {**hf_config, "model_type": _model_type(hf_config)}
    title = "Qwen3-MoE" if c["model_type"] == "qwen3_moe" else "Llama"
    sizes = {name: config_integer(c, name, title) for name in (
        "vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers",
        "max_position_embeddings")}
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    kv_heads = (heads if c.get("num_key_value_heads") is None
                else config_integer(c, "num_key_value_heads", title))
    problems: list[str] = []
    theta, scaling = read_rope(c, title, problems)  # Llama 3.1's llama3, Qwen3's yarn
    mlp = (_moe_fields(c, problems) if title == "Qwen3-MoE"
           else {"mlp_hidden_dim": config_integer(c, "intermediate_size", title)})
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (SwiGLU here is SiLU-gated)")
    if c.get("attention_bias") or c.get("mlp_bias"):
        problems.append("attention_bias/mlp_bias (gptmini's Llama layout has no biases)")
    head_dim = (hidden // heads if c.get("head_dim") is None  # Qwen3's is its own
                else config_integer(c, "head_dim", title))
    if c.get("quantization_config") is not None:
        problems.append(quantization_problem(c["quantization_config"]))
    qk_norm = c.get("model_type") in ("qwen3", "qwen3_moe")
    norm_eps = config_number(c, "rms_norm_eps", title, 1e-6)
    if qk_norm and norm_eps != QK_NORM_EPS:
        problems.append(f"rms_norm_eps={c['rms_norm_eps']} with QK-norm (gptmini's QK-norm "
                        f"uses {QK_NORM_EPS})")
    layer_windows = _layer_windows(c, sizes["num_hidden_layers"], problems)
    if problems:
        raise ValueError(f"this {title} config cannot be loaded into GPTModel: "
                         + "; ".join(problems))
    return checked_config(
        title,
        vocab_size=sizes["vocab_size"], context_length=sizes["max_position_embeddings"],
        emb_dim=hidden, n_heads=heads, n_layers=sizes["num_hidden_layers"],
        drop_rate=0.0, n_kv_heads=None if kv_heads == heads else kv_heads,
        tie_weights=bool(c.get("tie_word_embeddings", False)), rope_theta=theta,
        rope_scaling=scaling, head_dim=None if head_dim * heads == hidden else head_dim,
        norm_eps=norm_eps, qk_norm=qk_norm, layer_windows=layer_windows,
        **{k: v for k, v in LLAMA.items() if k not in ("qk_norm", "attn_softcap")} | mlp,
    )


def _model_type(c: Mapping) -> str:
    """`c`'s model_type, or for a config.json without one the layout its architectures name
    (Qwen3MoeForCausalLM is Qwen3-MoE's, not Qwen3's: the longest start)."""
    if c.get("model_type") is not None:
        return c["model_type"]
    architecture = str((c.get("architectures") or [""])[0])
    return max((kind for kind, layout in LAYOUTS.items()
                if architecture.startswith(layout.architecture)),
               key=lambda kind: len(LAYOUTS[kind].architecture), default="llama")


def _moe_fields(c: Mapping, problems: list[str]) -> dict:
    """The GPTConfig fields of a Qwen3-MoE's experts (the moe feed-forward); a layer that
    is dense (mlp_only_layers, decoder_sparse_step) or a shared expert is a problem."""
    c = {"num_experts": c.get("num_local_experts", 128), **c}  # transformers 5 saves that name
    options = {ours: c.get(theirs, default) for (theirs, ours), default in zip(
        MOE_FIELDS.items(), (128, 8, False, 0.001), strict=True)}  # Qwen3MoeConfig's defaults
    for name in ("num_experts", "num_experts_per_tok"):
        options[MOE_FIELDS[name]] = config_integer(c, name, "Qwen3-MoE",
                                                   options[MOE_FIELDS[name]])
    coef = options["aux_loss_coef"]
    if not (is_finite_number(coef) and coef >= 0):
        problems.append(f"router_aux_loss_coef={coef!r} (gptmini reads a number >= 0)")
    if c.get("decoder_sparse_step", 1) != 1 or c.get("mlp_only_layers"):
        problems.append(f"decoder_sparse_step={c.get('decoder_sparse_step', 1)!r}, "
                        f"mlp_only_layers={c.get('mlp_only_layers')!r} (dense layers among "
                        "the sparse ones; gptmini's feed-forward is the same in every layer: "
                        "only decoder_sparse_step 1 and no mlp_only_layers load)")
    if c.get("shared_expert_intermediate_size"):
        problems.append("shared_expert_intermediate_size (Qwen3-MoE has no shared expert)")
    return {"mlp": "moe", "mlp_options": options, "mlp_hidden_dim": config_integer(
        c, "moe_intermediate_size", "Qwen3-MoE", 768)}


def _layer_windows(c: Mapping, n_layers: int, problems: list[str]) -> list[int | None] | None:
    """GPTConfig.layer_windows of a Qwen3 config: `sliding_window` at its layer_types'
    "sliding_attention" layers (use_sliding_window on; without layer_types, the layers from
    max_window_layers on, as transformers reads it), or None: every layer full."""
    if not c.get("use_sliding_window") or c.get("sliding_window") is None:
        return None
    if c.get("model_type") != "qwen3":
        problems.append(f"use_sliding_window in a {c.get('model_type')!r} config (gptmini "
                        "reads per-layer windows in Qwen3's layout)")
        return None
    types = c.get("layer_types")
    if types is None:
        first = config_integer(c, "max_window_layers", "Qwen3")
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(n_layers)]
    return windows_of_types(c, types, n_layers, "Qwen3", problems)


def config_to_llama(cfg: GPTConfig) -> dict:
    """A `config.json` dict that `transformers.LlamaConfig` reads as `cfg` (with qk_norm,
    one that `Qwen3Config` reads).

    Raises:
        ValueError: `cfg` is not Llama's architecture (the options it lacks are named).
    """
    differ = [f"{k}={getattr(cfg, k)!r}" for k, v in LLAMA.items()
              if getattr(cfg, k) != v and k != "qk_norm"]
    if differ:
        raise ValueError(
            "Llama's layout is rotary positions, RMSNorm, SwiGLU, no biases, no soft-cap, no "
            "attention sinks or gates and full attention (Qwen3's adds QK-norm); this model "
            f"has {', '.join(differ)}. "
            "Export it with " + ", ".join(f"{k}={v!r}" for k, v in LLAMA.items()
                                          if k != "qk_norm"))
    if cfg.qk_norm and cfg.norm_eps != QK_NORM_EPS:
        raise ValueError(
            f"Qwen3's layout (Llama's with QK-norm) has one rms_norm_eps, and gptmini's QK-norm "
            f"uses {QK_NORM_EPS}; this model has norm_eps={cfg.norm_eps}. Train with "
            f"--model.norm_eps {QK_NORM_EPS} to export it")
    qwen = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            **_qwen3_windows(cfg)}
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_width,
        "hidden_size": cfg.emb_dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        **rope_entries(cfg.rope_theta, cfg.rope_scaling),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_weights,
        "initializer_range": 0.02,
        "use_cache": True,
        **(qwen if cfg.qk_norm else {}),
    }


def _qwen3_windows(cfg: GPTConfig) -> dict:
    """config.json's sliding-window entries for cfg.layer_windows (Qwen3 has one window for
    every sliding layer, and no Llama has any).

    Raises:
        ValueError: windows without QK-norm (not Qwen3), or windows of different sizes.
    """
    if cfg.layer_windows is None:
        return {"use_sliding_window": False}
    sizes = sorted({w for w in cfg.layer_windows if w is not None})
    if not cfg.qk_norm or len(sizes) > 1:
        raise ValueError(
            f"layer_windows={cfg.layer_windows} export only in Qwen3's layout, which has "
            f"QK-norm and one sliding_window for every windowed layer; this model has "
            f"qk_norm={cfg.qk_norm} and windows {sizes}. Train with --model.qk_norm true and "
            "one window size (gptmini.model.window_pattern)")
    return {"use_sliding_window": True, "sliding_window": sizes[0], "max_window_layers": 0,
            "layer_types": ["full_attention" if w is None else "sliding_attention"
                            for w in cfg.layer_windows]}


def config_to_qwen3_moe(cfg: GPTConfig) -> dict:
    """A `config.json` dict that `transformers.Qwen3MoeConfig` reads as `cfg`: Qwen3's with
    the moe feed-forward's experts in every layer (intermediate_size, the width of dense
    layers it has none of, is the experts').

    Raises:
        ValueError: `cfg`'s feed-forward is not a mixture of experts, or has a shared
            expert, or the rest is not Qwen3's (QK-norm, full attention; each named).
    """
    moe = _moe(cfg)
    if moe is None or moe.shared_hidden_dim is not None or not cfg.qk_norm or (
            cfg.layer_windows is not None):
        raise ValueError(
            "Qwen3-MoE's layout is Qwen3's (QK-norm, full attention) with a mixture of experts "
            f"and no shared expert in every layer; this model has mlp={cfg.mlp!r}, "
            f"mlp_options={cfg.mlp_options!r}, qk_norm={cfg.qk_norm}, layer_windows="
            f"{cfg.layer_windows}. Export it with mlp='moe', no shared_hidden_dim in "
            "mlp_options, qk_norm=True and layer_windows=None")
    frame = config_to_llama(replace(cfg, mlp="swiglu", mlp_options=None))
    return {**frame, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "intermediate_size": moe.hidden_dim, "moe_intermediate_size": moe.hidden_dim,
            **{theirs: getattr(moe, ours) for theirs, ours in MOE_FIELDS.items()},
            "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False}


def from_llama_state_dict(state_dict: Mapping[str, Tensor], hf_config: Mapping) -> GPTModel:
    """A `GPTModel` (eval mode) holding a `LlamaForCausalLM`'s (or `Qwen3ForCausalLM`'s,
    or `Qwen3MoeForCausalLM`'s) weights."""
    cfg = config_from_llama(hf_config)
    title = "Qwen3-MoE" if _moe(cfg) else "Llama"
    state_dict = _experts_one_by_one(state_dict)
    ours, seen = take_weights(state_dict, _expand(cfg), cfg, title)
    return model_from_weights(cfg, ours, untaken(state_dict, seen), title)


def _experts_one_by_one(state_dict: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """`state_dict` with transformers 5's fused experts, `mlp.experts.gate_up_proj` (E,
    2 * h, d; gate rows first) and `mlp.experts.down_proj` (E, d, h), as the checkpoints'
    one weight per expert and projection; any other state dict as it is."""
    fused = [k for k in state_dict if k.endswith(("mlp.experts.gate_up_proj",
                                                    "mlp.experts.down_proj"))]
    if not fused:
        return state_dict
    split = {k: v for k, v in state_dict.items() if k not in fused}
    for key in fused:
        prefix, stacked = key.rsplit(".", 1)[0], state_dict[key]
        for e, weight in enumerate(stacked):  # weight (2 * h, d) or (d, h)
            parts = (zip(("gate_proj", "up_proj"), weight.chunk(2), strict=True)
                     if key.endswith("gate_up_proj") else [("down_proj", weight)])
            split.update({f"{prefix}.{e}.{proj}.weight": w for proj, w in parts})
    return split


def to_llama_state_dict(model: GPTModel) -> dict[str, Tensor]:
    """`LlamaForCausalLM` keys for `model`'s weights (contiguous copies; a tied head is
    left out, as `save_pretrained` does)."""
    config_to_llama(model.cfg)  # raises for what Llama's layout cannot hold
    return give_weights(model, _expand(model.cfg))


def to_qwen3_moe_state_dict(model: GPTModel) -> dict[str, Tensor]:
    """`Qwen3MoeForCausalLM` keys for `model`'s weights, each expert's on its own, as its
    checkpoints store them (contiguous copies; a tied head is left out)."""
    config_to_qwen3_moe(model.cfg)  # raises for what Qwen3-MoE's layout cannot hold
    return give_weights(model, _expand(model.cfg))


def interleaved_to_halves(weight: Tensor, n_heads: int) -> Tensor:
    """A query or key projection (n_heads * head_dim, in) of Meta's interleaved rotary
    layout (pairs 2i, 2i + 1) as ours (halves i, i + head_dim / 2): each head's rows are
    reordered so that pair i's two rows become rows i and i + head_dim / 2."""
    out_features = weight.shape[0]
    head_dim = out_features // n_heads
    # (n_heads, head_dim / 2, 2, in) -> (n_heads, 2, head_dim / 2, in)
    return (weight.view(n_heads, head_dim // 2, 2, -1).transpose(1, 2)
            .reshape(out_features, -1))


_LLAMA_FUNCTIONS = (config_from_llama, from_llama_state_dict, config_to_llama,
                    to_llama_state_dict)
LAYOUTS = {"llama": Layout("Llama", "Llama", *_LLAMA_FUNCTIONS),
           "qwen3": Layout("Qwen3", "Qwen3", *_LLAMA_FUNCTIONS),
           "qwen3_moe": Layout("Qwen3-MoE, every layer sparse", "Qwen3Moe", config_from_llama,
                               from_llama_state_dict, config_to_qwen3_moe,
                               to_qwen3_moe_state_dict)}
"""The model_types this module reads and writes (Qwen3's is Llama's layout with QK-norm;
config_to_llama writes a model with QK-norm as Qwen3's; Qwen3-MoE's is Qwen3's with the moe
feed-forward, gptmini.variants.moe, whose hf_layout names it)."""
