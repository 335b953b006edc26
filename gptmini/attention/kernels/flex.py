"""torch's FlexAttention with the context's mask as a BlockMask: masked blocks are skipped.

Loaded the first time a model names it (the `flex` entry of the kernels' table)."""

import functools
import os

import torch
from torch import Tensor

from gptmini.attention import masks
from gptmini.attention.kernels.sdpa import SdpaKernel

__all__ = ["FlexKernel", "block_mask", "context_block_mask"]


class FlexKernel:
    """`flex_attention`, compiled (set GPTMINI_COMPILE_FLEX=0 for the eager one: the same
    math, no compiling). torch 2.13 has no FlexAttention backward on CPU, so on CPU it serves
    evaluation and generation and refuses training. A call with a KV cache runs on SDPA:
    one block mask and one compile per cached length would not pay. Sinks rescale flex's
    output by its log-sum-exp (gptmini.attention.sinks)."""

    has_dropout = False
    has_sinks = True
    cpu_backward = False  # torch 2.13's FlexAttention on a CPU runs forward only

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
        blocks = context_block_mask(context)
        if sinks is None:
            return flex(queries, keys, values, block_mask=blocks, score_mod=context.score_mod,
                        enable_gqa=gqa)
        from torch.nn.attention.flex_attention import AuxRequest

        from gptmini.attention.sinks import rescale_by_lse

        out, aux = flex(queries, keys, values, block_mask=blocks, score_mod=context.score_mod,
                        enable_gqa=gqa, return_aux=AuxRequest(lse=True))
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


def context_block_mask(context):
    """The context's mask as a FlexAttention BlockMask, or None for all keys: made once per
    forward pass for every layer (`context.once`); a mask that reads no data (causal,
    window) is the same for every batch, built once per shape."""
    if context.mask is None:
        return None
    if not context.data_dependent:
        settings = context.settings
        return _fixed_block_mask(settings.causal, settings.window_size, context.num_tokens,
                                 context.num_keys, str(context.device))
    return context.once("block_mask", lambda: block_mask(
        context.mask, context.batch, context.num_tokens, context.num_keys, context.device))


@functools.lru_cache(maxsize=16)
def _fixed_block_mask(causal: bool, window: int | None, num_tokens: int, num_keys: int,
                      device: str):
    # Causal and window block masks depend only on the shape: one per shape for the process
    # (a pure memo of an immutable value, thread-safe), so compiled flex finds it again.
    parts = [masks.causal if causal else masks.full]
    if window is not None and num_keys > window:
        parts.append(masks.sliding_window(window))
    mask = parts[0] if len(parts) == 1 else masks.and_masks(*parts)
    return block_mask(mask, None, num_tokens, num_keys, device)


def block_mask(mask: masks.MaskMod, batch: int | None, num_tokens: int, num_keys: int, device=None,
               block_size: int = 128):
    """The mask as a FlexAttention BlockMask (batch None: the same for every row).

    FlexAttention counts queries from 0; the mask counts absolute positions, so queries are
    shifted by num_keys - num_tokens.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    offset = num_keys - num_tokens
    shifted = mask if offset == 0 else _shift_queries(mask, offset)
    return create_block_mask(shifted, batch, None, num_tokens, num_keys, device=device,
                             BLOCK_SIZE=block_size)


def _shift_queries(mask: masks.MaskMod, offset: int) -> masks.MaskMod:
    def shifted(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mask(b, h, q_idx + offset, kv_idx)

    return shifted
