"""The GPT model with every part beyond the core's (gptmini.core.model, the book's chapter 4
GPT and Qwen3's blocks): what a block is made of comes from tables, each an object built
once from the config: the position scheme (gptmini.attention.positions), shared by every
layer, makes the position embedding and rotates or modifies scores; each layer's token
mixer (gptmini.model.mixers) makes its attention (or another mixer) and its cache; the
feed-forward (gptmini.model.feedforward) makes the MLP. Imports only torch, so the model
can be lifted into any loop.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gptmini.attention import AttentionContext, AttentionSettings, BaseKVCache
from gptmini.attention.positions import PositionScheme
from gptmini.core import model as core
from gptmini.model.config import GPTConfig
from gptmini.model.feedforward import FeedForwardKind
from gptmini.model.mixers import TokenMixer

__all__ = ["GPTModel", "TransformerBlock", "add_aux_loss", "cross_entropy", "init_gpt2_weights",
           "lm_loss"]


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: x + att(norm1(x)), then x + ff(norm2(x)); with cfg.post_norms,
    x + post_norm1(att(norm1(x))), then x + post_norm2(ff(norm2(x))). `att` is what the
    layer's token mixer makes (the book's attention by default), `ff` what the feed-forward
    makes. `position_scheme` is the model's, shared by every block (None: a new one of
    cfg's); `layer` is the block's index, which picks its mixer and window; `mixer` and
    `feed_forward` are the model's objects (None: cfg's)."""

    def __init__(self, cfg: GPTConfig, position_scheme: PositionScheme | None = None,
                 layer: int = 0, *, mixer: TokenMixer | None = None,
                 feed_forward: FeedForwardKind | None = None):
        super().__init__()
        mixer = mixer or cfg.mixers()[layer]
        feed_forward = feed_forward or cfg.feed_forward()
        self.att = mixer.make_module(layer, position_scheme or cfg.position_scheme())
        self.ff = feed_forward.make_module()
        self.norm1 = cfg.make_norm()
        self.norm2 = cfg.make_norm()
        self.post_norm1 = cfg.make_norm() if cfg.post_norms else nn.Identity()
        self.post_norm2 = cfg.make_norm() if cfg.post_norms else nn.Identity()
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)
        # which of the two hand in auxiliary losses (fixed here: no branch on data)
        self.att_aux, self.ff_aux = mixer.aux_loss, feed_forward.aux_loss

    def forward(
        self,
        x: Tensor,
        context: AttentionContext | None = None,
        kv_cache: BaseKVCache | None = None,
        return_weights: bool = False,
        aux_losses: dict[str, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """x (b, num_tokens, emb_dim) through the block; `context` is the forward pass's
        (None: the attention builds its own, causal over x); `aux_losses` collects the
        pass's auxiliary losses (see `add_aux_loss`)."""
        extra = {"aux_losses": aux_losses} if self.att_aux else {}
        att = self.att(self.norm1(x), context=context, kv_cache=kv_cache,
                       return_weights=return_weights, **extra)
        weights = None
        if return_weights:
            att, weights = att
        x = x + self.drop_shortcut(self.post_norm1(att))
        extra = {"aux_losses": aux_losses} if self.ff_aux else {}
        x = x + self.drop_shortcut(self.post_norm2(self.ff(self.norm2(x), **extra)))
        return (x, weights) if return_weights else x


class GPTModel(core.GPTModel):
    """The core's GPT (gptmini.core.model) built from the model's tables: each layer's token
    mixer and the feed-forward (gptmini.model.mixers, gptmini.model.feedforward), every
    position scheme and norm, a padded vocabulary, Gemma's embedding scale and logit
    soft-cap; its pass before the head (`hidden_states`, which `lm_loss` below runs),
    attention weights and auxiliary losses. `GPTModel(cfg)` keeps PyTorch's initialisation
    (the book's); `init_gpt2_weights(model)` draws GPT-2's, which a training run starts from."""

    config_class = GPTConfig
    context_class = AttentionContext

    def __init__(self, cfg: GPTConfig | dict):
        super().__init__(cfg)
        cfg = self.cfg
        # Gemma's sqrt(width), a float32 number in the model's dtype as transformers keeps it
        self.register_buffer("emb_scale", torch.tensor(cfg.emb_dim ** 0.5)
                             if cfg.scale_embeddings else None, persistent=False)
        # what contexts are built with: the attention layers' (a model with none builds
        # them for positions, with the settings its attention would have)
        self._settings = next(
            (block.att.settings for block in self.trf_blocks if hasattr(block.att, "settings")),
            AttentionSettings(window_size=cfg.window_size, position_scheme=self.position_scheme,
                              softcap=cfg.attn_softcap))

    def make_blocks(self, cfg: GPTConfig) -> list[nn.Module]:
        self.mixers = cfg.mixers()  # each layer's token mixer: what is asked of a layer
        self.feed_forward = cfg.feed_forward()
        return [TransformerBlock(cfg, self.position_scheme, i, mixer=self.mixers[i],
                                 feed_forward=self.feed_forward) for i in range(cfg.n_layers)]

    @property
    def attention_settings(self) -> AttentionSettings:
        return self._settings

    def residual_weights(self) -> list[nn.Parameter]:
        return [weight for block, mixer in zip(self.trf_blocks, self.mixers, strict=True)
                for weight in (*mixer.residual_weights(block.att),
                               *self.feed_forward.residual_weights(block.ff))]

    def forward(
        self,
        in_idx: Tensor,
        attention_mask: Tensor | None = None,
        *,
        logits_to_keep: int | Tensor | None = None,
        kv_caches: list[BaseKVCache] | None = None,
        document_ids: Tensor | None = None,
        context: AttentionContext | None = None,
        aux_losses: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """Next-token logits (b, num_tokens or logits_to_keep, vocab_size), in the model's
        dtype. The loss is `lm_loss`'s (below); attention weights are `attention_weights`'.

        Args:
            in_idx: (b, num_tokens) token ids.
            attention_mask: optional (b, num_keys) mask, 1 at real tokens and 0 at padding,
                covering cached tokens too. Positions count from each row's first real
                token, so a left-padded prompt is embedded as it would be alone.
            logits_to_keep: compute the logits of the last this many positions only (the
                head is the largest matmul of a small GPT; generation needs one position),
                or of the positions a 1-d index tensor names (an engine step: each
                sequence's last token).
            kv_caches: one KV cache per layer (`KVCache`, or the engine's paged views); new
                keys and values are appended.
            document_ids: (b, num_keys) the document of each token when several are packed
                in one window: no token attends across a document's edge, and positions
                count from each document's first token, as generation counts from a
                prompt's (so a document looks the same wherever the window cut it).
            context: the pass's AttentionContext, if the caller built it (the engine does),
                holding attention_mask and document_ids. None: built here, once.
            aux_losses: a dict that receives the layers' auxiliary losses (hidden_states').
        """
        x = self.hidden_states(in_idx, attention_mask, kv_caches=kv_caches,
                               document_ids=document_ids, context=context,
                               aux_losses=aux_losses)
        if isinstance(logits_to_keep, Tensor):
            x = x[:, logits_to_keep, :]  # (b, len(logits_to_keep), emb)
        elif logits_to_keep is not None:
            x = x[:, -logits_to_keep:, :]  # (b, logits_to_keep, emb)
        return self.logits(x)  # (b, num_tokens, vocab_size)

    def hidden_states(
        self,
        in_idx: Tensor,
        attention_mask: Tensor | None = None,
        *,
        kv_caches: list[BaseKVCache] | None = None,
        document_ids: Tensor | None = None,
        context: AttentionContext | None = None,
        aux_losses: dict[str, Tensor] | None = None,
        weights: list[Tensor] | None = None,
    ) -> Tensor:
        """The last block's output (b, num_tokens, emb_dim): forward's pass without the head.
        `aux_losses`, a dict, receives the layers' auxiliary losses (a mixture of experts'
        load balance), each weighted by its coefficient; `weights`, a list, each layer's
        attention weights (b, n_heads, num_tokens, num_keys), from the explicit path."""
        context = self._context(in_idx, attention_mask, document_ids, kv_caches, context)
        without = [] if weights is None else [i for i, m in enumerate(self.mixers)
                                               if not m.has_weights]
        if without:
            titles = " and ".join(dict.fromkeys(self.mixers[i].title for i in without))
            raise ValueError(f"layers {without} are {titles} layers (cfg.layer_kinds): "
                             "they have no attention weights to return")
        x = self.embed(in_idx, context)  # (b, num_tokens, emb_dim)
        for i, block in enumerate(self.trf_blocks):
            x = block(x, context, kv_caches[i] if kv_caches else None, weights is not None,
                      aux_losses)
            if weights is not None:
                x, layer_weights = x
                weights.append(layer_weights)
        if aux_losses is not None:
            aux_losses.update(self.feed_forward.finish_aux_losses(aux_losses))
        return x

    def attention_weights(self, in_idx: Tensor, attention_mask: Tensor | None = None,
                          **options) -> list[Tensor]:
        """Each layer's attention weights for a pass over `in_idx` (see hidden_states)."""
        weights = []
        self.hidden_states(in_idx, attention_mask, weights=weights, **options)
        return weights

    def _context(self, in_idx: Tensor, attention_mask: Tensor | None,
                 document_ids: Tensor | None, kv_caches: list[BaseKVCache] | None,
                 context: AttentionContext | None) -> AttentionContext:
        """The pass's context: the caller's, or built here once for every layer."""
        b, num_tokens = in_idx.shape
        past = len(kv_caches[0]) if kv_caches else 0
        if context is None or context.ragged is None:  # a packed row's are checked
            self.check_length(past + num_tokens)
        if context is None:
            return self.new_context(b, num_tokens, past, attention_mask=attention_mask,
                                    document_ids=document_ids,
                                    uses_cache=kv_caches is not None, device=in_idx.device)
        if attention_mask is not None or document_ids is not None:
            raise ValueError("pass attention_mask and document_ids to AttentionContext.build, "
                             "not beside a context that already holds its masks")
        return context

    def embed(self, in_idx: Tensor, context: AttentionContext) -> Tensor:
        x = self.tok_emb(in_idx)  # (b, num_tokens, emb_dim)
        if self.emb_scale is not None:
            x = x * self.emb_scale
        return self.drop_emb(self.position_scheme.embed(x, context))

    def logits(self, x: Tensor) -> Tensor:
        """The head, soft-capped if the config says so, padding ids cut off."""
        logits = self.out_head(self.final_norm(x))  # (..., vocab_width)
        if self.cfg.logit_softcap is not None:
            logits = self.cfg.logit_softcap * torch.tanh(logits / self.cfg.logit_softcap)
        if self.cfg.vocab_width > self.cfg.vocab_size:
            # Padding ids are not tokens: no logit for them, so nothing can sample them.
            logits = logits[..., : self.cfg.vocab_size]  # (..., vocab_size)
        return logits

    def new_kv_caches(self) -> list:
        """Empty caches, one per layer, for `forward(..., kv_caches=...)`, as each layer's
        mixer keeps them: a KVCache per attention layer (a windowed one's holds only its
        window: `WindowKVCache`), a DeltaNetState (fixed size) per Gated DeltaNet layer."""
        return [mixer.new_cache(block.att)
                for mixer, block in zip(self.mixers, self.trf_blocks, strict=True)]


def lm_loss(model, inputs: Tensor, targets: Tensor, reduction: str = "mean", *,
            chunk_size: int | None = None, document_ids: Tensor | None = None,
            aux_losses: dict[str, Tensor] | None = None) -> Tensor:
    """The next-token cross-entropy of `model` (a GPTModel) in float32: its logits, or in
    chunks its last hidden states and the head. Compiled as one function (as the training
    tasks do), inductor fuses the head, the float32 upcast and the cross-entropy, with no
    float32 copy of the logits: 1.28x faster in bf16 than a compiled forward whose logits an
    eager cross-entropy reads (`bench/bench_loss.py`, 2-core Xeon).

    Args:
        inputs: (b, num_tokens) token ids.
        targets: (b, num_tokens) the next token at each position; -100 marks a position
            that counts for nothing.
        reduction: "mean" over the counted positions, "sum", or "none" for one loss per
            position (b, num_tokens), 0 where targets are -100.
        chunk_size: run the head and the loss on this many positions at a time and
            recompute them in backward, so the full (b, num_tokens, vocab_size) logits and
            their gradient never exist at once: measured on a CPU, 8 x 1024 positions of
            GPT-2's vocabulary peaked at 1.3 GB instead of 5.3 GB, for 14% more time.
            None: all at once.
        document_ids: forward's, for documents packed in one window.
        aux_losses: a dict that receives the layers' auxiliary losses by name (see
            `add_aux_loss`); the loss returned is the language model's alone.
    """
    if not chunk_size:  # through model(...): its hooks run (FSDP2 gathers its weights)
        logits = model(inputs, document_ids=document_ids, aux_losses=aux_losses)
        return cross_entropy(logits, targets, reduction)
    # (an FSDP2 forward method: gptmini.train.sharding)
    x = model.hidden_states(inputs, document_ids=document_ids, aux_losses=aux_losses)

    def piece(rows: Tensor, row_targets: Tensor) -> Tensor:
        return cross_entropy(model.logits(rows), row_targets, "none")  # (chunk,)

    rows, flat = x.flatten(0, 1), targets.flatten()  # (b * num_tokens, emb), (b * num_tokens,)
    losses = torch.cat([
        checkpoint(piece, rows[i : i + chunk_size], flat[i : i + chunk_size],
                   use_reentrant=False)
        for i in range(0, len(flat), chunk_size)
    ]).view(targets.shape)
    if reduction == "none":
        return losses
    return losses.sum() if reduction == "sum" else losses.sum() / (targets != -100).sum()


def cross_entropy(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross-entropy in float32 (or float64), whatever the logits' dtype: logits
    (..., vocab_size) against targets of their leading shape, as `lm_loss`'s arguments."""
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


def add_aux_loss(aux_losses: dict[str, Tensor] | None, name: str, loss: Tensor) -> None:
    """How a module whose `aux_loss` is True hands the model an auxiliary loss: `loss`, a scalar
    weighted by its coefficient (or statistics its feed-forward's finish_aux_losses makes one),
    summed under `name` over the layers into `aux_losses`; nothing when it is None (not asked)."""
    if aux_losses is not None:
        aux_losses[name] = aux_losses[name] + loss if name in aux_losses else loss


@torch.no_grad()
def init_gpt2_weights(model: core.GPTModel) -> core.GPTModel:
    """GPT-2's initialisation, in place, for a run to start from: every linear and embedding
    weight from N(0, 0.02), biases 0, then `model.residual_weights()` from
    N(0, 0.02 / sqrt(2 * n_layers)), so the residual stream's variance does not grow with
    depth. Modules are visited children first (`nn.Module.apply`), and a tied weight is
    drawn for each module that holds it but keeps its first draw. Returns the model."""
    drawn = set()

    def draw(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            weight = module.weight if module.weight not in drawn else torch.empty_like(
                module.weight)  # (the same numbers drawn as for an untied head)
            nn.init.normal_(weight, mean=0.0, std=0.02)
            drawn.add(module.weight)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    model.apply(draw)
    for weight in model.residual_weights():
        nn.init.normal_(weight, mean=0.0, std=0.02 / math.sqrt(2 * model.cfg.n_layers))
    return model
