"""An export is written whole or not at all (issue 36 items 1 and 7): a failure while
writing leaves the earlier export as it was, nothing of another model stays beside a new
one, and every file has the same permissions."""

import errno
import json
import os
import stat

import pytest
import torch

import gptmini.convert.hub as hub
from gptmini.checkpoint import load_checkpoint
from gptmini.convert import export_hf
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import get_tokenizer, tokenizer_fingerprint, train_bpe


def byte_model(seed: int, vocab_size: int = 257) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(GPTConfig(vocab_size=vocab_size, context_length=16, emb_dim=16, n_heads=2,
                              n_layers=1, drop_rate=0.0, qkv_bias=True,
                              tie_weights=True)).eval()


def files_of(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def full_disk_after(limit: int):
    """A weight writer that writes `limit` bytes and then fails as a full disk does."""

    def save_file(state, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * limit)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    return save_file


def test_a_failed_export_leaves_the_earlier_one_as_it_was(tmp_path, monkeypatch):
    target = tmp_path / "export"
    first = byte_model(0)
    export_hf(first, target, get_tokenizer("byte"))
    before = files_of(target)
    # Another model, with another vocabulary: its tokenizer.json would fit, its weights not.
    bpe = train_bpe(["to be or not to be, that is the question " * 40], 280)
    monkeypatch.setattr(hub, "save_file", full_disk_after(100))
    with pytest.raises(OSError, match=r"could not write the export .*No space left.*unchanged"):
        export_hf(byte_model(1, bpe.n_vocab), target, bpe)
    assert files_of(target) == before  # byte for byte: the old tokenizer.json too
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no staging left behind
    monkeypatch.undo()
    back = load_checkpoint(target)
    assert tokenizer_fingerprint(back.tokenizer) == tokenizer_fingerprint(get_tokenizer("byte"))
    idx = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert torch.equal(back.model(idx), first(idx))


def test_an_interrupted_export_leaves_the_earlier_one(tmp_path, monkeypatch):
    target = tmp_path / "export"
    export_hf(byte_model(0), target, get_tokenizer("byte"))
    before = files_of(target)

    def interrupted(state, path, metadata=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(hub, "save_file", interrupted)
    bpe = train_bpe(["to be or not to be, that is the question " * 40], 280)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C after the tokenizer, before the weights
        export_hf(byte_model(1, bpe.n_vocab), target, bpe)
    assert files_of(target) == before and len(list(tmp_path.iterdir())) == 1


def test_an_export_without_a_tokenizer_leaves_no_foreign_one(tmp_path):
    target = tmp_path / "export"
    bpe = train_bpe(["to be or not to be, that is the question " * 40], 280)
    export_hf(byte_model(0, bpe.n_vocab), target, bpe)
    assert (target / "tokenizer.json").is_file()
    gpt2_sized = byte_model(1, 50257)
    export_hf(gpt2_sized, target)  # no tokenizer: GPT-2's vocabulary is the layout's default
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    back = load_checkpoint(target)
    assert back.tokenizer.n_vocab == 50257  # GPT-2's, not the fitted bpe left from before


def test_export_files_share_one_mode(tmp_path):
    old = os.umask(0o022)
    try:
        target = export_hf(byte_model(0), tmp_path / "export", get_tokenizer("byte"))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()}
    assert modes == dict.fromkeys(modes, 0o644), modes
    assert stat.S_IMODE(target.stat().st_mode) == 0o755


def test_export_refuses_a_directory_holding_other_files(tmp_path):
    target = tmp_path / "work"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (target / "data").mkdir()
    with pytest.raises(ValueError, match=r"not a model's \(data/, notes.txt\).*new or empty"):
        export_hf(byte_model(0), target)
    assert sorted(p.name for p in target.iterdir()) == ["data", "notes.txt"]
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        export_hf(byte_model(0), tmp_path / "f")


def test_an_old_directory_left_aside_by_a_kill_is_put_back(tmp_path):
    target = tmp_path / "export"
    export_hf(byte_model(0), target)
    before = files_of(target)
    aside = tmp_path / ".export.old-99999"  # a kill between the two renames of a swap
    target.rename(aside)
    (tmp_path / ".export.tmp-99999").mkdir()  # and its half-written new directory
    config = json.loads((aside / "config.json").read_text())
    with pytest.raises(ValueError, match="holds files"):  # the recovered one is checked too
        (aside / "stray.txt").write_text("x")
        export_hf(byte_model(1), target)
    assert files_of(target) == {**before, "stray.txt": b"x"}
    assert json.loads((target / "config.json").read_text()) == config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
