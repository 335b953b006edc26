"""What one forward pass attends with, built once and read by every layer.

`GPTModel.forward` (or the engine, for one of its steps) builds one `AttentionContext` and
hands it to every block, as torchtitan builds its masks once per batch and nano-vllm's
model runner builds one context per step. It is built with the layers' `AttentionSettings`
(causal, window, position scheme, soft-cap: the same for every layer) and holds:

    positions   (b, num_tokens): where each new token sits in its sequence, counted from
                its row's first real token (padding) or its document's first token
    mask        the mask function of gptmini.attention.masks for this call, or None (all keys)
    score_mod   the score modifier (the position scheme's, such as ALiBi; soft-capping), or
                None

and makes the mask's per-kernel forms lazily, once, for every layer to share:

    dense()          (b, 1, num_tokens, num_keys) booleans: the explicit path and SDPA
    float_mask(...)  an additive modifier and the mask as one float bias, for SDPA
    empty_rows()     (b, num_tokens): queries the mask leaves no key (left padding)
    once(key, make)  anything else every layer shares: a rotary scheme's angles, flex's
                     BlockMask, the tiled kernel's plan (each kernel makes its own form)

Positions are absolute within a call: the queries are the last num_tokens of num_keys
positions (the keys before them are in a KV cache).

An engine step packs the new tokens of many sequences into one row, so that every linear
layer runs on exactly the tokens there are; its context carries a `Ragged` layout, through
which attention reads them one sequence per row (see `Ragged`).
"""

from dataclasses import dataclass, field, fields, replace
from typing import Protocol

import torch
from torch import Tensor

from gptmini.attention import masks
from gptmini.attention.errors import ArgumentError
from gptmini.attention.positions import NoPositions, PositionScheme

__all__ = ["AttentionContext", "AttentionSettings", "Ragged", "check_window", "layer_context",
           "positions_in_documents"]


@dataclass(frozen=True)
class AttentionSettings:
    """What a layer attends with, the same for every layer of a model: a context is built
    with them, and a layer refuses a context built with other settings."""

    causal: bool = True
    """A query sees itself and earlier keys only (False: both ways, as an encoder)."""
    window_size: int | None = None
    """Query i sees keys i - window_size + 1 ... i (non-causal: less than this far either
    side); None: every key."""
    position_scheme: PositionScheme = field(default_factory=NoPositions)
    """How positions enter (gptmini.attention.positions): its rotation and score modifier."""
    softcap: float | None = None
    """Soft-cap the scaled scores at this value (cap * tanh(score / cap)); None: no cap."""

    def __post_init__(self):
        check_window(self.window_size)

    def __str__(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))

    def mask(self, num_tokens: int, num_keys: int, attention_mask: Tensor | None,
             document_ids: Tensor | None) -> masks.MaskMod | None:
        """The mask of a call over `num_tokens` new of `num_keys` keys, or None (all)."""
        parts = []
        if self.causal and not (num_tokens == 1 and num_keys >= 1):
            parts.append(masks.causal)  # a single newest query sees every earlier key anyway
        if self.window_size is not None and num_keys > self.window_size:  # else none is farther
            parts.append(masks.sliding_window(self.window_size))
        if attention_mask is not None:
            parts.append(masks.padding(attention_mask))
        if document_ids is not None:
            parts.append(masks.document(document_ids))
        return None if not parts else parts[0] if len(parts) == 1 else masks.and_masks(*parts)

    def score_mod(self, device: torch.device | str | None) -> masks.ScoreMod | None:
        """The position scheme's modifier, then the soft-cap, or None."""
        mods = []
        scheme_mod = self.position_scheme.score_mod(device)
        if scheme_mod is not None:
            mods.append(scheme_mod)
        if self.softcap is not None:
            mods.append(masks.softcap(self.softcap))
        return None if not mods else mods[0] if len(mods) == 1 else masks.chain(*mods)


def check_window(window: int | None) -> None:
    """A sliding window's rule: a positive number of keys, or None for all of them.

    Raises:
        ArgumentError: naming window_size.
    """
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                               or window < 1):
        raise ArgumentError("window_size", window, "use a positive integer, or None for every "
                            "key (full causal attention)")


class AttentionContext:
    """One forward pass's positions and mask (see the module docstring).

    Build it with `AttentionContext.build`, which works out the positions; the forms are
    computed on first use and kept. A context belongs to one forward pass: layers share it,
    threads and steps do not.

    Args:
        positions: (b, num_tokens) the new tokens' positions.
        num_keys: cached tokens + new tokens.
        settings: the layers' settings (mask, position scheme, soft-cap).
        attention_mask: optional (b, num_keys), 1 at real tokens and 0 at padding.
        document_ids: optional (b, num_keys), the document of each token.
        uses_cache: keys before the new tokens come from a KV cache (even empty).
        rows_alike: every row has the same positions.
        ragged: several sequences packed in one row (an engine step; see `Ragged`).
    """

    def __init__(self, positions: Tensor, num_keys: int, settings: AttentionSettings, *,
                 attention_mask: Tensor | None = None, document_ids: Tensor | None = None,
                 uses_cache: bool = False, rows_alike: bool = False,
                 ragged: "Ragged | None" = None):
        self.positions, self.num_keys, self.settings = positions, num_keys, settings
        self.batch, self.num_tokens = positions.shape
        self.device = positions.device
        self.mask = settings.mask(self.num_tokens, num_keys, attention_mask, document_ids)
        self.score_mod = settings.score_mod(self.device)
        self.padded = attention_mask is not None  # only padding can leave a query no key
        # as given, for layers that read them as tensors (Gated DeltaNet zeroes padding)
        self.attention_mask, self.document_ids = attention_mask, document_ids
        # the mask reads padding or document tensors
        self.data_dependent = attention_mask is not None or document_ids is not None
        self.uses_cache, self.rows_alike, self.ragged = uses_cache, rows_alike, ragged
        self._per_key = (attention_mask, document_ids)  # for a layer's own view (for_layer)
        self._forms: dict = {}

    @classmethod
    def build(cls, batch: int, num_tokens: int, num_cached: int = 0, *,
              settings: AttentionSettings | None = None, attention_mask: Tensor | None = None,
              document_ids: Tensor | None = None, uses_cache: bool = False,
              positions: Tensor | None = None, ragged: "Ragged | None" = None,
              device: torch.device | str | None = None) -> "AttentionContext":
        """The context of a call over `num_tokens` new tokens after `num_cached` cached ones.

        Args:
            batch, num_tokens: the new tokens' shape.
            num_cached: tokens already in the KV cache; num_keys = num_cached + num_tokens.
            settings: the attention's own settings (every layer's, in a model); None: the
                defaults (causal, no window, no positions in attention, no cap).
            attention_mask: optional (b, num_keys), 1 at real tokens and 0 at padding.
            document_ids: optional (b, num_keys), the document of each token.
            uses_cache: a KV cache is in play (even empty, on its first call).
            positions: (b, num_tokens) the new tokens' positions, when they are not their
                places in this call (a cache that dropped its oldest tokens continues from
                the positions it holds); None: worked out from the arguments above.
            ragged: the packed sequences' layout, for an engine step over many sequences
                in one row (batch 1); attention then masks with `ragged.context_for`.
            device: where positions and masks live (default: the masks' tensors' device).

        Raises:
            ValueError: attention_mask, document_ids or positions of the wrong shape.
        """
        num_keys = num_cached + num_tokens
        for name, per_key in (("attention_mask", attention_mask), ("document_ids", document_ids)):
            if per_key is not None and tuple(per_key.shape) != (batch, num_keys):
                raise ValueError(
                    f"{name} must have shape (batch, num_keys) = ({batch}, {num_keys}), got "
                    f"{tuple(per_key.shape)}; with a KV cache it covers cached tokens too"
                )
            if per_key is not None:
                device = per_key.device
        rows_alike = positions is None and attention_mask is None and document_ids is None
        if positions is None:
            positions = _positions(batch, num_tokens, num_cached, attention_mask, document_ids,
                                   device)
        elif tuple(positions.shape) != (batch, num_tokens):
            raise ValueError(f"positions must have shape (batch, num_tokens) = ({batch}, "
                             f"{num_tokens}), got {tuple(positions.shape)}")
        return cls(positions, num_keys, settings or AttentionSettings(),
                   attention_mask=attention_mask, document_ids=document_ids,
                   uses_cache=uses_cache, rows_alike=rows_alike, ragged=ragged)

    def for_layer(self, settings: AttentionSettings, num_keys: int | None = None
                  ) -> "AttentionContext":
        """This pass as a layer with its own window sees it (a model of local and global
        layers, GPTConfig.layer_windows), over only the last `num_keys` keys (a windowed
        layer's KV cache holds only its window); kept for every layer that asks the same.

        Raises:
            ValueError: `settings` differ from this context's in more than the window.
        """
        num_keys = self.num_keys if num_keys is None else num_keys
        if settings == self.settings and num_keys == self.num_keys:
            return self
        if replace(settings, window_size=self.settings.window_size) != self.settings:
            raise ValueError(
                f"the context was built with {self.settings}, but this layer has {settings}; "
                "build it with the layer's settings (settings=layer.settings; "
                "GPTModel.new_context does): layers may differ in their window only")
        if not self.num_tokens <= num_keys <= self.num_keys:
            raise ValueError(f"a layer's view keeps the last num_keys of {self.num_keys} keys "
                             f"and all {self.num_tokens} new ones; got num_keys={num_keys}")

        def view():
            attention_mask, document_ids = (None if t is None else t[:, -num_keys:]
                                            for t in self._per_key)
            return AttentionContext(self.positions, num_keys, settings,
                                    attention_mask=attention_mask, document_ids=document_ids,
                                    uses_cache=self.uses_cache, rows_alike=self.rows_alike,
                                    ragged=self.ragged)

        return self.once(("layer", settings.window_size, num_keys), view)

    @property
    def plain_causal(self) -> bool:
        """Causal over the whole call and nothing else: SDPA's is_causal (flash kernels)."""
        return (self.mask is masks.causal and self.num_tokens == self.num_keys
                and self.score_mod is None)

    def once(self, key, make):
        """`make()`, computed on the first call with this `key` and kept for the pass: what
        every layer shares (a rotary scheme's angles, the mask's forms)."""
        if key not in self._forms:
            self._forms[key] = make()
        return self._forms[key]

    def dense(self) -> Tensor | None:
        """(b, 1, num_tokens, num_keys), True where a query may attend, or None for all.

        A query with no key at all (left padding) is let see every key here, so a softmax
        over it is not NaN; `empty_rows` says which to zero afterwards.
        """
        return self.once("dense", self._dense)

    def _dense(self) -> Tensor | None:
        if self.mask is None:
            return None
        allowed = masks.dense(self.mask, self.batch, self.num_tokens, self.num_keys, self.device)
        if self.padded:
            empty = ~allowed.any(dim=-1)  # (b, 1, num_tokens)
            self._forms["empty_rows"] = empty[:, 0]
            allowed = allowed | empty[..., None]
        return allowed

    def float_mask(self, num_heads: int, dtype: torch.dtype) -> Tensor:
        """An additive score modifier plus the mask as one bias (b, num_heads, num_tokens,
        num_keys): the modifier where a query may attend, -inf where not."""
        def build():
            bias = masks.score_bias(self.score_mod, self.batch, num_heads, self.num_tokens,
                                    self.num_keys, self.device, dtype)
            allowed = self.dense()
            return bias if allowed is None else bias.masked_fill(~allowed, -torch.inf)

        return self.once(("float_mask", num_heads, dtype), build)

    def empty_rows(self) -> Tensor | None:
        """(b, num_tokens): True at queries the mask lets see no key; None if there are none
        by construction (only padding can empty a row: a query always sees itself)."""
        if not self.padded:
            return None
        return self.once("empty_rows", lambda: ~masks.rows_with_keys(
            self.mask, self.batch, self.num_tokens, self.num_keys, self.device))

def layer_context(settings: AttentionSettings, context_length: int, x: Tensor,
                  num_cached: int, *, context: AttentionContext | None, uses_cache: bool,
                  attention_mask: Tensor | None = None, document_ids: Tensor | None = None,
                  positions: Tensor | None = None) -> AttentionContext:
    """What an attention layer attends with in one call: `context` (the forward pass's),
    checked against the call and seen with the layer's own `settings` (its window:
    `AttentionContext.for_layer`), or, without one, a context built here from the arguments.
    MultiHeadAttention and MultiHeadLatentAttention both begin here.

    Args:
        settings: the layer's settings.
        context_length: the most positions the layer may see in one call.
        x: (b, num_tokens, ...) the layer's input: the call's shape and device.
        num_cached: tokens already in the layer's KV cache.
        context: the forward pass's context, or None.
        uses_cache: a KV cache is in play (even empty).
        attention_mask, document_ids, positions: as `AttentionContext.build`'s; only
            without a context (a context holds them already).

    Raises:
        ValueError: without a context, more positions than context_length (the fix: crop
            the input; a pass's context was checked once, where it was built); arguments
            beside a context, or a context of another shape or of other settings than a
            window.
    """
    b, num_tokens = x.shape[:2]
    if context is None:
        if num_cached + num_tokens > context_length:
            raise ValueError(
                f"attention got {num_cached + num_tokens} positions but context_length is "
                f"{context_length}; crop the input to its last {context_length} tokens")
        return AttentionContext.build(
            b, num_tokens, num_cached, settings=settings, attention_mask=attention_mask,
            document_ids=document_ids, uses_cache=uses_cache, positions=positions,
            device=x.device)
    if context.ragged is not None:  # an engine step: its sequences are checked there
        num_cached = context.num_keys - num_tokens
    if attention_mask is not None or document_ids is not None or positions is not None:
        raise ValueError("pass attention_mask, document_ids and positions to "
                         "AttentionContext.build, not beside a context that holds them")
    if (context.batch, context.num_tokens, context.num_keys) != (
            b, num_tokens, num_cached + num_tokens):
        raise ValueError(
            f"the context was built for (batch, num_tokens, num_keys) = ({context.batch}, "
            f"{context.num_tokens}, {context.num_keys}), but this call has ({b}, "
            f"{num_tokens}, {num_cached + num_tokens}); build one context per forward pass")
    if context.settings != settings:  # a layer with its own window, or a mistake
        return context.for_layer(settings)
    return context


class Ragged(Protocol):
    """Sequences packed in one row, as attention reads them: what an engine step's layout
    must offer (the engine's own is `PackedRow`, gptmini/generate/engine/packed.py).

    Linear layers see the packed row (1, total_new); attention lays the packed queries out
    one sequence per row, left-padded to the longest (`unpack`), attends them against each
    sequence's keys (left-padded alike by the KV cache) under a per-sequence context
    (`context_for`: the padding masked, causal, windowed and modified as the layer's own
    attention is), and puts the output back in packed order (`pack`). Where each sequence's
    keys live is the engine's business, not attention's.
    """

    def unpack(self, x: Tensor) -> Tensor:
        """(1, heads, total_new, head_dim) packed -> (num_seqs, heads, longest_new, head_dim)."""
        ...

    def pack(self, x: Tensor) -> Tensor:
        """(num_seqs, heads, longest_new, head_dim) -> (1, heads, total_new, head_dim)."""
        ...

    def context_for(self, settings: AttentionSettings) -> AttentionContext:
        """The per-sequence context as a layer with `settings` (its own window) sees it."""
        ...


def _positions(batch: int, num_tokens: int, num_cached: int, attention_mask: Tensor | None,
               document_ids: Tensor | None, device) -> Tensor:
    """(b, num_tokens) the new tokens' places: counted from each document's start, from each
    row's first real token, or plainly after the cached ones."""
    if document_ids is not None:
        return positions_in_documents(document_ids)[:, -num_tokens:]
    if attention_mask is not None:
        # each token's place among its row's real tokens, so a left-padded prompt is
        # positioned as it would be alone
        positions = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        return positions[:, -num_tokens:]  # (b, num_tokens)
    return torch.arange(num_cached, num_cached + num_tokens, device=device).expand(batch, -1)


def positions_in_documents(document_ids: Tensor) -> Tensor:
    """(b, n): each token's position counted from the first token of its document."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]  # a new document begins
    first = torch.where(starts, index, 0).cummax(dim=1).values  # (b, n) its document's start
    return index - first
