"""A Hugging Face config's rotary settings, read and written: `rope_theta` and the
`rope_parameters` / `rope_scaling` entries, as GPTConfig's rope_theta and rope_scaling.

transformers 5 writes one `rope_parameters` entry (its rope_type, its settings and
rope_theta); the published configs of Llama 3.1 and Qwen3 carry `rope_theta` beside a
`rope_scaling` entry, as transformers 4 wrote them. Both are read, and both are written, so
either reader loads an export. What transformers fills in, gptmini fills in alike: a llama3
or yarn entry without `original_max_position_embeddings` takes `max_position_embeddings`,
and a yarn entry without a factor their ratio. A type gptmini does not compute (dynamic,
longrope) is named, as are settings it does not read.
"""

from collections.abc import Mapping

from gptmini.attention.positions.scaling import PARTIAL, ROPE_SCALINGS
from gptmini.convert.weights import config_number

__all__ = ["RopeEntry", "read_rope", "read_rope_entry", "rope_base", "rope_entries"]

PLAIN_KEYS = ("rope_type", "type", "rope_theta")
"""What an entry of plain rotary positions (rope_type 'default') may hold."""
RopeEntry = tuple[float | None, dict | None]
"""An entry read: its rope_theta (None: it has none) and GPTConfig.rope_scaling (None: plain)."""


def read_rope_entry(entry: object, key: str, config: Mapping, problems: list[str], *,
                    partial: bool = False) -> RopeEntry:
    """One rope entry (`config[key]`, or a layer type's of a nested one) as gptmini reads
    it, with a partial_rotary_factor only where the layout turns part of a head (`partial`);
    what it cannot read goes into `problems`."""
    if entry is None:
        return None, None
    if not isinstance(entry, Mapping):
        problems.append(f"{key}={entry!r} (gptmini reads an object such as "
                        "{'rope_type': 'default'}, or null)")
        return None, None
    theta = (None if entry.get("rope_theta") is None
             else config_number(entry, "rope_theta", key, 10000.0))
    kind = entry.get("rope_type", entry.get("type"))
    settings = {k: v for k, v in entry.items() if k not in PLAIN_KEYS}
    turned = {} if settings.get(PARTIAL, 1.0) == 1.0 else {PARTIAL: settings[PARTIAL]}
    settings.pop(PARTIAL, None)  # (1: every dimension turns, gptmini's default)
    if turned and not partial:
        problems.append(f"{key} with {PARTIAL}={turned[PARTIAL]!r} (this layout turns every "
                        "dimension of a head)")
        turned = {}
    if kind in (None, "default"):
        if settings:
            problems.append(f"{key} with {', '.join(f'{k}={v!r}' for k, v in settings.items())} "
                            f"and rope_type {kind!r} (plain rotary positions take no settings)")
        return theta, ({"rope_type": "default", **turned} if turned else None)
    if kind not in ROPE_SCALINGS:
        problems.append(f"rope scaling {kind!r} in {key} (gptmini computes "
                        f"{', '.join(ROPE_SCALINGS)} scaling and plain rotary positions, "
                        "rope_type 'default')")
        return theta, None
    if kind != "linear" and settings.get("original_max_position_embeddings") is None:
        settings["original_max_position_embeddings"] = config.get("max_position_embeddings")
    if kind == "yarn" and settings.get("factor") is None and settings[
            "original_max_position_embeddings"]:
        settings["factor"] = (config.get("max_position_embeddings", 0)
                              / settings["original_max_position_embeddings"])
    return theta, {"rope_type": kind, **settings, **turned}


def read_rope(config: Mapping, layout: str, problems: list[str], *, partial: bool = False
              ) -> tuple[float, dict | None]:
    """rope_theta and GPTConfig.rope_scaling of a config with one rotary setting for every
    layer (Llama's, Qwen3's; `partial` as read_rope_entry's); `rope_parameters` and
    `rope_scaling` must agree."""
    thetas, scalings = [], {}
    if config.get("rope_theta") is not None:
        thetas.append(config_number(config, "rope_theta", layout, 10000.0))
    for key in ("rope_parameters", "rope_scaling"):
        if config.get(key) is not None:
            theta, scalings[key] = read_rope_entry(config[key], key, config, problems,
                                                   partial=partial)
            thetas += [] if theta is None else [theta]
    if len(scalings) == 2 and scalings["rope_parameters"] != scalings["rope_scaling"]:
        problems.append(f"rope_parameters and rope_scaling that disagree ({scalings}): keep one")
    if len(set(thetas)) > 1:
        problems.append(f"rope_theta values that differ ({sorted(set(thetas))})")
    return (thetas[0] if thetas else 10000.0), next(iter(scalings.values()), None)


def rope_base(config: Mapping, layout: str = "Llama") -> tuple[float, list[str]]:
    """The rotary base of a layout that reads plain rotary positions only (DeepSeek-V3's
    here), and what of its rope entries gptmini cannot compute there."""
    problems: list[str] = []
    theta, scaling = read_rope(config, layout, problems)
    if scaling is not None:
        problems.append(f"rope scaling {scaling['rope_type']!r} (gptmini's {layout} layout "
                        "reads plain rotary positions, rope_type 'default')")
    return theta, problems


def rope_entries(theta: float, scaling: dict | None, *, partial: bool = False) -> dict:
    """config.json's rope entries for `theta` and `scaling`: transformers 5's
    rope_parameters, and for transformers 4 rope_theta and, if scaled, rope_scaling.

    Raises:
        ValueError: `scaling` turns part of each head, and the layout (not `partial`)
            turns every dimension.
    """
    if not partial and PARTIAL in (scaling or {}):
        raise ValueError(f"this model turns only part of each head ({PARTIAL}="
                         f"{scaling[PARTIAL]}), and this layout turns every dimension: "
                         "export it as Qwen3.5's, or train it without partial_rotary_factor")
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return {"rope_theta": theta, "rope_parameters": parameters,
            **({"rope_scaling": dict(scaling)} if scaling else {})}
