"""What every Hugging Face layout shares: weights renamed to gptmini's, into a GPTModel; the
checks a config.json's fields and a state dict's tensors pass before they are used."""

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from gptmini.model import ConfigError, GPTConfig, GPTModel

__all__ = ["LAYER_TYPES", "Layout", "check_finite", "check_float_weights", "checked_config",
           "config_integer", "config_number", "give_weights", "model_from_weights",
           "quantization_problem", "take_weights", "untaken", "windows_of_types"]


class Layout(NamedTuple):
    """One Hugging Face `model_type` as gptmini reads and writes it: each layout's module
    (gpt2.py, llama.py, deepseek.py) lists its own in a LAYOUTS dict by model_type, which
    gptmini.convert.hub gathers, so a new layout, or a new model_type of one, is a row in
    its own module."""

    title: str
    """How messages name it ("Qwen3")."""
    architecture: str
    """The start of its `architectures` class names ("Qwen3": Qwen3ForCausalLM), for a
    config.json without model_type."""
    config_from: Callable
    """config.json dict -> GPTConfig."""
    model_from: Callable
    """(state dict, config.json dict) -> GPTModel."""
    config_to: Callable
    """GPTConfig -> config.json dict (raising for what the layout cannot hold)."""
    state_to: Callable
    """GPTModel -> its state dict under the layout's names."""


def model_from_weights(cfg: GPTConfig, weights: dict[str, Tensor], unknown: list[str],
                       layout: str) -> GPTModel:
    """A `GPTModel` (eval mode) of `cfg` holding `weights` (gptmini's names), mapped from a
    `layout` state dict in which the keys `unknown` had no place.

    Raises:
        ValueError: weights with no place, quantized weights, or weights that do not fit
            `cfg` (non-finite ones are refused by `load_hf`, which reads the whole file).
    """
    if unknown:
        raise ValueError(f"the {layout} state dict has weights GPTModel has no place for: "
                         f"{unknown[:5]}")
    check_float_weights(weights, f"the {layout} state dict")  # free; finiteness reads them all
    if cfg.tie_weights:
        weights["out_head.weight"] = weights["tok_emb.weight"]
    model = GPTModel(cfg)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ValueError(f"the {layout} weights do not fit its config ({cfg}):\n{err}") from err
    return model.eval()


def take_weights(state_dict: Mapping[str, Tensor], rows: list[tuple[str, str]],
                 cfg: GPTConfig, layout: str) -> tuple[dict[str, Tensor], set[str]]:
    """gptmini's weights of `rows` ((gptmini name, Hugging Face name) pairs) from a `layout`
    state dict, and the Hugging Face names taken; a tied head is left to the embedding.

    Raises:
        ValueError: a weight missing, named with what needs it.
    """
    ours, seen = {}, set()
    for name, hf_name in rows:
        if name == "out_head.weight" and cfg.tie_weights:
            continue
        if hf_name not in state_dict:
            raise ValueError(f"the {layout} state dict has no {hf_name!r} (needed for {name})")
        ours[name] = state_dict[hf_name]
        seen.add(hf_name)
    return ours, seen


def untaken(state_dict: Mapping[str, Tensor], seen: set[str]) -> list[str]:
    """The state dict's keys no row took, but a tied model's head and the rotary buffers
    some checkpoints carry (no weights)."""
    return sorted(k for k in set(state_dict) - seen
                  if k != "lm_head.weight" and not k.endswith("rotary_emb.inv_freq"))


def give_weights(model: GPTModel, rows: list[tuple[str, str]]) -> dict[str, Tensor]:
    """`model`'s weights of `rows` under their Hugging Face names (contiguous copies; a
    tied head is left out, as `save_pretrained` does)."""
    ours = model.state_dict()
    return {hf_name: ours[name].detach().clone().contiguous() for name, hf_name in rows
            if not (name == "out_head.weight" and model.cfg.tie_weights)}


def checked_config(layout: str, **fields) -> GPTConfig:
    """`GPTConfig(**fields)` for a `layout` config.json, a field it refuses (a rope scaling
    setting out of range, a head size of the wrong parity) named as that config's problem.

    Raises:
        ValueError: naming the layout and the GPTConfig field.
    """
    try:
        return GPTConfig(**fields)
    except ConfigError as err:
        raise ValueError(f"this {layout} config cannot be loaded into GPTModel: {err}") from None


def check_float_weights(weights: Mapping[str, Tensor], where: str) -> None:
    """Refuse integer and 8-bit weights: quantized ones, whose scales live elsewhere, would
    be copied into float parameters as their raw codes.

    Raises:
        ValueError: naming the first such tensor and its dtype.
    """
    for name, tensor in weights.items():
        if isinstance(tensor, Tensor) and (not tensor.is_floating_point()
                                           or tensor.element_size() < 2):
            raise ValueError(
                f"{where} holds quantized weights ({name} is {tensor.dtype}); gptmini loads "
                "float32, float16 or bfloat16 weights only, and would copy the codes without "
                "their scales. Dequantize them first (e.g. load with transformers and "
                "save_pretrained the float model)")


def check_finite(weights: Mapping[str, Tensor], where: str) -> None:
    """Refuse weights holding NaN or infinity, which make every output NaN.

    Raises:
        ValueError: naming each such tensor (up to three) and how many values are not
            finite.
    """
    bad = []
    for name, tensor in weights.items():
        if isinstance(tensor, Tensor) and tensor.is_floating_point():
            count = int((~torch.isfinite(tensor)).sum())
            if count:
                bad.append(f"{name} ({count:,} of {tensor.numel():,} values)")
    if bad:
        more = f" and {len(bad) - 3} more tensors" if len(bad) > 3 else ""
        raise ValueError(
            f"{where} holds non-finite weights (NaN or infinity): {', '.join(bad[:3])}{more}; "
            "every output would be NaN. A run that diverged saved them: take an earlier "
            "checkpoint (best.ckpt, or a copy from before the divergence)")


def config_integer(config: Mapping, name: str, layout: str, default: int | None = None) -> int:
    """`config[name]` as a positive integer (`default` when it is absent, if given).

    Raises:
        ValueError: naming the field, what it holds and what gptmini reads.
    """
    if name not in config and default is not None:
        return default
    if name not in config:
        raise ValueError(f"the {layout} config has no {name!r}, which gptmini reads as a "
                         "positive integer; is it another architecture's config?")
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the {layout} config's {name!r} is {value!r}; gptmini reads a "
                         "positive integer there")
    return value


def config_number(config: Mapping, name: str, layout: str, default: float) -> float:
    """`config[name]` as a finite positive number (`default` when absent or null).

    Raises:
        ValueError: naming the field, what it holds and what gptmini reads.
    """
    value = config.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"the {layout} config's {name!r} is {value!r}; gptmini reads a "
                         "finite positive number there")
    return float(value)


def quantization_problem(quantization: object) -> str:
    """What a config's `quantization_config` is, as a reason it cannot be loaded."""
    method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
    return (f"quantization_config (quant_method={method!r}: quantized weights, whose scales "
            "gptmini does not apply; dequantize and save the float model first)")


LAYER_TYPES = {"full_attention": False, "sliding_attention": True}
"""The layer_types entries gptmini reads (Qwen3's, Gemma 3's, gpt-oss's): whether the layer
has the config's sliding_window."""


def windows_of_types(config: Mapping, types: object, n_layers: int, layout: str,
                     problems: list[str]) -> list[int | None] | None:
    """GPTConfig.layer_windows of `types` (a config's layer_types): its sliding_window at
    the "sliding_attention" layers, None at the others; None where every layer is full.
    What cannot be read goes into `problems`."""
    if (not isinstance(types, list) or len(types) != n_layers
            or any(t not in LAYER_TYPES for t in types)):
        problems.append(f"layer_types={types!r} (gptmini reads a list of num_hidden_layers="
                        f"{n_layers} entries, each one of {', '.join(LAYER_TYPES)})")
        return None
    if not any(LAYER_TYPES[t] for t in types):
        return None
    if config.get("sliding_window") is None:
        problems.append("sliding_window=None beside sliding_attention layers")
        return None
    window = config_integer(config, "sliding_window", layout)
    return [window if LAYER_TYPES[t] else None for t in types]
