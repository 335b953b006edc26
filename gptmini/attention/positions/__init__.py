"""Position schemes, one object per scheme: how a token's place enters the model.

    base.py     `PositionScheme`: where a scheme may act (an embedding, a rotation of queries
                and keys, a score modifier) and whether it is relative
    learned.py  the book's: a learned embedding of each position added to the token's
    rope.py     rotary embeddings: queries and keys rotated by position, so q·k depends only
                on distances
    alibi.py    ALiBi: each head's scores penalized by the distance
    none.py     no positions: a causal decoder reads order from its mask

`GPTConfig.position` names one of `SCHEMES`; `GPTConfig.position_scheme()` builds it (the
scheme checks its own constraints there), and `GPTModel` builds it once and hands it to
every layer. Generation, FLOP counts and checkpoints ask the scheme (`relative`,
`make_embedding`), never its name. A new scheme is one file here and its name in `SCHEMES`.
"""

import importlib

from gptmini.attention.positions.base import ModelShape, PositionScheme
from gptmini.attention.positions.learned import LearnedPositions
from gptmini.attention.positions.none import NoPositions
from gptmini.attention.table import Table

__all__ = ["SCHEMES", "AlibiPositions", "LearnedPositions", "ModelShape", "NoPositions",
           "PositionScheme", "RotaryPositions", "alibi_slopes", "apply_rope", "rope_angles"]

SCHEMES = Table("position scheme", {
    "learned": LearnedPositions,
    "rope": "gptmini.attention.positions.rope:RotaryPositions",
    "alibi": "gptmini.attention.positions.alibi:AlibiPositions",
    "none": NoPositions,
})
"""Every scheme by the name GPTConfig.position gives it (read-only: this is the registry);
the book's two are here, rotary and ALiBi load the first time a config names them."""

_LAZY = {"RotaryPositions": "rope", "apply_rope": "rope", "rope_angles": "rope",
         "AlibiPositions": "alibi", "alibi_slopes": "alibi"}


def __getattr__(name: str):
    """The rotary and ALiBi names, imported when first asked for."""
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
