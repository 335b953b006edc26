"""A table of names to classes, as kernels, position schemes and (in gptmini.model) a
layer's token mixer and feed-forward are chosen: a built-in by its name, its entry a class
or, for one off the book's path, its import path, imported the first time it is asked for
(so `from gptmini.attention import MultiHeadAttention` never loads it); and a class of your
own by its import path 'package.module:ClassName', with no entry at all.
"""

import importlib
import re
from collections.abc import Iterator, Mapping

__all__ = ["Table", "is_import_path"]


_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_import_path(name: object) -> bool:
    """'package.module:ClassName' (by its form alone; nothing is imported)."""
    return isinstance(name, str) and _IMPORT_PATH.fullmatch(name) is not None


class Table(Mapping):
    """Read-only names -> classes; an entry given as an import path is imported on first use.

    `table[name]` is the class of a table name or of an import path of your own;
    `name in table` and iterating see the table's names only. `what` names the table's
    kind in messages ("backend", "token mixer"); nothing is imported until asked for.
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
