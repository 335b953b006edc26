"""What the config's checks are made of: `ConfigError`, which GPTConfig and the objects of
its tables (mixers, feed-forwards) raise for a field they refuse, `is_finite_number`, and
the norms' names (`NORMS`), which the config checks and the attention mixer reads."""

import math

from gptmini.core.model import ConfigError

__all__ = ["NORMS", "ConfigError", "is_finite_number"]


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool, not a string) that is neither NaN nor infinite."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


NORMS = {"layernorm": "rmsnorm", "rmsnorm": "rmsnorm", "rmsnorm1p": "rmsnorm1p"}
"""GPTConfig.norm's names, each with the RMS norm its QK-norm takes (Gemma's for Gemma's)."""
