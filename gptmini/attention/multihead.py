"""Multi-head attention (the book's Listing 3.5, gptmini.core.attention) with every option
beyond the core: sliding windows per layer, the kernels' table (flex, tiled, or yours by
import path), ALiBi and rope scaling through the position scheme, soft-capping, attention
sinks, an output gate, a score scale of its own, and an engine step's packed rows.

The core's forward runs unchanged; this module fills its hooks: `new_kernel` (the table),
`layer_context` (a layer's own window over the pass, packed rows), `attend` (sinks, packed
rows, a window's own KV cache), `query_scale` and `gate`. flex and tiled have no attention
dropout: they refuse a dropout above 0 in training (GPTConfig.attn_drop_rate 0).
"""

import torch
from torch import Tensor, nn

from gptmini.attention.context import AttentionContext, AttentionSettings, layer_context
from gptmini.attention.kernels import KERNELS, attend, backend_name, make_kernel
from gptmini.attention.positions import NoPositions, PositionScheme
from gptmini.core import attention as core
from gptmini.core.attention import check_dropout, check_heads
from gptmini.core.layers import ArgumentError

__all__ = ["BACKENDS", "MultiHeadAttention", "check_dropout", "check_heads"]

BACKENDS = tuple(KERNELS)
"""The built-in kernels' names (gptmini.attention.kernels.KERNELS)."""


class MultiHeadAttention(core.MultiHeadAttention):
    """The book's multi-head attention (gptmini.core.attention.MultiHeadAttention: its
    parameters in the book's order, num_kv_heads, window_size, causal, head_dim, out_bias)
    with every option beyond the core.

    Options beyond the core, keyword-only:
        backend: the kernel (gptmini.attention.kernels): a built-in's name, "sdpa"
            (default), "explicit", "flex" or "tiled"; a kernel class of your own; or its
            import path "package.module:ClassName". Assigning `backend` later swaps it.
        position_scheme: how positions enter attention (gptmini.attention.positions): its
            rotation of queries and keys, its score modifier. A GPTModel hands every layer
            its scheme; None: no positions in attention (the book's: they are embedded).
        rope_theta: for a module used alone, rotary positions with this base (the same as
            position_scheme=RotaryPositions(head_dim, rope_theta)).
        alibi: for a module used alone, ALiBi's per-head distance penalties on the scores
            (the same as position_scheme=AlibiPositions(num_heads)).
        qk_norm: as the core's, or a name of gptmini.attention.norm.RMS_NORMS for the
            kind ("rmsnorm1p": Gemma 3's).
        scale: the scores' factor instead of 1/sqrt(head_dim) (Gemma's
            query_pre_attn_scalar ** -0.5).
        softcap: soft-cap the scaled scores at this value (cap * tanh(score / cap)).
        sinks: a learned logit per head in the softmax's denominator (gpt-oss's attention
            sinks, gptmini.attention.sinks): the parameter `sinks` (num_heads,), starting
            at 0; the weights then sum to less than 1. Every built-in kernel adds it.
        gate: "headwise" or "elementwise": a sigmoid gate from the input on each head's
            output before out_proj (Qwen3-Next's gated attention, gptmini.attention.gate);
            "none": no gate.

    What its contexts must be built with (causal, window, position scheme, soft-cap) is
    `settings`, an `AttentionSettings`.
    """

    # The book's six parameters, then one keyword per option above, each one a reader may
    # type (the README's, the conformance kit's specs); rope_theta and alibi stay as the
    # short spelling of two position schemes for a module used alone.
    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        num_kv_heads: int | None = None,
        window_size: int | None = None,
        causal: bool = True,
        backend: str | type = "sdpa",
        position_scheme: PositionScheme | None = None,
        rope_theta: float | None = None,
        alibi: bool = False,
        qk_norm: bool | str = False,
        out_bias: bool = True,
        softcap: float | None = None,
        sinks: bool = False,
        gate: str = "none",
        head_dim: int | None = None,
        scale: float | None = None,
    ):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias,
                         num_kv_heads=num_kv_heads, window_size=window_size, causal=causal,
                         backend=backend, qk_norm=_qk_norm(qk_norm), head_dim=head_dim,
                         out_bias=out_bias)
        scheme = _position_scheme(position_scheme, rope_theta, alibi, num_heads, self.head_dim)
        self.settings = AttentionSettings(causal, window_size, scheme, softcap)
        self.query_scale = _query_scale(scale, self.head_dim)
        # after the book's weights, which keep their order; zeros: no random numbers drawn
        self.register_parameter("sinks", nn.Parameter(torch.zeros(num_heads)) if sinks else None)
        self._check_sinks(self.kernel, backend)
        if gate != "none":
            from gptmini.attention.gate import OutputGate  # (checks the name against GATES)

            self.gate = OutputGate(d_in, num_heads, self.head_dim, gate, bias=qkv_bias)

    def new_kernel(self, backend: str | type):
        """The kernel `backend` names in the table (raising, naming the choices, for an
        unknown one); refused if the module has sinks and the kernel cannot add them."""
        kernel = make_kernel(backend)
        self._check_sinks(kernel, backend)
        return kernel

    def _check_sinks(self, kernel, backend: str | type) -> None:
        if getattr(self, "sinks", None) is not None and not getattr(kernel, "has_sinks", False):
            raise ValueError(
                f"the {backend_name(backend)} attention backend cannot add attention sinks "
                "(a kernel that can says has_sinks = True): use sdpa, explicit, flex or "
                "tiled, or turn the sinks off (GPTConfig.attn_sinks=False)")

    def layer_context(self, x: Tensor, num_cached: int, context: AttentionContext | None,
                      uses_cache: bool, attention_mask: Tensor | None,
                      document_ids: Tensor | None, positions: Tensor | None
                      ) -> AttentionContext:
        """The pass's context, checked and seen with this layer's window, or one built here
        (gptmini.attention.context.layer_context)."""
        return layer_context(self.settings, self.context_length, x, num_cached,
                             context=context, uses_cache=uses_cache,
                             attention_mask=attention_mask, document_ids=document_ids,
                             positions=positions)

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, context: AttentionContext,
               return_weights: bool) -> tuple[Tensor, Tensor | None]:
        """The kernel's output (gptmini.attention.kernels.attend: packed rows, sinks), or the
        explicit path's and its weights."""
        if keys.shape[2] < context.num_keys and context.ragged is None:
            # a WindowKVCache returned its window's keys only: mask over those
            context = context.for_layer(self.settings, keys.shape[2])
        return attend(self.kernel, self.backend, queries, keys, values, context,
                      dropout_p=self.dropout.p if self.training else 0.0,
                      return_weights=return_weights, sinks=self.sinks)


def _query_scale(scale: float | None, head_dim: int) -> float | None:
    """What queries are multiplied by so that the scores, which every kernel scales by
    1/sqrt(head_dim), are scaled by `scale` instead; None: nothing to multiply.

    Raises:
        ArgumentError: naming scale, when it is not a finite positive number.
    """
    if scale is None:
        return None
    if not (isinstance(scale, float | int) and 0 < scale < float("inf")):
        raise ArgumentError("scale", scale, "use a finite positive factor, or None for "
                            "1/sqrt(head_dim)")
    factor = scale * head_dim ** 0.5
    return None if factor == 1.0 else factor


def _qk_norm(kind: bool | str):
    """QK-norm's option as the core takes it: False, or a maker of the norm of the kind
    named in gptmini.attention.norm.RMS_NORMS (True: RMSNorm), with Qwen3's epsilon."""
    if kind is False:
        return False
    from gptmini.attention.norm import RMS_NORMS  # (loaded by the option that needs it)

    kind = "rmsnorm" if kind is True else kind
    if kind not in RMS_NORMS:
        raise ArgumentError("qk_norm", kind, f"use True or one of {', '.join(RMS_NORMS)}")
    return lambda head_dim: RMS_NORMS[kind](head_dim, eps=1e-6)


def _position_scheme(scheme: PositionScheme | None, rope_theta: float | None, alibi: bool,
                     num_heads: int, head_dim: int) -> PositionScheme:
    """The scheme of a module's options: position_scheme, or one of its two short forms."""
    given = [name for name, value in (("position_scheme", scheme is not None),
                                      ("rope_theta", rope_theta is not None),
                                      ("alibi", alibi)) if value]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} each choose how positions enter: pass one "
                         "(rope_theta and alibi are short for a position_scheme)")
    if rope_theta is not None:  # (the schemes load with the option that names them)
        from gptmini.attention.positions.rope import RotaryPositions

        return RotaryPositions(head_dim=head_dim, theta=rope_theta)
    if alibi:
        from gptmini.attention.positions.alibi import AlibiPositions

        return AlibiPositions(num_heads=num_heads)
    return NoPositions() if scheme is None else scheme
