"""Causal multi-head attention (the book's Listing 3.5) and the masks it combines.

Letters in the shape comments:
    b             batch size
    num_tokens    queries in this call (the new tokens)
    num_keys      keys in this call: cached tokens + new tokens
    num_heads     query heads
    num_kv_heads  key/value heads (fewer than num_heads for grouped-query attention)
    head_dim      d_out // num_heads

One mask convention everywhere: True means "may attend". Masks are small boolean
functions combined with `&`; the attention module negates the result once, where the seed
fills scores with -inf.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def causal_mask(num_tokens: int, num_keys: int | None = None, device=None) -> Tensor:
    """Query i may attend key j when j <= i.

    The queries are the last `num_tokens` of `num_keys` positions, which is what a KV
    cache needs: a new token at absolute position p sees every cached key.

    Returns:
        Bool tensor of shape (num_tokens, num_keys).
    """
    num_keys = num_tokens if num_keys is None else num_keys
    query_pos = torch.arange(num_keys - num_tokens, num_keys, device=device)[:, None]  # (q, 1)
    key_pos = torch.arange(num_keys, device=device)[None, :]  # (1, num_keys)
    return key_pos <= query_pos


def sliding_window_mask(
    num_tokens: int, num_keys: int, window_size: int, device=None
) -> Tensor:
    """Query i may attend key j when j > i - window_size (combine with `causal_mask`).

    Together with the causal mask, query i sees keys i - window_size + 1 ... i.

    Returns:
        Bool tensor of shape (num_tokens, num_keys).
    """
    query_pos = torch.arange(num_keys - num_tokens, num_keys, device=device)[:, None]  # (q, 1)
    key_pos = torch.arange(num_keys, device=device)[None, :]  # (1, num_keys)
    return key_pos > query_pos - window_size


def padding_mask(attention_mask: Tensor) -> Tensor:
    """Every query may attend the real (non-padding) keys of its own sequence.

    Args:
        attention_mask: (b, num_keys), nonzero/True at real tokens, 0/False at padding.

    Returns:
        Bool tensor of shape (b, 1, 1, num_keys), broadcasting over heads and queries.
    """
    return attention_mask.bool()[:, None, None, :]  # (b, 1, 1, num_keys)


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
    """Causal multi-head self-attention, constructed exactly as the book's Listing 3.5.

    The parameters `W_query`, `W_key`, `W_value`, `out_proj` are created in the book's
    order, so under the same `torch.manual_seed` this module starts from the book's
    weights and prints the book's numbers.

    Beyond the book, as keyword-only options:
        num_kv_heads: grouped-query attention; `num_kv_heads` key/value heads, each shared
            by `num_heads // num_kv_heads` query heads (1 is multi-query attention).
        window_size: sliding-window attention; query i sees keys i - window_size + 1 ... i.
        use_sdpa: compute through `F.scaled_dot_product_attention` (fused kernels, flash
            on GPUs); False runs the book's explicit scores-mask-softmax path.
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
        use_sdpa: bool = True,
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
        self.d_out = d_out
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = d_out // num_heads
        self.context_length = context_length
        self.window_size = window_size
        self.use_sdpa = use_sdpa

        kv_dim = num_kv_heads * self.head_dim
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, kv_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, kv_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)  # combines the heads' outputs
        self.dropout = nn.Dropout(dropout)
        # The book registers its triangular mask as a buffer; here masks are built per call
        # from the functions above, so they also cover caches, windows and padding, and
        # checkpoints do not carry a context_length^2 tensor per layer. The book's state
        # dicts still load: their "mask" entry is dropped, as it is fixed by context_length.
        self.register_load_state_dict_pre_hook(_drop_book_mask)

    def forward(
        self,
        x: Tensor,
        attention_mask: Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend causally over `x` (and the cached tokens before it).

        Args:
            x: (b, num_tokens, d_in).
            attention_mask: optional (b, num_keys) mask of real tokens (1) and padding (0),
                covering cached and new tokens.
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
        if attention_mask is not None and attention_mask.shape != (b, num_keys):
            raise ValueError(
                f"attention_mask must have shape (batch, num_keys) = ({b}, {num_keys}), "
                f"got {tuple(attention_mask.shape)}; with a KV cache it covers cached tokens too"
            )

        allowed = self._allowed(num_tokens, num_keys, attention_mask, x.device)
        empty_rows = None
        if allowed is not None and attention_mask is not None:
            # A query with no allowed key (left padding) would softmax over -inf only and
            # give NaN; let it see every key, then zero its output.
            empty_rows = ~allowed.any(dim=-1, keepdim=True)  # (b, 1, num_tokens, 1)
            allowed = allowed | empty_rows

        if self.use_sdpa and not return_weights:
            context_vec = self._sdpa(queries, keys, values, allowed, num_tokens, num_keys)
            weights = None
        else:
            context_vec, weights = self._explicit(queries, keys, values, allowed, empty_rows)

        # (b, num_heads, num_tokens, head_dim) -> (b, num_tokens, d_out)
        context_vec = context_vec.transpose(1, 2).contiguous().view(b, num_tokens, self.d_out)
        out = self.out_proj(context_vec)
        if empty_rows is not None:
            out = out.masked_fill(empty_rows[:, 0], 0.0)  # (b, num_tokens, 1) broadcast
        return (out, weights) if return_weights else out

    def _allowed(
        self, num_tokens: int, num_keys: int, attention_mask: Tensor | None, device
    ) -> Tensor | None:
        """The combined mask, or None when a single query may see every key."""
        if num_tokens == 1 and attention_mask is None and (
            self.window_size is None or num_keys <= self.window_size
        ):
            return None
        allowed = causal_mask(num_tokens, num_keys, device)  # (num_tokens, num_keys)
        if self.window_size is not None:
            allowed = allowed & sliding_window_mask(num_tokens, num_keys, self.window_size, device)
        if attention_mask is not None:
            allowed = allowed & padding_mask(attention_mask)  # (b, 1, num_tokens, num_keys)
        return allowed

    def _sdpa(self, queries, keys, values, allowed, num_tokens, num_keys) -> Tensor:
        dropout_p = self.dropout.p if self.training else 0.0
        gqa = self.num_kv_heads != self.num_heads
        plain_causal = (
            allowed is not None
            and num_tokens == num_keys
            and self.window_size is None
            and allowed.dim() == 2
        )
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
        # In float32 whatever the inputs (bf16 rounding in a softmax costs accuracy).
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1,
                                     dtype=torch.float32)
        if empty_rows is not None:
            attn_weights = attn_weights.masked_fill(empty_rows, 0.0)
        attn_weights = self.dropout(attn_weights)
        return attn_weights.to(values.dtype) @ values, attn_weights
