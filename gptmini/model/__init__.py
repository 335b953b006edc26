"""The model: `GPTConfig` (which checks itself) and its presets, the transformer blocks and
`GPTModel` (gpt.py), and what a model costs in parameters and FLOPs (flops.py).

Imports only torch, so `GPTModel` can be lifted into any training loop.
"""

from gptmini.model.config import (
    GPT_CONFIG_124M,
    MLPS,
    NORMS,
    PRESETS,
    ConfigError,
    GPTConfig,
    is_finite_number,
    window_pattern,
)
from gptmini.model.gpt import GPTModel, TransformerBlock, cross_entropy

__all__ = ["GPT_CONFIG_124M", "MLPS", "NORMS", "PRESETS", "ConfigError", "GPTConfig",
           "GPTModel", "TransformerBlock", "cross_entropy", "is_finite_number", "window_pattern"]
