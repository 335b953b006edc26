"""Sampling and autoregressive generation, with a KV cache.

`generate` keeps the book's chapter 5 signature and, with `use_cache=False` (the default),
the book's computation: every step runs the model on the last `context_size` tokens and
samples from the last position. With `use_cache=True` the prompt is run once (prefill) and
each later step feeds only the newest token against cached keys and values; greedy output
is the same, token for token.

Past `context_size`, both paths slide the context as the book's `idx[:, -context_size:]`
does. The cache path stays exactly equal to that crop by recomputing the cache from the
cropped context once the sequence has outgrown it; from then on each new token costs a
forward pass over `context_size` tokens, the same as recompute (positions shift by one each
step, so no cached key is still valid). A model whose positions enter attention only as
distances (rotary, ALiBi, none) can instead roll its cache (`slide="roll"`): drop the oldest
entry and feed the newest token alone, as a sliding window over the whole sequence would.

Batches of prompts with different lengths are left-padded (`left_pad`) and passed with their
`attention_mask`; the model counts positions from each row's first real token, so every row
generates what its prompt generates alone.

Beyond the book's arguments, the sampling settings come as one `SamplingParams`
(`sampling=`), and how the run goes as keywords both functions share, `GenerateOptions`.
"""

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from gptmini.attention.positions import SCHEMES
from gptmini.generate.sampling import Detokenizer, SamplingParams, sample, sample_next_token
from gptmini.tokenizer import encode_prompt

__all__ = [
    "GenerateOptions",
    "generate",
    "generate_stream",
    "left_pad",
    "sample_next_token",
    "stream_text",
]


def left_pad(
    prompts: Sequence[Sequence[int] | Tensor], pad_id: int = 0, device=None
) -> tuple[Tensor, Tensor]:
    """Stack prompts of different lengths, padded on the left.

    Args:
        prompts: token id lists (or 1-D tensors), each at least one token long.
        pad_id: id written at padding positions (any valid id; the mask hides it).

    Returns:
        idx (b, max_len) and attention_mask (b, max_len), 1 at real tokens, 0 at padding.
    """
    if len(prompts) == 0:
        raise ValueError("left_pad got no prompts; pass at least one list of token ids")
    rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if any(len(r) == 0 for r in rows):
        raise ValueError("every prompt needs at least one token; start empty prompts with "
                         "<|endoftext|> (tokenizer.eot_token)")
    max_len = max(len(r) for r in rows)
    idx = torch.full((len(rows), max_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), max_len), dtype=torch.long)
    for i, r in enumerate(rows):
        idx[i, max_len - len(r):] = r
        mask[i, max_len - len(r):] = 1
    return idx.to(device), mask.to(device)


@dataclass(frozen=True)
class GenerateOptions:
    """How a `generate()` or `generate_stream()` run goes, beyond what it samples: the
    keywords both take, written once here. Sampling settings are a `SamplingParams`."""

    num_samples: int = 1
    """Samples per prompt; rows come out prompt by prompt (prompt 0 sample 0, prompt 0
    sample 1, ..., prompt 1 sample 0, ...)."""
    attention_mask: Tensor | None = None
    """(b, num_tokens), 1 at real tokens and 0 at left padding (`left_pad`)."""
    generator: torch.Generator | None = None
    """Random source for sampling; a seed in the SamplingParams makes a fresh one instead."""
    use_cache: bool = False
    """One prefill, then one token per step against cached keys and values."""
    slide: str = "recompute"
    """Past context_size, "recompute" the cache from the cropped context at every step (the
    book's crop, exactly), or "roll": drop the cache's oldest token and feed the newest
    alone, as a sliding window of context_size over the whole sequence would. Roll needs
    use_cache and a model whose positions enter attention only relatively (position rope,
    alibi or none)."""

    def __post_init__(self):
        n = self.num_samples
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_samples must be an integer >= 1, got {n!r}")


def generate(
    model: nn.Module,
    idx: Tensor,
    max_new_tokens: int,
    context_size: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    *,
    sampling: SamplingParams | None = None,
    **options: Any,
) -> Tensor:
    """The book's `generate`, plus any sampling setting, several samples, batching and a
    KV cache.

    The positional parameters are the book's, so `generate(model, idx, 50, 256, 1.4, 25)`
    runs as in chapter 5; everything new is keyword-only:
    `generate(model, idx, 50, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=1),
    use_cache=True)`.

    Args:
        model: a `GPTModel` (or any module mapping (b, n) ids to (b, n, vocab) logits when
            `use_cache=False` and no `attention_mask` is given). Call `model.eval()` first.
        idx: (b, num_tokens) prompt ids; left-padded when `attention_mask` is given.
        max_new_tokens: most tokens to add.
        context_size: tokens the model sees per step; defaults to the model's context_length.
        temperature: 0 for greedy, > 0 to sample.
        top_k: sample among the k most likely tokens.
        eos_id: a row stops when it draws this id; generation stops when every row has.
            As in the book the final eos is not appended; rows that finished earlier are
            filled with `eos_id` until the last one does.
        sampling: every sampling setting at once (top_p, seed, ...), instead of
            `temperature` and `top_k`; its max_new_tokens is replaced by the argument's.
            Stop strings, stop ids and logprobs are the engine's (`Engine`).
        **options: `GenerateOptions` fields: num_samples, attention_mask, generator,
            use_cache, slide.

    Returns:
        (b * num_samples, num_tokens + n) ids, the prompt followed by n <= max_new_tokens
        new tokens.
    """
    prompts, steps = _start(model, idx, max_new_tokens, context_size, temperature, top_k,
                            eos_id, sampling, options)
    steps = list(steps)
    if not steps:
        return prompts
    return torch.cat([prompts, torch.stack(steps, dim=1)], dim=1)


def generate_stream(
    model: nn.Module,
    idx: Tensor,
    max_new_tokens: int,
    context_size: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    *,
    sampling: SamplingParams | None = None,
    **options: Any,
) -> Iterator[Tensor]:
    """Like `generate`, but yields each step's new tokens as soon as they are drawn.

    Takes the same arguments as `generate`, which is this generator collected; arguments
    are checked when it is called.

    Yields:
        (b * num_samples,) token ids, one tensor per step.
    """
    return _start(model, idx, max_new_tokens, context_size, temperature, top_k, eos_id,
                  sampling, options)[1]


def _start(model, idx, max_new_tokens, context_size, temperature, top_k, eos_id, sampling,
           options) -> tuple[Tensor, Iterator[Tensor]]:
    """Check the arguments of `generate`/`generate_stream`: the prompts each row starts
    from, and the steps still to run."""
    params = _sampling(max_new_tokens, temperature, top_k, sampling)
    run = _options(options)
    if run.generator is not None and params.seed is not None:
        raise ValueError("pass either seed or generator, not both; a seed makes a new generator")
    prompts, mask = _prepare(idx, run.attention_mask, run.num_samples)
    context_size = _context_size(model, context_size)
    _check_slide(model, run.slide, run.use_cache)
    generator = run.generator if params.seed is None else params.generator(prompts.device)
    if getattr(model, "training", False):
        warnings.warn(
            "generating with a model in training mode: dropout makes outputs random and the "
            "KV cache path differ from recompute; call model.eval() first",
            stacklevel=3,
        )
    return prompts, _stream(model, prompts, mask, params, context_size, eos_id, generator,
                            run.use_cache, run.slide == "roll")


def _sampling(max_new_tokens: int, temperature: float, top_k: int | None,
              sampling: SamplingParams | None) -> SamplingParams:
    """The run's SamplingParams: the book's arguments, or `sampling` with their budget."""
    if sampling is None:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k)
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if temperature != 0.0 or top_k is not None:
        raise ValueError(f"temperature={temperature!r}, top_k={top_k!r} and sampling= were "
                         "both given; put every setting in sampling=SamplingParams(...)")
    if sampling.stop or sampling.stop_ids or sampling.logprobs is not None:
        raise ValueError("generate() takes no stop strings, stop_ids or logprobs (it stops at "
                         "eos_id and returns ids); the engine does: "
                         "gptmini.generate.engine.Engine")
    return replace(sampling, max_new_tokens=max_new_tokens)


def _options(options: dict[str, Any]) -> GenerateOptions:
    """`**options` as GenerateOptions; a sampling setting given there says where it goes."""
    known = {f.name for f in fields(GenerateOptions)}
    for name in options:
        if name in known:
            continue
        if name in {f.name for f in fields(SamplingParams)}:
            raise TypeError(f"{name}= is a sampling setting: pass "
                            f"sampling=SamplingParams({name}=...)")
        raise TypeError(f"unexpected keyword {name}=; generate() takes the book's arguments, "
                        f"sampling= and {', '.join(sorted(known))}")
    return GenerateOptions(**options)


@torch.inference_mode()
def _stream(model, idx, mask, params, context_size, eos_id, generator, use_cache,
            roll) -> Iterator[Tensor]:
    # Separate from generate_stream so that bad arguments raise at the call, not at the
    # first next().
    b = idx.shape[0]
    finished = torch.zeros(b, dtype=torch.bool, device=idx.device)
    caches = None
    for _ in range(params.max_new_tokens):
        if use_cache and caches is not None and idx.shape[1] <= context_size:
            # The cache holds every token but the newest: feed just that one.
            logits = _last_logits(model, idx[:, -1:], mask, caches)
        elif roll and caches is not None:
            # Past the context: forget the oldest, and the newest continues the positions.
            for cache in caches:
                cache.drop_oldest(len(cache) - (context_size - 1))
            mask = None if mask is None else mask[:, -context_size:]
            context = model.new_context(b, 1, context_size - 1, attention_mask=mask,
                                        uses_cache=True, device=idx.device,
                                        positions=caches[0].positions[:, -1:] + 1)
            logits = model(idx[:, -1:], kv_caches=caches, context=context,
                           logits_to_keep=1)[:, -1].float()
        else:
            # First step, or past context_size: (re)compute over the cropped context.
            idx_cond = idx[:, -context_size:]
            mask_cond = None if mask is None else mask[:, -context_size:]
            caches = model.new_kv_caches() if use_cache else None
            logits = _last_logits(model, idx_cond, mask_cond, caches)
        next_ids = sample(logits, params, generator)  # (b,)
        if eos_id is not None:
            next_ids = next_ids.masked_fill(finished, eos_id)
            finished = finished | (next_ids == eos_id)
            if bool(finished.all()):
                return
        yield next_ids
        idx = torch.cat([idx, next_ids[:, None]], dim=1)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)


def _prepare(
    idx: Tensor, attention_mask: Tensor | None, num_samples: int
) -> tuple[Tensor, Tensor | None]:
    """Validate the prompt batch and repeat each prompt `num_samples` times."""
    if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.shape[1] == 0:
        shape = tuple(idx.shape) if isinstance(idx, Tensor) else type(idx).__name__
        raise ValueError(
            f"idx must be a (batch, num_tokens) tensor of token ids with num_tokens >= 1, got "
            f"{shape}; use idx.unsqueeze(0) for one prompt and <|endoftext|> for an empty one"
        )
    mask = None
    if attention_mask is not None:
        if attention_mask.shape != idx.shape:
            raise ValueError(
                f"attention_mask must have the shape of idx {tuple(idx.shape)}, got "
                f"{tuple(attention_mask.shape)}"
            )
        mask = attention_mask.to(device=idx.device, dtype=torch.long)
        left_padded = bool((mask[:, 1:] >= mask[:, :-1]).all()) and bool((mask[:, -1] == 1).all())
        if not left_padded or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(
                "attention_mask must be 0s then 1s in every row (left padding, at least one "
                "real token); build prompts with gptmini.generate.loop.left_pad"
            )
        if bool(mask.all()):
            mask = None  # nothing padded: the unmasked path is the same and faster
    if num_samples > 1:
        idx = idx.repeat_interleave(num_samples, dim=0)
        mask = None if mask is None else mask.repeat_interleave(num_samples, dim=0)
    return idx, mask


def _check_slide(model: nn.Module, slide: str, use_cache: bool) -> None:
    if slide not in ("recompute", "roll"):
        raise ValueError(f"slide must be 'recompute' or 'roll', got {slide!r}")
    if slide == "recompute":
        return
    fixed = [mixer.title for mixer in getattr(model, "mixers", ()) if not mixer.rolls]
    if fixed:
        raise ValueError(f"slide='roll' drops the oldest cached tokens, which a {fixed[0]} "
                         "layer's state (GPTConfig.layer_kinds) cannot: use slide='recompute'")
    scheme = getattr(model, "position_scheme", None)  # a GPTModel's
    if not use_cache or not getattr(scheme, "relative", False):
        relative = " or ".join(name for name, kind in SCHEMES.items() if kind.relative)
        position = getattr(getattr(model, "cfg", None), "position", None)
        raise ValueError(
            "slide='roll' keeps the cached keys of earlier positions, which is exact only "
            "with use_cache=True and positions that enter attention as distances (a GPTModel "
            f"with position {relative}); this one has use_cache={use_cache}, "
            f"position={position!r}: use slide='recompute'")


def _context_size(model: nn.Module, context_size: int | None) -> int:
    cfg = getattr(model, "cfg", None)
    limit = getattr(cfg, "context_length", None)
    if context_size is None:
        if limit is None:
            raise ValueError("context_size is needed for a model without cfg.context_length")
        return limit
    if isinstance(context_size, bool) or not isinstance(context_size, int) or context_size < 1:
        raise ValueError(f"context_size must be an integer >= 1, got {context_size!r}")
    if limit is not None and context_size > limit:
        raise ValueError(
            f"context_size={context_size} exceeds the model's context_length={limit}; "
            f"use context_size={limit} (or leave it None)"
        )
    return context_size


def _last_logits(
    model: nn.Module,
    idx: Tensor,
    mask: Tensor | None,
    caches: list | None,
) -> Tensor:
    """Logits of the last position only, (b, vocab_size), in float32 for sampling.

    A GPTModel (compiled or not) runs its output head, the largest matmul of a small GPT,
    on that position alone; any other module gets the book's call.
    """
    if hasattr(model, "new_kv_caches"):
        logits = model(idx, mask, kv_caches=caches, logits_to_keep=1)
    elif mask is not None:
        logits = model(idx, mask)
    else:
        logits = model(idx)  # the book's call, for any module
    return logits[:, -1, :].float()


def stream_text(
    model: nn.Module,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    sampling: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    stop_at_eos: bool = True,
    use_cache: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> Iterator[str]:
    """Generate from a text prompt and yield the new text piece by piece.

    An empty prompt starts from `<|endoftext|>`. Text comes out as soon as it is complete
    UTF-8, so a character split over two BPE tokens appears once both are drawn.

    Args:
        model: a `GPTModel` in eval mode.
        tokenizer: a tiktoken `Encoding` (see `gptmini.tokenizer.get_tokenizer`).
        prompt: the text to continue; a special token written in it (`<|endoftext|>`) is
            that token (`gptmini.tokenizer.encode_prompt`, the rule serve.py shares).
        max_new_tokens: most tokens to add.
        sampling: the sampling settings, as in `generate` (default: greedy).
        generator: random source for sampling, as in `GenerateOptions`.
        stop_at_eos: stop at `<|endoftext|>` (not printed).
        use_cache: generate with the KV cache (the default here; same greedy tokens).
        on_token: called with each generated id (a piece of text may hold several, or wait
            for the next one): how generate.py counts its tokens per second.

    Yields:
        Pieces of the generated text (the prompt itself is not repeated).
    """
    eot = tokenizer.eot_token
    ids = encode_prompt(tokenizer, prompt)
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    text, sent = Detokenizer(tokenizer), 0
    for next_ids in generate_stream(
        model, idx, max_new_tokens, eos_id=eot if stop_at_eos else None, sampling=sampling,
        generator=generator, use_cache=use_cache,
    ):
        text.add(int(next_ids[0]))
        if on_token is not None:
            on_token(int(next_ids[0]))
        if len(text.text) > sent:
            yield text.text[sent:]
            sent = len(text.text)
    text.finish()
    if len(text.text) > sent:
        yield text.text[sent:]
