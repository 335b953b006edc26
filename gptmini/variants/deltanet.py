"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024; Qwen3-Next's linear attention layer).

Letters in the shape comments:
    b             batch size
    num_tokens    tokens in this call (the new tokens)
    num_heads     value heads (each with its own state)
    num_k_heads   query/key heads (num_heads is a multiple: each serves a group of value heads)
    k_dim, v_dim  a key's and a value's head width
    C             chunk size of the chunked form

Instead of keys and values growing with the sequence, each head keeps one fixed matrix S
(k_dim, v_dim), a fast-weight memory read by a query (o = S^T q) and written by each token
with the gated delta rule:

    S <- alpha * (I - beta k k^T) S + beta k v^T       alpha = exp(g) in (0, 1], beta in (0, 1)

alpha forgets (the gate, Mamba 2's decay), and the delta rule replaces what S recalled for k
(S^T k) by v at the rate beta instead of adding v on top. Queries and keys are L2-normalized
and queries scaled by 1/sqrt(k_dim). Before that, queries, keys and values pass a short
causal depthwise convolution (kernel `conv_kernel`, SiLU); after it each head's output is
RMS-normalized and gated by SiLU(z), z a projection of the input, then projected out.

Two forms compute the same thing:
    recurrent  token by token (`recurrent_delta_rule`): decoding, one token per call
    chunked    `chunked_delta_rule`: within a chunk of C tokens the updates are solved at
               once as a triangular system (the WY form: matmuls), and only the chunks run
               in sequence: training and prefill

The layer's cache is its state (`DeltaNetState`): S per head and the convolution's last
`conv_kernel - 1` inputs, a fixed size whatever the length. A padded position (attention
mask 0) neither writes nor forgets: its input is zeroed (k = v = 0), and its beta and its
log-decay g too, so the state passes it unchanged. Left padding is then exact; so is padding
on the right or between calls, except that the convolution's window still counts a padded
position as an input of zero.

`DeltaNet` is the "deltanet" entry of the model's token mixers (gptmini.model.mixers): what a
GPTModel asks of a Gated DeltaNet layer (GPTConfig.layer_kinds), and `GatedDeltaNetLayer` the
layer called as a block calls its mixer.
"""

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptmini.attention import AttentionContext
from gptmini.model import ConfigError, GPTConfig
from gptmini.model.mixers import MIXERS, TokenMixer, layer_mixer_names

__all__ = ["CHUNK_SIZE", "CONV_KERNEL", "DeltaNet", "DeltaNetState", "GatedDeltaNet",
           "GatedDeltaNetLayer", "chunked_delta_rule", "recurrent_delta_rule"]

CHUNK_SIZE = 64
"""Tokens per chunk of the chunked form, by default (FLA's and Qwen3-Next's 64)."""
CONV_KERNEL = 4
"""The short convolution's width, by default (Qwen3-Next's linear_conv_kernel_dim)."""


class DeltaNetState:
    """A Gated DeltaNet layer's cache: its recurrent state and its convolution's tail.

    `recurrent` is (b, num_heads, k_dim, v_dim), `conv` (b, channels, conv_kernel - 1) (the
    last inputs of the convolution); both None until the first call. `len(state)` counts the
    tokens it has seen, as a KV cache's counts the tokens it holds (the model reads the
    number of past tokens off its first layer's cache).
    """

    def __init__(self):
        self.recurrent: Tensor | None = None
        self.conv: Tensor | None = None
        self.num_seen = 0

    def __len__(self) -> int:
        return self.num_seen

    def __repr__(self) -> str:
        return f"DeltaNetState(num_seen={self.num_seen})"

    @property
    def positions(self) -> None:
        """No per-token positions: the state holds no tokens."""
        return None

    @property
    def nbytes(self) -> int:
        """Bytes the state holds (0 before its first call): the same at every length."""
        return sum(t.numel() * t.element_size() for t in (self.recurrent, self.conv)
                   if t is not None)

    def drop_oldest(self, n: int) -> None:
        """Refused: every token seen is mixed into the state, none can be taken out."""
        raise ValueError("a Gated DeltaNet layer's state cannot forget its oldest tokens "
                         "(they are mixed into it); generate with slide='recompute'")


def recurrent_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token.

    Args:
        q, k: (b, num_heads, num_tokens, k_dim), already normalized and (q) scaled.
        v: (b, num_heads, num_tokens, v_dim).
        g: (b, num_heads, num_tokens) log of the decay alpha (<= 0).
        beta: (b, num_heads, num_tokens) the write rate.
        state: (b, num_heads, k_dim, v_dim) S before the first token; None: zeros.

    Returns:
        The outputs (b, num_heads, num_tokens, v_dim) and S after the last token.
    """
    b, h, n, k_dim = k.shape
    if state is None:
        state = q.new_zeros(b, h, k_dim, v.shape[-1])
    outputs = []
    for t in range(n):
        state = state * g[:, :, t, None, None].exp()
        k_t = k[:, :, t]  # (b, num_heads, k_dim)
        recalled = torch.einsum("bhkv,bhk->bhv", state, k_t)  # what S returns for k
        delta = (v[:, :, t] - recalled) * beta[:, :, t, None]  # (b, num_heads, v_dim)
        state = state + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    return torch.stack(outputs, dim=2), state


# Long for its comments: the derivation of the chunked form is the docstring's, line by line.
def chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       state: Tensor | None = None, chunk_size: int = CHUNK_SIZE
                       ) -> tuple[Tensor, Tensor]:
    """The gated delta rule a chunk at a time: `recurrent_delta_rule`'s result with matmuls.

    Within a chunk starting from S0, with G_i the cumulative log-decay to token i, write
    S_i = e^{G_i} S0 + sum_{j<=i} e^{G_i - G_j} k_j u_j^T. Token j's update u_j (its
    "pseudo-value") is beta_j times (v_j minus what the state just before it recalls for k_j):

        u_j = beta_j v_j - beta_j e^{G_j} S0^T k_j - sum_{l<j} beta_j e^{G_j - G_l} (k_j.k_l) u_l

    that is (I + A) U = beta V - (beta e^G K) S0 with A strictly lower triangular, solved
    by one triangular solve per chunk for both right-hand sides (they do not depend on S0,
    so every chunk is solved at once). Then, chunk after chunk:

        o_i = e^{G_i} S0^T q_i + sum_{j<=i} e^{G_i - G_j} (q_i.k_j) u_j
        S_C = e^{G_C} S0 + sum_j e^{G_C - G_j} k_j u_j^T

    Args and returns as `recurrent_delta_rule`, plus `chunk_size` (C).
    """
    b, h, n, k_dim = k.shape
    v_dim = v.shape[-1]
    if state is None:
        state = q.new_zeros(b, h, k_dim, v_dim)
    pad = -n % chunk_size  # pad the end with tokens that change nothing before them
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (n + pad) // chunk_size
    # (b, num_heads, num_chunks, C, k_dim / v_dim), and (b, num_heads, num_chunks, C)
    q, k, v = (x.reshape(b, h, num_chunks, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, h, num_chunks, chunk_size) for x in (g, beta))

    cum = g.cumsum(-1)  # G_i, (b, num_heads, num_chunks, C)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # e^{G_i - G_j} for j <= i, else 0 (masked before exp, where it would overflow)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, -math.inf).exp()
    k_beta = k * beta[..., None]  # (b, num_heads, num_chunks, C, k_dim)
    # (I + A): A_{jl} = beta_j e^{G_j - G_l} k_j.k_l below the diagonal, 1 on it
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    system = system + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    u_free = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                           unitriangular=True)  # (..., C, v_dim)
    u_per_state = torch.linalg.solve_triangular(system, k_beta * cum[..., None].exp(),
                                                upper=False, unitriangular=True)  # (..., C, k_dim)
    scores = q @ k.transpose(-1, -2) * decay  # (b, num_heads, num_chunks, C, C)
    q_decayed = q * cum[..., None].exp()
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # e^{G_C - G_j} k_j
    chunk_decay = cum[..., -1].exp()  # e^{G_C}, (b, num_heads, num_chunks)

    outputs = []
    for c in range(num_chunks):
        u = u_free[:, :, c] - u_per_state[:, :, c] @ state  # (b, num_heads, C, v_dim)
        outputs.append(q_decayed[:, :, c] @ state + scores[:, :, c] @ u)
        state = (state * chunk_decay[:, :, c, None, None]
                 + k_to_end[:, :, c].transpose(-1, -2) @ u)
    out = torch.cat(outputs, dim=2)[:, :, :n]  # (b, num_heads, num_tokens, v_dim)
    return out, state


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension (FLA's and Qwen3-Next's form: a zero
    vector stays zero)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet token mixer, in a block where attention would be (see the module).

    Args:
        d_in: width of the input and output (the residual stream).
        num_heads: value heads, each with its own (k_dim, v_dim) state.
        head_dim: k_dim, a query's and key's head width.
        value_head_dim: v_dim; None: head_dim.
        num_key_heads: query/key heads (a divisor of num_heads; each serves
            num_heads // num_key_heads value heads, as Qwen3-Next's 16 serve 32); None:
            num_heads.
        conv_kernel: width of the causal depthwise convolution over queries, keys, values.
        chunk_size: tokens per chunk of the chunked form.
        norm_eps: the output RMSNorm's epsilon.
    """

    def __init__(self, d_in: int, num_heads: int, head_dim: int, *,
                 value_head_dim: int | None = None, num_key_heads: int | None = None,
                 conv_kernel: int = CONV_KERNEL, chunk_size: int = CHUNK_SIZE,
                 norm_eps: float = 1e-6):
        super().__init__()
        num_key_heads = num_key_heads or num_heads
        if num_heads % num_key_heads:
            raise ValueError(f"num_key_heads={num_key_heads} must divide "
                             f"num_heads={num_heads} (each key head serves a group)")
        if conv_kernel < 1 or chunk_size < 1:
            raise ValueError(f"conv_kernel={conv_kernel} and chunk_size={chunk_size} must be "
                             "positive integers")
        self.num_heads, self.num_key_heads = num_heads, num_key_heads
        self.head_dim, self.value_head_dim = head_dim, value_head_dim or head_dim
        self.conv_kernel, self.chunk_size, self.norm_eps = conv_kernel, chunk_size, norm_eps
        key_dim = num_key_heads * head_dim
        value_dim = num_heads * self.value_head_dim
        self.W_query = nn.Linear(d_in, key_dim, bias=False)
        self.W_key = nn.Linear(d_in, key_dim, bias=False)
        self.W_value = nn.Linear(d_in, value_dim, bias=False)
        self.W_gate = nn.Linear(d_in, value_dim, bias=False)  # z, the output gate
        self.W_beta = nn.Linear(d_in, num_heads, bias=False)  # the write rate, per head
        self.W_decay = nn.Linear(d_in, num_heads, bias=False)  # the decay's input, per head
        self.channels = 2 * key_dim + value_dim  # queries, keys, values: one convolution
        self.conv1d = nn.Conv1d(self.channels, self.channels, conv_kernel,
                                groups=self.channels, bias=False)
        # The decay g = -exp(A_log) * softplus(W_decay x + dt_bias), Mamba 2's: A in
        # (0, 16], and softplus(dt_bias) a step between 0.001 and 0.1 (log-uniform).
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(1.0, 16.0).log())
        step = torch.exp(torch.empty(num_heads).uniform_(math.log(1e-3), math.log(0.1)))
        self.dt_bias = nn.Parameter(step + torch.log(-torch.expm1(-step)))  # softplus^-1
        self.norm_weight = nn.Parameter(torch.ones(self.value_head_dim))
        self.out_proj = nn.Linear(value_dim, d_in, bias=False)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None,
                state: DeltaNetState | None = None) -> Tensor:
        """x (b, num_tokens, d_in) -> (b, num_tokens, d_in).

        Args:
            x: the new tokens.
            attention_mask: optional (b, num_tokens) of the new tokens, 1 at real tokens
                and 0 at left padding (a padded input is zeroed, and so writes nothing).
            state: the layer's cache; read and then replaced by the state after x. One
                new token per call runs the recurrent form, more the chunked one.
        """
        b, num_tokens, _ = x.shape
        if attention_mask is not None:
            x = x * attention_mask[:, :, None].to(x.dtype)
        wide = torch.promote_types(x.dtype, torch.float32)  # the rule runs in float32 or 64
        mixed = torch.cat([self.W_query(x), self.W_key(x), self.W_value(x)], dim=-1)
        mixed, conv_tail = self._convolve(mixed, None if state is None else state.conv)
        key_dim = self.num_key_heads * self.head_dim
        q, k, v = mixed.split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
        # (b, num_heads or num_k_heads, num_tokens, head width)
        q, k = (y.view(b, num_tokens, self.num_key_heads, self.head_dim).transpose(1, 2)
                .to(wide) for y in (q, k))
        v = v.view(b, num_tokens, self.num_heads, self.value_head_dim).transpose(1, 2).to(wide)
        group = self.num_heads // self.num_key_heads
        if group > 1:  # each query/key head serves `group` consecutive value heads
            q, k = (y.repeat_interleave(group, dim=1) for y in (q, k))
        q = l2_normalize(q) / math.sqrt(self.head_dim)
        k = l2_normalize(k)
        beta = torch.sigmoid(self.W_beta(x)).transpose(1, 2).to(wide)  # (b, num_heads, n)
        g = (-self.A_log.to(wide).exp()
             * F.softplus(self.W_decay(x).to(wide) + self.dt_bias)).transpose(1, 2)
        if attention_mask is not None:  # a padded position neither writes nor forgets
            keep = attention_mask[:, None, :].to(wide)  # (b, 1, num_tokens)
            beta, g = beta * keep, g * keep
        before = None if state is None else state.recurrent
        if before is not None and num_tokens == 1:
            out, after = recurrent_delta_rule(q, k, v, g, beta, before)
        else:
            out, after = chunked_delta_rule(q, k, v, g, beta, before, self.chunk_size)
        if state is not None:
            state.recurrent, state.conv = after, conv_tail
            state.num_seen += num_tokens
        out = out.transpose(1, 2)  # (b, num_tokens, num_heads, v_dim)
        z = self.W_gate(x).view(b, num_tokens, self.num_heads, self.value_head_dim)
        out = (F.rms_norm(out, (self.value_head_dim,), self.norm_weight.to(wide), self.norm_eps)
               * F.silu(z.to(wide)))
        return self.out_proj(out.to(x.dtype).flatten(2))  # (b, num_tokens, d_in)

    def _convolve(self, mixed: Tensor, tail: Tensor | None) -> tuple[Tensor, Tensor]:
        """The causal depthwise convolution and SiLU over (b, num_tokens, channels), after
        the previous call's last inputs (zeros at the start); returns the outputs and the
        new tail (b, channels, conv_kernel - 1)."""
        b, num_tokens, channels = mixed.shape
        inputs = mixed.transpose(1, 2)  # (b, channels, num_tokens)
        if tail is None:
            tail = inputs.new_zeros(b, channels, self.conv_kernel - 1)
        inputs = torch.cat([tail.to(inputs.dtype), inputs], dim=-1)  # (b, channels, K-1+n)
        out = F.silu(self.conv1d(inputs))  # (b, channels, num_tokens)
        return out.transpose(1, 2), inputs[:, :, inputs.shape[-1] - (self.conv_kernel - 1):]


class GatedDeltaNetLayer(GatedDeltaNet):
    """A GatedDeltaNet called as a block calls its token mixer (gptmini.model.mixers): with
    the pass's context, of which it reads the padding (left padding is zeroed: exact) and
    refuses what it cannot do yet, and its `DeltaNetState` as the cache. Positions do not
    enter it (the convolution and the decay order the tokens)."""

    def forward(self, x: Tensor, attention_mask: Tensor | None = None,
                state: DeltaNetState | None = None, *,
                context: AttentionContext | None = None, kv_cache: DeltaNetState | None = None,
                return_weights: bool = False) -> Tensor:
        """x (b, num_tokens, d_in) -> (b, num_tokens, d_in); `attention_mask` and `state` as
        GatedDeltaNet's, or `context` and `kv_cache` as a block passes them."""
        if return_weights:
            raise ValueError("a Gated DeltaNet layer has no attention weights to return")
        state = state if kv_cache is None else kv_cache
        if state is not None and not isinstance(state, DeltaNetState):
            raise ValueError(f"a Gated DeltaNet layer keeps a DeltaNetState, not a "
                             f"{type(state).__name__}; make the caches with "
                             "model.new_kv_caches()")
        if context is not None:
            if context.ragged is not None or context.document_ids is not None:
                raise ValueError(
                    "Gated DeltaNet layers (GPTConfig.layer_kinds) cannot yet restart their "
                    "state inside a row: no packed documents (document_ids) and no engine "
                    "steps; train without packing, generate with generate()")
            if context.attention_mask is not None:  # (b, num_keys): the new tokens' part
                attention_mask = context.attention_mask[:, -x.shape[1]:]
        return super().forward(x, attention_mask, state)


@dataclass(frozen=True)
class DeltaNet(TokenMixer):
    """Gated DeltaNet as a layer's token mixer (the "deltanet" entry of
    gptmini.model.mixers.MIXERS), the norms' epsilon and these options of
    GPTConfig.mixer_options["deltanet"] (GatedDeltaNet's keywords):

        num_heads       value heads, each with its own state (n_heads)
        num_key_heads   query/key heads, a divisor of num_heads (num_heads)
        head_dim        a query's and key's width (emb_dim // n_heads)
        value_head_dim  a value's width (head_dim)
        conv_kernel     the short convolution's width (4)

    Its cache is a fixed state, which neither pages, rolls nor has attention weights."""

    title: ClassVar[str] = "Gated DeltaNet"
    options: ClassVar[tuple[str, ...]] = ("num_heads", "num_key_heads", "head_dim",
                                          "value_head_dim", "conv_kernel")
    has_weights: ClassVar[bool] = False
    pageable: ClassVar[bool] = False  # the engine's blocks hold keys and values
    rolls: ClassVar[bool] = False  # a state cannot drop its oldest tokens
    hf_layout: ClassVar[str | None] = "qwen3_5_text"
    cfg: Any
    sizes: dict

    @classmethod
    def from_config(cls, cfg: GPTConfig) -> "DeltaNet":
        # Its state holds every token seen: a window given to its layers would be stored in
        # the config and never applied.
        kinds = layer_mixer_names(cfg)
        windowed = [i for i, name in enumerate(kinds)
                    if MIXERS[name] is cls and cfg.window_of(i) is not None]
        if windowed:
            field = "window_size" if cfg.layer_windows is None else "layer_windows"
            example = [None if i in windowed else cfg.window_of(i) for i in range(len(kinds))]
            raise ConfigError(field, getattr(cfg, field), f"layer {windowed[0]} is Gated "
                              "DeltaNet, which applies no window (its state holds every token "
                              f"it saw): give its layers None, layer_windows={example}"
                              + (" and window_size None" if field == "window_size" else ""))
        given = cls.options_of(cfg)
        for name, value in given.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError("mixer_options", cfg.mixer_options, f"deltanet's {name} is "
                                  f"{value!r}: use a positive integer, or leave it out for "
                                  "its default")
        heads = given.get("num_heads", cfg.n_heads)
        head_dim = given.get("head_dim", cfg.emb_dim // cfg.n_heads)
        sizes = {"num_heads": heads, "num_key_heads": given.get("num_key_heads", heads),
                 "head_dim": head_dim, "value_head_dim": given.get("value_head_dim", head_dim),
                 "conv_kernel": given.get("conv_kernel", CONV_KERNEL)}
        if heads % sizes["num_key_heads"]:
            raise ConfigError("mixer_options", cfg.mixer_options, f"deltanet's num_key_heads="
                              f"{sizes['num_key_heads']} must divide its num_heads={heads} "
                              "(each key head serves a group of value heads)")
        return cls(cfg, sizes)

    def make_module(self, layer: int, position_scheme) -> GatedDeltaNetLayer:
        sizes = dict(self.sizes)
        return GatedDeltaNetLayer(self.cfg.emb_dim, sizes.pop("num_heads"),
                                  sizes.pop("head_dim"), **sizes, norm_eps=self.cfg.norm_eps)

    def new_cache(self, module: nn.Module) -> DeltaNetState:
        return DeltaNetState()

    def flops_per_token(self, layer: int, seq_len: int) -> float:
        """H value heads of v = value_head_dim, H_k query/key heads of k = head_dim, conv
        kernel K, chunks of C tokens.

        Matmul weights: W_query and W_key (d x H_k k each), W_value and W_gate (d x H v
        each), W_beta and W_decay (d x H each), out_proj (H v x d), and the depthwise
        convolution's K weights for each of its 2 H_k k + H v channels (2 * K FLOPs per
        channel and token forward, like a matmul weight).

        The state update runs chunked in training (`chunked_delta_rule`), each value head
        with its group's key head. Per chunk and head, forward: K_beta K^T and Q K^T (2 *
        C^2 * k each), two unit-triangular solves of C rows for k and v right-hand columns
        (C^2 * (k + v), the BLAS trsm count), scores @ U (2 * C^2 * v), and against the
        state U_per_state @ S, Q_decayed @ S and K_to_end^T @ U (2 * C * k * v each). Per
        token: C * (5k + 3v) + 6 * k * v forward, times 3. A last partial chunk is padded to
        C tokens and computed whole, so T is counted up to a multiple of C. (Decoding runs the
        recurrent form instead: about 4 * k * v per head and token, reading and writing the
        state; it is not training and not counted here.)
        """
        d, s = self.cfg.emb_dim, self.sizes
        heads, k, v = s["num_heads"], s["head_dim"], s["value_head_dim"]
        keys, values = s["num_key_heads"] * k, heads * v
        weights = (2 * d * keys + 3 * d * values + 2 * d * heads
                   + (2 * keys + values) * s["conv_kernel"])
        chunks = math.ceil(seq_len / CHUNK_SIZE)
        per_chunk = heads * (CHUNK_SIZE ** 2 * (5 * k + 3 * v) + 6 * CHUNK_SIZE * k * v)
        return 6 * weights + 3 * chunks * per_chunk / seq_len
