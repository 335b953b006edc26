"""The GPT of the book's chapter 4, with the modern parts the default run uses: token (and
learned position) embeddings, `n_layers` pre-norm blocks (attention and a feed-forward,
each inside a residual), a final norm and a linear head; `GPTConfig` swaps in Qwen3's
blocks (rotary positions, RMSNorm, SwiGLU, QK-norm, grouped-query heads, no biases).
Built in the book's order with PyTorch's default initialisation, so
`torch.manual_seed(123); GPTModel(GPT_CONFIG_124M)` is the book's model; a training run
starts from GPT-2's initialisation instead (gptmini.model.init_gpt2_weights).
"""

from dataclasses import asdict, dataclass

from torch import Tensor, nn

from gptmini.core.attention import (
    AttentionContext,
    BaseKVCache,
    KVCache,
    MultiHeadAttention,
    check_dropout,
    check_heads,
)
from gptmini.core.kernels import KERNELS
from gptmini.core.layers import ArgumentError, FeedForward, SwiGLU
from gptmini.core.positions import LearnedPositions, NoPositions, RotaryPositions

__all__ = ["GPT_CONFIG_124M", "ConfigError", "GPTConfig", "GPTModel", "TransformerBlock"]

# The book's configuration dictionary, field for field.
GPT_CONFIG_124M = {"vocab_size": 50257, "context_length": 1024, "emb_dim": 768, "n_heads": 12,
                   "n_layers": 12, "drop_rate": 0.1, "qkv_bias": False}

POSITIONS = {"learned": LearnedPositions, "rope": RotaryPositions, "none": NoPositions}
NORMS = {"layernorm": lambda cfg: nn.LayerNorm(cfg.emb_dim, eps=cfg.norm_eps, bias=cfg.bias),
         "rmsnorm": lambda cfg: nn.RMSNorm(cfg.emb_dim, eps=cfg.norm_eps)}
MLPS = {"gelu": (FeedForward, lambda emb_dim: 4 * emb_dim),
        "swiglu": (SwiGLU, lambda emb_dim: -(-8 * emb_dim // 3 // 64) * 64)}
"""The core's parts by their config names (a feed-forward with its default width)."""


class ConfigError(ValueError):
    """A GPTConfig field refused: `field`, its `value` and the `fix`, so that a command can
    name its own flag for it (`for_flag`)."""

    def __init__(self, field: str, value: object, fix: str):
        super().__init__(f"GPTConfig.{field}={value!r} is invalid: {fix}")
        self.field, self.value, self.fix = field, value, fix

    def for_flag(self, prefix: str = "--model.") -> str:
        """The message with the field named as the command line's flag."""
        return f"{prefix}{self.field} {self.value!r} is invalid: {self.fix}"


@dataclass
class GPTConfig:
    """A GPT's architecture, with the book's field names first."""

    vocab_size: int = 50257
    """Token ids the tokenizer has; 50257 for GPT-2's BPE."""
    context_length: int = 1024
    """Most tokens the model sees at once."""
    emb_dim: int = 768
    """Width of the residual stream."""
    n_heads: int = 12
    """Attention (query) heads per layer."""
    n_layers: int = 12
    """Transformer blocks."""
    drop_rate: float = 0.1
    """Dropout on embeddings, residual branches and attention weights."""
    qkv_bias: bool = False
    """Bias in the query, key and value projections (GPT-2 has it)."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: n_heads, 1: multi-query."""
    tie_weights: bool = False
    """Share the token embedding with the output head (GPT-2 does; the book does not)."""
    attention_backend: str = "sdpa"
    """The kernel: sdpa (fused; flash on GPUs) or explicit (the book's)."""
    position: str = "learned"
    """learned (the book's embedding), rope (rotary queries and keys) or none."""
    rope_theta: float = 10000.0
    """Rotary base: frequency i of a head is rope_theta ** (-2i / head_dim)."""
    norm: str = "layernorm"
    """layernorm (the book's) or rmsnorm (no mean, no bias: Llama's)."""
    norm_eps: float = 1e-5
    """The norms' epsilon."""
    mlp: str = "gelu"
    """gelu (the book's 4x GELU) or swiglu (Llama's gated SiLU, 8/3x, a multiple of 64)."""
    mlp_hidden_dim: int | None = None
    """The feed-forward's hidden width; None: its default."""
    qk_norm: bool = False
    """RMSNorm each head's queries and keys before attending (Qwen3, OLMo 2)."""
    bias: bool = True
    """Biases in out_proj, the feed-forward and LayerNorm (GPT-2's; Llama has none)."""

    def __post_init__(self):
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
            value = getattr(self, name)
            self._need(isinstance(value, int) and value >= 1, name, "use a positive integer")
        for name, table in (("attention_backend", KERNELS), ("position", POSITIONS),
                            ("norm", NORMS), ("mlp", MLPS)):
            self._need(getattr(self, name) in table, name, f"use one of {', '.join(table)}")
        try:
            check_heads(self.emb_dim, self.n_heads, self.kv_heads)
            check_dropout(self.drop_rate)
            self.position_scheme()
        except ArgumentError as err:
            field = {"num_heads": "n_heads", "num_kv_heads": "n_kv_heads", "head_dim": "n_heads",
                     "dropout": "drop_rate"}.get(err.argument, err.argument)
            raise ConfigError(field, getattr(self, field), err.fix) from None
        self._need(0.0 < self.norm_eps < 1.0, "norm_eps", "use a small positive number, "
                   "such as 1e-5")

    def _need(self, ok: bool, field: str, fix: str) -> None:
        if not ok:
            raise ConfigError(field, getattr(self, field), fix)

    @property
    def head_size(self) -> int:
        return self.emb_dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads where it is None."""
        return self.n_kv_heads or self.n_heads

    @property
    def vocab_width(self) -> int:
        """Rows of the token embedding and the output head."""
        return self.vocab_size

    def position_scheme(self):
        """A new position scheme of this config, which the model hands every layer."""
        return POSITIONS[self.position].from_config(self)

    def make_norm(self) -> nn.Module:
        """A new norm over emb_dim (LayerNorm's bias is cfg.bias)."""
        return NORMS[self.norm](self)

    @property
    def hidden_dim(self) -> int:
        """The feed-forward's hidden width: mlp_hidden_dim, or its kind's default."""
        return self.mlp_hidden_dim or MLPS[self.mlp][1](self.emb_dim)

    def to_dict(self) -> dict:
        return asdict(self)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + att(norm1(x)), then x + ff(norm2(x))."""

    def __init__(self, cfg: GPTConfig, position_scheme=None):
        super().__init__()
        self.att = MultiHeadAttention(
            d_in=cfg.emb_dim, d_out=cfg.emb_dim, context_length=cfg.context_length,
            dropout=cfg.drop_rate, num_heads=cfg.n_heads, qkv_bias=cfg.qkv_bias,
            num_kv_heads=cfg.n_kv_heads, backend=cfg.attention_backend,
            position_scheme=position_scheme, qk_norm=cfg.qk_norm, out_bias=cfg.bias)
        self.ff = MLPS[cfg.mlp][0](cfg.emb_dim, cfg.hidden_dim, bias=cfg.bias)
        self.norm1, self.norm2 = cfg.make_norm(), cfg.make_norm()
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x: Tensor, context: AttentionContext | None = None,
                kv_cache: BaseKVCache | None = None) -> Tensor:
        """x (b, num_tokens, emb_dim) through the block, with the pass's context."""
        x = x + self.drop_shortcut(self.att(self.norm1(x), context=context, kv_cache=kv_cache))
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


class GPTModel(nn.Module):
    """A decoder-only GPT: `model(in_idx)` -> logits (b, num_tokens, vocab_size).

    Its hooks, for a model built from more tables (gptmini.model): `make_blocks`, `embed`,
    `logits` and `residual_weights`, and the config's `position_scheme()`, `make_norm()`
    and `vocab_width`.
    """

    config_class = GPTConfig  # what a dict given as cfg becomes (the book passes its dict)
    context_class = AttentionContext

    def __init__(self, cfg: GPTConfig | dict):
        super().__init__()
        self.cfg = cfg = self.config_class(**cfg) if isinstance(cfg, dict) else cfg
        self.tok_emb = nn.Embedding(cfg.vocab_width, cfg.emb_dim)
        self.position_scheme = cfg.position_scheme()  # one, shared by every layer
        pos_emb = self.position_scheme.make_embedding()
        if pos_emb is not None:  # under the book's name, which its state dicts use
            self.pos_emb = pos_emb
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList(self.make_blocks(cfg))
        self.final_norm = cfg.make_norm()
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_width, bias=False)
        if cfg.tie_weights:
            self.out_head.weight = self.tok_emb.weight
        self.register_load_state_dict_pre_hook(_rename_book_norms)

    def make_blocks(self, cfg: GPTConfig) -> list[nn.Module]:
        return [TransformerBlock(cfg, self.position_scheme) for _ in range(cfg.n_layers)]

    @property
    def attention_settings(self):
        """What the pass's context is built with: the attention layers' settings."""
        return self.trf_blocks[0].att.settings

    def forward(self, in_idx: Tensor, attention_mask: Tensor | None = None, *,
                kv_caches: list[BaseKVCache] | None = None) -> Tensor:
        """Next-token logits (b, num_tokens, vocab_size) for token ids (b, num_tokens);
        `attention_mask` (b, num_keys) is 1 at real tokens and 0 at padding (positions count
        from each row's first real token), `kv_caches` one cache per layer."""
        b, num_tokens = in_idx.shape
        past = len(kv_caches[0]) if kv_caches else 0
        self.check_length(past + num_tokens)
        # one context for every layer: positions, the mask and its forms, made once
        context = self.new_context(b, num_tokens, past, attention_mask=attention_mask,
                                   uses_cache=kv_caches is not None, device=in_idx.device)
        x = self.embed(in_idx, context)  # (b, num_tokens, emb_dim)
        for i, block in enumerate(self.trf_blocks):
            x = block(x, context, kv_caches[i] if kv_caches else None)
        return self.logits(x)

    def check_length(self, num_keys: int) -> None:
        """Raises ValueError, saying how to crop, past the context."""
        if num_keys > self.cfg.context_length:
            raise ValueError(f"got {num_keys} tokens but context_length is "
                             f"{self.cfg.context_length}; crop to the last "
                             f"{self.cfg.context_length} tokens "
                             f"(idx[:, -{self.cfg.context_length}:])")

    def new_context(self, batch: int, num_tokens: int, num_cached: int = 0, **options
                    ) -> AttentionContext:
        """The AttentionContext of one forward pass with the model's attention settings
        (`options`: AttentionContext.build's)."""
        return self.context_class.build(batch, num_tokens, num_cached,
                                        settings=self.attention_settings, **options)

    def embed(self, in_idx: Tensor, context: AttentionContext) -> Tensor:
        """(b, num_tokens) ids -> (b, num_tokens, emb_dim), positions added as the scheme
        adds them, then dropout."""
        return self.drop_emb(self.position_scheme.embed(self.tok_emb(in_idx), context))

    def logits(self, x: Tensor) -> Tensor:
        """The head on the last block's output: (..., emb_dim) -> (..., vocab_size)."""
        return self.out_head(self.final_norm(x))

    def residual_weights(self) -> list[nn.Parameter]:
        """The weights that write into the residual stream (GPT-2 scales their init)."""
        return [w for block in self.trf_blocks
                for w in (block.att.out_proj.weight, block.ff.proj_out.weight)]

    def new_kv_caches(self) -> list[BaseKVCache]:
        """Empty caches, one per layer, for `forward(..., kv_caches=...)`."""
        return [KVCache() for _ in self.trf_blocks]


def _rename_book_norms(module, state_dict, prefix, *args):
    """Load the book's chapter 4/5 state dicts: its LayerNorm names its parameters `scale`
    and `shift` where nn.LayerNorm has `weight` and `bias` (the attention's `mask` buffers
    are dropped by MultiHeadAttention's own hook)."""
    for key in [k for k in state_dict if k.startswith(prefix) and "norm" in k]:
        for book, ours in ((".scale", ".weight"), (".shift", ".bias")):
            if key.endswith(book):
                state_dict[key.removesuffix(book) + ours] = state_dict.pop(key)
