"""The random state of a process (torch's CPU and CUDA generators, Python's), saved in
checkpoints and restored on resume, so that a resumed run draws the dropout masks an
uninterrupted one would."""

import random

import torch

__all__ = ["rng_states", "set_rng_states"]


def rng_states() -> dict:
    """This process's random generators: torch (CPU, and CUDA when present) and Python's."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(_as_tuples(states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _as_tuples(value):
    """random.setstate wants the tuples that a checkpoint round trip may turn into lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list | tuple) else value
