"""Multi-head attention (the book's Listing 3.5) and the kernels it can run on.

Letters in the shape comments:
    b             batch size
    num_tokens    queries in this call (the new tokens)
    num_keys      keys in this call: cached tokens + new tokens
    num_heads     query heads
    num_kv_heads  key/value heads (fewer than num_heads for grouped-query attention)
    head_dim      d_out // num_heads

Masks come from gptmini.masks, written once (True means "may attend"); this module picks
which apply (causal or full, a window, padding, documents) and hands them to one backend:

    sdpa      F.scaled_dot_product_attention, is_causal=True whenever no other mask applies
              (flash kernels stay eligible on GPUs), else a dense boolean mask
    explicit  the book's scores, masked_fill_ with -inf, softmax, dropout: the reference,
              and the only one that returns the weights
    flex      torch.nn.attention.flex_attention, compiled, with a BlockMask: masked blocks
              are skipped. No backward on CPU (torch 2.13), so on CPU it serves evaluation
              and generation, not training; decoding with a KV cache runs on sdpa
    tiled     gptmini.flash: flash attention from scratch, memory linear in the length

A query with no key to attend (left padding) gets a zero output, never NaN, on every one.
flex and tiled have no attention dropout: they refuse a dropout above 0 in training (set
the attention's own rate to 0: GPTConfig.attn_drop_rate).
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptmini import masks
from gptmini.flash import tiled_attention

BACKENDS = ("sdpa", "explicit", "flex", "tiled")
COMPILE_FLEX = True
"""Compile FlexAttention (its fast path). Tests switch it off: eager flex is the same math."""


class KVCache:
    """Keys and values of the tokens seen so far, for one attention layer.

    `keys` and `values` are (b, num_kv_heads, num_cached, head_dim); `update` appends the
    new tokens' keys and values and returns all of them.

    Without autograd the tensors live in buffers that grow by doubling, so appending one
    token writes one token: concatenating instead would copy the whole cache (and fault in
    fresh memory) at every step, which at batch 8 costs as much as the matmuls. With
    autograd (a new key that requires grad) it concatenates, so gradients flow as before.
    """

    def __init__(self, keys: Tensor | None = None, values: Tensor | None = None):
        self._keys, self._values, self._len = None, None, 0
        if keys is not None:
            self.keys, self.values = keys, values

    # Assigning keys/values replaces the cache's contents (the former dataclass fields).
    @property
    def keys(self) -> Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self._len]

    @keys.setter
    def keys(self, keys: Tensor | None):
        self._keys = keys
        self._len = 0 if keys is None else keys.shape[2]

    @property
    def values(self) -> Tensor | None:
        return None if self._values is None else self._values[:, :, : self._len]

    @values.setter
    def values(self, values: Tensor | None):
        self._values = values

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"KVCache(num_cached={self._len})"

    def update(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        if self._keys is None:
            self.keys, self.values = keys, values
            return keys, values
        if torch.is_grad_enabled() and (keys.requires_grad or self._keys.requires_grad):
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
            return self.keys, self.values
        start, end = self._len, self._len + keys.shape[2]
        if end > self._keys.shape[2] or self._keys.requires_grad:
            self._grow(end)
        self._keys[:, :, start:end] = keys
        self._values[:, :, start:end] = values
        self._len = end
        return self.keys, self.values

    def _grow(self, needed: int):
        # (b, num_kv_heads, capacity, head_dim), capacity doubling: O(1) amortized appends
        capacity = max(needed, 2 * self._len, 64)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], capacity, old.shape[3])
            new[:, :, : self._len] = old[:, :, : self._len]
            setattr(self, name, new)


def _drop_book_mask(module, state_dict, prefix, *args):
    state_dict.pop(prefix + "mask", None)


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
        causal: False attends both ways, as seed 002's encoder does.
        backend: "sdpa" (default), "explicit", "flex" or "tiled" (see the module's docstring).
    """

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
        backend: str = "sdpa",
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or d_out % num_heads != 0:
            raise ValueError(
                f"d_out must be divisible by num_heads, got d_out={d_out}, "
                f"num_heads={num_heads}; pick num_heads among the divisors of d_out"
            )
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads must be divisible by num_kv_heads, got num_heads={num_heads}, "
                f"num_kv_heads={num_kv_heads}; use a divisor of num_heads (1 = multi-query)"
            )
        if window_size is not None and window_size < 1:
            raise ValueError(
                f"window_size must be at least 1, got {window_size}; "
                "use None for full causal attention"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.d_out = d_out
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = d_out // num_heads
        self.context_length = context_length
        self.window_size = window_size
        self.causal = causal
        self.backend = backend
        self.tile = 256
        """Queries and keys per tile of the tiled backend."""

        kv_dim = num_kv_heads * self.head_dim
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, kv_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, kv_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)  # combines the heads' outputs
        self.dropout = nn.Dropout(dropout)
        # The book registers its triangular mask as a buffer; here masks are built per call
        # (gptmini.masks), so they also cover caches, windows, padding and documents, and
        # checkpoints do not carry a context_length^2 tensor per layer. The book's state
        # dicts still load: their "mask" entry is dropped, as it is fixed by context_length.
        self.register_load_state_dict_pre_hook(_drop_book_mask)

    def forward(
        self,
        x: Tensor,
        attention_mask: Tensor | None = None,
        *,
        document_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_weights: bool = False,
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

        Returns:
            (b, num_tokens, d_out), and with `return_weights` the weights
            (b, num_heads, num_tokens, num_keys). A query with no key to attend (a
            left-padding position) gets zero weights and a zero output, never NaN.
        """
        b, num_tokens, _ = x.shape
        queries = self.W_query(x)  # (b, num_tokens, d_out)
        keys = self.W_key(x)  # (b, num_tokens, num_kv_heads * head_dim)
        values = self.W_value(x)

        # (b, num_tokens, num_heads, head_dim) -> (b, num_heads, num_tokens, head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(b, num_tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)

        if kv_cache is not None:
            keys, values = kv_cache.update(keys, values)  # (b, num_kv_heads, num_keys, hd)
        num_keys = keys.shape[2]
        if num_keys > self.context_length:
            raise ValueError(
                f"attention got {num_keys} positions but context_length is "
                f"{self.context_length}; crop the input to its last {self.context_length} "
                "tokens"
            )
        for name, per_key in (("attention_mask", attention_mask), ("document_ids", document_ids)):
            if per_key is not None and per_key.shape != (b, num_keys):
                raise ValueError(
                    f"{name} must have shape (batch, num_keys) = ({b}, {num_keys}), got "
                    f"{tuple(per_key.shape)}; with a KV cache it covers cached tokens too"
                )

        mask = self._mask(num_tokens, num_keys, attention_mask, document_ids)
        backend = "explicit" if return_weights else self.backend
        if backend == "flex" and kv_cache is not None:
            backend = "sdpa"  # one block mask (and one compile) per length would not pay
        dropout_p = self.dropout.p if self.training else 0.0
        if backend in ("flex", "tiled") and dropout_p > 0:
            raise ValueError(
                f"the {backend} attention backend has no attention dropout, and this module "
                f"is training with dropout {dropout_p}: set the attention dropout to 0 "
                "(--model.attn_drop_rate 0) or use the sdpa or explicit backend"
            )
        weights = None
        if backend in ("sdpa", "explicit"):
            allowed = None if mask is None else masks.dense(mask, b, num_tokens, num_keys,
                                                            x.device)
            empty_rows = None
            if allowed is not None and attention_mask is not None:
                # A query with no allowed key (left padding) would softmax over -inf only
                # and give NaN; let it see every key, then zero its output.
                empty_rows = ~allowed.any(dim=-1, keepdim=True)  # (b, 1, num_tokens, 1)
                allowed = allowed | empty_rows
            if backend == "sdpa":
                context_vec = self._sdpa(queries, keys, values, allowed, dropout_p,
                                         plain_causal=self._plain_causal(mask, num_tokens,
                                                                         num_keys))
            else:
                context_vec, weights = self._explicit(queries, keys, values, allowed,
                                                      empty_rows)
        else:
            empty_rows = None
            if attention_mask is not None:  # only padding can leave a query no key at all
                has_key = masks.rows_with_keys(mask, b, num_tokens, num_keys, x.device)
                empty_rows = ~has_key[:, None, :, None]  # (b, 1, num_tokens, 1)
            if backend == "flex":
                context_vec = self._flex(queries, keys, values, mask, b, num_tokens, num_keys,
                                         attention_mask, document_ids)
            else:
                group = self.num_heads // self.num_kv_heads
                context_vec = tiled_attention(queries, keys.repeat_interleave(group, dim=1),
                                              values.repeat_interleave(group, dim=1), mask,
                                              tile=self.tile)

        # (b, num_heads, num_tokens, head_dim) -> (b, num_tokens, d_out)
        context_vec = context_vec.transpose(1, 2).contiguous().view(b, num_tokens, self.d_out)
        out = self.out_proj(context_vec)
        if empty_rows is not None:
            out = out.masked_fill(empty_rows[:, 0], 0.0)  # (b, num_tokens, 1) broadcast
        return (out, weights) if return_weights else out

    def _mask(self, num_tokens: int, num_keys: int, attention_mask: Tensor | None,
              document_ids: Tensor | None) -> masks.MaskMod | None:
        """The mask of this call, or None when every query may see every key."""
        parts = []
        if self.causal and not (num_tokens == 1 and num_keys >= 1):
            parts.append(masks.causal)  # a single newest query sees every earlier key anyway
        window = self.window_size
        if window is not None and num_keys > window:  # else no query is farther than it
            parts.append(masks.sliding_window(window))
        if attention_mask is not None:
            parts.append(masks.padding(attention_mask))
        if document_ids is not None:
            parts.append(masks.document(document_ids))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else masks.and_masks(*parts)

    def _plain_causal(self, mask, num_tokens: int, num_keys: int) -> bool:
        return mask is masks.causal and num_tokens == num_keys

    def _sdpa(self, queries, keys, values, allowed, dropout_p, plain_causal) -> Tensor:
        gqa = self.num_kv_heads != self.num_heads
        if plain_causal:
            # is_causal with no explicit mask keeps flash kernels eligible on GPUs.
            return F.scaled_dot_product_attention(
                queries, keys, values, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa
            )
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=allowed, dropout_p=dropout_p, enable_gqa=gqa
        )

    def _explicit(self, queries, keys, values, allowed, empty_rows) -> tuple[Tensor, Tensor]:
        """The book's path: scores, in-place -inf fill, softmax, dropout."""
        if self.num_kv_heads != self.num_heads:
            # (b, num_kv_heads, num_keys, head_dim) -> (b, num_heads, num_keys, head_dim)
            group = self.num_heads // self.num_kv_heads
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_tokens, num_keys)
        if allowed is not None:
            attn_scores.masked_fill_(~allowed, -torch.inf)
        # In float32 or wider (bf16 rounding in a softmax costs accuracy; float64 stays).
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1,
                                     dtype=torch.promote_types(attn_scores.dtype, torch.float32))
        if empty_rows is not None:
            attn_weights = attn_weights.masked_fill(empty_rows, 0.0)
        attn_weights = self.dropout(attn_weights)
        return attn_weights.to(values.dtype) @ values, attn_weights

    def _flex(self, queries, keys, values, mask, b, num_tokens, num_keys, attention_mask,
              document_ids) -> Tensor:
        if queries.requires_grad and queries.device.type == "cpu":
            raise ValueError(
                "the flex attention backend has no backward pass on CPU (torch's FlexAttention "
                "runs forward only there): evaluate or generate with flex on CPU, and train "
                "with the sdpa, explicit or tiled backend, or on a GPU"
            )
        if mask is None:
            block = None
        elif attention_mask is None and document_ids is None:  # the same for every batch
            block = _fixed_block_mask(self.causal, self.window_size, num_tokens, num_keys,
                                      str(queries.device))
        else:  # data-dependent: rebuilt per batch, once for all layers of a forward pass
            block = _data_block_mask(mask, attention_mask, document_ids, b, num_tokens,
                                     num_keys)
        return _flex_attention(queries)(queries, keys, values, block_mask=block,
                                        enable_gqa=self.num_kv_heads != self.num_heads)


def _flex_attention(queries: Tensor):
    from torch.nn.attention.flex_attention import flex_attention

    if (not COMPILE_FLEX or torch.compiler.is_compiling()  # the outer compile covers it
            or (queries.device.type == "cpu" and queries.dtype == torch.float64)):
        return flex_attention  # (inductor's CPU kernel has no float64: the same math, eager)
    return _compiled_flex()


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=16)
def _fixed_block_mask(causal: bool, window: int | None, num_tokens: int, num_keys: int,
                      device: str):
    parts = [masks.causal if causal else masks.full]
    if window is not None:
        parts.append(masks.sliding_window(window))
    mask = parts[0] if len(parts) == 1 else masks.and_masks(*parts)
    return masks.block_mask(mask, None, num_tokens, num_keys, device)


_last_data_block: tuple = ()


def _data_block_mask(mask, attention_mask, document_ids, b, num_tokens, num_keys):
    """Every layer of one forward pass gets the same padding and document tensors: build
    their BlockMask once, keyed by those very tensor objects (held, so no id is reused)."""
    global _last_data_block
    key = (attention_mask, document_ids, b, num_tokens, num_keys)
    if _last_data_block and all(
        x is y if isinstance(x, Tensor) or x is None else x == y
        for x, y in zip(_last_data_block[0], key, strict=True)
    ):
        return _last_data_block[1]
    device = (attention_mask if attention_mask is not None else document_ids).device
    block = masks.block_mask(mask, b, num_tokens, num_keys, device)
    _last_data_block = (key, block)
    return block
