"""The GPT model of the book's chapter 4, built on `MultiHeadAttention`.

Token + position embeddings, dropout, `n_layers` pre-LayerNorm transformer blocks
(attention and a 4x GELU feed-forward, each inside a residual), a final LayerNorm and a
linear output head. Imports only torch, so the model can be lifted into any training loop.
"""

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gptmini.attention import BaseKVCache, KVCache, MultiHeadAttention
from gptmini.context import AttentionContext
from gptmini.kernels import KERNELS

# The book's configuration dictionary, field for field.
GPT_CONFIG_124M = {
    "vocab_size": 50257,
    "context_length": 1024,
    "emb_dim": 768,
    "n_heads": 12,
    "n_layers": 12,
    "drop_rate": 0.1,
    "qkv_bias": False,
}


@dataclass
class GPTConfig:
    """Architecture of a GPT model, with the book's field names."""

    vocab_size: int = 50257
    """Number of token ids the tokenizer has; 50257 for GPT-2's BPE."""
    context_length: int = 1024
    """Most tokens the model sees at once (size of the position embedding)."""
    emb_dim: int = 768
    """Width of the residual stream."""
    n_heads: int = 12
    """Attention (query) heads per layer; must divide emb_dim."""
    n_layers: int = 12
    """Transformer blocks."""
    drop_rate: float = 0.1
    """Dropout on embeddings and residual branches, and on attention weights unless
    attn_drop_rate says otherwise."""
    qkv_bias: bool = False
    """Bias in the query, key and value projections (GPT-2 has it)."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads, 1 multi-query."""
    window_size: int | None = None
    """Sliding-window attention: each token sees this many most recent tokens; None = all."""
    tie_weights: bool = False
    """Share the token embedding with the output head (GPT-2 does; the book does not)."""
    attention_backend: str = "sdpa"
    """Attention kernel: sdpa (fused, flash on GPUs), explicit (the book's), flex
    (FlexAttention, compiled; forward only on CPU) or tiled (flash attention from scratch)."""
    attn_drop_rate: float | None = None
    """Dropout on attention weights; None: drop_rate. flex and tiled train only with 0."""
    padded_vocab_size: int | None = None
    """Width of the embedding and output head, if wider than vocab_size (e.g. 50304, a multiple
    of 64, for faster matmuls); the ids past vocab_size are never predicted. None: vocab_size."""

    def __post_init__(self):
        def need(ok: bool, field: str, fix: str):
            if not ok:
                raise ValueError(f"GPTConfig.{field}={getattr(self, field)!r} is invalid: {fix}")

        for field in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
            value = getattr(self, field)
            need(isinstance(value, int) and value >= 1, field, "use a positive integer")
        need(
            self.emb_dim % self.n_heads == 0,
            "n_heads",
            f"it must divide emb_dim={self.emb_dim}",
        )
        need(0.0 <= self.drop_rate < 1.0, "drop_rate", "use a value in [0, 1)")
        if self.n_kv_heads is not None:
            need(
                isinstance(self.n_kv_heads, int)
                and self.n_kv_heads >= 1
                and self.n_heads % self.n_kv_heads == 0,
                "n_kv_heads",
                f"use a divisor of n_heads={self.n_heads}, or None for one per query head",
            )
        if self.window_size is not None:
            need(
                isinstance(self.window_size, int) and self.window_size >= 1,
                "window_size",
                "use a positive integer, or None for full causal attention",
            )
        need(
            self.attention_backend in KERNELS,
            "attention_backend",
            f"use one of {', '.join(KERNELS)}",
        )
        if self.attn_drop_rate is not None:
            need(0.0 <= self.attn_drop_rate < 1.0, "attn_drop_rate",
                 "use a value in [0, 1), or None for drop_rate")
        if self.padded_vocab_size is not None:
            need(
                isinstance(self.padded_vocab_size, int)
                and self.padded_vocab_size >= self.vocab_size,
                "padded_vocab_size",
                f"use at least vocab_size={self.vocab_size} (e.g. the next multiple of 64), or "
                "None for no padding",
            )

    @property
    def vocab_width(self) -> int:
        """Rows of the token embedding and the output head: padded_vocab_size or vocab_size."""
        return self.padded_vocab_size or self.vocab_size

    def fit_vocab(self, n_vocab: int) -> "GPTConfig":
        """This config for a tokenizer of `n_vocab` ids, with the same weight shapes.

        A vocab_size wider than the tokenizer (checkpoints from before padded_vocab_size
        existed, Hugging Face models with padded embeddings) is padding: it becomes
        padded_vocab_size, and vocab_size the tokenizer's count.

        Raises:
            ValueError: the model has fewer ids than the tokenizer.
        """
        if n_vocab > self.vocab_size:
            raise ValueError(
                f"the model has vocab_size={self.vocab_size} but its tokenizer has {n_vocab} "
                "ids; it was trained with another tokenizer"
            )
        if n_vocab == self.vocab_size:
            return self
        return replace(self, vocab_size=n_vocab, padded_vocab_size=self.vocab_width)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named preset (see `PRESETS`), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return asdict(self)


_GPT2 = {"vocab_size": 50257, "context_length": 1024, "drop_rate": 0.0, "qkv_bias": True,
         "tie_weights": True}
PRESETS: dict[str, dict] = {
    # The book's four GPT-2 sizes (named by OpenAI's parameter counts).
    "gpt2-124m": {**_GPT2, "emb_dim": 768, "n_layers": 12, "n_heads": 12},
    "gpt2-355m": {**_GPT2, "emb_dim": 1024, "n_layers": 24, "n_heads": 16},
    "gpt2-774m": {**_GPT2, "emb_dim": 1280, "n_layers": 36, "n_heads": 20},
    "gpt2-1558m": {**_GPT2, "emb_dim": 1600, "n_layers": 48, "n_heads": 25},
    # Sizes that train on a laptop CPU in minutes.
    "cpu-tiny": {"vocab_size": 50257, "context_length": 64, "emb_dim": 64, "n_layers": 2,
                 "n_heads": 2, "drop_rate": 0.0, "tie_weights": True},
    "cpu-small": {"vocab_size": 50257, "context_length": 128, "emb_dim": 256, "n_layers": 4,
                  "n_heads": 4, "drop_rate": 0.1, "tie_weights": True},
}


class FeedForward(nn.Module):
    """Position-wise MLP: emb_dim -> 4 * emb_dim -> emb_dim with GELU (tanh approximation)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, 4 * cfg.emb_dim),
            nn.GELU(approximate="tanh"),  # the book's and GPT-2's GELU
            nn.Linear(4 * cfg.emb_dim, cfg.emb_dim),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + att(norm1(x)), then x + ff(norm2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.att = MultiHeadAttention(
            d_in=cfg.emb_dim,
            d_out=cfg.emb_dim,
            context_length=cfg.context_length,
            dropout=cfg.drop_rate if cfg.attn_drop_rate is None else cfg.attn_drop_rate,
            num_heads=cfg.n_heads,
            qkv_bias=cfg.qkv_bias,
            num_kv_heads=cfg.n_kv_heads,
            window_size=cfg.window_size,
            backend=cfg.attention_backend,
        )
        self.ff = FeedForward(cfg)
        self.norm1 = nn.LayerNorm(cfg.emb_dim, eps=1e-5)
        self.norm2 = nn.LayerNorm(cfg.emb_dim, eps=1e-5)
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
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = nn.LayerNorm(cfg.emb_dim, eps=1e-5)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_width, bias=False)
        self.apply(self._init_weights)
        # GPT-2 scales the projections that write into the residual stream by
        # 1/sqrt(2 * n_layers), so the stream's variance does not grow with depth.
        for block in self.trf_blocks:
            for proj in (block.att.out_proj, block.ff.layers[2]):
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

    def forward(
        self,
        in_idx: Tensor,
        attention_mask: Tensor | None = None,
        *,
        targets: Tensor | None = None,
        reduction: str = "mean",
        loss_chunk_size: int | None = None,
        logits_to_keep: int | None = None,
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
                head is the largest matmul of a small GPT; generation needs one position).
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
        b, num_tokens = in_idx.shape
        past = len(kv_caches[0]) if kv_caches else 0
        if past + num_tokens > self.cfg.context_length:
            raise ValueError(
                f"got {past + num_tokens} tokens but context_length is "
                f"{self.cfg.context_length}; crop to the last {self.cfg.context_length} "
                f"tokens (idx[:, -{self.cfg.context_length}:])"
            )
        if targets is not None and (return_weights or logits_to_keep is not None):
            raise ValueError("with targets forward returns the loss; pass targets alone, or "
                             "ask for logits (logits_to_keep, return_weights) without them")
        if context is None:
            context = AttentionContext.build(
                b, num_tokens, past, causal=True, window_size=self.cfg.window_size,
                attention_mask=attention_mask, document_ids=document_ids,
                uses_cache=kv_caches is not None, device=in_idx.device)
        elif attention_mask is not None or document_ids is not None:
            raise ValueError("pass attention_mask and document_ids to AttentionContext.build, "
                             "not beside a context that already holds its masks")
        positions = context.positions  # (b, num_tokens)
        if context.rows_alike:
            positions = positions[:1]  # one lookup broadcast over the batch, as in the book
        # (b, num_tokens, emb_dim): each token's embedding plus its position's
        x = self.drop_emb(self.tok_emb(in_idx) + self.pos_emb(positions))

        all_weights = []
        for i, block in enumerate(self.trf_blocks):
            cache = kv_caches[i] if kv_caches else None
            x = block(x, context, cache, return_weights)
            if return_weights:
                x, weights = x
                all_weights.append(weights)
        if targets is not None and loss_chunk_size:
            return self._chunked_loss(x, targets, reduction, loss_chunk_size)
        if logits_to_keep is not None:
            x = x[:, -logits_to_keep:, :]  # (b, logits_to_keep, emb)
        logits = self._logits(x)  # (b, num_tokens, vocab_size)
        if targets is not None:
            return cross_entropy(logits, targets, reduction)
        return (logits, all_weights) if return_weights else logits

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

    def new_kv_caches(self) -> list[KVCache]:
        """Empty caches, one per layer, for `forward(..., kv_caches=...)`."""
        return [KVCache() for _ in self.trf_blocks]


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
