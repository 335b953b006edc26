"""The model's architecture as one dataclass that checks itself, the book's GPT-2 presets,
and the modern options (rotary or ALiBi positions, RMSNorm, SwiGLU or ReLU², QK-norm,
no biases, soft-capped scores) beside them. What a layer is made of comes from tables: its
position scheme (gptmini.attention.positions), its token mixer (gptmini.model.mixers) and
its feed-forward (gptmini.model.feedforward), each an object built from this config that
checks the fields it reads."""

from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

from torch import nn

from gptmini.attention import kernels
from gptmini.attention.context import check_window
from gptmini.attention.multihead import check_dropout, check_heads
from gptmini.attention.positions import SCHEMES, PositionScheme
from gptmini.core import model as core
from gptmini.core.layers import ArgumentError
from gptmini.core.positions import RotaryPositions
from gptmini.model.checks import NORMS, ConfigError, is_finite_number
from gptmini.model.feedforward import MLPS, FeedForwardKind
from gptmini.model.mixers import MIXERS, TokenMixer, layer_mixer_names

__all__ = ["GPT_CONFIG_124M", "MIXERS", "MLPS", "NORMS", "PRESETS", "ConfigError", "GPTConfig",
           "is_finite_number", "window_pattern"]

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


def window_pattern(spec: str, window: int, n_layers: int) -> list[int | None]:
    """GPTConfig.layer_windows for `n_layers` layers of `spec` "local:global": that many
    layers with a `window`, then that many global ones (None), repeated and cut at n_layers.
    "5:1" is Gemma 3's (every sixth layer global), "1:1" gpt-oss's alternation (the first
    layer local).

    Raises:
        ValueError: a spec not of two non-negative counts, or a window or layer count below 1.
    """
    try:
        local, global_ = (int(part) for part in spec.split(":"))
    except (AttributeError, ValueError):
        local = global_ = -1
    if local < 0 or global_ < 0 or local + global_ == 0:
        raise ValueError(f"window pattern {spec!r} is invalid: use 'local:global', two "
                         "counts such as '5:1' (Gemma 3) or '1:1' (gpt-oss)")
    for name, value in (("window", window), ("n_layers", n_layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"window_pattern's {name}={value!r} is invalid: use a positive "
                             "integer")
    period = [window] * local + [None] * global_
    return [period[i % len(period)] for i in range(n_layers)]


@dataclass
class GPTConfig(core.GPTConfig):
    """Architecture of a GPT model: the core's fields (gptmini.core.model.GPTConfig, the
    book's names first), some of them with more choices here, and the options beyond the
    core. It checks itself against the tables, not against the core's few parts."""

    n_heads: int = 12
    """Attention (query) heads per layer; must divide emb_dim unless head_dim is set."""
    drop_rate: float = 0.1
    """Dropout on embeddings and residual branches, and on attention weights unless
    attn_drop_rate says otherwise."""
    window_size: int | None = None
    """Sliding-window attention: each token sees this many most recent tokens; None = all."""
    attention_backend: str = "sdpa"
    """Attention kernel: sdpa (fused, flash on GPUs), explicit (the book's), flex
    (FlexAttention, compiled; forward only on CPU), tiled (flash attention from scratch), or
    a kernel class of your own as 'package.module:ClassName' (imported when the model is
    built)."""
    attn_drop_rate: float | None = None
    """Dropout on attention weights; None: drop_rate. flex and tiled train only with 0."""
    padded_vocab_size: int | None = None
    """Width of the embedding and output head, if wider than vocab_size (e.g. 50304, a multiple
    of 64, for faster matmuls); the ids past vocab_size are never predicted. None: vocab_size."""
    position: str = "learned"
    """How positions enter, a name in gptmini.attention.positions.SCHEMES: learned (the
    book's embedding), rope (rotary queries and keys), alibi (per-head distance penalties on
    the scores) or none."""
    norm: str = "layernorm"
    """layernorm (the book's), rmsnorm (no mean, no bias: Llama's) or rmsnorm1p (its gain
    1 + weight, the weight starting at 0: Gemma's)."""
    norm_eps: float = 1e-5
    """The norms' epsilon (GPT-2's 1e-5; Llama checkpoints say theirs, often 1e-6)."""
    mlp: str = "gelu"
    """The feed-forward, a name in gptmini.model.feedforward.MLPS (gelu: the book's 4x GELU;
    swiglu, relu2, geglu: Gemma's, moe: a mixture of experts, oss_moe: gpt-oss's), or your
    own as 'package.module:ClassName'."""
    mlp_hidden_dim: int | None = None
    """The MLP's (each expert's) hidden width; None: the feed-forward's (gelu's 4 * emb_dim)."""
    mlp_options: dict | None = None
    """The feed-forward's own options by name (moe's experts, top_k, ...); None: none."""
    bias: bool = True
    """Biases in the attention's output projection, the MLP and LayerNorm (GPT-2 has them;
    Llama has none). The query/key/value projections follow qkv_bias."""
    attn_softcap: float | None = None
    """Soft-cap the attention scores at this value (cap * tanh(score / cap), Gemma 2's);
    None: no cap."""
    # issue 37, attention sinks and gated attention
    attn_sinks: bool = False
    """A learned logit per head in the softmax's denominator (gpt-oss's attention sinks):
    a head may attend to nothing. Every built-in kernel has them."""
    attn_gate: str = "none"
    """A sigmoid gate from the block's input on each head's output, before out_proj
    (Qwen3-Next's gated attention): none, headwise (one per head) or elementwise (one per
    output channel, Qwen3-Next's)."""
    # Which token mixer each layer has (gptmini.model.mixers).
    layer_kinds: list[str] | None = None
    """Each layer's token mixer, a name in gptmini.model.mixers.MIXERS per layer:
    "attention" (the book's), "mla" (multi-head latent attention) or "deltanet" (Gated
    DeltaNet, gptmini.variants.deltanet: a fixed-size state instead of a KV cache), or one of
    your own as 'package.module:ClassName'. Qwen3-Next's 3:1 is ["deltanet", "deltanet",
    "deltanet", "attention"] repeated; None: attention everywhere."""
    mixer_options: dict | None = None
    """The token mixers' own options, under each mixer's name: {"mla": {"kv_lora_rank":
    64, "q_lora_rank": 96}, "deltanet": {"num_heads": 8}} (each mixer's class lists the keys
    it reads and their defaults); only for mixers some layer has. None: none."""
    # Local/global layer patterns (issue 37): a window per layer.
    layer_windows: list[int | None] | None = None
    """A sliding window per layer, None for a layer that sees every key: Gemma 3's five
    local layers per global one, gpt-oss's alternation (build one with `window_pattern`).
    A windowed layer's KV cache holds only its window. None: every layer has window_size."""
    # The published checkpoints' own shapes (issue 45): Qwen3's and Gemma 3's head size,
    # Llama 3.1's and YaRN's rotary scaling, Gemma 3's blocks.
    head_dim: int | None = None
    """Each attention head's size where it is not emb_dim / n_heads (Qwen3-0.6B: 128 for a
    width of 1024 and 16 heads; Gemma 3: 256); None: emb_dim / n_heads, the book's."""
    rope_scaling: dict | None = None
    """Rotary frequency scaling as Hugging Face's rope_parameters without rope_theta: a
    rope_type of linear, llama3 or yarn and its settings (gptmini.attention.positions.scaling),
    e.g. Llama 3.1's {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
    'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}; None: none."""
    rope_local_theta: float | None = None
    """The rotary base of windowed (local) layers, which rotate without rope_scaling (Gemma
    3's rope_local_base_freq, 10000); None: rope_theta and rope_scaling in every layer."""
    attn_scale_dim: float | None = None
    """Divide the scores by the square root of this instead of the head size's (Gemma's
    query_pre_attn_scalar); None: the head size, the book's."""
    post_norms: bool = False
    """A norm on each sublayer's output too, before it joins the residual stream (Gemma 2
    and 3 norm before and after attention and the MLP)."""
    scale_embeddings: bool = False
    """Multiply the token embeddings by sqrt(emb_dim), Gemma's (a tied head reads them
    unscaled)."""
    logit_softcap: float | None = None
    """Soft-cap the logits at this value (cap * tanh(logits / cap), Gemma 2's
    final_logit_softcapping); None: no cap."""

    def __post_init__(self):
        self._check_shape()
        self._check_attention()
        self._check_blocks()

    def _need(self, ok: bool, field: str, fix: str) -> None:
        if not ok:
            raise ConfigError(field, getattr(self, field), fix)

    def _need_number(self, field: str, ok, fix: str) -> None:
        """A float setting: a finite number (checked first: NaN fails no comparison of
        the kind `not x > 0` and inf passes most) for which `ok` holds."""
        value = getattr(self, field)
        self._need(is_finite_number(value) and ok(value), field, fix)

    @contextmanager
    def _as_field(self, **fields: str):
        """A rule of gptmini.attention run on this config's values: its ArgumentError named
        as the field (`fields` maps an argument to its field; by default the same name)."""
        try:
            yield
        except ArgumentError as err:
            field = fields.get(err.argument, err.argument)
            raise ConfigError(field, getattr(self, field, err.value), err.fix) from None

    def _check_shape(self) -> None:
        """The sizes: counts, heads that divide the width, rates, vocabulary."""
        need = self._need
        for field in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
            value = getattr(self, field)
            need(isinstance(value, int) and value >= 1, field, "use a positive integer")
        with self._as_field(num_heads="n_heads", num_kv_heads="n_kv_heads"):
            check_heads(self.emb_dim, self.n_heads, self.kv_heads,
                        self.head_dim)
        for field in ("drop_rate", "attn_drop_rate"):
            value = getattr(self, field)
            if value is not None or field == "drop_rate":
                need(is_finite_number(value), field, "use a number in [0, 1)")
                with self._as_field(dropout=field):
                    check_dropout(value)
        if self.padded_vocab_size is not None:
            need(isinstance(self.padded_vocab_size, int)
                 and self.padded_vocab_size >= self.vocab_size, "padded_vocab_size",
                 f"use at least vocab_size={self.vocab_size} (e.g. the next multiple of 64), "
                 "or None for no padding")

    def _check_attention(self) -> None:
        """The attention's options, by the attention's own rules: window, kernel, position
        scheme (which checks its own constraints), soft-cap, sinks, gate."""
        need = self._need
        with self._as_field():
            check_window(self.window_size)
        if self.layer_windows is not None:
            self._check_layer_windows()
        need(kernels.is_backend_name(self.attention_backend), "attention_backend",
             f"use one of {', '.join(kernels.KERNELS)}, or a kernel class of your own as "
             "'package.module:ClassName'")
        need(self.position in SCHEMES, "position", f"use one of {', '.join(SCHEMES)}")
        for field in ("rope_scaling", "rope_local_theta"):  # only a scheme that reads them
            need(getattr(self, field) is None or field in SCHEMES[self.position].options,
                 field, f"position {self.position!r} does not read it: use position 'rope', "
                 "or None")
        with self._as_field(head_dim="n_heads" if self.head_dim is None else "head_dim"):
            RotaryPositions.check_theta(self.rope_theta)  # the base's one rule, any scheme
            self.position_scheme()  # checks its own constraints
        for field, fix in (("attn_softcap", "a finite positive cap such as 50, or None"),
                           ("logit_softcap", "a finite positive cap such as 30, or None"),
                           ("attn_scale_dim", "a finite positive number (Gemma's "
                            "query_pre_attn_scalar, such as 256), or None for the head size")):
            if getattr(self, field) is not None:
                self._need_number(field, lambda x: x > 0.0, "use " + fix)
        need(isinstance(self.attn_sinks, bool), "attn_sinks", "use true or false")

    def _check_blocks(self) -> None:
        """Norm, the layers' token mixers and the feed-forward, each of which checks the
        fields it reads as it is built."""
        need = self._need
        need(self.norm in NORMS, "norm", f"use one of {', '.join(NORMS)}")
        for field in ("post_norms", "scale_embeddings"):
            need(isinstance(getattr(self, field), bool), field, "use true or false")
        # An epsilon of 1 or more swamps the variance it is added to: every token's
        # normalized activations shrink toward zero, and the model predicts one distribution.
        self._need_number("norm_eps", lambda x: 0.0 < x < 1.0,
                          "use a small positive number below 1, such as 1e-5")
        if self.mlp_hidden_dim is not None:
            need(isinstance(self.mlp_hidden_dim, int) and self.mlp_hidden_dim >= 1,
                 "mlp_hidden_dim", "use a positive integer, or None for the default")
        need(MLPS.accepts(self.mlp), "mlp", f"use {MLPS.choices()}")
        kinds = self.layer_kinds
        if kinds is not None:
            need(isinstance(kinds, list | tuple) and len(kinds) == self.n_layers
                 and all(MIXERS.accepts(kind) for kind in kinds), "layer_kinds",
                 f"use a list of n_layers={self.n_layers} names, each {MIXERS.choices()} "
                 "(e.g. Qwen3-Next's 3:1: deltanet, deltanet, deltanet, attention), or None "
                 "for attention everywhere")
            self.layer_kinds = list(kinds)  # a tuple (or a YAML sequence) saved as a list
        self._check_options()
        self.mixers()
        self.feed_forward()

    def _check_options(self) -> None:
        """mlp_options and mixer_options (by mixer name): each part's own options, the keys
        its class lists (`options`)."""
        mixers = dict.fromkeys(layer_mixer_names(self))
        self._need(self.mlp_options is None or isinstance(self.mlp_options, dict),
                   "mlp_options", "use a mapping of option names to values, or None")
        self._need(self.mixer_options is None or isinstance(self.mixer_options, dict) and all(
            name in mixers and isinstance(given, dict)
            for name, given in self.mixer_options.items()), "mixer_options", "use a mapping "
            f"from a mixer some layer has (layer_kinds: {', '.join(mixers)}) to a mapping of "
            "its options, or None")
        parts = [("mlp_options", "mlp", MLPS, self.mlp, self.mlp_options, "feed-forward"),
                 *(("mixer_options", "layer_kinds", MIXERS, name, given, "mixer")
                   for name, given in (self.mixer_options or {}).items())]
        for field, named_by, table, name, given, what in parts:
            try:
                known = table[name].options
            except ValueError as err:  # a part of your own that does not import
                raise ConfigError(named_by, getattr(self, named_by), str(err)) from None
            unknown = sorted(set(given or {}) - set(known))
            self._need(not unknown, field, f"the {name} {what} has no option "
                       f"{', '.join(unknown)}; it reads "
                       + (", ".join(known) if known else f"none: leave {field} None"))

    def _check_layer_windows(self) -> None:
        """One window or None per layer, and no window_size beside them."""
        windows = self.layer_windows
        fix = (f"use a list of {self.n_layers} entries (n_layers), each a positive window or "
               f"None for a global layer, e.g. window_pattern('5:1', window=512, n_layers="
               f"{self.n_layers}); or None for window_size in every layer")
        self._need(isinstance(windows, list | tuple) and len(windows) == self.n_layers,
                   "layer_windows", fix)
        try:
            for window in windows:
                check_window(window)  # the window's one rule
        except ArgumentError:
            raise ConfigError("layer_windows", windows, fix) from None
        self.layer_windows = list(windows)  # a tuple (or a YAML sequence) saved as a list
        self._need(self.window_size is None, "window_size",
                   "use None beside layer_windows (which gives every layer its window)")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (0 first), or None: it sees every key."""
        return self.window_size if self.layer_windows is None else self.layer_windows[layer]

    @property
    def kv_window(self) -> int | None:
        """The newest tokens every layer's keys fit in: the widest window, or None where
        some layer sees every key (what a KV cache shared by the layers must hold, such as
        the engine's block tables)."""
        if self.layer_windows is None:
            return self.window_size
        return None if None in self.layer_windows else max(self.layer_windows)

    @property
    def head_size(self) -> int:
        """An attention head's size: head_dim, or emb_dim // n_heads."""
        return self.head_dim or self.emb_dim // self.n_heads

    @property
    def attention_dropout(self) -> float:
        """The attention weights' dropout: attn_drop_rate, or drop_rate where it is None."""
        return self.drop_rate if self.attn_drop_rate is None else self.attn_drop_rate

    def position_scheme(self) -> PositionScheme:
        """A new position scheme of this config (`SCHEMES[position]` for its shape);
        `GPTModel` builds one and hands it to every layer."""
        return SCHEMES[self.position].from_config(self)

    def make_norm(self) -> nn.Module:
        """A new norm over emb_dim: an RMS norm (gptmini.attention.norm's, faster on a CPU
        than torch's), or the core's LayerNorm (the book's)."""
        from gptmini.attention.norm import RMS_NORMS

        if self.norm in RMS_NORMS:
            return RMS_NORMS[self.norm](self.emb_dim, eps=self.norm_eps)
        return super().make_norm()

    def mixers(self) -> list[TokenMixer]:
        """Each layer's token mixer (gptmini.model.mixers), one object per kind, built here
        from its table entry (which checks the fields it reads)."""
        built: dict[str, TokenMixer] = {}
        for name in dict.fromkeys(layer_mixer_names(self)):
            try:
                kind = MIXERS[name]
            except ValueError as err:  # a mixer of your own that does not import
                raise ConfigError("layer_kinds", self.layer_kinds, str(err)) from None
            built[name] = kind.from_config(self)
        return [built[name] for name in layer_mixer_names(self)]

    def feed_forward(self) -> FeedForwardKind:
        """The blocks' feed-forward (gptmini.model.feedforward), built from its table entry
        (which checks the fields it reads)."""
        try:
            kind = MLPS[self.mlp]
        except ValueError as err:  # one of your own that does not import
            raise ConfigError("mlp", self.mlp, str(err)) from None
        return kind.from_config(self)

    @property
    def hidden_dim(self) -> int:
        """The feed-forward's hidden width (see mlp_hidden_dim), as it works it out."""
        return self.feed_forward().hidden_dim

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
