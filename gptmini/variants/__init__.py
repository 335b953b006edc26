"""Variants beyond the book's path, one file per family, each a token mixer (or, next, a
feed-forward) and what only it needs: the model's tables (gptmini.model.mixers.MIXERS)
name them by import path, so `from gptmini.model import GPTModel` never loads them.

    latent.py     multi-head latent attention (DeepSeek-V2/V3): a cache of latents ("mla")
    deltanet.py   Gated DeltaNet (Qwen3-Next's linear attention): a fixed state ("deltanet")
    geglu.py      GeGLU, Gemma's gated GELU feed-forward ("geglu")
"""

from gptmini.variants.deltanet import DeltaNet, DeltaNetState, GatedDeltaNet, GatedDeltaNetLayer
from gptmini.variants.geglu import GeGLU, GeGLUMLP
from gptmini.variants.latent import LatentAttention, MultiHeadLatentAttention

__all__ = ["DeltaNet", "DeltaNetState", "GatedDeltaNet", "GatedDeltaNetLayer", "GeGLU",
           "GeGLUMLP", "LatentAttention", "MultiHeadLatentAttention"]
