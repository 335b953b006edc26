"""Every private Lightning and jsonargparse name gptmini uses, in one place.

Three things a training run needs have no public API:

- `save_last_checkpoint`: have a `ModelCheckpoint` write its last.ckpt at the step a run
  ends on (Lightning's writes it only at its own intervals, so a run's last steps could be
  in no file);
- `rewind_batches`: move the fit loop's batch counters back to the last optimizer step, when
  a signal stops a run inside a gradient accumulation (the replayed micro-batches must not
  count twice on resume);
- `option_strings`: every `--a.b` option a jsonargparse parser knows, so that a mistyped
  one is named with the closest known one.

Each is a small function here, and nothing else in gptmini touches a private Lightning or
jsonargparse name. `PRIVATE_NAMES` lists each name with the parameters these functions call
it with; `moved_names()` checks them on the installed versions, and a test runs it, so a
release inside the version pins that moves one fails a test naming the release and the
name, instead of breaking resume at the first signal.
"""

import inspect
from dataclasses import dataclass
from typing import Any

import jsonargparse
import lightning
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["PRIVATE_NAMES", "PrivateName", "moved_names", "option_strings", "owner",
           "rewind_batches", "save_last_checkpoint"]

WRITTEN_AGAINST = {"lightning": "2.6.6", "jsonargparse": "4.53.0"}
"""The releases the names below were last checked against."""

BATCH_PROGRESS = "fit_loop.epoch_loop.batch_progress"
"""Where a Trainer keeps its count of training batches (`_BatchProgress`)."""
BATCH_TRACKERS = ("total", "current")  # the whole run's count, and this epoch's
BATCH_COUNTERS = ("ready", "started", "processed", "completed")


@dataclass(frozen=True)
class PrivateName:
    """One private name, how it is reached, and how gptmini uses it.

    Attributes:
        package: "lightning" or "jsonargparse": whose release can move it.
        owner: what `path` starts from: a class, or an instance ("Trainer()").
        path: the dotted attributes from `owner` to the name.
        parameters: a method's parameters as called here, `self` first; None for a value.
        kind: a value's type (None for a method).
        used_by: the function of this module that needs it.
    """

    package: str
    owner: str
    path: str
    parameters: tuple[str, ...] | None = None
    kind: type | None = None
    used_by: str = ""

    def __str__(self) -> str:
        return f"{self.owner}.{self.path}"


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("lightning", "ModelCheckpoint", "_should_skip_saving_checkpoint",
                ("self", "trainer"), used_by="save_last_checkpoint"),
    PrivateName("lightning", "ModelCheckpoint", "_monitor_candidates", ("self", "trainer"),
                used_by="save_last_checkpoint"),
    PrivateName("lightning", "ModelCheckpoint", "_save_last_checkpoint",
                ("self", "trainer", "monitor_candidates"), used_by="save_last_checkpoint"),
    *(PrivateName("lightning", "Trainer()", f"{BATCH_PROGRESS}.{tracker}.{counter}", kind=int,
                  used_by="rewind_batches")
      for tracker in BATCH_TRACKERS for counter in BATCH_COUNTERS),
    PrivateName("jsonargparse", "ArgumentParser()", "_actions", kind=list,
                used_by="option_strings"),
)


def save_last_checkpoint(callback: ModelCheckpoint, trainer: Trainer) -> None:
    """Have `callback` write its last checkpoint now, as at one of its own intervals.

    Nothing is written where Lightning itself would not write (fast_dev_run, the sanity
    check, outside fit) or when this step is already saved.
    """
    if not callback._should_skip_saving_checkpoint(trainer):
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def rewind_batches(trainer: Trainer, micro_batches: int) -> None:
    """Take the last `micro_batches` training batches off the fit loop's counts.

    Only for micro-batches after the last optimizer step: inside an accumulation only these
    counters move (no optimizer, scheduler or validation step), so the loop is then as it
    was at the end of that step's batch, and a resume replays the micro-batches rewound.
    """
    progress = _follow(trainer, BATCH_PROGRESS)
    for tracker in BATCH_TRACKERS:
        counts = getattr(progress, tracker)
        for counter in BATCH_COUNTERS:
            setattr(counts, counter, getattr(counts, counter) - micro_batches)


def option_strings(parser: jsonargparse.ArgumentParser) -> set[str]:
    """Every `--name` option `parser` accepts, nested groups' (`--model.emb_dim`) included:
    jsonargparse keeps all its actions, flattened, in argparse's `_actions`."""
    return {opt for action in parser._actions for opt in action.option_strings
            if opt.startswith("--")}


# --- the check ----------------------------------------------------------------------------

def owner(label: str) -> Any:
    """What a `PrivateName.owner` label stands for: the class itself, or a fresh instance."""
    if label == "ModelCheckpoint":
        return ModelCheckpoint
    if label == "Trainer()":
        return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False)
    if label == "ArgumentParser()":
        return jsonargparse.ArgumentParser()
    raise ValueError(f"no owner {label!r}: use ModelCheckpoint, Trainer() or ArgumentParser()")


def moved_names(names: tuple[PrivateName, ...] = PRIVATE_NAMES) -> list[str]:
    """The private names that the installed Lightning or jsonargparse no longer has as
    `names` says, one sentence each naming the release, the name and its user here
    (empty when all are where they were)."""
    owners: dict[str, Any] = {}
    problems = []
    for name in names:
        release = f"{name.package} {_version(name.package)}"
        user = f"gptmini.train.lightning_internals.{name.used_by}"
        was = f"(gptmini was checked against {name.package} {WRITTEN_AGAINST[name.package]})"
        if name.owner not in owners:
            owners[name.owner] = owner(name.owner)
        try:
            value = _follow(owners[name.owner], name.path)
        except AttributeError:
            problems.append(f"{release} has no {name}, which {user} uses {was}")
            continue
        if name.parameters is not None:
            found = _parameters(value)
            if found != name.parameters:
                problems.append(
                    f"{release} changed {name}: {user} calls it as ({', '.join(name.parameters)})"
                    f", {release} has ({', '.join(found or ('?',))}) {was}")
        elif name.kind is not None and not isinstance(value, name.kind):
            problems.append(f"{release} changed {name}: {user} expects a {name.kind.__name__}, "
                            f"{release} has a {type(value).__name__} {was}")
    return problems


def _follow(obj: Any, path: str) -> Any:
    for attribute in path.split("."):
        obj = getattr(obj, attribute)
    return obj


def _parameters(function: Any) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # not a function
        return None


def _version(package: str) -> str:
    return {"lightning": lightning, "jsonargparse": jsonargparse}[package].__version__
