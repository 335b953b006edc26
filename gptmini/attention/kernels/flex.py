"""torch's FlexAttention with the context's BlockMask: masked blocks are skipped."""

import functools
import os

import torch
from torch import Tensor

from gptmini.attention.kernels.sdpa import SdpaKernel
from gptmini.attention.sinks import rescale_by_lse


class FlexKernel:
    """`flex_attention`, compiled (set GPTMINI_COMPILE_FLEX=0 for the eager one: the same
    math, no compiling). torch 2.13 has no FlexAttention backward on CPU, so on CPU it serves
    evaluation and generation and refuses training. A call with a KV cache runs on SDPA:
    one block mask and one compile per cached length would not pay. Sinks rescale flex's
    output by its log-sum-exp (gptmini.attention.sinks)."""

    has_dropout = False
    has_sinks = True

    def __init__(self):
        self._sdpa = SdpaKernel()

    def __call__(self, queries: Tensor, keys: Tensor, values: Tensor, context,
                 dropout_p: float = 0.0, *, sinks: Tensor | None = None) -> Tensor:
        if context.uses_cache:
            return self._sdpa(queries, keys, values, context, dropout_p, sinks=sinks)
        if queries.requires_grad and queries.device.type == "cpu":
            raise ValueError(
                "the flex attention backend has no backward pass on CPU (torch's FlexAttention "
                "runs forward only there): evaluate or generate with flex on CPU, and train "
                "with the sdpa, explicit or tiled backend, or on a GPU"
            )
        flex = _flex_attention(queries)
        gqa = keys.shape[1] != queries.shape[1]
        if sinks is None:
            return flex(queries, keys, values, block_mask=context.block_mask(),
                        score_mod=context.score_mod, enable_gqa=gqa)
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = flex(queries, keys, values, block_mask=context.block_mask(),
                        score_mod=context.score_mod, enable_gqa=gqa,
                        return_aux=AuxRequest(lse=True))
        return rescale_by_lse(out, aux.lse, sinks)


def _flex_attention(queries: Tensor):
    from torch.nn.attention.flex_attention import flex_attention

    if (os.environ.get("GPTMINI_COMPILE_FLEX", "1") == "0"
            or torch.compiler.is_compiling()  # the outer compile covers it
            or (queries.device.type == "cpu" and queries.dtype == torch.float64)):
        return flex_attention  # (inductor's CPU kernel has no float64: the same math, eager)
    return _compiled_flex()


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
