"""The core: what a reader reads, importing only torch. attention.py (the book's
MultiHeadAttention, one pass's AttentionContext, the KV cache), masks.py (the mask algebra),
kernels.py (explicit and SDPA), positions.py (learned, rotary), layers.py (the
feed-forwards), model.py (GPTConfig, GPTModel). Everything else attaches from outside
through their hooks: see gptmini.attention and gptmini.model.
"""

from gptmini.core.attention import (
    AttentionContext,
    AttentionSettings,
    BaseKVCache,
    KVCache,
    MultiHeadAttention,
)
from gptmini.core.model import (
    GPT_CONFIG_124M,
    ConfigError,
    GPTConfig,
    GPTModel,
    TransformerBlock,
)

__all__ = ["GPT_CONFIG_124M", "AttentionContext", "AttentionSettings", "BaseKVCache",
           "ConfigError", "GPTConfig", "GPTModel", "KVCache", "MultiHeadAttention",
           "TransformerBlock"]
