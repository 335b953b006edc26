"""Multi-head attention (the book's Listing 3.5).

Letters in the shape comments:
    b             batch size
    num_tokens    queries in this call (the new tokens)
    num_keys      keys in this call: cached tokens + new tokens
    num_heads     query heads
    num_kv_heads  key/value heads (fewer than num_heads for grouped-query attention)
    head_dim      d_out // num_heads, or the head_dim given (then the heads are
                  num_heads * head_dim wide together, and out_proj maps that to d_out)

The module projects queries, keys and values, turns queries and keys by their positions if
its position scheme rotates (gptmini.attention.positions), appends keys and values to a KV
cache if given one, and hands them to its kernel, chosen once at construction
(gptmini.attention.kernels: sdpa, explicit, flex, tiled, or a class of your own). What the
call attends with (the positions of the new tokens and the mask, in every kernel's form) is
an `AttentionContext` (gptmini.attention.context): a model builds one per forward pass and
passes it to every layer; called alone, the module builds its own from its arguments.

A query with no key to attend (left padding) gets a zero output, never NaN, on every
kernel. flex and tiled have no attention dropout: they refuse a dropout above 0 in training
(set the attention's own rate to 0: GPTConfig.attn_drop_rate).
"""

import torch
from torch import Tensor, nn

from gptmini.attention.context import AttentionContext, AttentionSettings, layer_context
from gptmini.attention.errors import ArgumentError
from gptmini.attention.kernels import KERNELS, attend, backend_name, make_kernel
from gptmini.attention.kv_cache import BaseKVCache
from gptmini.attention.positions import SCHEMES, NoPositions, PositionScheme

BACKENDS = tuple(KERNELS)
"""The built-in kernels' names (gptmini.attention.kernels.KERNELS)."""


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention, constructed exactly as the book's Listing 3.5.

    The parameters `W_query`, `W_key`, `W_value`, `out_proj` are created in the book's
    order, so under the same `torch.manual_seed` this module starts from the book's
    weights and prints the book's numbers.

    Beyond the book, as keyword-only options:
        num_kv_heads: grouped-query attention; `num_kv_heads` key/value heads, each shared
            by `num_heads // num_kv_heads` query heads (1 is multi-query attention).
        window_size: sliding-window attention; query i sees keys i - window_size + 1 ... i
            (with causal=False: keys less than window_size away on either side).
        causal: False attends both ways, as a bidirectional encoder does.
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
        qk_norm: RMSNorm each head's queries and keys before attending (as Qwen3 and
            OLMo 2 do), which keeps the scores' scale in check; a name of
            gptmini.attention.norm.RMS_NORMS picks the kind ("rmsnorm1p": Gemma 3's).
        head_dim: each head's size, where it is not d_out // num_heads (Qwen3-0.6B's 128
            for a width of 1024 and 16 heads; Gemma 3's 256).
        scale: the scores' factor instead of 1/sqrt(head_dim) (Gemma's
            query_pre_attn_scalar ** -0.5).
        out_bias: a bias in out_proj (the book's); Llama-style models have none.
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

    # 20 parameters: the book's six, then one keyword per option above, each one a reader
    # may type (the README's, the conformance kit's specs); rope_theta and alibi stay as the
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
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_heads(d_out, num_heads, num_kv_heads, head_dim)
        check_dropout(dropout)
        self.d_out = d_out
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim or d_out // num_heads
        inner = num_heads * self.head_dim  # the heads side by side: d_out unless head_dim
        self.query_scale = _query_scale(scale, self.head_dim)
        self.context_length = context_length
        scheme = _position_scheme(position_scheme, rope_theta, alibi, num_heads, self.head_dim)
        self.settings = AttentionSettings(causal, window_size, scheme, softcap)

        kv_dim = num_kv_heads * self.head_dim
        self.W_query = nn.Linear(d_in, inner, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, kv_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, kv_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(inner, d_out, bias=out_bias)  # combines the heads' outputs
        self.dropout = nn.Dropout(dropout)
        if qk_norm:  # one gain per head dimension, shared by the heads
            self.q_norm, self.k_norm = _qk_norms(qk_norm, self.head_dim)
        self.qk_norm = bool(qk_norm)
        # after the book's weights, which keep their order; zeros: no random numbers drawn
        self.register_parameter("sinks", nn.Parameter(torch.zeros(num_heads)) if sinks else None)
        self.gate = None
        if gate != "none":
            from gptmini.attention.gate import OutputGate  # (checks the name against GATES)

            self.gate = OutputGate(d_in, num_heads, self.head_dim, gate, bias=qkv_bias)
        self.backend = backend  # builds self.kernel, once the sinks it must add are known
        # The book registers its triangular mask as a buffer; here masks are built per call
        # (gptmini.attention.context), so they also cover caches, windows, padding and
        # documents, and checkpoints do not carry a context_length^2 tensor per layer. The
        # book's state dicts still load: their "mask" entry is dropped, as it is fixed by
        # context_length.
        self.register_load_state_dict_pre_hook(_drop_book_mask)

    @property
    def backend(self) -> str | type:
        return self._backend

    @backend.setter
    def backend(self, backend: str | type):
        kernel = make_kernel(backend)  # raises, naming the choices, for an unknown one
        if getattr(self, "sinks", None) is not None and not getattr(kernel, "has_sinks", False):
            raise ValueError(
                f"the {backend_name(backend)} attention backend cannot add attention sinks "
                "(a kernel that can says has_sinks = True): use sdpa, explicit, flex or "
                "tiled, or turn the sinks off (GPTConfig.attn_sinks=False)")
        self.kernel = kernel
        self._backend = backend

    def forward(
        self,
        x: Tensor,
        attention_mask: Tensor | None = None,
        *,
        document_ids: Tensor | None = None,
        kv_cache: BaseKVCache | None = None,
        return_weights: bool = False,
        context: AttentionContext | None = None,
        positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend over `x` (and the cached tokens before it).

        Args:
            x: (b, num_tokens, d_in).
            attention_mask: optional (b, num_keys) mask of real tokens (1) and padding (0),
                covering cached and new tokens.
            document_ids: optional (b, num_keys) id of each token's document, for several
                documents packed in one window: a query sees only its own document's keys.
            kv_cache: optional cache; the new keys and values are appended to it.
            return_weights: also return the attention weights, computed on the explicit
                path (the weights the output was really computed from).
            context: the forward pass's AttentionContext, built once by the model for
                every layer; then attention_mask and document_ids are already in it. None:
                built here from the arguments above.
            positions: (b, num_tokens) positions of x's tokens, where they are not 0, 1, ...
                after the cache (rotary attention called alone); None: counted as usual.

        Returns:
            (b, num_tokens, d_out), and with `return_weights` the weights
            (b, num_heads, num_tokens, num_keys). A query with no key to attend (a
            left-padding position) gets zero weights and a zero output, never NaN.
        """
        b, num_tokens, _ = x.shape
        num_cached = len(kv_cache) if kv_cache is not None else 0
        # the pass's context, checked and seen with this layer's window, or one built here
        context = layer_context(self.settings, self.context_length, x, num_cached,
                                context=context, uses_cache=kv_cache is not None,
                                attention_mask=attention_mask, document_ids=document_ids,
                                positions=positions)
        queries = self.W_query(x)  # (b, num_tokens, d_out)
        keys = self.W_key(x)  # (b, num_tokens, num_kv_heads * head_dim)
        values = self.W_value(x)

        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim)
        keys = keys.view(b, num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # per head vector, while each is still contiguous in memory
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        # (b, num_tokens, num_heads, head_dim) -> (b, num_heads, num_tokens, head_dim)
        queries, keys = queries.transpose(1, 2), keys.transpose(1, 2)
        values = values.view(b, num_tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # rotated at their positions (a rotary scheme), then cached
        queries, keys = self.settings.position_scheme.rotate(queries, keys, context)
        if self.query_scale is not None:
            queries = queries * self.query_scale

        if kv_cache is not None:
            # (b, num_kv_heads, num_keys, head_dim)
            keys, values = kv_cache.update(keys, values, context.positions)
            if keys.shape[2] < context.num_keys and context.ragged is None:
                # a WindowKVCache returned its window's keys only: mask over those
                context = context.for_layer(self.settings, keys.shape[2])
        # (b, num_heads, num_tokens, head_dim): the kernel's, or the explicit path's + weights
        context_vec, weights = attend(
            self.kernel, self.backend, queries, keys, values, context,
            dropout_p=self.dropout.p if self.training else 0.0,
            return_weights=return_weights, sinks=self.sinks)

        # (b, num_heads, num_tokens, head_dim) -> (b, num_tokens, num_heads * head_dim)
        context_vec = context_vec.transpose(1, 2).contiguous().view(b, num_tokens, -1)
        if self.gate is not None:
            context_vec = self.gate(x, context_vec)
        out = self.out_proj(context_vec)
        empty_rows = context.empty_rows()  # (b, num_tokens) or None
        if empty_rows is not None:
            out = out.masked_fill(empty_rows[..., None], 0.0)  # out_proj's bias, zeroed
        return (out, weights) if return_weights else out


def check_heads(d_out: int, num_heads: int, num_kv_heads: int, head_dim: int | None = None
                ) -> None:
    """The heads' rule: query heads divide the width (unless they have a head_dim of their
    own), key/value heads divide the query heads.

    Raises:
        ArgumentError: naming head_dim, num_heads or num_kv_heads.
    """
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool)
                                 or head_dim < 1):
        raise ArgumentError("head_dim", head_dim, "use a positive integer, or None for the "
                            "width / the heads")
    if (not isinstance(num_heads, int) or num_heads < 1
            or (head_dim is None and d_out % num_heads != 0)):
        raise ArgumentError("num_heads", num_heads, f"it must divide the width ({d_out}): "
                            "pick one of its divisors, or give the heads a head_dim")
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ArgumentError("num_kv_heads", num_kv_heads, f"use a divisor of the {num_heads} "
                            "query heads (1: multi-query attention)")


def check_dropout(dropout: float) -> None:
    """The attention dropout's rule: a rate in [0, 1) (NaN fails it too).

    Raises:
        ArgumentError: naming dropout.
    """
    if not 0.0 <= dropout < 1.0:
        raise ArgumentError("dropout", dropout, "use a number in [0, 1)")


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


def _qk_norms(kind: bool | str, head_dim: int) -> tuple[nn.Module, nn.Module]:
    """QK-norm's two norms, of the kind named (True: RMSNorm), with Qwen3's epsilon."""
    from gptmini.attention.norm import RMS_NORMS  # (loaded by the option that needs it)

    if kind is not True and kind not in RMS_NORMS:
        raise ArgumentError("qk_norm", kind, f"use True or one of {', '.join(RMS_NORMS)}")
    norm = RMS_NORMS["rmsnorm" if kind is True else kind]
    return norm(head_dim, eps=1e-6), norm(head_dim, eps=1e-6)


def _position_scheme(scheme: PositionScheme | None, rope_theta: float | None, alibi: bool,
                     num_heads: int, head_dim: int) -> PositionScheme:
    """The scheme of a module's options: position_scheme, or one of its two short forms."""
    given = [name for name, value in (("position_scheme", scheme is not None),
                                      ("rope_theta", rope_theta is not None),
                                      ("alibi", alibi)) if value]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} each choose how positions enter: pass one "
                         "(rope_theta and alibi are short for a position_scheme)")
    if rope_theta is not None:
        return SCHEMES["rope"](head_dim=head_dim, theta=rope_theta)
    if alibi:
        return SCHEMES["alibi"](num_heads=num_heads)
    return NoPositions() if scheme is None else scheme


def _drop_book_mask(module, state_dict, prefix, *args):
    state_dict.pop(prefix + "mask", None)
