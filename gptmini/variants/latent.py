"""Multi-head latent attention (MLA, DeepSeek-V2 and V3): keys and values compressed jointly
into one small latent per token, plus one rotary key shared by every head.

Letters in the shape comments (those of gptmini.attention.multihead, and):
    rank        kv_lora_rank: the latent's width, all a token's keys and values come from
    nope_dim    qk_nope_head_dim: the part of a head's query and key with no position
    rope_dim    qk_rope_head_dim: the decoupled rotary part (one key for all heads)
    v_dim       v_head_dim: a head's value size

Per token, the layer computes a latent c = RMSNorm(W_dkv x) (rank) and a rotary key
k_rot = rope(W_kr x) (rope_dim). A head's key is [W_uk_h c, k_rot] and its value W_uv_h c:
both are up-projections of the latent (`kv_b_proj` holds W_uk and W_uv of every head).
The KV cache therefore holds only c and k_rot, (rank + rope_dim) numbers per token and
layer, where multi-head attention holds 2 * num_heads * head_dim (the cache's `keys` are
the latents, its `values` the rotary keys; any BaseKVCache holds them).

Two equal ways to attend (DeepSeek-V2, section 2.1.2):
    plain      expand every cached latent into keys and values, attend as multi-head
               attention does (training and prefill: the expansion is paid once per token)
    absorbed   fold W_uk into the query (q_h W_uk_h, rank wide) and W_uv into the output,
               and attend over the latents themselves as one shared key/value head: no
               cached token is ever expanded (decoding: the query is one token)

Both give the same output (tests/variants/test_latent.py checks it in float64). Parameter
names are Hugging Face's DeepseekV3Attention's, except `out_proj` (its o_proj), the name
every gptmini attention gives the projection into the residual stream.

`LatentAttention` is the "mla" entry of the model's token mixers (gptmini.model.mixers):
what a GPTModel asks of an MLA layer, from GPTConfig.mixer_options["mla"], which it checks.
"""

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gptmini.attention.context import AttentionContext, AttentionSettings, layer_context
from gptmini.attention.kernels import attend, make_kernel
from gptmini.attention.norm import RMSNorm
from gptmini.attention.positions import NoPositions, PositionScheme
from gptmini.core.attention import BaseKVCache
from gptmini.model import ConfigError, GPTConfig
from gptmini.model.mixers import TokenMixer

__all__ = ["LatentAttention", "MultiHeadLatentAttention", "latent_cache_numbers"]


def latent_cache_numbers(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Numbers cached per token and layer by MLA: the latent and the rotary key."""
    return kv_lora_rank + qk_rope_head_dim


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention, through gptmini's context, kernels and caches.

    Args:
        d_in: the input's (residual stream's) width; the output has the same.
        context_length: most positions one call may cover (cached + new).
        dropout: on the attention weights.
        num_heads: query heads (every head has its own key and value, expanded from the
            shared latent).
        kv_lora_rank: the latent's width.
        qk_nope_head_dim: a head's query/key part without positions.
        qk_rope_head_dim: the decoupled rotary part (the position scheme rotates it when
            it is rotary: its head_dim must be this).
        v_head_dim: a head's value size.
        q_lora_rank: compress the query too (DeepSeek-V3: 1536), through an RMSNorm'd
            latent of this width; None: one full query projection.
        qkv_bias: a bias in the down-projections (Hugging Face's attention_bias).
        window_size, causal, backend, position_scheme, softcap: as MultiHeadAttention's.
        out_bias: a bias in out_proj.
        norm_eps: the latents' RMSNorm epsilon (DeepSeek's 1e-6).
        absorb: True: always attend absorbed; False: always plain; None (default): absorbed
            when decoding from a cache that already holds tokens, plain otherwise.
    """

    # As many parameters as the options a reader sets (DeepSeek's five sizes among them).
    def __init__(
        self,
        d_in: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        qkv_bias: bool = False,
        window_size: int | None = None,
        causal: bool = True,
        backend: str | type = "sdpa",
        position_scheme: PositionScheme | None = None,
        out_bias: bool = False,
        softcap: float | None = None,
        norm_eps: float = 1e-6,
        absorb: bool | None = None,
    ):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                            ("qk_nope_head_dim", qk_nope_head_dim),
                            ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim),
                            ("q_lora_rank", 1 if q_lora_rank is None else q_lora_rank)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MultiHeadLatentAttention's {name} must be a positive "
                                 f"integer, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.num_heads, self.context_length = num_heads, context_length
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        scheme = NoPositions() if position_scheme is None else position_scheme
        if getattr(scheme, "head_dim", qk_rope_head_dim) != qk_rope_head_dim:
            raise ValueError(f"the position scheme rotates {scheme.head_dim} dimensions but "
                             f"MLA's rotary key has qk_rope_head_dim={qk_rope_head_dim}; build "
                             "the scheme with head_dim=qk_rope_head_dim")
        self.settings = AttentionSettings(causal, window_size, scheme, softcap)
        self.backend = backend  # builds self.kernel
        self.absorb = absorb

        q_out = num_heads * self.qk_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_in, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_in, q_lora_rank, bias=qkv_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False)
        # x -> [latent, rotary key]: "with_mqa" as DeepSeek names it (one key for all heads)
        self.kv_a_proj_with_mqa = nn.Linear(d_in, kv_lora_rank + qk_rope_head_dim,
                                            bias=qkv_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=norm_eps)
        # latent -> [W_uk_h c, W_uv_h c] for every head h; no bias, so that it can be absorbed
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
                                   bias=False)
        self.out_proj = nn.Linear(num_heads * v_head_dim, d_in, bias=out_bias)
        self.dropout = nn.Dropout(dropout)

    @property
    def backend(self) -> str | type:
        return self._backend

    @backend.setter
    def backend(self, backend: str | type):
        self.kernel = make_kernel(backend)  # raises, naming the choices, for an unknown one
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
        """Attend over `x` (and the cached tokens before it); the arguments and the result
        are MultiHeadAttention.forward's. The cache is handed latents (b, 1, num_tokens,
        rank) as keys and rotary keys (b, 1, num_tokens, rope_dim) as values."""
        b, num_tokens, _ = x.shape
        num_cached = len(kv_cache) if kv_cache is not None else 0
        context = layer_context(self.settings, self.context_length, x, num_cached,
                                context=context, uses_cache=kv_cache is not None,
                                attention_mask=attention_mask, document_ids=document_ids,
                                positions=positions)
        if self.q_lora_rank is None:
            queries = self.q_proj(x)  # (b, num_tokens, num_heads * qk_head_dim)
        else:
            queries = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        # (b, num_tokens, num_heads, qk_head_dim) -> (b, num_heads, num_tokens, qk_head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = queries.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim],
                                                         dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # (b, 1, num_tokens, rank)
        k_rot = k_rot[:, None]  # (b, 1, num_tokens, rope_dim): one head, shared
        q_rot, k_rot = self.settings.position_scheme.rotate(q_rot, k_rot, context)
        if kv_cache is not None:  # (b, 1, num_keys, rank), (b, 1, num_keys, rope_dim)
            latent, k_rot = kv_cache.update(latent, k_rot, context.positions)

        absorb = self.absorb if self.absorb is not None else (
            kv_cache is not None and num_cached > 0)
        if absorb:
            context_vec, weights = self._absorbed(q_nope, q_rot, latent, k_rot, context,
                                                  return_weights)
        else:
            context_vec, weights = self._plain(q_nope, q_rot, latent, k_rot, context,
                                               return_weights)
        # (b, num_heads, num_tokens, v_dim) -> (b, num_tokens, num_heads * v_dim)
        context_vec = context_vec.transpose(1, 2).reshape(b, num_tokens, -1)
        out = self.out_proj(context_vec)
        empty_rows = context.empty_rows()  # (b, num_tokens) or None
        if empty_rows is not None:
            out = out.masked_fill(empty_rows[..., None], 0.0)  # out_proj's bias, zeroed
        return (out, weights) if return_weights else out

    def _plain(self, q_nope: Tensor, q_rot: Tensor, latent: Tensor, k_rot: Tensor,
               context: AttentionContext, return_weights: bool):
        """Every latent expanded into each head's key and value, then attended."""
        b, _, num_keys, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0])  # (b, num_keys, num_heads * (nope_dim + v_dim))
        # (b, num_keys, num_heads, nope_dim + v_dim) -> (b, num_heads, num_keys, ...)
        kv = kv.view(b, num_keys, self.num_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, values = kv.split([self.nope_dim, self.v_dim], dim=-1)
        # (b, num_heads, num_keys, qk_head_dim): the rotary key is the same for every head
        keys = torch.cat([k_nope, k_rot.expand(-1, self.num_heads, -1, -1)], dim=-1)
        queries = torch.cat([q_nope, q_rot], dim=-1)
        return attend(self.kernel, self.backend, queries, keys, values, context,
                      dropout_p=self.dropout.p if self.training else 0.0,
                      return_weights=return_weights)

    def _absorbed(self, q_nope: Tensor, q_rot: Tensor, latent: Tensor, k_rot: Tensor,
                  context: AttentionContext, return_weights: bool):
        """Attention over the latents: q_nope_h . (W_uk_h c) = (W_uk_h^T q_nope_h) . c, and
        softmax(.) (W_uv_h c) = W_uv_h (softmax(.) c), so the keys are [c, k_rot] and the
        values c, one head shared by all (multi-query attention, rank + rope_dim wide)."""
        # (num_heads, nope_dim + v_dim, rank): each head's W_uk above its W_uv
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim,
                                       self.kv_lora_rank)
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.einsum("bhnd,hdr->bhnr", q_nope, w_uk)  # (b, num_heads, n, rank)
        # Kernels scale scores by 1/sqrt(the query's width), here rank + rope_dim; the
        # scores must be scaled as the plain path's, by 1/sqrt(nope_dim + rope_dim).
        width = self.kv_lora_rank + self.rope_dim
        queries = torch.cat([q_latent, q_rot], dim=-1) * math.sqrt(width / self.qk_head_dim)
        keys = torch.cat([latent, k_rot], dim=-1)  # (b, 1, num_keys, rank + rope_dim)
        context_vec, weights = attend(self.kernel, self.backend, queries, keys, latent, context,
                                      dropout_p=self.dropout.p if self.training else 0.0,
                                      return_weights=return_weights)
        # (b, num_heads, num_tokens, rank) -> (b, num_heads, num_tokens, v_dim)
        return torch.einsum("bhnr,hvr->bhnv", context_vec, w_uv), weights


@dataclass(frozen=True)
class LatentAttention(TokenMixer):
    """Multi-head latent attention as a layer's token mixer (the "mla" entry of
    gptmini.model.mixers.MIXERS): DeepSeek's sizes from GPTConfig.mixer_options["mla"],
    defaults filled in (`dims`, under MultiHeadLatentAttention's keywords), and the options
    of the book's attention it lacks refused by name. Its options, with head_dim = emb_dim
    // n_heads:

        kv_lora_rank       the latent a token's keys and values come from (4 * head_dim)
        q_lora_rank        the query's latent (DeepSeek-V3's 1536); None: a full projection
        qk_nope_head_dim   a head's query/key part without positions (head_dim)
        qk_rope_head_dim   the decoupled rotary part (head_dim // 2, at least 2)
        v_head_dim         a head's value size (head_dim)
    """

    title: ClassVar[str] = "multi-head latent attention"
    options: ClassVar[tuple[str, ...]] = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                          "qk_rope_head_dim", "v_head_dim")
    pageable: ClassVar[bool] = False  # its cache holds latents, not per-head keys and values
    hf_layout: ClassVar[str | None] = "deepseek_v3"
    cfg: Any
    dims: dict

    @classmethod
    def from_config(cls, cfg: GPTConfig) -> "LatentAttention":
        given = cls.options_of(cfg)
        for name, value in given.items():
            if not (value is None and name != "kv_lora_rank") and not (
                    isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError("mixer_options", cfg.mixer_options, f"mla's {name} is "
                                  f"{value!r}: use a positive integer, or leave it out for "
                                  "its default")
        head_dim = cfg.emb_dim // cfg.n_heads
        dims = {"kv_lora_rank": given.get("kv_lora_rank") or 4 * head_dim,
                "q_lora_rank": given.get("q_lora_rank"),
                "qk_nope_head_dim": given.get("qk_nope_head_dim") or head_dim,
                "qk_rope_head_dim": given.get("qk_rope_head_dim") or max(2, head_dim // 2),
                "v_head_dim": given.get("v_head_dim") or head_dim}
        for name, rank, heads in (
                ("kv_lora_rank", dims["kv_lora_rank"],
                 dims["qk_nope_head_dim"] + dims["v_head_dim"]),
                ("q_lora_rank", dims["q_lora_rank"],
                 dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"])):
            widest = cfg.n_heads * heads  # what the latent compresses, per token
            if rank is not None and rank > widest:
                raise ConfigError("mixer_options", cfg.mixer_options, f"mla's {name} of "
                                  f"{rank} is a latent wider than the {cfg.n_heads} heads x "
                                  f"{heads} dimensions it compresses ({widest} per token): "
                                  f"it caches and computes more than attention would; use at "
                                  f"most {widest}, far less for a saving (e.g. "
                                  f"{max(1, widest // 4)})")
        mixer = cls(cfg, dims)
        try:
            mixer.scheme_of(cfg.position_scheme())
        except ValueError:
            raise ConfigError("mixer_options", cfg.mixer_options, f"mla's qk_rope_head_dim "
                              f"is {dims['qk_rope_head_dim']}: rotary dimensions turn in "
                              "pairs, use an even size") from None
        for field, fine, fix in (
                ("n_kv_heads", cfg.n_kv_heads is None, "it shares its latent across heads "
                 "already: leave n_kv_heads None"),
                ("qk_norm", not cfg.qk_norm, "it normalizes its latents instead: leave "
                 "qk_norm False"),
                ("attn_sinks", not cfg.attn_sinks, "it has no sinks yet: leave attn_sinks "
                 "False"),
                ("attn_gate", cfg.attn_gate == "none", "it has no output gate yet: leave "
                 "attn_gate 'none'"),
                ("layer_windows", cfg.layer_windows is None, "it has one window for every "
                 "layer: use window_size, or leave layer_windows None"),
                ("head_dim", cfg.head_dim is None, "its heads are sized by its qk_nope_head_dim, "
                 "qk_rope_head_dim and v_head_dim (mixer_options): leave head_dim None"),
                ("attn_scale_dim", cfg.attn_scale_dim is None, "it scales by its query's "
                 "size: leave attn_scale_dim None")):
            if not fine:
                raise ConfigError(field, getattr(cfg, field), "multi-head latent attention "
                                  f"(layer_kinds mla) has this option of attention's: {fix}")
        return mixer

    def scheme_of(self, scheme: PositionScheme) -> PositionScheme:
        """The model's scheme as MLA uses it: a rotary one turns only the rotary part."""
        if hasattr(scheme, "head_dim"):
            return replace(scheme, head_dim=self.dims["qk_rope_head_dim"])
        return scheme

    def make_module(self, layer: int, position_scheme: PositionScheme
                    ) -> MultiHeadLatentAttention:
        cfg = self.cfg
        return MultiHeadLatentAttention(
            cfg.emb_dim, cfg.context_length, cfg.attention_dropout, cfg.n_heads, **self.dims,
            qkv_bias=cfg.qkv_bias, window_size=cfg.window_size, backend=cfg.attention_backend,
            position_scheme=self.scheme_of(position_scheme), out_bias=cfg.bias,
            softcap=cfg.attn_softcap)

    def flops_per_token(self, layer: int, seq_len: int) -> float:
        """As training runs it, the plain path (the absorbed one is for decoding). Matmul
        weights, with r = kv_lora_rank, qk = qk_nope_head_dim + qk_rope_head_dim,
        v = v_head_dim, q = q_lora_rank:

            query     d x (H * qk), or through its latent: d x q + q x (H * qk)
            kv_a      d x (r + qk_rope_head_dim): the latent and the shared rotary key
            kv_b      r x (H * (qk_nope_head_dim + v)): every token's latent up-projected once
            out_proj  (H * v) x d

        Scores over queries and keys qk wide (2 * T * H * qk forward) and values v wide
        (2 * T * H * v): 6 * T * H * (qk + v) with backward, 12 * T * d when qk = v = d / H."""
        d, heads, dims = self.cfg.emb_dim, self.cfg.n_heads, self.dims
        rank, rope, v = dims["kv_lora_rank"], dims["qk_rope_head_dim"], dims["v_head_dim"]
        qk = dims["qk_nope_head_dim"] + rope
        q_rank = dims["q_lora_rank"]
        query = d * heads * qk if q_rank is None else d * q_rank + q_rank * heads * qk
        weights = (query + d * (rank + rope) + rank * heads * (dims["qk_nope_head_dim"] + v)
                   + heads * v * d)
        return 6 * weights + 6 * seq_len * heads * (qk + v)
