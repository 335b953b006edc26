"""Attention kernels as a table: a name, and a class whose instances compute attention.

A kernel is built once, when `MultiHeadAttention` is constructed with `backend=name`, and
then called as

    kernel(queries, keys, values, context, dropout_p) -> (b, num_heads, num_tokens, head_dim)

with queries (b, num_heads, num_tokens, head_dim), keys and values
(b, num_kv_heads, num_keys, head_dim) (grouped-query attention: fewer key/value heads) and
the forward pass's `AttentionContext` (gptmini.attention.context), whose mask it applies in
whichever form it wants (`dense()`, `block_mask()`, `tile_plan(tile)`). A kernel with no
attention dropout says so with `has_dropout = False`, and is never handed a dropout above 0.

Adding one is one file and one line: write the class, then `register("name", Class)` (or
add it to `KERNELS` below); `MultiHeadAttention(..., backend="name")` and
`--model.attention_backend name` then use it.
"""

from gptmini.attention.kernels.explicit import ExplicitKernel, explicit_attention
from gptmini.attention.kernels.flex import FlexKernel
from gptmini.attention.kernels.sdpa import SdpaKernel
from gptmini.attention.kernels.tiled import TiledKernel

__all__ = ["KERNELS", "ExplicitKernel", "FlexKernel", "SdpaKernel", "TiledKernel",
           "explicit_attention", "make_kernel", "register"]

KERNELS: dict[str, type] = {
    "sdpa": SdpaKernel,
    "explicit": ExplicitKernel,
    "flex": FlexKernel,
    "tiled": TiledKernel,
}


def register(name: str, kernel: type) -> None:
    """Make `kernel` (a class built with no arguments) the backend called `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a kernel's name must be a non-empty string, got {name!r}")
    if not callable(kernel):
        raise ValueError(f"kernel {name!r} must be a class or factory, got {kernel!r}")
    KERNELS[name] = kernel


def make_kernel(name: str):
    """A new instance of the kernel called `name`."""
    if name not in KERNELS:
        raise ValueError(f"backend must be one of {', '.join(KERNELS)}, got {name!r}")
    return KERNELS[name]()
