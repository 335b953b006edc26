"""Llama's Hugging Face layout to and from `GPTModel` (and Qwen3's: Llama's with QK-norm).

RoPE + RMSNorm + SwiGLU + no biases + an untied head (+ grouped-query attention) is Llama's
architecture: a `GPTConfig` with those options is one, and its weights map one to one onto
`transformers`' `LlamaForCausalLM` (`TABLE`). Both store `nn.Linear` weights as
(out_features, in_features), so nothing is transposed.

Rotary layout: gptmini rotates each head's dimension i with dimension i + head_dim / 2,
as `transformers` does (`rotate_half`), so Hugging Face Llama weights load as they are.
Meta's original checkpoints rotate interleaved pairs (2i, 2i + 1) instead; their query and
key projections become ours by permuting each head's rows (`interleaved_to_halves`), which
is what `transformers`' own conversion script does.

A directory is read and written without importing `transformers`: `config.json` and
`model.safetensors`, by gptmini.convert's `load_hf` and `export_hf`, which use this layout
for `model_type: llama` and for a model of Llama's architecture.
"""

from collections.abc import Mapping

from torch import Tensor

from gptmini.convert.weights import (
    Layout,
    config_integer,
    config_number,
    model_from_weights,
    quantization_problem,
)
from gptmini.model import GPTConfig, GPTModel

__all__ = ["LAYOUTS", "TABLE", "config_from_llama", "config_to_llama", "from_llama_state_dict",
           "interleaved_to_halves", "is_llama_architecture", "rope_base", "to_llama_state_dict"]

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
QK_NORM_EPS = 1e-6
"""gptmini's QK-norm epsilon; Qwen3 uses its one rms_norm_eps there too, so a model exports
as Qwen3 only with norm_eps equal to it."""
LLAMA = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False,
         "qkv_bias": False, "qk_norm": False, "attn_softcap": None, "window_size": None,
         "attn_sinks": False, "attn_gate": "none", "layer_kinds": None,
         "mla_kv_lora_rank": None}
"""The GPTConfig options that make a model Llama's architecture (with qk_norm: Qwen3's);
one with multi-head latent attention is DeepSeek-V3's (gptmini.convert.deepseek)."""


def is_llama_architecture(cfg: GPTConfig) -> bool:
    """Whether `cfg` has Llama's position scheme and MLP, and so goes to and comes from
    Hugging Face in Llama's layout (whose checks then name whatever else does not fit)
    rather than GPT-2's."""
    return all(getattr(cfg, field) == LLAMA[field] for field in ("position", "mlp"))


def _expand(n_layers: int, qk_norm: bool = False) -> list[tuple[str, str]]:
    table = TABLE + (QK_NORM_TABLE if qk_norm else [])
    return [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in table
            for i in (range(n_layers) if "{i}" in ours else [0])]


def config_from_llama(hf_config: Mapping) -> GPTConfig:
    """The GPTConfig of a Llama `config.json` dict.

    Raises:
        ValueError: what the config asks for that GPTModel does not have (biases, rope
            scaling, another activation, a head size other than hidden / heads).
    """
    c = dict(hf_config)
    sizes = {name: config_integer(c, name, "Llama") for name in (
        "vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers",
        "intermediate_size", "max_position_embeddings")}
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    kv_heads = (heads if c.get("num_key_value_heads") is None
                else config_integer(c, "num_key_value_heads", "Llama"))
    theta, problems = rope_base(c)
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (SwiGLU here is SiLU-gated)")
    if c.get("attention_bias") or c.get("mlp_bias"):
        problems.append("attention_bias/mlp_bias (gptmini's Llama layout has no biases)")
    if c.get("head_dim") not in (None, hidden // heads):
        problems.append(f"head_dim={c['head_dim']!r} (gptmini's is hidden_size / heads = "
                        f"{hidden // heads})")
    if c.get("quantization_config") is not None:
        problems.append(quantization_problem(c["quantization_config"]))
    qk_norm = c.get("model_type") == "qwen3"
    norm_eps = config_number(c, "rms_norm_eps", "Llama", 1e-6)
    if qk_norm and norm_eps != QK_NORM_EPS:
        problems.append(f"rms_norm_eps={c['rms_norm_eps']} with QK-norm (gptmini's QK-norm "
                        f"uses {QK_NORM_EPS})")
    layer_windows = _layer_windows(c, sizes["num_hidden_layers"], problems)
    if problems:
        raise ValueError("this Llama config cannot be loaded into GPTModel: "
                         + "; ".join(problems))
    return GPTConfig(
        vocab_size=sizes["vocab_size"], context_length=sizes["max_position_embeddings"],
        emb_dim=hidden, n_heads=heads, n_layers=sizes["num_hidden_layers"],
        drop_rate=0.0, n_kv_heads=None if kv_heads == heads else kv_heads,
        tie_weights=bool(c.get("tie_word_embeddings", False)), rope_theta=theta,
        norm_eps=norm_eps, mlp_hidden_dim=sizes["intermediate_size"],
        qk_norm=qk_norm, layer_windows=layer_windows,
        **{k: v for k, v in LLAMA.items() if k not in ("qk_norm", "attn_softcap")},
    )


LAYER_TYPES = {"full_attention": False, "sliding_attention": True}
"""Qwen3's layer_types entries gptmini reads: whether the layer has the sliding window."""


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
    window = config_integer(c, "sliding_window", "Qwen3")
    types = c.get("layer_types")
    if types is None:
        first = config_integer(c, "max_window_layers", "Qwen3")
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(n_layers)]
    if (not isinstance(types, list) or len(types) != n_layers
            or any(t not in LAYER_TYPES for t in types)):
        problems.append(f"layer_types={types!r} (gptmini reads a list of num_hidden_layers="
                        f"{n_layers} entries, each one of {', '.join(LAYER_TYPES)})")
        return None
    windows = [window if LAYER_TYPES[t] else None for t in types]
    return windows if any(windows) else None


ROPE_KEYS = ("rope_type", "type", "rope_theta")
"""What a rope_parameters / rope_scaling entry may hold for plain rotary positions."""


def rope_base(config: Mapping) -> tuple[float, list[str]]:
    """The rotary base a Llama config asks for, and what of its rope entries gptmini cannot
    compute: `rope_scaling` and `rope_parameters` are both read (a config may carry a
    default one beside a scaled one), and anything but plain rotary positions is named.
    """
    problems, thetas = [], []
    if config.get("rope_theta") is not None:
        thetas.append(config_number(config, "rope_theta", "Llama", 10000.0))
    for key in ("rope_parameters", "rope_scaling"):
        entry = config.get(key)
        if entry is None:
            continue
        if not isinstance(entry, Mapping):
            problems.append(f"{key}={entry!r} (gptmini reads an object such as "
                            "{'rope_type': 'default'}, or null)")
            continue
        kind = entry.get("rope_type", entry.get("type"))
        extra = sorted(k for k in entry if k not in ROPE_KEYS)
        if kind not in (None, "default"):
            problems.append(f"rope scaling {kind!r} in {key} (only plain rotary positions, "
                            "rope_type 'default')")
        elif extra:
            problems.append(f"{key} with {', '.join(f'{k}={entry[k]!r}' for k in extra)} and "
                            f"rope_type {kind!r} (gptmini reads plain rotary positions only: "
                            "no scaling factor)")
        if entry.get("rope_theta") is not None:
            thetas.append(config_number(entry, "rope_theta", f"Llama {key}", 10000.0))
    if len(set(thetas)) > 1:
        problems.append(f"rope_theta values that differ ({sorted(set(thetas))})")
    return (thetas[0] if thetas else 10000.0), problems


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
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
        "head_dim": cfg.emb_dim // cfg.n_heads,
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
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


def from_llama_state_dict(state_dict: Mapping[str, Tensor], hf_config: Mapping) -> GPTModel:
    """A `GPTModel` (eval mode) holding a `LlamaForCausalLM`'s weights."""
    cfg = config_from_llama(hf_config)
    ours, seen = {}, set()
    for name, hf_name in _expand(cfg.n_layers, cfg.qk_norm):
        if name == "out_head.weight" and cfg.tie_weights:
            continue
        if hf_name not in state_dict:
            raise ValueError(f"the Llama state dict has no {hf_name!r} (needed for {name})")
        ours[name] = state_dict[hf_name]
        seen.add(hf_name)
    unknown = sorted(k for k in set(state_dict) - seen
                     if not k.endswith("rotary_emb.inv_freq") and k != "lm_head.weight")
    return model_from_weights(cfg, ours, unknown, "Llama")


def to_llama_state_dict(model: GPTModel) -> dict[str, Tensor]:
    """`LlamaForCausalLM` keys for `model`'s weights (contiguous copies; a tied head is
    left out, as `save_pretrained` does)."""
    config_to_llama(model.cfg)  # raises for what Llama's layout cannot hold
    ours = model.state_dict()
    return {hf_name: ours[name].detach().clone().contiguous()
            for name, hf_name in _expand(model.cfg.n_layers, model.cfg.qk_norm)
            if not (name == "out_head.weight" and model.cfg.tie_weights)}


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
           "qwen3": Layout("Qwen3", "Qwen3", *_LLAMA_FUNCTIONS)}
"""The model_types this module reads and writes (Qwen3's is Llama's layout with QK-norm;
config_to_llama writes a model with QK-norm as Qwen3's)."""
