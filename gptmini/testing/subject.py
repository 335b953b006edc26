"""What the kit tests: the declared spec, and the Subject that builds and calls the target."""

import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

BOOK_ARGS = ("d_in", "d_out", "context_length", "dropout", "num_heads")


@dataclass
class AttentionSpec:
    """What a module's signature cannot tell the kit. Every field has the book's default."""

    causal: bool = True
    """True: a decoder's attention, the book's. False: it attends both ways (seed 002's
    encoder), and the kit checks that it does."""
    padding: str | None = None
    """The forward keyword of a (b, num_tokens) padding mask, e.g. "attention_mask" (None:
    no padding mask declared, so none is tested)."""
    padding_marks: str = "real"
    """What True (or 1) marks in that mask: "real" tokens, or "pad" positions."""
    window: int | None = None
    """Build the module with this sliding window (None: no window declared)."""
    window_kwarg: str = "window_size"
    """The constructor keyword that takes the window."""
    window_counts_self: bool = True
    """True: window w lets query i see keys i-w+1 ... i (w keys, itself included; gptmini's
    and Mistral's convention). False: keys i-w ... i (w keys before it, and itself)."""
    positions: str | None = None
    """The forward keyword taking (b, num_tokens) integer positions of x's tokens, for
    attention whose positions enter only as distances (rotary, ALiBi): the kit checks that
    moving every token by the same amount changes nothing. None: not declared."""
    kv_step: Callable | None = None
    """How to run with a KV cache: kv_step(module, x_new, state) -> (out, state), starting
    from state None, where x_new is (b, new_tokens, d_in). None: no cache declared."""
    d_in: int | None = None
    """Input width (default 8): passed as d_in, or what a factory without d_in expects."""
    d_out: int | None = None
    """Output width (default: d_in): passed as d_out, or what a factory without it gives."""
    num_heads: int | None = None
    """Heads (default 2): passed as num_heads, or declares how many a factory without that
    argument builds (then a leak names its head, and equals_gptmini can run)."""
    softmax: bool = True
    """True: each output is a softmax-weighted mean of values. False: linear attention with
    a recurrent state (gptmini.variants.deltanet's Gated DeltaNet), whose output is not:
    identical_tokens and equals_gptmini do not apply, every other check does."""

    sinks: str | None = None
    """The module's attribute holding its attention sinks, (num_heads,) logits in each
    head's softmax denominator (gpt-oss's; gptmini's is "sinks"). The kit sets them to
    seeded random values, so every check runs with sinks that take weight; the checks that
    need weights summing to 1 (identical_tokens, book_numbers) set them to -inf, which is
    no sink; equals_gptmini gives gptmini's the same. None: no sinks declared."""
    gate: str | None = None
    """The module's attribute holding its output gate's linear layer (gptmini's is
    "gate.W_gate"): sigmoid(x W) times each head's output before out_proj, d_in -> d_out
    (elementwise, Qwen3-Next's) or d_in -> num_heads (headwise). equals_gptmini gives
    gptmini's gate the same weights. None: no gate declared."""

    def __post_init__(self):
        if self.padding_marks not in ("real", "pad"):
            raise ValueError(f"padding_marks must be 'real' or 'pad', got "
                             f"{self.padding_marks!r}: what True marks in the padding mask")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}; None: no window")


class NotApplicable(Exception):
    """A check that cannot run on this target; its message says why. `loud`: the report
    warns, because without this check a class of bugs goes unseen."""

    def __init__(self, why: str, loud: bool = False):
        super().__init__(why)
        self.loud = loud


class OutOfTime(NotApplicable):
    """The time budget ran out before this check: untested, which a gate must not pass."""


class InputMutated(Exception):
    """The module wrote into its input tensor: every check would see a different input."""


class Subject:
    """The attention under test: builds it with the kit's sizes and calls it."""

    def __init__(self, target: Callable[..., nn.Module], spec: AttentionSpec,
                 dtype: torch.dtype, device: str | torch.device):
        self.target, self.spec, self.dtype, self.device = target, spec, dtype, device
        call = target.__init__ if inspect.isclass(target) else target
        try:
            parameters = inspect.signature(call).parameters
        except (TypeError, ValueError):  # a builtin or an extension: no signature to read
            parameters = {}
        self.accepts = set(parameters)
        self.any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        names = [p for p in parameters if p != "self"]
        self.book_constructor = tuple(names[:5]) == BOOK_ARGS
        self.d_in = spec.d_in or 8
        self.d_out = spec.d_out or self.d_in
        self.heads_known = spec.num_heads is not None or self.takes("num_heads")
        self.num_heads = spec.num_heads or 2
        self.context_length = 32
        self.deadline, self.time_budget, self.call_seconds = math.inf, math.inf, 0.0

    def takes(self, name: str) -> bool:
        return name in self.accepts or (self.any_keyword and name in BOOK_ARGS + ("qkv_bias",))

    def constructor_kwargs(self, *, dropout: float = 0.0, **sizes) -> dict:
        """What the target is called with: the book's arguments it accepts, at the kit's sizes."""
        values = {"d_in": self.d_in, "d_out": self.d_out, "context_length": self.context_length,
                  "dropout": dropout, "num_heads": self.num_heads, "qkv_bias": False, **sizes}
        return {k: v for k, v in values.items() if self.takes(k)}

    def build(self, *, dropout: float = 0.0, seed: int = 0, window: bool = True,
              dtype: torch.dtype | None = None, sinks: bool = True, **sizes) -> nn.Module:
        """The module, seeded, in eval mode, in the kit's dtype and device; declared sinks
        (AttentionSpec.sinks) random, or with `sinks=False` at -inf (none).

        Raises:
            NotApplicable: the target takes no dropout (and dropout > 0 was asked).
        """
        kwargs = self.constructor_kwargs(dropout=dropout, **sizes)
        if dropout > 0 and not self.takes("dropout"):
            raise NotApplicable("it takes no dropout argument")
        if window and self.spec.window is not None:
            kwargs[self.spec.window_kwarg] = self.spec.window
        torch.manual_seed(seed)
        module = self.target(**kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(f"it built a {type(module).__name__}, not an nn.Module")
        if self.spec.sinks is not None:
            with torch.no_grad():
                held = attribute(module, self.spec.sinks)
                held.copy_(torch.randn(held.shape, generator=torch.Generator().manual_seed(seed))
                           if sinks else torch.full(held.shape, -torch.inf))
        return module.to(device=self.device, dtype=dtype or self.dtype).eval()

    def inputs(self, b: int, n: int, seed: int = 1, scale: float = 1.0) -> Tensor:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(b, n, self.d_in, generator=gen) * scale).to(self.device, self.dtype)

    def call(self, module: nn.Module, x: Tensor, real: Tensor | None = None,
             grad: bool = False, trial: bool = False, positions: Tensor | None = None
             ) -> Tensor:
        """Run the module (without autograd unless `grad`); `real` (b, n) marks real tokens
        and is passed as the declared padding mask, `positions` (b, n) as the declared
        positions keyword. `trial`: a first try, which reports no changed input (the checks
        do).

        Raises:
            InputMutated: the module changed `x` in place.
            NotApplicable: the time budget ran out.
        """
        if time.monotonic() > self.deadline:
            raise OutOfTime(f"not finished: the time budget of {self.time_budget:g} s ran "
                                f"out (one call takes about {self.call_seconds:.2g} s); give "
                                "a larger time_budget (--time_budget)", loud=True)
        kwargs = {}
        if positions is not None:
            kwargs[self.spec.positions] = positions.to(self.device)
        if real is not None:
            mask = real if self.spec.padding_marks == "real" else ~real
            kwargs[self.spec.padding] = mask.to(self.device)
        before = x.detach().clone()
        with torch.set_grad_enabled(grad):
            out = module(x, **kwargs)
        if not trial and not torch.equal(before.nan_to_num(), x.detach().nan_to_num()):
            raise InputMutated("it changed its input tensor in place (an in-place operation "
                               "such as x += ..., x.mul_(...) or x[...] = ... on the input); "
                               "a layer must leave its input as it was: write x = x + ...")
        return out

    def call_seeing_heads(self, module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """The output and, when the module has the book's `out_proj`, that projection's input:
        the heads' outputs side by side, (b, num_tokens, d_out), so a leak names its head."""
        seen = []
        out_proj = getattr(module, "out_proj", None)
        if not isinstance(out_proj, nn.Module):
            return self.call(module, x), None
        hook = out_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
        try:
            out = self.call(module, x)
        finally:
            hook.remove()
        return out, seen[0] if len(seen) == 1 else None

    @property
    def atol(self) -> float:
        """What "unchanged" means: float64 exact to 1e-9, float32 to 1e-5, half types 2e-2."""
        return {torch.float64: 1e-9, torch.float32: 1e-5}.get(self.dtype, 2e-2)


def attribute(module: nn.Module, path: str):
    """`module`'s attribute at a dotted `path` ("gate.W_gate"), or a ValueError naming it."""
    found = module
    for part in path.split("."):
        if not hasattr(found, part):
            raise ValueError(f"the module has no {path!r} (declared in AttentionSpec); name "
                             "the attribute that holds it")
        found = getattr(found, part)
    return found


def one_line(err: Exception, limit: int = 160) -> str:
    """An exception as one short line: its type and its message's first line."""
    first = (str(err).strip().splitlines() or [""])[0]
    if len(first) > limit:
        first = first[:limit].rsplit(" ", 1)[0] + " ..."
    return f"{type(err).__name__}: {first}"
