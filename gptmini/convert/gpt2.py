"""GPT-2 weights in and out, in the Hugging Face `transformers` layout (Llama's: llama.py;
directories on disk: hub.py).

Hugging Face's GPT-2 differs from `GPTModel` in names and in two ways of storing weights:
its projections are `Conv1D` modules whose weight is (in_features, out_features), the
transpose of `nn.Linear`'s, and one `c_attn` projection holds query, key and value side by
side. `TABLE` below is the whole correspondence; everything else in this file walks it.
The architectures otherwise agree: GPT-2's `gelu_new` is the tanh GELU the book uses, its
LayerNorm epsilon is 1e-5, it has biases in the qkv projection (`qkv_bias=True`) and its
output head is the token embedding (`tie_weights=True`).

No `transformers` import is needed: hub.py reads and writes the directories directly.
"""

from collections.abc import Mapping

import torch
from torch import Tensor

from gptmini.convert.weights import (
    Layout,
    config_integer,
    config_number,
    model_from_weights,
    quantization_problem,
)
from gptmini.model import GPTConfig, GPTModel

__all__ = ["LAYOUTS", "TABLE", "config_from_hf", "config_to_hf", "from_hf_state_dict",
           "to_hf_state_dict"]

# (gptmini name, Hugging Face name, Conv1D weight to transpose, third of c_attn or None).
# Names under trf_blocks.{i} / h.{i} repeat for every layer.
TABLE: list[tuple[str, str, bool, int | None]] = [
    ("tok_emb.weight", "wte.weight", False, None),
    ("pos_emb.weight", "wpe.weight", False, None),
    ("trf_blocks.{i}.norm1.weight", "h.{i}.ln_1.weight", False, None),
    ("trf_blocks.{i}.norm1.bias", "h.{i}.ln_1.bias", False, None),
    ("trf_blocks.{i}.att.W_query.weight", "h.{i}.attn.c_attn.weight", True, 0),
    ("trf_blocks.{i}.att.W_key.weight", "h.{i}.attn.c_attn.weight", True, 1),
    ("trf_blocks.{i}.att.W_value.weight", "h.{i}.attn.c_attn.weight", True, 2),
    ("trf_blocks.{i}.att.W_query.bias", "h.{i}.attn.c_attn.bias", False, 0),
    ("trf_blocks.{i}.att.W_key.bias", "h.{i}.attn.c_attn.bias", False, 1),
    ("trf_blocks.{i}.att.W_value.bias", "h.{i}.attn.c_attn.bias", False, 2),
    ("trf_blocks.{i}.att.out_proj.weight", "h.{i}.attn.c_proj.weight", True, None),
    ("trf_blocks.{i}.att.out_proj.bias", "h.{i}.attn.c_proj.bias", False, None),
    ("trf_blocks.{i}.norm2.weight", "h.{i}.ln_2.weight", False, None),
    ("trf_blocks.{i}.norm2.bias", "h.{i}.ln_2.bias", False, None),
    ("trf_blocks.{i}.ff.layers.0.weight", "h.{i}.mlp.c_fc.weight", True, None),
    ("trf_blocks.{i}.ff.layers.0.bias", "h.{i}.mlp.c_fc.bias", False, None),
    ("trf_blocks.{i}.ff.layers.2.weight", "h.{i}.mlp.c_proj.weight", True, None),
    ("trf_blocks.{i}.ff.layers.2.bias", "h.{i}.mlp.c_proj.bias", False, None),
    ("final_norm.weight", "ln_f.weight", False, None),
    ("final_norm.bias", "ln_f.bias", False, None),
    ("out_head.weight", "lm_head.weight", False, None),
]
_PREFIX = "transformer."  # GPT2LMHeadModel keeps the trunk here; GPT2Model has no prefix
_GELU_TANH = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"}  # tanh approximations of GELU


def _expand(n_layers: int):
    for ours, theirs, transpose, part in TABLE:
        for i in range(n_layers) if "{i}" in ours else [None]:
            yield ours.format(i=i), theirs.format(i=i), transpose, part


def config_from_hf(hf_config: Mapping | object) -> GPTConfig:
    """The `GPTConfig` of a Hugging Face GPT-2 config (a `config.json` dict or `GPT2Config`).

    Raises:
        ValueError: the config describes something `GPTModel` does not compute (another
            activation, MLP width, LayerNorm epsilon or attention scaling).
    """
    cfg = dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()
    model_type = cfg.get("model_type", "gpt2")
    problems = []
    if model_type != "gpt2":
        problems.append(f"model_type={model_type!r} (only 'gpt2' maps onto GPTModel)")
    if cfg.get("activation_function", "gelu_new") not in _GELU_TANH:
        problems.append(f"activation_function={cfg['activation_function']!r} (GPTModel uses "
                        "the tanh GELU, 'gelu_new')")
    if problems:  # another architecture: its fields are not GPT-2's, say that first
        raise ValueError("this GPT-2 config cannot be loaded into GPTModel: " + "; ".join(problems))
    n_embd = config_integer(cfg, "n_embd", "GPT-2")
    sizes = {name: config_integer(cfg, name, "GPT-2") for name in ("vocab_size", "n_head",
                                                                    "n_layer")}
    context = config_integer(cfg, "n_positions", "GPT-2",
                             default=config_integer(cfg, "n_ctx", "GPT-2", default=1024))
    if cfg.get("n_inner") not in (None, 4 * n_embd):
        problems.append(f"n_inner={cfg['n_inner']!r} (GPTModel's MLP is 4 * n_embd = "
                        f"{4 * n_embd})")
    if abs(config_number(cfg, "layer_norm_epsilon", "GPT-2", 1e-5) - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon={cfg['layer_norm_epsilon']} (GPTModel uses 1e-5)")
    if cfg.get("scale_attn_by_inverse_layer_idx", False) or not cfg.get(
        "scale_attn_weights", True
    ):
        problems.append("non-standard attention scaling (GPTModel divides by sqrt(head_dim))")
    if cfg.get("add_cross_attention", False):
        problems.append("add_cross_attention=True")
    if cfg.get("quantization_config") is not None:
        problems.append(quantization_problem(cfg["quantization_config"]))
    if problems:
        raise ValueError("this GPT-2 config cannot be loaded into GPTModel: " + "; ".join(problems))
    return GPTConfig(
        vocab_size=sizes["vocab_size"],
        context_length=context,
        emb_dim=n_embd,
        n_heads=sizes["n_head"],
        n_layers=sizes["n_layer"],
        drop_rate=0.0,  # for inference; dropout has no weights to convert
        qkv_bias=True,
        tie_weights=bool(cfg.get("tie_word_embeddings", True)),
    )


def config_to_hf(cfg: GPTConfig) -> dict:
    """A `config.json` dict that `transformers.GPT2Config` reads as `cfg`.

    Raises:
        ValueError: `cfg` uses grouped-query or sliding-window attention, which GPT-2 lacks.
    """
    unsupported = []
    if cfg.n_kv_heads not in (None, cfg.n_heads):
        unsupported.append(f"n_kv_heads={cfg.n_kv_heads} (grouped-query attention)")
    if cfg.window_size is not None:
        unsupported.append(f"window_size={cfg.window_size} (sliding-window attention)")
    if cfg.layer_windows is not None:
        unsupported.append(f"layer_windows={cfg.layer_windows} (sliding-window attention)")
    book = {"position": "learned", "norm": "layernorm", "mlp": "gelu", "qk_norm": False,
            "bias": True, "attn_softcap": None, "norm_eps": 1e-5, "attn_sinks": False,
            "attn_gate": "none", "layer_kinds": None, "attn_scale_dim": None,
            "post_norms": False, "scale_embeddings": False, "logit_softcap": None}
    unsupported += [f"{field}={getattr(cfg, field)!r}" for field, value in book.items()
                    if getattr(cfg, field) != value]
    if cfg.head_size * cfg.n_heads != cfg.emb_dim:
        unsupported.append(f"head_dim={cfg.head_dim} (heads of their own size)")
    if cfg.hidden_dim != 4 * cfg.emb_dim:
        unsupported.append(f"mlp_hidden_dim={cfg.mlp_hidden_dim}")
    if unsupported:
        raise ValueError(
            "GPT-2's layout has only learned positions, LayerNorm, a 4x GELU MLP with biases "
            f"and full multi-head attention, so this model cannot be exported to it: "
            f"{', '.join(unsupported)}. Export a model with the book's options"
        )
    out = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_width,  # the embedding's rows; padding ids included
        "n_positions": cfg.context_length,
        "n_embd": cfg.emb_dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.drop_rate,
        "embd_pdrop": cfg.drop_rate,
        "attn_pdrop": cfg.drop_rate,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": cfg.tie_weights,
        "use_cache": True,
    }
    if cfg.vocab_size > 50256:  # GPT-2's <|endoftext|> exists only in its full vocabulary
        out.update(bos_token_id=50256, eos_token_id=50256)
    return out


def from_hf_state_dict(state_dict: Mapping[str, Tensor], hf_config: Mapping | object) -> GPTModel:
    """A `GPTModel` (eval mode) holding a Hugging Face GPT-2's weights.

    Args:
        state_dict: from `GPT2LMHeadModel` (keys `transformer.*`, `lm_head.weight`) or
            `GPT2Model` (no prefix); the causal-mask buffers `attn.bias` /
            `attn.masked_bias` of old checkpoints are ignored.
        hf_config: its config, a `config.json` dict or a `transformers.GPT2Config`.
    """
    cfg = config_from_hf(hf_config)
    theirs = {k.removeprefix(_PREFIX): v for k, v in state_dict.items()}
    ours, seen = {}, set()
    for name, hf_name, transpose, part in _expand(cfg.n_layers):
        if name == "out_head.weight" and (cfg.tie_weights or hf_name not in theirs):
            if not cfg.tie_weights:
                raise ValueError("the config says tie_word_embeddings=False but there is no "
                                 "lm_head.weight in the state dict")
            continue  # tied: GPTModel shares tok_emb.weight
        if hf_name not in theirs:
            raise ValueError(f"the GPT-2 state dict has no {hf_name!r} (needed for {name})")
        tensor = theirs[hf_name]
        seen.add(hf_name)
        if part is not None:  # query, key, value side by side along the output dimension
            tensor = tensor.chunk(3, dim=-1)[part]
        ours[name] = tensor.t() if transpose else tensor
    ignored = {k for k in theirs if k.endswith((".attn.bias", ".attn.masked_bias"))}
    unknown = sorted(set(theirs) - seen - ignored - {"lm_head.weight"})
    return model_from_weights(cfg, ours, unknown, "GPT-2")


def to_hf_state_dict(model: GPTModel) -> dict[str, Tensor]:
    """`GPT2LMHeadModel` keys and layouts for `model`'s weights (contiguous copies).

    A tied head is left out, as `save_pretrained` does; `qkv_bias=False` becomes zero biases
    (GPT-2 always has them, and a zero bias computes the same).
    """
    config_to_hf(model.cfg)  # raises for what GPT-2 cannot hold
    ours = model.state_dict()
    parts: dict[str, list] = {}
    out = {}
    for name, hf_name, transpose, part in _expand(model.cfg.n_layers):
        if name == "out_head.weight":
            if not model.cfg.tie_weights:
                out["lm_head.weight"] = ours[name].detach().clone().contiguous()
            continue
        if name in ours:
            tensor = ours[name].detach()
        else:  # no qkv bias
            weight = ours[name.replace(".bias", ".weight")]
            tensor = weight.new_zeros(weight.shape[0])
        tensor = tensor.t() if transpose else tensor
        key = _PREFIX + hf_name
        if part is None:
            out[key] = tensor.clone().contiguous()
        else:
            parts.setdefault(key, [None] * 3)[part] = tensor
    for key, (q, k, v) in parts.items():
        out[key] = torch.cat([q, k, v], dim=-1).contiguous()
    return out


LAYOUTS = {"gpt2": Layout("GPT-2", "GPT2", config_from_hf, from_hf_state_dict, config_to_hf,
                          to_hf_state_dict)}
"""The model_type this module reads and writes (gptmini.convert.weights.Layout)."""
