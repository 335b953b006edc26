"""Token mixers as a table: what a layer mixes its tokens with, one object per kind, built
once from the config, which the model, the engine, generation, FLOP counts and conversion
ask instead of branching on a name.

    attention   the book's MultiHeadAttention with its options (`Attention`, here)
    mla         multi-head latent attention, DeepSeek's (gptmini.variants.latent)
    deltanet    Gated DeltaNet, Qwen3-Next's linear attention (gptmini.variants.deltanet)

GPTConfig.layer_kinds names each layer's (None: attention everywhere), and
GPTConfig.mixer_options holds a mixer's own options under its name ({"mla": {"kv_lora_rank":
64}}). A variant's entry is its import path, imported when a
config names it, so `from gptmini.model import GPTModel` never loads it. A new one is its
own file and one entry here; one of your own needs no entry: name its `TokenMixer` by
import path 'package.module:ClassName' in layer_kinds. Its module is called by the block as

    module(x, context=context, kv_cache=cache, return_weights=flag) -> out, or (out, weights)

with x (b, num_tokens, emb_dim), the pass's AttentionContext, and `aux_losses=` if its
`aux_loss` is True.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from gptmini.attention import MultiHeadAttention
from gptmini.attention.positions import PositionScheme
from gptmini.attention.table import Table
from gptmini.model.checks import NORMS, ConfigError

__all__ = ["MIXERS", "Attention", "TokenMixer", "layer_mixer_names"]

Config = Any
"""A GPTConfig (gptmini.model.config imports this module, so it is not imported here)."""


class TokenMixer:
    """What the model, the engine, generation, FLOP counts and conversion ask of a layer's
    token mixer; each built-in answers for itself. Write one as a dataclass built by
    `from_config`, which checks the config fields it reads (raising ConfigError)."""

    title: ClassVar[str] = "token mixer"
    """How messages name its layers ("Gated DeltaNet")."""
    options: ClassVar[tuple[str, ...]] = ()
    """The keys it reads from GPTConfig.mixer_options under its name (the config refuses
    any other)."""
    has_weights: ClassVar[bool] = True
    """Its module computes attention weights (forward's return_weights, attention maps)."""
    pageable: ClassVar[bool] = True
    """The engine can keep its cache in paged blocks of per-head keys and values."""
    rolls: ClassVar[bool] = True
    """Its cache may drop its oldest tokens (generation's slide='roll')."""
    aux_loss: ClassVar[bool] = False
    """Its module takes `aux_losses=`, this pass's auxiliary losses (None: nobody asked),
    and adds its own, weighted, with gptmini.model.add_aux_loss; `lm_loss(...,
    aux_losses=parts)` hands them to the task, which adds them to the loss."""
    hf_layout: ClassVar[str | None] = None
    """The Hugging Face model_type a model of it exports as (gptmini.convert), or None: the
    frame's (GPT-2's or Llama's)."""

    @classmethod
    def from_config(cls, cfg: Config) -> "TokenMixer":
        """This mixer for `cfg`, its own fields checked."""
        raise NotImplementedError

    @classmethod
    def options_of(cls, cfg: Config) -> dict:
        """Its own options from cfg.mixer_options (under whichever name the layers give it),
        or {}."""
        names = [name for name in dict.fromkeys(layer_mixer_names(cfg)) if MIXERS[name] is cls]
        given = cfg.mixer_options or {}
        return dict(next((given[name] for name in names if name in given), None) or {})

    def make_module(self, layer: int, position_scheme: PositionScheme) -> nn.Module:
        """A new module for layer `layer` (0 first), with the model's position scheme."""
        raise NotImplementedError

    def new_cache(self, module: nn.Module) -> object:
        """An empty cache (or state) for `module`, as forward's kv_caches take it."""
        from gptmini.attention.kv_cache import KVCache  # (loaded when generation asks)

        return KVCache()

    def flops_per_token(self, layer: int, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward) of layer `layer`, over windows of
        `seq_len` tokens (gptmini.model.flops says how they are counted)."""
        raise NotImplementedError

    def residual_weights(self, module: nn.Module) -> list[nn.Parameter]:
        """The weights that write into the residual stream (GPT-2 scales their init)."""
        return [module.out_proj.weight]


@dataclass(frozen=True)
class Attention(TokenMixer):
    """The book's MultiHeadAttention with GPTConfig's attention options: grouped-query heads,
    a window per layer, QK-norm, soft-capping, sinks, an output gate, the kernel."""

    title: ClassVar[str] = "attention"
    cfg: Config

    @classmethod
    def from_config(cls, cfg: Config) -> "Attention":
        """Its options are GPTConfig's own fields, checked there; the gate's here, where its
        table loads with the option that uses it."""
        if cfg.attn_gate != "none":
            from gptmini.attention.gate import GATES

            if cfg.attn_gate not in GATES:
                raise ConfigError("attn_gate", cfg.attn_gate, f"use one of {', '.join(GATES)}")
        return cls(cfg)

    def make_module(self, layer: int, position_scheme: PositionScheme) -> MultiHeadAttention:
        cfg = self.cfg
        return MultiHeadAttention(
            d_in=cfg.emb_dim,
            d_out=cfg.emb_dim,
            context_length=cfg.context_length,
            dropout=cfg.attention_dropout,
            num_heads=cfg.n_heads,
            qkv_bias=cfg.qkv_bias,
            num_kv_heads=cfg.n_kv_heads,
            window_size=cfg.window_of(layer),
            backend=cfg.attention_backend,
            position_scheme=position_scheme,
            qk_norm=cfg.qk_norm and NORMS[cfg.norm],  # the RMS norm of the model's kind
            out_bias=cfg.bias,
            softcap=cfg.attn_softcap,
            sinks=cfg.attn_sinks,
            gate=cfg.attn_gate,
            head_dim=cfg.head_dim,
            scale=None if cfg.attn_scale_dim is None else cfg.attn_scale_dim ** -0.5,
        )

    def new_cache(self, module: MultiHeadAttention) -> object:
        window = module.settings.window_size  # a windowed layer's cache holds its window only
        if window is None:
            return super().new_cache(module)
        from gptmini.attention.window_cache import WindowKVCache  # (loaded with a window)

        return WindowKVCache(window)

    def flops_per_token(self, layer: int, seq_len: int) -> float:
        """6 * N for W_query (d x d), W_key and W_value (d x kv_dim each), out_proj (d x d)
        and the gate's W_gate (d x d elementwise, d x H headwise); then per token, each of H
        heads scores T keys (2 * T * head_dim) and mixes T values (2 * T * head_dim)
        forward: 4 * T * d, times 3 = 12 * T * d; with a head_dim of their own, the heads'
        width H * head_dim in place of d in all but the input's side."""
        cfg = self.cfg
        d, inner = cfg.emb_dim, cfg.n_heads * cfg.head_size
        kv_dim = cfg.head_size * cfg.kv_heads
        gate = {"none": 0, "headwise": cfg.n_heads, "elementwise": inner}[cfg.attn_gate]
        weights = d * inner + 2 * d * kv_dim + inner * d + d * gate
        return 6 * weights + 12 * seq_len * inner


MIXERS = Table("token mixer", {
    "attention": Attention,
    "mla": "gptmini.variants.latent:LatentAttention",
    "deltanet": "gptmini.variants.deltanet:DeltaNet",
})
"""Every token mixer by the name GPTConfig.layer_kinds gives it (read-only)."""


def layer_mixer_names(cfg: Config) -> list[str]:
    """Each layer's mixer name: cfg.layer_kinds, or attention everywhere."""
    return list(cfg.layer_kinds or ["attention"] * cfg.n_layers)
