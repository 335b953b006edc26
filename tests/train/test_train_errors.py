"""Errors, not tracebacks: each ordinary mistake ends in one line naming the input and the fix.

Each row printed a raw traceback before. The network is never reached (see conftest.py).
"""

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import HANG_SECONDS, make_model, save_checkpoint, tiny_args

import gptmini.checkpoint.atomic as checkpoint_io
from gptmini.convert import export_hf
from gptmini.generate.command import generate_main
from gptmini.train.command import main

REPO = Path(__file__).resolve().parents[2]


def corrupt_checkpoint(tmp_path: Path) -> Path:
    path = save_checkpoint(make_model(vocab_size=50257), tmp_path / "cut.ckpt")
    path.write_bytes(path.read_bytes()[:5000])
    return path


def nan_checkpoint(tmp_path: Path) -> Path:
    model = make_model(vocab_size=50257)
    with torch.no_grad():
        model.final_norm.weight[:2] = float("nan")
    return save_checkpoint(model, tmp_path / "nan.ckpt")


# Each row: (files to write under tmp_path, extra arguments (with {tmp} for tmp_path), what
# the one line must say).
TRAIN_ROWS = {
    "typo'd local path": (
        {"small.txt": "text " * 500}, ["--data.corpus.source", "smal"],
        ["no file or directory 'smal' here", "hub dataset", "Did you mean the local 'small.txt'"],
    ),
    "hub name offline": (
        {}, ["--data.corpus.source", "someone/corpus"],
        ["taken for a Hugging Face hub dataset", "--data.corpus.hub_revision", "offline"],
    ),
    "truncated jsonl line": (
        {"d.jsonl": '{"text": "one two three"}\n' * 40 + '{"text": "cut off mi'},
        ["--data.corpus.source", "{tmp}/d.jsonl"],
        ["d.jsonl line 41 is not valid JSON", "fix or remove that line"],
    ),
    "a .gz that is not gzip": (
        {"plain.txt.gz": "not compressed at all " * 100},
        ["--data.corpus.source", "{tmp}/plain.txt.gz"],
        ["plain.txt.gz is not a valid .gz file", "rename it without .gz"],
    ),
    "UTF-16 text": (
        {"wide.txt": ("\ufeff" + "text in UTF-16 " * 100).encode("utf-16-le")},
        ["--data.corpus.source", "{tmp}/wide.txt"],
        ["wide.txt is UTF-16LE (little-endian), not UTF-8", "iconv -f UTF-16LE -t UTF-8"],
    ),
    "UTF-32 text": (
        {"wider.txt": ("text in UTF-32 " * 100).encode("utf-32")},
        ["--data.corpus.source", "{tmp}/wider.txt"],
        ["wider.txt is UTF-32LE (little-endian), not UTF-8"],
    ),
    "negative checkpoint_every": (
        {}, ["--checkpoint_every", "-1"], ["--checkpoint_every=-1 is invalid: use 1 or more"],
    ),
    "beta1 above 1": ({}, ["--model.beta1", "1.5"], ["--model.beta1 1.5 is invalid: use a "
                                                      "number in [0, 1)"]),
    "an infinite norm_eps (YAML .inf)": ({}, ["--model.norm_eps", ".inf"],
                                         ["--model.norm_eps inf is invalid"]),
    "an infinite attn_softcap": ({}, ["--model.attn_softcap", ".inf"],
                                 ["--model.attn_softcap inf is invalid"]),
    "a negative gradient_clip_val": ({}, ["--trainer.gradient_clip_val", "-1"],
                                     ["--trainer.gradient_clip_val -1"]),
    "a seed above 32 bits": ({}, ["--seed_everything", str(2**32 + 1)],
                             ["--seed_everything 4294967297 is out of range"]),
    "a stop_grace of nan": ({}, ["--stop_grace", ".nan"], ["--stop_grace=nan is invalid"]),
    "negative max_steps": (
        {}, ["--trainer.max_steps", "-5"], ["`max_steps` must be a non-negative integer or -1"],
    ),
    "a GPU that is not there": (
        {}, ["--trainer.accelerator", "gpu"],
        ["--trainer.accelerator gpu: this machine has no CUDA GPU", "use --trainer.accelerator"],
    ),
    "a tokenizer to download, offline": (
        {}, ["--model.tokenizer", "cl100k_base"],
        ["'cl100k_base' needs its vocabulary from the internet", "tokenizer 'gpt2'"],
    ),
    "a text file as --ckpt_path": (
        {"notes.ckpt": "these are my notes"}, ["--ckpt_path", "{tmp}/notes.ckpt"],
        ["notes.ckpt: it is corrupt, truncated or not a PyTorch checkpoint"],
    ),
    "a truncated --ckpt_path": (
        {"cut.ckpt": corrupt_checkpoint}, ["--ckpt_path", "{tmp}/cut.ckpt"],
        ["cut.ckpt: it is corrupt, truncated or not a PyTorch checkpoint"],
    ),
    "resuming a checkpoint holding NaN": (
        {"nan.ckpt": nan_checkpoint}, ["--ckpt_path", "{tmp}/nan.ckpt"],
        ["--ckpt_path", "nan.ckpt holds non-finite weights", "model.final_norm.weight (2 of"],
    ),
    "validation inside a gradient accumulation": (
        {}, ["--trainer.accumulate_grad_batches", "4", "--trainer.val_check_interval", "10"],
        ["val_check_interval=10 batches is not a multiple of accumulate_grad_batches=4",
         "--trainer.val_check_interval 8"],
    ),
}


@pytest.mark.parametrize("row", TRAIN_ROWS)
def test_train_py_mistakes_end_in_one_clear_line(tmp_path, corpus, capsys, monkeypatch, row):
    files, extra, expected = TRAIN_ROWS[row]
    for name, content in files.items():
        path = tmp_path / name
        if callable(content):
            content(tmp_path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)  # the .gz row: named .gz, but plain text
    monkeypatch.chdir(tmp_path)  # where a typo'd relative path is looked up
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "no-tiktoken-cache"))
    args = tiny_args(tmp_path, corpus, *(a.replace("{tmp}", str(tmp_path)) for a in extra))
    assert main(args) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("train.py: error: ")
    for phrase in expected:
        assert phrase in last, (phrase, last)


def test_a_truncated_safetensors_file_in_a_hugging_face_directory(tmp_path, capsys):
    directory = export_hf(make_model(vocab_size=50257, qkv_bias=True, tie_weights=True),
                          tmp_path / "hf")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SystemExit) as exc:
        generate_main(["--hf", str(directory), "--max_new_tokens", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "cannot read the weights in" in err and "truncated or damaged" in err


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_disk_that_fills_or_turns_read_only_during_a_save(
    tmp_path, corpus, capsys, monkeypatch, code
):
    """The run stops with one line; the checkpoint saved before it is whole and loads."""
    args = tiny_args(tmp_path, corpus, "--trainer.max_steps", "4", "--checkpoint_every", "2")
    real, saves = torch.save, []

    def save(obj, f):  # the second checkpoint meets the full (or read-only) disk
        saves.append(1)
        if len(saves) == 2:
            f.write(b"half a checkpoint")
            raise OSError(code, os.strerror(code))
        real(obj, f)

    monkeypatch.setattr(checkpoint_io.torch, "save", save)
    assert main(args) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"could not write the checkpoint {tmp_path}" in last and os.strerror(code) in last
    assert "unchanged" in last and "--ckpt_path last" in last
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2


@pytest.mark.slow
def test_a_file_size_limit_stops_the_run_with_one_line_and_keeps_the_last_checkpoint(
    tmp_path, corpus
):
    args = tiny_args(tmp_path, corpus, "--trainer.max_steps", "6", "--checkpoint_every", "2",
                     "--model.emb_dim", "64", "--model.context_length", "32")
    first = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=HANG_SECONDS,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    size, before = ckpt.stat().st_size, ckpt.read_bytes()

    def limit():  # every file this process writes must stay below one checkpoint
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))

    resumed = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args, "--trainer.max_steps", "10",
         "--ckpt_path", "last"],
        cwd=tmp_path, capture_output=True, text=True, timeout=HANG_SECONDS, preexec_fn=limit,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert resumed.returncode == 1, resumed.stderr[-2000:]
    last = resumed.stderr.strip().splitlines()[-1]
    assert "Traceback" not in resumed.stderr and "could not write the checkpoint" in last
    assert "File too large" in last
    assert ckpt.read_bytes() == before
    assert not list(ckpt.parent.glob(".*.tmp-*"))

