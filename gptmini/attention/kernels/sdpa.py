"""torch's fused scaled_dot_product_attention (gptmini.core.kernels), with an additive
score modifier, attention sinks, and a GPU's backends chosen for a growing KV cache."""

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from gptmini.core import kernels as core

__all__ = ["SdpaKernel", "backends_for"]

# With a KV cache every step has a new key length, for which cuDNN's attention builds a
# graph: 39.9 ms a GPT-2 124M decode step on an H200 against 5.8 ms without it (bf16,
# batch 1; 54.1 against 4.0 ms at 64; docs/benchmarks.md). Training keeps torch's choice.
GROWING_KEYS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def backends_for(device: torch.device, uses_cache: bool) -> list[SDPBackend] | None:
    """The SDPA backends a call on `device` may use (None: torch's own choice)."""
    return GROWING_KEYS if device.type == "cuda" and uses_cache else None


class SdpaKernel(core.SdpaKernel):
    """The core's SDPA kernel; an additive score modifier (ALiBi) goes with the mask as one
    float bias, and sinks are one more key and value, both zero, whose bias is the sink
    (gptmini.attention.sinks). Any other modifier (soft-capping) takes the explicit path.
    A cached call on a GPU keeps off cuDNN's attention (`backends_for`)."""

    has_sinks = True

    def __call__(self, queries: Tensor, keys: Tensor, values: Tensor, context,
                 dropout_p: float = 0.0, *, sinks: Tensor | None = None) -> Tensor:
        mod = context.score_mod
        backends = backends_for(queries.device, context.uses_cache)
        with nullcontext() if backends is None else sdpa_kernel(backends):
            if sinks is None and (mod is None or not getattr(mod, "additive", False)):
                return super().__call__(queries, keys, values, context, dropout_p)
            if mod is not None and not getattr(mod, "additive", False):
                from gptmini.attention.kernels.explicit import explicit_attention

                return explicit_attention(queries, keys, values, context, dropout_p,
                                          sinks=sinks)[0]
            if sinks is not None:  # (loaded by the option that needs it)
                from gptmini.attention.sinks import sdpa_with_sinks

                return sdpa_with_sinks(queries, keys, values, context, dropout_p, sinks)
            bias = context.float_mask(queries.shape[1], queries.dtype)
            return F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias,
                                                  dropout_p=dropout_p,
                                                  enable_gqa=keys.shape[1] != queries.shape[1])
