"""Attention kernels: the built-in ones as a fixed table, and your own by class.

A kernel is built once, when `MultiHeadAttention` is constructed with `backend=...`, and
called as the core's are (gptmini.core.kernels: its signature, shapes and `has_dropout`).
One with no backward pass on a CPU says so with `cpu_backward = False` (the device check
skips it); one that adds attention sinks (gptmini.attention.sinks) with `has_sinks = True`,
and only then is called with the keyword `sinks=` (num_heads,) as well; a module with
sinks refuses a kernel without them, by name. Modules call their kernel through `attend`
below, which also lays an engine step's packed sequences out one per row and takes the
explicit path where the attention weights are asked for.

A backend is named three ways, and which one a name means never depends on what was
imported before:

    "sdpa", "explicit", "flex", "tiled"   the built-ins: `KERNELS` below, read-only; a new
                                          built-in is one file here and its name in KERNELS
                                          (flex and tiled by import path: they load the first
                                          time a model names them)
    a class                               your own: MultiHeadAttention(..., backend=MyKernel)
    "package.module:ClassName"            your own, by import path, where only a string goes
                                          (GPTConfig.attention_backend, --model.attention_backend,
                                          a checkpoint): imported when the model is built
"""

from torch import Tensor

from gptmini.attention.kernels.explicit import ExplicitKernel, explicit_attention
from gptmini.attention.kernels.sdpa import SdpaKernel
from gptmini.attention.table import Table

__all__ = ["KERNELS", "ExplicitKernel", "FlexKernel", "SdpaKernel", "TiledKernel", "attend",
           "backend_name", "explicit_attention", "is_backend_name", "make_kernel"]

KERNELS = Table("backend", {
    "sdpa": SdpaKernel,
    "explicit": ExplicitKernel,
    "flex": "gptmini.attention.kernels.flex:FlexKernel",
    "tiled": "gptmini.attention.kernels.tiled:TiledKernel",
})
"""The built-in kernels by name (read-only: a kernel of your own is passed, not registered)."""

_CHOICES = (f"one of {', '.join(KERNELS)}, a kernel class, or a kernel of your own by "
            "import path as 'package.module:ClassName'")


def is_backend_name(name: object) -> bool:
    """A built-in's name or an import path 'package.module:ClassName' (not imported here:
    whether a name is valid depends on the name alone)."""
    return KERNELS.accepts(name)


def backend_name(backend: str | type) -> str:
    """How `backend` is named in messages: a string as it is, a class by its import path."""
    if isinstance(backend, str):
        return backend
    return f"{backend.__module__}:{backend.__qualname__}"


def make_kernel(backend: str | type):
    """A new instance of the kernel `backend` names (see the module docstring).

    Raises:
        ValueError: an unknown name, an import path that does not import, or something that
            is not a class; the message names the input and the forms a backend takes.
    """
    if isinstance(backend, str) and not is_backend_name(backend):
        raise ValueError(f"backend must be {_CHOICES}, got {backend!r}")
    kernel = KERNELS[backend] if isinstance(backend, str) else backend
    if not isinstance(kernel, type):
        raise ValueError(f"backend must be {_CHOICES}, got {backend!r}, which is not a class")
    return kernel()


def attend(kernel, backend: str | type, queries: Tensor, keys: Tensor, values: Tensor,
           context, *, dropout_p: float = 0.0, return_weights: bool = False,
           sinks: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """An attention module's call into its kernel (MultiHeadAttention's and
    MultiHeadLatentAttention's): the kernel's output (b, num_heads, num_tokens, head_dim)
    and None, or with `return_weights` the explicit path's output and its weights
    (b, num_heads, num_tokens, num_keys), the ones the output was computed from. An engine
    step's packed queries are attended one sequence per row (the context's `Ragged`), then
    packed again.

    Args:
        kernel: the module's kernel (`make_kernel(backend)`).
        backend: how the module named it, for messages.
        queries, keys, values: as a kernel takes them (see the module docstring).
        context: the layer's AttentionContext (its settings are the layer's).
        dropout_p: the attention dropout of this call (0 outside training).
        return_weights: the explicit path and its weights instead of the kernel.
        sinks: (num_heads,) the module's attention sinks, or None; given only to a kernel
            that has_sinks (the module refuses any other when it has them).

    Raises:
        ValueError: weights asked of packed sequences, or a dropout above 0 for a kernel
            without dropout (naming the backend and the fix).
    """
    ragged = context.ragged
    if ragged is not None:  # one row per sequence for attention, then packed again
        if return_weights:
            raise ValueError("return_weights needs one sequence per row; an engine "
                             "step's packed sequences have no such weights")
        queries, context = ragged.unpack(queries), ragged.context_for(context.settings)
    if return_weights:
        context_vec, weights = explicit_attention(queries, keys, values, context, dropout_p,
                                                  sinks=sinks)
    else:
        if dropout_p > 0 and not kernel.has_dropout:
            raise ValueError(
                f"the {backend_name(backend)} attention backend has no attention "
                f"dropout, and this module is training with dropout {dropout_p}: set the "
                "attention dropout to 0 (--model.attn_drop_rate 0) or use the sdpa or "
                "explicit backend"
            )
        weights = None
        if sinks is None:
            context_vec = kernel(queries, keys, values, context, dropout_p)
        else:  # only a kernel that has_sinks is given the keyword
            context_vec = kernel(queries, keys, values, context, dropout_p, sinks=sinks)
    if ragged is not None:
        context_vec = ragged.pack(context_vec)
    return context_vec, weights


def __getattr__(name: str) -> type:
    """FlexKernel and TiledKernel by their names too, imported when first asked for."""
    if name in ("FlexKernel", "TiledKernel"):
        return KERNELS[name.removesuffix("Kernel").lower()]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
