"""torch's fused scaled_dot_product_attention: the default kernel."""

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from gptmini.attention.kernels.explicit import explicit_attention

# With a KV cache every step has a new key length, for which cuDNN's attention builds a
# graph: 39.9 ms a GPT-2 124M decode step on an H200 against 5.8 ms without it (bf16,
# batch 1; 54.1 against 4.0 ms at 64; docs/benchmarks.md). Training keeps torch's choice.
GROWING_KEYS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def backends_for(device: torch.device, uses_cache: bool) -> list[SDPBackend] | None:
    """The SDPA backends a call on `device` may use (None: torch's own choice)."""
    return GROWING_KEYS if device.type == "cuda" and uses_cache else None


class SdpaKernel:
    """`F.scaled_dot_product_attention`. With causal alone over the whole call it passes
    `is_causal=True` and no mask, so flash kernels stay eligible on GPUs; any other mask
    goes as the context's dense boolean mask, and an additive score modifier (ALiBi) with
    it as one float bias. SDPA has no hook for other modifiers (soft-capping): with one,
    this kernel computes the scores itself, as the explicit path does. Sinks are one more
    key and value, both zero, whose bias is the sink (gptmini.attention.sinks)."""

    has_dropout = True
    has_sinks = True

    def __call__(self, queries: Tensor, keys: Tensor, values: Tensor, context,
                 dropout_p: float = 0.0, *, sinks: Tensor | None = None) -> Tensor:
        backends = backends_for(queries.device, context.uses_cache)
        with nullcontext() if backends is None else sdpa_kernel(backends):
            return self._attend(queries, keys, values, context, dropout_p, sinks)

    def _attend(self, queries: Tensor, keys: Tensor, values: Tensor, context,
                dropout_p: float, sinks: Tensor | None) -> Tensor:
        gqa = keys.shape[1] != queries.shape[1]
        mod = context.score_mod
        if mod is not None and not getattr(mod, "additive", False):
            return explicit_attention(queries, keys, values, context, dropout_p,
                                      sinks=sinks)[0]
        if sinks is not None:  # (loaded by the option that needs it, as every sink's path)
            from gptmini.attention.sinks import sdpa_with_sinks

            return sdpa_with_sinks(queries, keys, values, context, dropout_p, sinks)
        if mod is not None:
            bias = context.float_mask(queries.shape[1], queries.dtype)
            return F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias,
                                                  dropout_p=dropout_p, enable_gqa=gqa)
        if context.plain_causal:
            return F.scaled_dot_product_attention(queries, keys, values, dropout_p=dropout_p,
                                                  is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=context.dense(),
                                              dropout_p=dropout_p, enable_gqa=gqa)
