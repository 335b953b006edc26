"""The GPT model of the book's chapter 4, built on `MultiHeadAttention`.

Token + position embeddings, dropout, `n_layers` pre-LayerNorm transformer blocks
(attention and a 4x GELU feed-forward, each inside a residual), a final LayerNorm and a
linear output head: the book's model, and the default. GPTConfig (gptmini.model.config) swaps in
the modern parts: rotary or ALiBi positions instead of the embedding, RMSNorm, SwiGLU or
ReLU², QK-norm, no biases. The position scheme (gptmini.attention.positions) is built once
from GPTConfig.position and shared: it makes the position embedding, and every layer's
attention rotates or modifies scores with it. Imports only torch, so the model can be lifted
into any loop.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gptmini.attention import (
    BaseKVCache,
    KVCache,
    MultiHeadAttention,
    MultiHeadLatentAttention,
    WindowKVCache,
)
from gptmini.attention.context import AttentionContext, AttentionSettings, Ragged
from gptmini.attention.deltanet import DeltaNetState, GatedDeltaNet
from gptmini.attention.norm import RMSNorm
from gptmini.attention.positions import PositionScheme
from gptmini.model.config import GPTConfig

__all__ = ["DeltaNetBlock", "GPTModel", "TransformerBlock", "cross_entropy"]

class FeedForward(nn.Module):
    """Position-wise MLP: emb_dim -> 4 * emb_dim -> emb_dim with GELU (tanh approximation),
    the book's; with cfg.mlp "relu2", squared ReLU (modded-nanogpt's) in its place."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, cfg.hidden_dim, bias=cfg.bias),
            nn.GELU(approximate="tanh") if cfg.mlp == "gelu" else SquaredReLU(),
            nn.Linear(cfg.hidden_dim, cfg.emb_dim, bias=cfg.bias),
        )

    @property
    def proj_out(self) -> nn.Linear:
        return self.layers[2]

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class SquaredReLU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x).square()


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x)), Llama's (names as Hugging Face's)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.emb_dim, cfg.hidden_dim, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.emb_dim, cfg.hidden_dim, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.emb_dim, bias=cfg.bias)

    @property
    def proj_out(self) -> nn.Linear:
        return self.down_proj

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def make_norm(cfg: GPTConfig) -> nn.Module:
    """LayerNorm (the book's) or RMSNorm, over emb_dim."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)  # torch's, faster on a CPU
    return nn.LayerNorm(cfg.emb_dim, eps=cfg.norm_eps, bias=cfg.bias)


def latent_attention(cfg: GPTConfig, position_scheme: PositionScheme | None = None
                     ) -> MultiHeadLatentAttention:
    """A block's multi-head latent attention (cfg.mla_kv_lora_rank is set), with the
    model's position scheme (None: a new one of cfg's)."""
    return MultiHeadLatentAttention(
        cfg.emb_dim, cfg.context_length,
        cfg.drop_rate if cfg.attn_drop_rate is None else cfg.attn_drop_rate, cfg.n_heads,
        **cfg.mla_dims, qkv_bias=cfg.qkv_bias, window_size=cfg.window_size,
        backend=cfg.attention_backend, position_scheme=position_scheme or cfg.position_scheme(),
        out_bias=cfg.bias, softcap=cfg.attn_softcap)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + att(norm1(x)), then x + ff(norm2(x)). `position_scheme` is
    the model's, shared by every block (None: a new one of cfg's); `layer` is the block's
    index, which picks its window (GPTConfig.window_of)."""

    def __init__(self, cfg: GPTConfig, position_scheme: PositionScheme | None = None,
                 layer: int = 0):
        super().__init__()
        mla = cfg.mla_kv_lora_rank is not None  # multi-head latent attention (issue 37)
        self.att = latent_attention(cfg, position_scheme) if mla else MultiHeadAttention(
            d_in=cfg.emb_dim,
            d_out=cfg.emb_dim,
            context_length=cfg.context_length,
            dropout=cfg.drop_rate if cfg.attn_drop_rate is None else cfg.attn_drop_rate,
            num_heads=cfg.n_heads,
            qkv_bias=cfg.qkv_bias,
            num_kv_heads=cfg.n_kv_heads,
            window_size=cfg.window_of(layer),
            backend=cfg.attention_backend,
            position_scheme=position_scheme or cfg.position_scheme(),
            qk_norm=cfg.qk_norm,
            out_bias=cfg.bias,
            softcap=cfg.attn_softcap,
            sinks=cfg.attn_sinks,
            gate=cfg.attn_gate,
        )
        self.ff = SwiGLU(cfg) if cfg.mlp == "swiglu" else FeedForward(cfg)
        self.norm1 = make_norm(cfg)
        self.norm2 = make_norm(cfg)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(
        self,
        x: Tensor,
        context: AttentionContext | None = None,
        kv_cache: BaseKVCache | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """x (b, num_tokens, emb_dim) through the block; `context` is the forward pass's
        (None: the attention builds its own, causal over x)."""
        att = self.att(self.norm1(x), context=context, kv_cache=kv_cache,
                       return_weights=return_weights)
        weights = None
        if return_weights:
            att, weights = att
        x = x + self.drop_shortcut(att)
        x = x + self.drop_shortcut(self.ff(self.norm2(x)))
        return (x, weights) if return_weights else x


class DeltaNetBlock(nn.Module):
    """A block whose token mixer is Gated DeltaNet (gptmini.attention.deltanet) instead of
    attention, for GPTConfig.layer_kinds: x + mix(norm1(x)), then x + ff(norm2(x)). Its
    cache is a `DeltaNetState`; positions do not enter it (the convolution and the decay
    order the tokens)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        # Held as `att`, the attention's name, so that the model's init and every
        # state-dict key outside the mixer read as a TransformerBlock's.
        self.att = GatedDeltaNet(cfg.emb_dim, cfg.n_heads, cfg.emb_dim // cfg.n_heads,
                                 norm_eps=cfg.norm_eps)
        self.ff = SwiGLU(cfg) if cfg.mlp == "swiglu" else FeedForward(cfg)
        self.norm1 = make_norm(cfg)
        self.norm2 = make_norm(cfg)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x: Tensor, context: AttentionContext | None = None,
                kv_cache: DeltaNetState | None = None, return_weights: bool = False) -> Tensor:
        """x (b, num_tokens, emb_dim) through the block; of `context` it reads the padding
        (left padding is zeroed: exact) and refuses what it cannot do yet."""
        if return_weights:
            raise ValueError("a Gated DeltaNet layer has no attention weights to return")
        if kv_cache is not None and not isinstance(kv_cache, DeltaNetState):
            raise ValueError(f"a Gated DeltaNet layer keeps a DeltaNetState, not a "
                             f"{type(kv_cache).__name__}; make the caches with "
                             "model.new_kv_caches()")
        mask = None
        if context is not None:
            if context.ragged is not None or context.document_ids is not None:
                raise ValueError(
                    "Gated DeltaNet layers (GPTConfig.layer_kinds) cannot yet restart their "
                    "state inside a row: no packed documents (document_ids) and no engine "
                    "steps; train without packing, generate with generate()")
            if context.attention_mask is not None:  # (b, num_keys): the new tokens' part
                mask = context.attention_mask[:, -x.shape[1]:]
        x = x + self.drop_shortcut(self.att(self.norm1(x), mask, kv_cache))
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


def _rename_book_norms(module, state_dict, prefix, *args):
    """Load the book's chapter 4/5 GPTModel state dicts (`torch.save(model.state_dict())`):
    its LayerNorm names its parameters `scale` and `shift` where nn.LayerNorm has `weight`
    and `bias`; everything else has the same name (the attention masks are dropped by
    MultiHeadAttention's own hook)."""
    for key in [k for k in state_dict if k.startswith(prefix) and "norm" in k]:
        for book, ours in ((".scale", ".weight"), (".shift", ".bias")):
            if key.endswith(book):
                state_dict[key.removesuffix(book) + ours] = state_dict.pop(key)


class GPTModel(nn.Module):
    """GPT-2 style decoder-only language model."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_width, cfg.emb_dim)
        self.position_scheme = cfg.position_scheme()  # one, shared by every layer
        pos_emb = self.position_scheme.make_embedding()
        if pos_emb is not None:  # held under the book's name, which its state dicts use
            self.pos_emb = pos_emb
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList([
            DeltaNetBlock(cfg) if cfg.layer_kind(i) == "deltanet"
            else TransformerBlock(cfg, self.position_scheme, i) for i in range(cfg.n_layers)])
        # what contexts are built with: the attention layers' (a model of DeltaNet layers
        # only builds them for positions, with the settings its attention would have)
        self.attention_settings = next(
            (block.att.settings for block in self.trf_blocks
             if isinstance(block, TransformerBlock)),
            AttentionSettings(window_size=cfg.window_size, position_scheme=self.position_scheme,
                              softcap=cfg.attn_softcap))
        self.final_norm = make_norm(cfg)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_width, bias=False)
        self.apply(self._init_weights)
        # GPT-2 scales the projections that write into the residual stream by
        # 1/sqrt(2 * n_layers), so the stream's variance does not grow with depth.
        for block in self.trf_blocks:
            for proj in (block.att.out_proj, block.ff.proj_out):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))
        if cfg.tie_weights:
            self.out_head.weight = self.tok_emb.weight
        self.register_load_state_dict_pre_hook(_rename_book_norms)

    @staticmethod
    def _init_weights(module: nn.Module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # Long by its docstring only (every argument of the model's one entry point); the body
    # is the pass: its context, the embeddings, the blocks, the head.
    def forward(
        self,
        in_idx: Tensor,
        attention_mask: Tensor | None = None,
        *,
        targets: Tensor | None = None,
        reduction: str = "mean",
        loss_chunk_size: int | None = None,
        logits_to_keep: int | Tensor | None = None,
        kv_caches: list[BaseKVCache] | None = None,
        return_weights: bool = False,
        document_ids: Tensor | None = None,
        context: AttentionContext | None = None,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Next-token logits for every position, or the loss against `targets`.

        Args:
            in_idx: (b, num_tokens) token ids.
            attention_mask: optional (b, num_keys) mask, 1 at real tokens and 0 at padding,
                covering cached tokens too. Positions count from each row's first real
                token, so a left-padded prompt is embedded as it would be alone.
            targets: (b, num_tokens) the next token at each position; -100 marks a position
                that counts for nothing. With targets the cross-entropy is returned instead
                of the logits, computed here so that `torch.compile` fuses the head, the
                float32 upcast and the loss, with no full-vocabulary float32 copy of the
                logits outside the graph.
            reduction: with targets, "mean" over the counted positions, "sum", or "none"
                for one loss per position (b, num_tokens), 0 where targets are -100.
            loss_chunk_size: with targets, run the head and the loss on this many positions
                at a time and recompute them in backward, so the full (b, num_tokens,
                vocab_size) logits and their gradient never exist at once: measured on a
                CPU, 8 x 1024 positions of GPT-2's vocabulary peaked at 1.3 GB instead of
                5.3 GB, for 14% more time. None: all at once.
            logits_to_keep: compute the logits of the last this many positions only (the
                head is the largest matmul of a small GPT; generation needs one position),
                or of the positions a 1-d index tensor names (an engine step: each
                sequence's last token).
            kv_caches: one KV cache per layer (`KVCache`, or the engine's paged views); new
                keys and values are appended.
            return_weights: also return each layer's attention weights
                (b, n_heads, num_tokens, num_keys), from the explicit attention path.
            document_ids: (b, num_keys) the document of each token when several are packed
                in one window: no token attends across a document's edge, and positions
                count from each document's first token, as generation counts from a
                prompt's (so a document looks the same wherever the window cut it).
            context: the AttentionContext of this pass, if the caller built it (the engine
                does, for a step); then attention_mask and document_ids are in it. None:
                built here, once, for every layer.

        Returns:
            Logits (b, num_tokens or logits_to_keep, vocab_size), in the model's dtype, and
            with `return_weights` the list of weights; or, with targets, the float32 loss.
        """
        context = self._context(in_idx, attention_mask, document_ids, kv_caches, context)
        if return_weights and self.cfg.layer_kinds and "deltanet" in self.cfg.layer_kinds:
            mixers = [i for i, kind in enumerate(self.cfg.layer_kinds) if kind == "deltanet"]
            raise ValueError(f"layers {mixers} are Gated DeltaNet layers (cfg.layer_kinds): "
                             "they have no attention weights to return")
        if targets is not None and (return_weights or logits_to_keep is not None):
            raise ValueError("with targets forward returns the loss; pass targets alone, or "
                             "ask for logits (logits_to_keep, return_weights) without them")
        x = self.position_scheme.embed(self.tok_emb(in_idx), context)  # (b, num_tokens, emb)
        x = self.drop_emb(x)

        all_weights = []
        for i, block in enumerate(self.trf_blocks):
            cache = kv_caches[i] if kv_caches else None
            x = block(x, context, cache, return_weights)
            if return_weights:
                x, weights = x
                all_weights.append(weights)
        if targets is not None and loss_chunk_size:
            return self._chunked_loss(x, targets, reduction, loss_chunk_size)
        if isinstance(logits_to_keep, Tensor):
            x = x[:, logits_to_keep, :]  # (b, len(logits_to_keep), emb)
        elif logits_to_keep is not None:
            x = x[:, -logits_to_keep:, :]  # (b, logits_to_keep, emb)
        logits = self._logits(x)  # (b, num_tokens, vocab_size)
        if targets is not None:
            return cross_entropy(logits, targets, reduction)
        return (logits, all_weights) if return_weights else logits

    def _context(self, in_idx: Tensor, attention_mask: Tensor | None,
                 document_ids: Tensor | None, kv_caches: list[BaseKVCache] | None,
                 context: AttentionContext | None) -> AttentionContext:
        """The pass's context: the caller's, or built here once for every layer."""
        b, num_tokens = in_idx.shape
        past = len(kv_caches[0]) if kv_caches else 0
        packed = context is not None and context.ragged is not None  # its rows are checked
        if past + num_tokens > self.cfg.context_length and not packed:
            raise ValueError(
                f"got {past + num_tokens} tokens but context_length is "
                f"{self.cfg.context_length}; crop to the last {self.cfg.context_length} "
                f"tokens (idx[:, -{self.cfg.context_length}:])"
            )
        if context is None:
            return self.new_context(b, num_tokens, past, attention_mask=attention_mask,
                                    document_ids=document_ids,
                                    uses_cache=kv_caches is not None, device=in_idx.device)
        if attention_mask is not None or document_ids is not None:
            raise ValueError("pass attention_mask and document_ids to AttentionContext.build, "
                             "not beside a context that already holds its masks")
        return context

    def _logits(self, x: Tensor) -> Tensor:
        logits = self.out_head(self.final_norm(x))  # (..., vocab_width)
        if self.cfg.vocab_width > self.cfg.vocab_size:
            # Padding ids are not tokens: no logit for them, so nothing can sample them.
            logits = logits[..., : self.cfg.vocab_size]  # (..., vocab_size)
        return logits

    def _chunked_loss(self, x: Tensor, targets: Tensor, reduction: str, chunk: int) -> Tensor:
        def piece(rows: Tensor, row_targets: Tensor) -> Tensor:
            return cross_entropy(self._logits(rows), row_targets, "none")  # (chunk,)

        rows, flat = x.flatten(0, 1), targets.flatten()  # (b * num_tokens, emb), (b * num_tokens,)
        losses = torch.cat([
            checkpoint(piece, rows[i : i + chunk], flat[i : i + chunk], use_reentrant=False)
            for i in range(0, len(flat), chunk)
        ])
        if reduction == "none":
            return losses.view(targets.shape)
        if reduction == "sum":
            return losses.sum()
        return losses.sum() / (flat != -100).sum()

    def new_context(self, batch: int, num_tokens: int, num_cached: int = 0, *,
                    attention_mask: Tensor | None = None, document_ids: Tensor | None = None,
                    uses_cache: bool = False, positions: Tensor | None = None,
                    ragged: Ragged | None = None, device=None) -> AttentionContext:
        """The AttentionContext of one forward pass with this model's attention settings
        (window, position scheme, soft-cap); forward builds it, and so does the engine for
        a step."""
        return AttentionContext.build(
            batch, num_tokens, num_cached, settings=self.attention_settings,
            attention_mask=attention_mask, document_ids=document_ids, uses_cache=uses_cache,
            positions=positions, ragged=ragged, device=device)

    def new_kv_caches(self) -> list[KVCache | DeltaNetState]:
        """Empty caches, one per layer, for `forward(..., kv_caches=...)`: a KVCache per
        attention layer (a windowed one's holds only its window: `WindowKVCache`), a
        DeltaNetState (fixed size) per Gated DeltaNet layer."""
        return [self._new_cache(block) for block in self.trf_blocks]

    @staticmethod
    def _new_cache(block: nn.Module) -> KVCache | DeltaNetState:
        if isinstance(block, DeltaNetBlock):
            return DeltaNetState()
        window = block.att.settings.window_size
        if window is None or not isinstance(block.att, MultiHeadAttention):
            return KVCache()  # (latent attention masks over every key it is given)
        return WindowKVCache(window)


def cross_entropy(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross-entropy in float32 (or float64), whatever the logits' dtype.

    Args:
        logits: (b, num_tokens, vocab_size), or any (..., vocab_size).
        targets: (b, num_tokens) (the logits' leading shape); -100 positions are ignored.
        reduction: "mean", "sum" or "none" (per position, the targets' shape).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    wide = torch.promote_types(logits.dtype, torch.float32)  # bf16 up, float64 stays
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(wide),  # (positions, vocab_size)
        targets.reshape(-1),
        ignore_index=-100,
        reduction=reduction,
    )
    return loss.view(targets.shape) if reduction == "none" else loss
