"""The random state of a process (torch's CPU and CUDA generators, Python's), saved in
checkpoints and restored on resume, so that a resumed run draws the dropout masks an
uninterrupted one would."""

import random
import warnings

import torch

__all__ = ["every_rank_states", "restore_rank_states", "rng_states", "set_rng_states"]


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


def every_rank_states(world_size: int) -> list[dict]:
    """Every rank's `rng_states`, in rank order: every rank saves, rank 0 writes."""
    states = rng_states()
    if world_size > 1 and torch.distributed.is_initialized():
        per_rank = [None] * world_size
        torch.distributed.all_gather_object(per_rank, states)
        return per_rank
    return [states]


def restore_rank_states(states: list | dict | None, rank: int, world_size: int) -> None:
    """Restore this rank's own states of a checkpoint's `every_rank_states` (a dict: from
    before one state per rank), saying so when the world size changed and dropout will
    differ from an uninterrupted run. None or empty: nothing to restore."""
    if not states:
        return
    if isinstance(states, dict):
        states = [states]
    if len(states) != world_size:
        warnings.warn(
            f"the checkpoint holds the random state of {len(states)} rank(s) and this run "
            f"has {world_size}: dropout will differ from an uninterrupted run",
            stacklevel=2,
        )
    set_rng_states(states[rank % len(states)])
