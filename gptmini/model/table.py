"""What the model's tables are made of: a `Table` of names to classes, as a layer's mixer
and feed-forward are chosen (the built-ins by name, a variant's by its import path, imported
the first time a config names it so that the book's path never loads it, and a class of
your own by its import path 'package.module:ClassName' with no entry at all, as kernels are
named), and `ConfigError`, which a table's object raises for a GPTConfig field it refuses.
"""

import importlib
import math
import re
from collections.abc import Iterator, Mapping

__all__ = ["ConfigError", "Table", "is_finite_number", "is_import_path"]


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

_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_import_path(name: object) -> bool:
    """'package.module:ClassName' (by its form alone; nothing is imported)."""
    return isinstance(name, str) and _IMPORT_PATH.fullmatch(name) is not None


class Table(Mapping):
    """Read-only names -> classes; an entry given as an import path is imported on first use.

    `table[name]` is the class of a table name or of an import path of your own;
    `name in table` and iterating see the table's names only. `what` names the table's
    kind in messages ("token mixer").
    """

    def __init__(self, what: str, entries: Mapping[str, type | str]):
        self.what, self._entries = what, dict(entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> type:
        entry = self._entries.get(name, name)
        if isinstance(entry, type):
            return entry
        if not is_import_path(entry):
            raise KeyError(name)
        return self._imported(entry)  # Python keeps the module: a second lookup is cheap

    def accepts(self, name: object) -> bool:
        """A table name or an import path (the path is not imported: its form decides)."""
        return name in self._entries or is_import_path(name)

    def choices(self) -> str:
        """The accepted names, for a message."""
        return (f"one of {', '.join(self._entries)}, or a {self.what} of your own as "
                "'package.module:ClassName'")

    def _imported(self, path: str) -> type:
        module_name, _, qualname = path.partition(":")
        try:
            found = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"{self.what} {path!r}: cannot import {module_name} ({err}); make "
                             "it importable (install its package, or put its folder on "
                             "PYTHONPATH)") from None
        for part in qualname.split("."):
            if not hasattr(found, part):
                raise ValueError(f"{self.what} {path!r}: {module_name} has no {qualname}; name "
                                 "a class it defines, as 'package.module:ClassName'")
            found = getattr(found, part)
        if not isinstance(found, type):
            raise ValueError(f"{self.what} {path!r} is not a class")
        return found
