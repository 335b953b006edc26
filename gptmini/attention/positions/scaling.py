"""Rotary frequency scaling: how a rotary scheme stretches its frequencies past the context
it was trained on, one class per Hugging Face `rope_type`, each computing the inverse
frequencies (and YaRN's attention factor) as `transformers.modeling_rope_utils`'
`ROPE_INIT_FUNCTIONS` does (the tests compare them, type by type).

    linear   every frequency divided by `factor` (position interpolation)
    llama3   Llama 3.1's: low frequencies divided by `factor`, high ones kept, the band
             between low_freq_factor and high_freq_factor blended
    yarn     YaRN: interpolation below the beta_slow rotations, extrapolation above
             beta_fast, a ramp between; cos and sin scaled by an attention factor

All three are static: the frequencies depend on the settings only, never on how long the
sequence is, so a model generates past `original_max_position_embeddings` with the same
frequencies (transformers recomputes frequencies only for the "dynamic" and "longrope"
types, which gptmini does not compute). `GPTConfig.rope_scaling` holds the settings as
Hugging Face's `rope_parameters` do, without `rope_theta`: `{"rope_type": "llama3",
"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
"original_max_position_embeddings": 8192}`; beside any type, `partial_rotary_factor` turns
only that share of each head (rope_type 'default': that alone). A new type is a class here
and its entry in `ROPE_SCALINGS`.
"""

import math
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import ClassVar

import torch
from torch import Tensor

from gptmini.core.layers import ArgumentError
from gptmini.core.positions import plain_inv_freq

__all__ = ["PARTIAL", "ROPE_SCALINGS", "Llama3Scaling", "LinearScaling", "RopeScaling",
           "YarnScaling", "plain_inv_freq", "rope_scaling", "rotary_fraction"]


class RopeScaling:
    """One rope_type's settings (a frozen dataclass of numbers, so two alike compare and hash
    equal); `from_options` checks them as they are read."""

    rope_type: ClassVar[str]
    """Its name in `ROPE_SCALINGS` and Hugging Face's rope_type."""
    flags: ClassVar[tuple[str, ...]] = ()
    """Its settings that are true or false (the others are positive numbers)."""

    @property
    def magnitude(self) -> float:
        """What cos and sin are multiplied by (so every score by its square); 1: none."""
        return 1.0

    @classmethod
    def from_options(cls, options: Mapping) -> "RopeScaling":
        """The settings in `options` (GPTConfig.rope_scaling without its rope_type).

        Raises:
            ArgumentError: naming rope_scaling: an unknown key, a required one missing, a
                value that is not a finite positive number.
        """
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(options) - set(known))
        required = [name for name, f in known.items() if f.default is MISSING]
        missing = [name for name in required if options.get(name) is None]
        if unknown or missing:
            optional = [name for name in known if name not in required]
            raise ArgumentError("rope_scaling", {"rope_type": cls.rope_type, **options},
                                f"{cls.rope_type} scaling reads {', '.join(required)}"
                                + (f" (and optionally {', '.join(optional)})" if optional
                                   else "") + "; "
                                + (f"{', '.join(unknown)} is not one of them" if unknown
                                   else f"{', '.join(missing)} missing"))
        values = {name: value for name, value in options.items() if value is not None}
        for name, value in values.items():
            flag = name in cls.flags
            fine = (isinstance(value, bool) if flag else
                    not isinstance(value, bool) and isinstance(value, int | float)
                    and math.isfinite(value) and value > 0)
            if not fine:
                raise ArgumentError("rope_scaling", {"rope_type": cls.rope_type, **options},
                                    f"its {name} is {value!r}: use "
                                    + ("true or false" if flag else "a finite positive number"))
        scaling = cls(**values)
        scaling.check()
        return scaling

    def check(self) -> None:
        """Rules between the settings (each class's own)."""

    def options(self) -> dict:
        """GPTConfig.rope_scaling of these settings (Hugging Face's rope_parameters less
        rope_theta), the unset optional ones left out."""
        return {"rope_type": self.rope_type,
                **{k: v for k, v in asdict(self).items() if v is not None}}

    def inv_freq(self, head_dim: int, theta: float, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> Tensor:
        """The scaled inverse frequencies, (head_dim / 2,) in `dtype`."""
        raise NotImplementedError

    def _need_factor(self) -> None:
        if self.factor < 1:
            raise ArgumentError("rope_scaling", self.options(), f"its factor is {self.factor}: "
                                "a scaling stretches the context, so use a factor of 1 or more")


@dataclass(frozen=True)
class LinearScaling(RopeScaling):
    """Position interpolation: positions (so every frequency) divided by `factor`."""

    rope_type: ClassVar[str] = "linear"
    factor: float

    def check(self) -> None:
        self._need_factor()

    def inv_freq(self, head_dim, theta, dtype, device=None) -> Tensor:
        return plain_inv_freq(head_dim, theta, dtype, device) / self.factor


@dataclass(frozen=True)
class Llama3Scaling(RopeScaling):
    """Llama 3.1's: frequencies whose wavelength is longer than the original context /
    low_freq_factor are divided by `factor`, those shorter than it / high_freq_factor kept,
    and the band between blended linearly in the number of turns over the original context."""

    rope_type: ClassVar[str] = "llama3"
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def check(self) -> None:
        self._need_factor()
        if self.high_freq_factor <= self.low_freq_factor:
            raise ArgumentError("rope_scaling", self.options(), "its high_freq_factor must be "
                                "above its low_freq_factor (Llama 3.1: 4.0 and 1.0)")

    def inv_freq(self, head_dim, theta, dtype, device=None) -> Tensor:
        inv_freq = plain_inv_freq(head_dim, theta, dtype, device)
        old = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        turns = old / wavelen  # how often each frequency turns over the original context
        smooth = (turns - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = torch.where(wavelen > old / self.low_freq_factor, inv_freq / self.factor,
                             blended)
        return torch.where(wavelen < old / self.high_freq_factor, inv_freq, scaled)


@dataclass(frozen=True)
class YarnScaling(RopeScaling):
    """YaRN (Peng et al., 2023): dimensions that turn fewer than beta_slow times over the
    original context are interpolated (divided by `factor`), those that turn more than
    beta_fast times kept, a linear ramp between; cos and sin are scaled by
    `attention_factor` (given, or 0.1 ln(factor) + 1, or DeepSeek's mscale ratio)."""

    rope_type: ClassVar[str] = "yarn"
    flags: ClassVar[tuple[str, ...]] = ("truncate",)
    factor: float
    original_max_position_embeddings: int
    beta_fast: float | None = None
    """None: 32, the paper's."""
    beta_slow: float | None = None
    """None: 1, the paper's."""
    attention_factor: float | None = None
    """cos and sin's factor; None: worked out from factor (and mscale, mscale_all_dim)."""
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    """Round the ramp's ends outwards to whole dimensions; None: true."""

    @property
    def magnitude(self) -> float:
        """attention_factor, or as transformers works it out: DeepSeek's ratio of mscales
        where both are given, else 0.1 ln(factor) + 1."""
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    def check(self) -> None:
        self._need_factor()

    def inv_freq(self, head_dim, theta, dtype, device=None) -> Tensor:
        def dim_of(turns: float) -> float:  # the dimension that turns this often
            return (head_dim * math.log(self.original_max_position_embeddings
                                        / (turns * 2 * math.pi))) / (2 * math.log(theta))

        low, high = dim_of(self.beta_fast or 32), dim_of(self.beta_slow or 1)
        if self.truncate is not False:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # no division by zero
        ramp = ((torch.arange(head_dim // 2, dtype=dtype, device=device) - low)
                / (high - low)).clamp(0, 1)
        extrapolated = plain_inv_freq(head_dim, theta, dtype, device)
        return extrapolated / self.factor * ramp + extrapolated * (1 - ramp)


ROPE_SCALINGS: dict[str, type[RopeScaling]] = {
    cls.rope_type: cls for cls in (LinearScaling, Llama3Scaling, YarnScaling)}
"""Every rope scaling by its rope_type."""


PARTIAL = "partial_rotary_factor"
"""The share of each head's dimensions that turn, the first ones (Hugging Face's name;
Qwen3-Next's and Qwen3.5's 0.25): a setting beside any rope_type, read by
`rotary_fraction`; 1 (or absent): all of them."""


def rope_scaling(options: Mapping | None) -> RopeScaling | None:
    """The scaling GPTConfig.rope_scaling describes (None: none, or rope_type 'default',
    which scales nothing and at most turns part of each head: `rotary_fraction`).

    Raises:
        ArgumentError: naming rope_scaling: not a mapping, an unknown rope_type, settings
            its type does not read.
    """
    if options is None:
        return None
    kind = options.get("rope_type") if isinstance(options, Mapping) else None
    if kind not in (*ROPE_SCALINGS, "default"):
        raise ArgumentError("rope_scaling", options, "use a mapping with a rope_type of "
                            f"{', '.join(ROPE_SCALINGS)} and its settings (e.g. "
                            "{'rope_type': 'linear', 'factor': 8.0}), or default with only "
                            f"a {PARTIAL}, or None for none")
    settings = {k: v for k, v in options.items() if k not in ("rope_type", PARTIAL)}
    if kind == "default":
        if settings:
            raise ArgumentError("rope_scaling", options, f"rope_type default scales nothing: "
                                f"leave out {', '.join(settings)} (it reads only {PARTIAL})")
        return None
    return ROPE_SCALINGS[kind].from_options(settings)


def rotary_fraction(options: Mapping | None) -> float:
    """The share of each head that turns, GPTConfig.rope_scaling's partial_rotary_factor
    (1: all of it).

    Raises:
        ArgumentError: naming rope_scaling: a share that is not a number in (0, 1].
    """
    value = (options or {}).get(PARTIAL, 1.0) if isinstance(options, Mapping | None) else 1.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ArgumentError("rope_scaling", options, f"its {PARTIAL} is {value!r}: use the "
                            "share of each head that turns, a number in (0, 1] (Qwen3.5's "
                            "0.25)")
    return float(value)
