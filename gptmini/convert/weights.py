"""What every Hugging Face layout shares: weights renamed to gptmini's, into a GPTModel."""

from torch import Tensor

from gptmini.model import GPTConfig, GPTModel

__all__ = ["model_from_weights"]


def model_from_weights(cfg: GPTConfig, weights: dict[str, Tensor], unknown: list[str],
                       layout: str) -> GPTModel:
    """A `GPTModel` (eval mode) of `cfg` holding `weights` (gptmini's names), mapped from a
    `layout` state dict in which the keys `unknown` had no place.

    Raises:
        ValueError: weights with no place, or weights that do not fit `cfg`.
    """
    if unknown:
        raise ValueError(f"the {layout} state dict has weights GPTModel has no place for: "
                         f"{unknown[:5]}")
    if cfg.tie_weights:
        weights["out_head.weight"] = weights["tok_emb.weight"]
    model = GPTModel(cfg)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ValueError(f"the {layout} weights do not fit its config ({cfg}):\n{err}") from err
    return model.eval()
