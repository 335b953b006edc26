"""Gemma 3's Hugging Face layout (the text model: `Gemma3ForCausalLM` with a
`Gemma3TextConfig`, model_type gemma3_text) to and from a `GPTModel`.

Gemma 3 is Llama's frame with these differences, each a GPTConfig option (none of them
asks for Gemma by name; `GEMMA` lists them):

    a norm before and after each sublayer        post_norms
    RMSNorm's gain 1 + weight (QK-norm's too)    norm "rmsnorm1p"
    embeddings times sqrt(hidden_size)           scale_embeddings
    scores divided by sqrt(query_pre_attn_scalar) attn_scale_dim (None where it is head_dim)
    RMSNorm on each head's queries and keys      qk_norm
    five local layers per global one             layer_windows, from layer_types
    the local layers' own rope base, unscaled    rope_local_theta; rope_scaling (global)
    gated GELU (tanh)                            mlp "geglu" (gptmini.variants.geglu)
    a head size of its own (256)                 head_dim
    final_logit_softcapping                      logit_softcap
    tied embeddings                              tie_weights

Its weights map one to one (`TABLE`). Rope settings are read from transformers 5's nested
rope_parameters ({"full_attention": ..., "sliding_attention": ...}) or from the published
configs' rope_theta, rope_local_base_freq and rope_scaling, and both are written. Refused by
name: attn_logit_softcapping (transformers' Gemma3 never applies it, so a model loaded with
it would not compute what transformers does), bidirectional attention (EmbeddingGemma), an
rms_norm_eps other than gptmini's QK-norm epsilon, another activation, biases, quantized
weights. The multimodal Gemma 3 (model_type gemma3: 4B and up) is another layout.
"""

from collections.abc import Mapping

from torch import Tensor

from gptmini.convert.llama import QK_NORM_EPS
from gptmini.convert.rope import read_rope_entry, rope_entries
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

__all__ = ["GEMMA", "LAYOUTS", "TABLE", "config_from_gemma3", "config_to_gemma3",
           "from_gemma3_state_dict", "to_gemma3_state_dict"]

TABLE: list[tuple[str, str]] = [  # (gptmini name, Hugging Face name); {i}: every layer
    ("tok_emb.weight", "model.embed_tokens.weight"),
    ("trf_blocks.{i}.norm1.weight", "model.layers.{i}.input_layernorm.weight"),
    ("trf_blocks.{i}.att.W_query.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("trf_blocks.{i}.att.W_key.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("trf_blocks.{i}.att.W_value.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("trf_blocks.{i}.att.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("trf_blocks.{i}.att.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("trf_blocks.{i}.att.out_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("trf_blocks.{i}.post_norm1.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("trf_blocks.{i}.norm2.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
    ("trf_blocks.{i}.ff.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("trf_blocks.{i}.ff.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("trf_blocks.{i}.ff.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("trf_blocks.{i}.post_norm2.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
    ("final_norm.weight", "model.norm.weight"),
    ("out_head.weight", "lm_head.weight"),
]
GEMMA = {"position": "rope", "norm": "rmsnorm1p", "mlp": "geglu", "bias": False,
         "qkv_bias": False, "qk_norm": True, "post_norms": True, "scale_embeddings": True,
         "attn_softcap": None, "window_size": None, "attn_sinks": False, "attn_gate": "none",
         "layer_kinds": None, "norm_eps": QK_NORM_EPS}
"""The GPTConfig options that make a model Gemma 3's architecture (its epsilon gptmini's
QK-norm's, as Gemma has one rms_norm_eps)."""
ACTIVATION = "gelu_pytorch_tanh"
"""Gemma 3's hidden_activation, GELU's tanh approximation (gptmini's GeGLU)."""


def _expand(n_layers: int) -> list[tuple[str, str]]:
    return [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in TABLE
            for i in (range(n_layers) if "{i}" in ours else [0])]


def config_from_gemma3(hf_config: Mapping) -> GPTConfig:
    """The GPTConfig of a Gemma 3 text `config.json` dict (transformers' defaults where a
    field is absent, as its Gemma3TextConfig has them).

    Raises:
        ValueError: what the config asks for that GPTModel does not compute, named.
    """
    c = dict(hf_config)
    sizes = {name: config_integer(c, name, "Gemma 3", default) for name, default in (
        ("vocab_size", None), ("hidden_size", None), ("intermediate_size", None),
        ("num_hidden_layers", None), ("num_attention_heads", None),
        ("num_key_value_heads", None), ("head_dim", 256),
        ("max_position_embeddings", 131072))}
    heads, layers = sizes["num_attention_heads"], sizes["num_hidden_layers"]
    problems = _refusals(c)
    windows = _layer_windows(c, layers, problems)
    theta, scaling, local_theta = _rope(c, problems)
    scalar = config_number(c, "query_pre_attn_scalar", "Gemma 3", 256.0)
    if problems:
        raise ValueError("this Gemma 3 config cannot be loaded into GPTModel: "
                         + "; ".join(problems))
    softcap = c.get("final_logit_softcapping")
    return checked_config(
        "Gemma 3", vocab_size=sizes["vocab_size"],
        context_length=sizes["max_position_embeddings"], emb_dim=sizes["hidden_size"],
        n_heads=heads, n_layers=layers, drop_rate=0.0, head_dim=sizes["head_dim"],
        n_kv_heads=None if sizes["num_key_value_heads"] == heads
        else sizes["num_key_value_heads"],
        tie_weights=bool(c.get("tie_word_embeddings", True)),
        mlp_hidden_dim=sizes["intermediate_size"], layer_windows=windows,
        rope_theta=theta, rope_scaling=scaling,
        rope_local_theta=local_theta if windows else None,
        attn_scale_dim=None if scalar == sizes["head_dim"] else scalar,
        logit_softcap=None if softcap is None else config_number(
            c, "final_logit_softcapping", "Gemma 3", 30.0),
        **GEMMA)


def _refusals(c: Mapping) -> list[str]:
    """What a Gemma 3 config asks for that gptmini does not compute as transformers does."""
    problems = []
    if c.get("hidden_activation", ACTIVATION) != ACTIVATION:
        problems.append(f"hidden_activation={c['hidden_activation']!r} (gptmini's GeGLU is "
                        f"{ACTIVATION!r}, GELU's tanh approximation)")
    if c.get("attention_bias"):
        problems.append("attention_bias (gptmini's Gemma 3 layout has no biases)")
    if c.get("attn_logit_softcapping") is not None:
        problems.append(f"attn_logit_softcapping={c['attn_logit_softcapping']!r} "
                        "(transformers' Gemma3 does not apply it, so gptmini would compute "
                        "another model than transformers does: set it to null)")
    if c.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention (gptmini's Gemma 3 is causal)")
    eps = config_number(c, "rms_norm_eps", "Gemma 3", 1e-6)
    if eps != QK_NORM_EPS:
        problems.append(f"rms_norm_eps={eps} (Gemma uses it in its QK-norm too, and "
                        f"gptmini's QK-norm uses {QK_NORM_EPS})")
    if c.get("quantization_config") is not None:
        problems.append(quantization_problem(c["quantization_config"]))
    return problems


def _layer_windows(c: Mapping, n_layers: int, problems: list[str]) -> list[int | None] | None:
    """GPTConfig.layer_windows of layer_types (or of the older sliding_window_pattern: every
    pattern-th layer global, the rest local, as transformers reads it), or None: all
    global."""
    types = c.get("layer_types")
    if types is None:
        pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6))
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            problems.append(f"sliding_window_pattern={pattern!r} (gptmini reads a positive "
                            "integer: every that many layers, one is global)")
            return None
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(n_layers)]
    return windows_of_types(c, types, n_layers, "Gemma 3", problems)


def _rope(c: Mapping, problems: list[str]) -> tuple[float, dict | None, float]:
    """The global layers' base and scaling, and the local layers' base (which gptmini
    rotates without scaling): from nested rope_parameters, else from rope_theta,
    rope_scaling and rope_local_base_freq."""
    nested = c.get("rope_parameters")
    if nested is not None and not (isinstance(nested, Mapping)
                                   and set(nested) <= {"full_attention", "sliding_attention"}):
        problems.append(f"rope_parameters={nested!r} (Gemma 3's are one entry per layer "
                        "type: full_attention and sliding_attention)")
        nested = None
    if nested:
        (theta, scaling), (local, local_scaling) = (read_rope_entry(
            nested.get(kind), f"rope_parameters.{kind}", c, problems)
            for kind in ("full_attention", "sliding_attention"))
    else:  # transformers 4's spelling: the scaling is the global layers'
        _, scaling = read_rope_entry(c.get("rope_scaling"), "rope_scaling", c, problems)
        theta = config_number(c, "rope_theta", "Gemma 3", 1_000_000.0)
        local = config_number(c, "rope_local_base_freq", "Gemma 3", 10_000.0)
        local_scaling = None
    theta = 1_000_000.0 if theta is None else theta  # Gemma3TextConfig's defaults
    local = 10_000.0 if local is None else local
    if local_scaling is not None and (local_scaling, local) != (scaling, theta):
        problems.append(f"rope scaling {local_scaling['rope_type']!r} on the sliding layers "
                        "(gptmini's local layers rotate plainly, or as the global ones)")
    return theta, scaling, (None if local_scaling is not None else local)


def config_to_gemma3(cfg: GPTConfig) -> dict:
    """A `config.json` dict that `transformers.Gemma3TextConfig` reads as `cfg`.

    Raises:
        ValueError: `cfg` is not Gemma 3's architecture (the options it lacks are named).
    """
    differ = [f"{k}={getattr(cfg, k)!r}" for k, v in GEMMA.items() if getattr(cfg, k) != v]
    sizes = sorted({w for w in cfg.layer_windows or [] if w is not None})
    if len(sizes) > 1:
        differ.append(f"layer windows of {len(sizes)} sizes {sizes} (Gemma 3 has one)")
    if differ:
        raise ValueError(
            "Gemma 3's layout is rotary positions, zero-centred RMSNorm before and after each "
            "sublayer and on queries and keys, scaled embeddings, GeGLU, no biases and one "
            f"window size; this model has {', '.join(differ)}. Export it with "
            + ", ".join(f"{k}={v!r}" for k, v in GEMMA.items()))
    windows = cfg.layer_windows or [None] * cfg.n_layers
    local = ({"rope_type": "default", "rope_theta": cfg.rope_local_theta}
             if cfg.rope_local_theta is not None
             else rope_entries(cfg.rope_theta, cfg.rope_scaling)["rope_parameters"])
    return {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": cfg.vocab_width, "hidden_size": cfg.emb_dim,
        "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size, "hidden_activation": ACTIVATION,
        "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps,
        "query_pre_attn_scalar": _whole(cfg.attn_scale_dim or cfg.head_size),
        "sliding_window": sizes[0] if sizes else cfg.context_length,
        "layer_types": ["full_attention" if w is None else "sliding_attention" for w in windows],
        "rope_parameters": {"full_attention": rope_entries(
            cfg.rope_theta, cfg.rope_scaling)["rope_parameters"], "sliding_attention": local},
        # transformers 4's spelling of the same, which transformers 5 reads alike
        "rope_theta": cfg.rope_theta, "rope_local_base_freq": local["rope_theta"],
        **({"rope_scaling": dict(cfg.rope_scaling)} if cfg.rope_scaling else {}),
        "final_logit_softcapping": cfg.logit_softcap, "attn_logit_softcapping": None,
        "attention_bias": False, "attention_dropout": 0.0,
        "use_bidirectional_attention": False, "tie_word_embeddings": cfg.tie_weights,
        "initializer_range": 0.02, "use_cache": True,
    }


def _whole(number: float) -> float | int:
    """An integer where the number is one (transformers' config types query_pre_attn_scalar
    an int and refuses 256.0)."""
    return int(number) if float(number).is_integer() else number


def from_gemma3_state_dict(state_dict: Mapping[str, Tensor], hf_config: Mapping) -> GPTModel:
    """A `GPTModel` (eval mode) holding a `Gemma3ForCausalLM`'s weights."""
    cfg = config_from_gemma3(hf_config)
    ours, seen = take_weights(state_dict, _expand(cfg.n_layers), cfg, "Gemma 3")
    return model_from_weights(cfg, ours, untaken(state_dict, seen), "Gemma 3")


def to_gemma3_state_dict(model: GPTModel) -> dict[str, Tensor]:
    """`Gemma3ForCausalLM` keys for `model`'s weights (contiguous copies; a tied head is
    left out, as `save_pretrained` does)."""
    config_to_gemma3(model.cfg)  # raises for what Gemma 3's layout cannot hold
    return give_weights(model, _expand(model.cfg.n_layers))


LAYOUTS = {"gemma3_text": Layout("Gemma 3", "Gemma3ForCausalLM", config_from_gemma3,
                                 from_gemma3_state_dict, config_to_gemma3,
                                 to_gemma3_state_dict)}
"""The model_type this module reads and writes: Gemma 3's text model."""
