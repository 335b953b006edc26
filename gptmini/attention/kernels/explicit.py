"""The book's explicit path (gptmini.core.kernels), with attention sinks."""

from torch import Tensor

from gptmini.core import kernels as core

__all__ = ["ExplicitKernel", "explicit_attention"]


def explicit_attention(queries: Tensor, keys: Tensor, values: Tensor, context,
                       dropout_p: float = 0.0, *, sinks: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
    """The core's `explicit_attention`; with `sinks` (num_heads,), each head's sink logit
    joins the softmax's denominator (gptmini.attention.sinks), and the weights sum to less
    than 1."""
    softmax = None
    if sinks is not None:  # (loaded by the option that needs it)
        from gptmini.attention.sinks import softmax_with_sinks

        def softmax(scores: Tensor, dtype) -> Tensor:
            return softmax_with_sinks(scores, sinks, dtype)

    return core.explicit_attention(queries, keys, values, context, dropout_p, softmax=softmax)


class ExplicitKernel(core.ExplicitKernel):
    """The book's path, with sinks."""

    has_sinks = True

    def __call__(self, queries: Tensor, keys: Tensor, values: Tensor, context,
                 dropout_p: float = 0.0, *, sinks: Tensor | None = None) -> Tensor:
        return explicit_attention(queries, keys, values, context, dropout_p, sinks=sinks)[0]
