"""What one forward pass attends with, beyond the core's (gptmini.core.attention): the
settings' soft-cap, an additive modifier and the mask as one float bias for SDPA, a layer's
own window over the pass, and an engine step's packed rows.

`GPTModel.forward` (or the engine, for one of its steps) builds one `AttentionContext` and
hands it to every block, as torchtitan builds its masks once per batch and nano-vllm's
model runner builds one context per step. Beside the core's forms (`dense()`,
`empty_rows()`, `once(key, make)` for what every layer shares: a rotary scheme's angles,
flex's BlockMask, the tiled kernel's plan) it makes

    float_mask(...)  an additive modifier and the mask as one float bias, for SDPA
    for_layer(...)   the pass as a layer with its own window sees it

An engine step packs the new tokens of many sequences into one row, so that every linear
layer runs on exactly the tokens there are; its context carries a `Ragged` layout, through
which attention reads them one sequence per row (see `Ragged`).
"""

from dataclasses import dataclass, fields, replace
from typing import Protocol

import torch
from torch import Tensor

from gptmini.attention import masks
from gptmini.core import attention as core
from gptmini.core.attention import check_window, positions_in_documents

__all__ = ["AttentionContext", "AttentionSettings", "Ragged", "check_window", "layer_context",
           "positions_in_documents"]


@dataclass(frozen=True)
class AttentionSettings(core.AttentionSettings):
    """The core's settings (causal, window, position scheme) and a soft-cap; the same for
    every layer of a model but its window."""

    softcap: float | None = None
    """Soft-cap the scaled scores at this value (cap * tanh(score / cap)); None: no cap."""

    def __str__(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))

    def score_mod(self, device) -> masks.ScoreMod | None:
        """The position scheme's modifier, then the soft-cap, or None."""
        mods = []
        scheme_mod = self.position_scheme.score_mod(device)
        if scheme_mod is not None:
            mods.append(scheme_mod)
        if self.softcap is not None:
            mods.append(masks.softcap(self.softcap))
        return None if not mods else mods[0] if len(mods) == 1 else masks.chain(*mods)


class AttentionContext(core.AttentionContext):
    """The core's context (see the module docstring), with an engine step's `ragged` rows.

    Args:
        ragged: several sequences packed in one row (an engine step; see `Ragged`).
        The rest: as gptmini.core.attention.AttentionContext's.
    """

    settings_class = AttentionSettings

    def __init__(self, positions: Tensor, num_keys: int, settings: core.AttentionSettings, *,
                 ragged: "Ragged | None" = None, **options):
        super().__init__(positions, num_keys, settings, **options)
        self.ragged = ragged
        # the mask reads padding or document tensors
        self.data_dependent = self.attention_mask is not None or self.document_ids is not None

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
                                            for t in (self.attention_mask, self.document_ids))
            return AttentionContext(self.positions, num_keys, settings,
                                    attention_mask=attention_mask, document_ids=document_ids,
                                    uses_cache=self.uses_cache, rows_alike=self.rows_alike,
                                    ragged=self.ragged)

        return self.once(("layer", settings.window_size, num_keys), view)

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
        """The core's, without making the dense mask where no kernel asked for it (flex's
        and the tiled kernel's masks are their own): evaluated a chunk of queries at a time."""
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
