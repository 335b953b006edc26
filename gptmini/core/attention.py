"""Multi-head attention (the book's Listing 3.5), what one forward pass attends with, and
the KV cache: what attention needs of one (`BaseKVCache`) and the plain one (`KVCache`;
gptmini.attention's grows buffers by doubling, the engine's is paged).

Letters in the shape comments: b batch, num_tokens the new tokens (queries), num_keys
cached + new tokens, num_heads query heads, num_kv_heads key/value heads (fewer for
grouped-query attention), head_dim d_out // num_heads (or the head_dim given).

A model builds one `AttentionContext` per forward pass (positions, the mask and its forms,
made once) and hands it to every layer, as torchtitan builds its masks once per batch;
called alone, the module builds its own. A query with no key to attend (left padding) gets
a zero output, never NaN. What attaches from outside (gptmini.attention) fills the
module's hooks: `new_kernel`, `layer_context`, `attend`, `query_scale`, `gate`.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gptmini.core import masks
from gptmini.core.kernels import KERNELS, explicit_attention
from gptmini.core.layers import ArgumentError
from gptmini.core.positions import NoPositions, PositionScheme

__all__ = ["AttentionContext", "AttentionSettings", "BaseKVCache", "KVCache",
           "MultiHeadAttention", "check_dropout", "check_heads", "check_window",
           "positions_in_documents"]


@dataclass(frozen=True)
class AttentionSettings:
    """What a layer attends with; a layer refuses a context built with other settings."""

    causal: bool = True
    """A query sees itself and earlier keys only (False: both ways, as an encoder)."""
    window_size: int | None = None
    """Query i sees keys i - window_size + 1 ... i (non-causal: less than this far either
    side); None: every key."""
    position_scheme: PositionScheme = field(default_factory=NoPositions)
    """How positions enter: its rotation and score modifier."""

    def __post_init__(self):
        check_window(self.window_size)

    def mask(self, num_tokens: int, num_keys: int, attention_mask: Tensor | None,
             document_ids: Tensor | None) -> masks.MaskMod | None:
        """The mask of a call over `num_tokens` new of `num_keys` keys, or None (all)."""
        parts = []
        if self.causal and not (num_tokens == 1 and num_keys >= 1):
            parts.append(masks.causal)  # a single newest query sees every earlier key anyway
        if self.window_size is not None and num_keys > self.window_size:  # else none is farther
            parts.append(masks.sliding_window(self.window_size))
        if attention_mask is not None:
            parts.append(masks.padding(attention_mask))
        if document_ids is not None:
            parts.append(masks.document(document_ids))
        return None if not parts else parts[0] if len(parts) == 1 else masks.and_masks(*parts)

    def score_mod(self, device):
        """The scores' modifier `(score, b, h, q_idx, kv_idx) -> score`, or None."""
        return self.position_scheme.score_mod(device)


class AttentionContext:
    """One forward pass's positions and mask, its forms made on first use and kept: layers
    share it, passes do not. Build it with `build`, which works out the positions."""

    ragged = None  # an engine step's packed rows (gptmini.attention.context.Ragged)
    settings_class = AttentionSettings  # what `build` makes when given no settings

    def __init__(self, positions: Tensor, num_keys: int, settings: AttentionSettings, *,
                 attention_mask: Tensor | None = None, document_ids: Tensor | None = None,
                 uses_cache: bool = False, rows_alike: bool = False):
        self.positions, self.num_keys, self.settings = positions, num_keys, settings
        self.batch, self.num_tokens = positions.shape
        self.device = positions.device
        self.mask = settings.mask(self.num_tokens, num_keys, attention_mask, document_ids)
        self.score_mod = settings.score_mod(self.device)
        self.padded = attention_mask is not None  # only padding can leave a query no key
        self.attention_mask, self.document_ids = attention_mask, document_ids
        self.uses_cache, self.rows_alike = uses_cache, rows_alike
        self._forms: dict = {}

    @classmethod
    def build(cls, batch: int, num_tokens: int, num_cached: int = 0, *,
              settings: AttentionSettings | None = None, attention_mask: Tensor | None = None,
              document_ids: Tensor | None = None, uses_cache: bool = False,
              positions: Tensor | None = None, device=None, **extra) -> "AttentionContext":
        """The context of a call over `num_tokens` new tokens after `num_cached` cached ones.

        Args:
            settings: the layers' settings; None: causal, no window, no positions.
            attention_mask: optional (b, num_keys), 1 at real tokens and 0 at padding.
            document_ids: optional (b, num_keys), the document of each token.
            uses_cache: a KV cache is in play (even empty, on its first call).
            positions: (b, num_tokens), where they are not the tokens' places (a cache that
                dropped its oldest tokens); None: counted from each row's first real token,
                each document's first token, or after the cached ones.
            device: where positions and masks live (default: the masks' tensors').
            extra: a subclass's own arguments.
        """
        num_keys = num_cached + num_tokens
        for name, per_key in (("attention_mask", attention_mask), ("document_ids", document_ids)):
            if per_key is not None and tuple(per_key.shape) != (batch, num_keys):
                raise ValueError(
                    f"{name} must have shape (batch, num_keys) = ({batch}, {num_keys}), got "
                    f"{tuple(per_key.shape)}; with a KV cache it covers cached tokens too")
            if per_key is not None:
                device = per_key.device
        rows_alike = positions is None and attention_mask is None and document_ids is None
        if positions is None:
            positions = _positions(batch, num_tokens, num_cached, attention_mask, document_ids,
                                   device)
        elif tuple(positions.shape) != (batch, num_tokens):
            raise ValueError(f"positions must have shape (batch, num_tokens) = ({batch}, "
                             f"{num_tokens}), got {tuple(positions.shape)}")
        return cls(positions, num_keys, settings or cls.settings_class(),
                   attention_mask=attention_mask, document_ids=document_ids,
                   uses_cache=uses_cache, rows_alike=rows_alike, **extra)

    @property
    def plain_causal(self) -> bool:
        """Causal over the whole call and nothing else: SDPA's is_causal (flash kernels)."""
        return (self.mask is masks.causal and self.num_tokens == self.num_keys
                and self.score_mod is None)

    def once(self, key, make):
        """`make()`, computed on the first call with this `key` and kept for the pass: what
        every layer shares (a rotary scheme's angles, a kernel's form of the mask)."""
        if key not in self._forms:
            self._forms[key] = make()
        return self._forms[key]

    def dense(self) -> Tensor | None:
        """(b, 1, num_tokens, num_keys), True where a query may attend, or None for all. A
        query with no key (left padding) sees all here, so its softmax is not NaN."""
        return self.once("dense", self._dense)

    def _dense(self) -> Tensor | None:
        if self.mask is None:
            return None
        allowed = masks.dense(self.mask, self.batch, self.num_tokens, self.num_keys, self.device)
        if self.padded:
            empty = ~allowed.any(dim=-1)  # (b, 1, num_tokens)
            self._forms["empty_rows"] = empty[:, 0]
            allowed = allowed | empty[..., None]
        return allowed

    def empty_rows(self) -> Tensor | None:
        """(b, num_tokens): True at queries the mask lets see no key (only padding can)."""
        if not self.padded:
            return None
        self.dense()  # which finds them as it is made
        return self._forms["empty_rows"]


class BaseKVCache(ABC):
    """What attention needs of a KV cache: `len(cache)`, the tokens seen before this call's
    (their positions continue from it); `update`, which stores the new tokens' keys (b,
    num_kv_heads, num_tokens, head_dim), values and positions and returns the keys and
    values the call attends to (a window's cache returns only its window's, attention then
    masks over those); `positions` (b, num_keys), those of the keys it returned last."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def update(self, keys: Tensor, values: Tensor,
               positions: Tensor | None = None) -> tuple[Tensor, Tensor]: ...

    @property
    @abstractmethod
    def positions(self) -> Tensor | None: ...


class KVCache(BaseKVCache):
    """Keys, values and positions of the tokens seen so far, concatenated at each update."""

    def __init__(self):
        self.keys = self.values = self._positions = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def positions(self) -> Tensor | None:  # None unless every token's was given
        return self._positions

    def update(self, keys: Tensor, values: Tensor,
               positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if self.keys is None:
            self.keys, self.values, self._positions = keys, values, positions
        else:  # (b, num_kv_heads, num_cached + num_tokens, head_dim)
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
            self._positions = (None if positions is None or self._positions is None
                               else torch.cat([self._positions, positions], dim=1))
        return self.keys, self.values


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention, constructed exactly as the book's Listing 3.5: `W_query`,
    `W_key`, `W_value`, `out_proj` in the book's order, so under the same
    `torch.manual_seed` it starts from the book's weights and prints the book's numbers.

    Beyond the book, keyword-only: `num_kv_heads` (grouped-query attention; 1: multi-query),
    `window_size` (sliding-window attention), `causal` (False: both ways, an encoder's),
    `backend` (the kernel: "sdpa", "explicit" or a kernel class), `position_scheme` (its
    rotation and score modifier; None: the book's, none in attention), `qk_norm` (RMSNorm
    each head's queries and keys, Qwen3's; or a maker `norm(head_dim)`), `head_dim` (where
    not d_out // num_heads), `out_bias` (the book's; Llama-style models have none).
    """

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float,
                 num_heads: int, qkv_bias: bool = False, *, num_kv_heads: int | None = None,
                 window_size: int | None = None, causal: bool = True,
                 backend: str | type = "sdpa", position_scheme: PositionScheme | None = None,
                 qk_norm=False, head_dim: int | None = None, out_bias: bool = True):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_heads(d_out, num_heads, num_kv_heads, head_dim)
        check_dropout(dropout)
        self.d_out, self.num_heads, self.num_kv_heads = d_out, num_heads, num_kv_heads
        self.head_dim = head_dim or d_out // num_heads
        self.context_length = context_length
        self.settings = AttentionSettings(causal, window_size, position_scheme or NoPositions())
        inner = num_heads * self.head_dim  # the heads side by side: d_out unless head_dim
        kv_dim = num_kv_heads * self.head_dim
        self.W_query = nn.Linear(d_in, inner, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, kv_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, kv_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(inner, d_out, bias=out_bias)  # combines the heads' outputs
        self.dropout = nn.Dropout(dropout)
        self.query_scale: float | None = None  # a factor on the queries (Gemma's scale)
        self.gate: nn.Module | None = None  # gate(x, heads_out) before out_proj
        self.qk_norm = bool(qk_norm)
        if qk_norm:  # one gain per head dimension, shared by the heads (Qwen3's epsilon)
            make = qk_norm if callable(qk_norm) else lambda dim: nn.RMSNorm(dim, eps=1e-6)
            self.q_norm, self.k_norm = make(self.head_dim), make(self.head_dim)
        self.backend = backend
        # The book registers its triangular mask as a buffer; here masks are built per
        # pass (they also cover caches, windows and padding). Its state dicts still load.
        self.register_load_state_dict_pre_hook(_drop_book_mask)

    @property
    def backend(self) -> str | type:
        return self._backend

    @backend.setter
    def backend(self, backend: str | type):
        self.kernel = self.new_kernel(backend)
        self._backend = backend

    def new_kernel(self, backend: str | type):
        """A new kernel for `backend`, a name in KERNELS or a class."""
        if isinstance(backend, type):
            return backend()
        if backend not in KERNELS:
            raise ArgumentError("backend", backend, f"use one of {', '.join(KERNELS)}, or a "
                                "kernel class")
        return KERNELS[backend]()

    def forward(self, x: Tensor, attention_mask: Tensor | None = None, *,
                document_ids: Tensor | None = None, kv_cache: BaseKVCache | None = None,
                return_weights: bool = False, context: AttentionContext | None = None,
                positions: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Attend over `x` (and the cached tokens before it).

        Args:
            x: (b, num_tokens, d_in).
            attention_mask, document_ids: optional (b, num_keys) (see AttentionContext.build),
                covering cached and new tokens.
            kv_cache: optional cache; the new keys and values are appended to it.
            return_weights: also return the weights (b, num_heads, num_tokens, num_keys),
                from the explicit path.
            context: the pass's AttentionContext, built once by the model, holding the
                masks; None: built here from the arguments.
            positions: (b, num_tokens) where not 0, 1, ... after the cache (rotary alone).

        Returns:
            (b, num_tokens, d_out), and with `return_weights` the weights.
        """
        b, num_tokens, _ = x.shape
        num_cached = len(kv_cache) if kv_cache is not None else 0
        context = self.layer_context(x, num_cached, context, kv_cache is not None,
                                     attention_mask, document_ids, positions)
        queries = self.W_query(x)  # (b, num_tokens, num_heads * head_dim)
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
        if kv_cache is not None:  # (b, num_kv_heads, num_keys, head_dim)
            keys, values = kv_cache.update(keys, values, context.positions)
        # (b, num_heads, num_tokens, head_dim): the kernel's, or the explicit path's + weights
        context_vec, weights = self.attend(queries, keys, values, context, return_weights)

        # (b, num_heads, num_tokens, head_dim) -> (b, num_tokens, num_heads * head_dim)
        context_vec = context_vec.transpose(1, 2).contiguous().view(b, num_tokens, -1)
        if self.gate is not None:
            context_vec = self.gate(x, context_vec)
        out = self.out_proj(context_vec)
        empty_rows = context.empty_rows()  # (b, num_tokens) or None
        if empty_rows is not None:
            out = out.masked_fill(empty_rows[..., None], 0.0)  # out_proj's bias, zeroed
        return (out, weights) if return_weights else out

    def layer_context(self, x: Tensor, num_cached: int, context: AttentionContext | None,
                      uses_cache: bool, attention_mask: Tensor | None,
                      document_ids: Tensor | None, positions: Tensor | None
                      ) -> AttentionContext:
        """The pass's context, or one built (and its length checked) here."""
        if context is not None:
            return context
        b, num_tokens = x.shape[:2]
        if num_cached + num_tokens > self.context_length:
            raise ValueError(
                f"attention got {num_cached + num_tokens} positions but context_length is "
                f"{self.context_length}; crop the input to its last {self.context_length} "
                "tokens")
        return AttentionContext.build(b, num_tokens, num_cached, settings=self.settings,
                                      attention_mask=attention_mask, document_ids=document_ids,
                                      uses_cache=uses_cache, positions=positions,
                                      device=x.device)

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, context: AttentionContext,
               return_weights: bool) -> tuple[Tensor, Tensor | None]:
        """The kernel's output and None, or the explicit path's output and its weights."""
        dropout_p = self.dropout.p if self.training else 0.0
        if return_weights:
            return explicit_attention(queries, keys, values, context, dropout_p)
        return self.kernel(queries, keys, values, context, dropout_p), None


def check_heads(d_out: int, num_heads: int, num_kv_heads: int, head_dim: int | None = None
                ) -> None:
    """Query heads divide the width (unless they have a head_dim), key/value heads divide
    the query heads; else ArgumentError naming head_dim, num_heads or num_kv_heads."""
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
    """A rate in [0, 1) (NaN fails it too). Raises ArgumentError naming dropout."""
    if not 0.0 <= dropout < 1.0:
        raise ArgumentError("dropout", dropout, "use a number in [0, 1)")


def check_window(window: int | None) -> None:
    """A positive number of keys, or None for all. Raises ArgumentError naming window_size."""
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                               or window < 1):
        raise ArgumentError("window_size", window, "use a positive integer, or None for every "
                            "key (full causal attention)")


def _positions(batch: int, num_tokens: int, num_cached: int, attention_mask: Tensor | None,
               document_ids: Tensor | None, device) -> Tensor:
    """(b, num_tokens) the new tokens' places: counted from each document's start, from each
    row's first real token (so a left-padded prompt sits as it would alone), or after the
    cached ones."""
    if document_ids is not None:
        return positions_in_documents(document_ids)[:, -num_tokens:]
    if attention_mask is not None:
        positions = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        return positions[:, -num_tokens:]  # (b, num_tokens)
    return torch.arange(num_cached, num_cached + num_tokens, device=device).expand(batch, -1)


def positions_in_documents(document_ids: Tensor) -> Tensor:
    """(b, n): each token's position counted from the first token of its document."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]  # a new document begins
    first = torch.where(starts, index, 0).cummax(dim=1).values  # (b, n) its document's start
    return index - first


def _drop_book_mask(module, state_dict, prefix, *args):
    state_dict.pop(prefix + "mask", None)
