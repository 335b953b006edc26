"""torch's fused scaled_dot_product_attention: the default kernel."""

import torch.nn.functional as F
from torch import Tensor


class SdpaKernel:
    """`F.scaled_dot_product_attention`. With causal alone over the whole call it passes
    `is_causal=True` and no mask, so flash kernels stay eligible on GPUs; any other mask
    goes as the context's dense boolean mask."""

    has_dropout = True

    def __call__(self, queries: Tensor, keys: Tensor, values: Tensor, context,
                 dropout_p: float = 0.0) -> Tensor:
        gqa = keys.shape[1] != queries.shape[1]
        if context.plain_causal:
            return F.scaled_dot_product_attention(queries, keys, values, dropout_p=dropout_p,
                                                  is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=context.dense(),
                                              dropout_p=dropout_p, enable_gqa=gqa)
