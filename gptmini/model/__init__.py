"""The model: `GPTConfig` (which checks itself) and its presets (config.py), the tables of
what a layer is made of, its token mixer (mixers.py) and its feed-forward (feedforward.py),
the transformer blocks, `GPTModel` and its loss (gpt.py), and what a model costs in
parameters and FLOPs (flops.py).

Imports only torch, so `GPTModel` can be lifted into any training loop.
"""

from gptmini.model.config import (
    GPT_CONFIG_124M,
    MIXERS,
    MLPS,
    NORMS,
    PRESETS,
    ConfigError,
    GPTConfig,
    is_finite_number,
    window_pattern,
)
from gptmini.model.feedforward import FeedForwardKind
from gptmini.model.gpt import (
    GPTModel,
    TransformerBlock,
    add_aux_loss,
    cross_entropy,
    init_gpt2_weights,
    lm_loss,
)
from gptmini.model.mixers import TokenMixer

__all__ = ["GPT_CONFIG_124M", "MIXERS", "MLPS", "NORMS", "PRESETS", "ConfigError",
           "FeedForwardKind", "GPTConfig", "GPTModel", "TokenMixer", "TransformerBlock",
           "add_aux_loss", "cross_entropy", "init_gpt2_weights", "lm_loss", "is_finite_number",
           "window_pattern"]
