"""Sharded checkpoints, as a sharded (FSDP2) run saves them, read whole.

A sharded checkpoint is a directory named as the file it stands for (`last.ckpt/`):

    .metadata, __<rank>_0.distcp   every rank's shards of the weights ("state_dict") and of
                                   the optimizer's states ("optimizer_0"), written by
                                   torch.distributed.checkpoint (each rank its own file)
    meta.pt                        the rest of the training checkpoint: step, loops, schedule,
                                   hyper_parameters, the model's config and vocabulary

That is Lightning's layout for `ModelParallelStrategy`, so a run resumes from it on any
number of ranks (torch.distributed.checkpoint reshards). `read_sharded` assembles the whole
checkpoint in one process, in the single-file layout (optimizer states keyed by position, as
`torch.optim.Optimizer.state_dict` keys them): generate.py, serve.py, evaluate.py and the
Hugging Face export read it as they read a file, and `python -m gptmini.checkpoint
consolidate` writes it as one (which an unsharded run can resume).
"""

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["SHARDED_METADATA", "consolidate", "consolidated_path", "is_sharded", "read_sharded",
           "read_sharded_metadata", "states_by_position"]

SHARDED_METADATA = "meta.pt"
"""The file of a sharded checkpoint's directory that holds all but weights and optimizer
states (Lightning's name for it: gptmini/train/lightning_internals.py checks it)."""


def is_sharded(path: str | Path) -> bool:
    """Whether `path` is a sharded checkpoint's directory."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def read_sharded_metadata(path: str | Path) -> dict:
    """The checkpoint of the directory `path` without its weights and optimizer states
    (cheap: no shard is read).

    Raises:
        ValueError: `meta.pt` is missing or unreadable, naming the directory.
    """
    meta = Path(path) / SHARDED_METADATA
    try:
        return torch.load(meta, map_location="cpu", weights_only=True)
    except Exception as err:  # missing, truncated, or needing arbitrary code
        raise ValueError(
            f"cannot read the sharded checkpoint {path}: its {SHARDED_METADATA} is missing or "
            f"unreadable ({type(err).__name__}: {str(err)[:200]}); pick another checkpoint"
        ) from None


def read_sharded(path: str | Path) -> dict:
    """The whole checkpoint of the directory `path`, in one process, as a single file holds
    it: "state_dict" (whole tensors), "optimizer_states" (by position), and `meta.pt`'s
    entries. Needs memory for all of it (the weights and about twice as much again).

    Raises:
        ValueError: the directory's shards or metadata are unreadable, naming it.
    """
    checkpoint = read_sharded_metadata(path)
    try:
        reader = dcp.FileSystemReader(str(path))
        metadata = reader.read_metadata()
        # Every saved entry, read in full: tensors into empty ones of their whole shape,
        # other values (steps, param groups) as they were saved.
        flat = {key: torch.empty(item.size, dtype=item.properties.dtype)
                if isinstance(item, TensorStorageMetadata) else None
                for key, item in metadata.state_dict_metadata.items()}
        dcp.load(flat, storage_reader=reader, no_dist=True)
    except Exception as err:
        raise ValueError(f"cannot read the sharded checkpoint {path}: its shards are missing "
                         f"or damaged ({type(err).__name__}: {str(err)[:200]})") from None
    whole = _nested(flat, metadata.planner_data)
    checkpoint["state_dict"] = whole.pop("state_dict")
    optimizers = sorted((k for k in whole if k.startswith("optimizer_")),
                        key=lambda k: int(k.removeprefix("optimizer_")))
    checkpoint["optimizer_states"] = [states_by_position(whole[k]) for k in optimizers]
    return checkpoint


def _nested(flat: dict, paths: dict) -> dict:
    """torch.distributed.checkpoint's flattened keys back into the nested dicts and lists
    they were saved from (`paths`: the metadata's planner_data, each key's path)."""
    root: dict = {}
    for key, value in flat.items():
        *parents, last = paths.get(key, (key,))
        node = root
        for part, below in zip(parents, [*parents[1:], last], strict=True):
            if isinstance(node, list):
                node.extend({} for _ in range(part + 1 - len(node)))
            child = node[part] if isinstance(node, list) else node.get(part)
            if child is None:
                child = [] if isinstance(below, int) else {}
                node[part] = child
            node = child
        if isinstance(node, list):
            node.extend(None for _ in range(last + 1 - len(node)))
        node[last] = value
    return root


def states_by_position(optimizer: dict) -> dict:
    """An optimizer state dict keyed by parameter names (what a sharded run saves) keyed by
    position instead, in the order of its param groups: what `Optimizer.load_state_dict`
    reads."""
    position: dict[str, int] = {}
    groups = []
    for group in optimizer["param_groups"]:
        names = group["params"]
        groups.append({**group, "params": [position.setdefault(n, len(position))
                                           for n in names]})
    state = {position[name]: value for name, value in optimizer.get("state", {}).items()}
    return {"state": state, "param_groups": groups}


def consolidated_path(path: str | Path) -> Path:
    """Where `consolidate` writes by default: beside the directory, `last.ckpt/` ->
    `last-consolidated.ckpt`."""
    path = Path(path)
    return path.with_name(f"{path.name.removesuffix('.ckpt')}-consolidated.ckpt")


def consolidate(path: str | Path, out: str | Path | None = None) -> Path:
    """Write the sharded checkpoint `path` as one file (`read_sharded`), atomically: what
    generate.py, serve.py, evaluate.py, the Hugging Face export and an unsharded resume read.

    Raises:
        ValueError: `path` is not a sharded checkpoint, or its parts are unreadable.
    """
    from gptmini.checkpoint.atomic import atomic_save  # Lightning's writer lives beside it

    if not is_sharded(path):
        raise ValueError(f"{path} is not a sharded checkpoint (a directory with .metadata, "
                         "as --trainer.strategy fsdp2 saves): nothing to consolidate")
    return atomic_save(read_sharded(path), consolidated_path(path) if out is None else out)
