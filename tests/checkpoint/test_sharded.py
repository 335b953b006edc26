"""Sharded checkpoints (a directory of torch.distributed.checkpoint shards and meta.pt): saved
so that a failed or killed save leaves the previous one, and read whole in one process."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gptmini.checkpoint.atomic import remove_stale_temporaries, replace_directory
from gptmini.checkpoint.sharded import is_sharded, read_sharded, states_by_position
from gptmini.train.sharding import FSDP2Strategy

# one process writes what a run's ranks write together: torch says so, once per save
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def write_sharded(path, value: float, step: int) -> None:
    """A sharded checkpoint as a run saves one (one rank), its weight filled with `value`."""
    dcp.save({"state_dict": {"model.w": torch.full((3, 2), value)},
              "optimizer_0": {"state": {"model.w": {"exp_avg": torch.full((3, 2), value)}},
                              "param_groups": [{"lr": 0.5, "params": ["model.w"]}]}},
             checkpoint_id=path, no_dist=True)
    torch.save({"global_step": step, "hyper_parameters": {"emb_dim": 2}}, path / "meta.pt")


def test_read_sharded_gives_the_single_file_layout(tmp_path):
    write_sharded(tmp_path / "last.ckpt", 1.5, step=7)
    assert is_sharded(tmp_path / "last.ckpt") and not is_sharded(tmp_path)
    whole = read_sharded(tmp_path / "last.ckpt")
    assert whole["global_step"] == 7 and whole["hyper_parameters"] == {"emb_dim": 2}
    assert torch.equal(whole["state_dict"]["model.w"], torch.full((3, 2), 1.5))
    (optimizer,) = whole["optimizer_states"]
    assert optimizer["param_groups"] == [{"lr": 0.5, "params": [0]}]  # by position
    assert torch.equal(optimizer["state"][0]["exp_avg"], torch.full((3, 2), 1.5))


def test_states_by_position_follow_the_param_groups_order():
    named = {"state": {"b": {"m": 2}, "a": {"m": 1}},
             "param_groups": [{"params": ["b"]}, {"params": ["c", "a"]}]}
    assert states_by_position(named) == {"state": {0: {"m": 2}, 2: {"m": 1}},
                                         "param_groups": [{"params": [0]}, {"params": [1, 2]}]}


def test_a_directory_replaces_the_previous_one_whole(tmp_path):
    target, new = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.tmp-1"
    write_sharded(target, 1.0, step=1)
    write_sharded(new, 2.0, step=2)
    replace_directory(new, target)
    assert read_sharded(target)["global_step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the old one gone


def test_a_kill_between_the_two_renames_puts_the_previous_one_back(tmp_path):
    """The one moment no last.ckpt exists: the previous one is aside, the new one staged."""
    aside, staged = tmp_path / f".last.ckpt.old-{os.getpid()}", tmp_path / ".last.ckpt.tmp-9"
    write_sharded(aside, 1.0, step=1)
    write_sharded(staged, 2.0, step=2)
    remove_stale_temporaries(tmp_path)
    assert read_sharded(tmp_path / "last.ckpt")["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_kill_after_the_swap_keeps_the_new_one_and_drops_the_old(tmp_path):
    write_sharded(tmp_path / f".last.ckpt.old-{os.getpid()}", 1.0, step=1)
    write_sharded(tmp_path / "last.ckpt", 2.0, step=2)
    remove_stale_temporaries(tmp_path)
    assert read_sharded(tmp_path / "last.ckpt")["global_step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_failed_sharded_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """A full disk while the shards are written: the error comes out, last.ckpt is the
    previous one, and nothing staged is left (the strategy outside a process group, as on
    one rank)."""
    target = tmp_path / "last.ckpt"
    write_sharded(target, 1.0, step=1)

    def full_disk(state, checkpoint_id):
        checkpoint_id.mkdir()
        (checkpoint_id / "__0_0.distcp").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        FSDP2Strategy().save_checkpoint({"state_dict": {}, "optimizer_states": [],
                                         "global_step": 2}, target)
    assert read_sharded(target)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_sharded_save_replaces_a_file_of_the_same_name(tmp_path):
    """A run that saved single files and resumes sharded: last.ckpt becomes a directory."""
    target = tmp_path / "last.ckpt"
    torch.save({"global_step": 1}, target)
    FSDP2Strategy().save_checkpoint({"state_dict": {"model.w": torch.ones(2)},
                                     "optimizer_states": [], "global_step": 2}, target)
    assert is_sharded(target) and read_sharded(target)["global_step"] == 2
