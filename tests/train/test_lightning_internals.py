"""The private Lightning and jsonargparse names gptmini relies on: all in one adapter module,
and each still where the installed releases keep it."""

import re
from pathlib import Path

import jsonargparse
import lightning
from lightning.pytorch.callbacks import ModelCheckpoint

import gptmini
from gptmini.train.lightning_internals import (
    PRIVATE_NAMES,
    PrivateName,
    moved_names,
    option_strings,
    owner,
    rewind_batches,
)

ADAPTER = Path(gptmini.__file__).parent / "train" / "lightning_internals.py"


def test_every_private_name_is_where_the_installed_releases_keep_it():
    moved = moved_names()
    assert not moved, "\n".join(moved)


def test_a_removed_name_fails_naming_the_release_the_name_and_its_user(monkeypatch):
    monkeypatch.delattr(ModelCheckpoint, "_monitor_candidates")
    [moved] = moved_names()
    assert moved.startswith(f"lightning {lightning.__version__} has no "
                            "ModelCheckpoint._monitor_candidates, which "
                            "gptmini.train.lightning_internals.save_last_checkpoint uses")


def test_a_changed_signature_fails_naming_both_signatures(monkeypatch):
    monkeypatch.setattr(ModelCheckpoint, "_save_last_checkpoint",
                        lambda self, trainer, candidates, extra: None)
    [moved] = moved_names()
    assert moved.startswith(
        f"lightning {lightning.__version__} changed ModelCheckpoint._save_last_checkpoint: "
        "gptmini.train.lightning_internals.save_last_checkpoint calls it as (self, trainer, "
        f"monitor_candidates), lightning {lightning.__version__} has (self, trainer, "
        "candidates, extra)")


def test_a_moved_attribute_of_a_trainer_or_a_parser_is_named_too():
    names = (PrivateName("lightning", "Trainer()", "fit_loop.epoch_loop.batch_counts.total",
                         kind=int, used_by="rewind_batches"),
             PrivateName("jsonargparse", "ArgumentParser()", "_actions", kind=dict,
                         used_by="option_strings"))
    gone, changed = moved_names(names)
    assert gone.startswith(f"lightning {lightning.__version__} has no "
                           "Trainer().fit_loop.epoch_loop.batch_counts.total")
    assert changed.startswith(f"jsonargparse {jsonargparse.__version__} changed "
                              "ArgumentParser()._actions: gptmini.train.lightning_internals."
                              "option_strings expects a dict, jsonargparse "
                              f"{jsonargparse.__version__} has a list")


def test_no_other_module_of_gptmini_touches_a_private_lightning_name():
    """The adapter's names, and any `_name` imported from lightning or jsonargparse."""
    used = {part for name in PRIVATE_NAMES for part in name.path.split(".")
            if part.startswith("_") or part in ("fit_loop", "epoch_loop", "batch_progress")}
    names = "|".join(sorted(used))
    pattern = re.compile(rf"\.({names})\b|\b(lightning|jsonargparse)[\w.]*\._\w|"
                         r"from (lightning|jsonargparse)[\w.]* import [^#\n]*\b_\w")
    found = [f"{path.relative_to(ADAPTER.parents[2])}:{number}: {line.strip()}"
             for path in sorted(ADAPTER.parents[1].rglob("*.py")) if path != ADAPTER
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert not found, "use gptmini.train.lightning_internals instead:\n" + "\n".join(found)


def test_option_strings_holds_nested_options_as_typed():
    class Model:
        def __init__(self, emb_dim: int = 16, n_layers: int = 2):
            pass

    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--run_name", type=str, default="run")
    parser.add_class_arguments(Model, "model")
    known = option_strings(parser)
    assert {"--run_name", "--model.emb_dim", "--model.n_layers"} <= known
    assert not any(opt.startswith("-") and not opt.startswith("--") for opt in known)


def test_rewind_batches_takes_micro_batches_off_the_run_and_the_epoch_counts():
    trainer = owner("Trainer()")
    total, current = (trainer.fit_loop.epoch_loop.batch_progress.total,
                      trainer.fit_loop.epoch_loop.batch_progress.current)
    for counts, n in ((total, 30), (current, 7)):
        counts.ready = counts.started = counts.processed = counts.completed = n
    rewind_batches(trainer, 3)
    assert [total.ready, total.started, total.processed, total.completed] == [27] * 4
    assert [current.ready, current.started, current.processed, current.completed] == [4] * 4
