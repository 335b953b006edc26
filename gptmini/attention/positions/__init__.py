"""Position schemes, one object per scheme: how a token's place enters the model.

    learned, none   the book's learned embedding, and no positions (gptmini.core.positions)
    rope.py         rotary positions (the core's) with Llama 3's and YaRN's frequency scaling
                    (scaling.py) and a local layers' base of their own
    alibi.py        ALiBi: each head's scores penalized by the distance
    base.py         `PositionScheme` (the core's) and the sizes a scheme is built from

`GPTConfig.position` names one of `SCHEMES`; `GPTConfig.position_scheme()` builds it (the
scheme checks its own constraints there), and `GPTModel` builds it once and hands it to
every layer. Generation, FLOP counts and checkpoints ask the scheme (`relative`,
`make_embedding`), never its name. A new scheme is one file here and its name in `SCHEMES`.
"""

import importlib

from gptmini.attention.positions.base import ModelShape, PositionScheme
from gptmini.attention.table import Table
from gptmini.core.positions import LearnedPositions, NoPositions

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
