"""What the config's checks are made of: `ConfigError`, which GPTConfig and the objects of
its tables (mixers, feed-forwards) raise for a field they refuse, `is_finite_number`, and
the norms' names (`NORMS`), which the config checks and the attention mixer reads."""

import math

__all__ = ["NORMS", "ConfigError", "is_finite_number"]


class ConfigError(ValueError):
    """A GPTConfig field refused: `field`, its `value` and the `fix`, so that a command can
    name its own flag for it (`for_flag`)."""

    def __init__(self, field: str, value: object, fix: str):
        super().__init__(f"GPTConfig.{field}={value!r} is invalid: {fix}")
        self.field, self.value, self.fix = field, value, fix

    def for_flag(self, prefix: str = "--model.") -> str:
        """The message with the field named as the command line's flag."""
        return f"{prefix}{self.field} {self.value!r} is invalid: {self.fix}"


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool, not a string) that is neither NaN nor infinite."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


NORMS = {"layernorm": "rmsnorm", "rmsnorm": "rmsnorm", "rmsnorm1p": "rmsnorm1p"}
"""GPTConfig.norm's names, each with the RMS norm its QK-norm takes (Gemma's for Gemma's)."""
