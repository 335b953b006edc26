"""train.py on chat records: gptmini's template grows the vocabulary (and a GPT-2 source's
embedding and head), the checkpoint carries its template for serving, and evaluate.py
scores the responses alone."""

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_args

from gptmini.analysis.evaluate import evaluate_main
from gptmini.chat import BOOK, GPTMINI, template_for
from gptmini.checkpoint import load_checkpoint
from gptmini.convert import export_hf
from gptmini.model import GPTConfig, GPTModel
from gptmini.train.command import main

REPO = Path(__file__).resolve().parents[2]

CHAT = [{"role": "user", "content": "Who loves Juliet?"},
        {"role": "assistant", "content": "Romeo."}, {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "Paris, too."}]


@pytest.fixture
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": CHAT}) for _ in range(60)))
    return path


def test_a_chat_fine_tune_from_gpt2_grows_the_vocabulary_and_carries_its_template(
        tmp_path, corpus, chat_file, capsys):
    torch.manual_seed(0)
    source = export_hf(GPTModel(GPTConfig(vocab_size=50257, context_length=64, emb_dim=32,
                                          n_heads=2, n_layers=2, qkv_bias=True,
                                          tie_weights=True)), tmp_path / "gpt2")
    before = load_checkpoint(source).model.tok_emb.weight.detach()
    args = ["--config", str(REPO / "configs" / "book-gpt2.yaml"), *tiny_args(
                     tmp_path, corpus, "--model.init_from", str(source), "--model.qkv_bias", "true",
                     "--model.context_length", "64", "--model.learning_rate", "1e-9",
                     "--data.chat.records", str(chat_file), "--trainer.max_steps", "2",
                     "--model.warmup_steps", "1", "--checkpoint_every", "2")]
    assert main(args) == 0
    assert "template gptmini: 51 training examples" in capsys.readouterr().out
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    model, tokenizer, hparams = load_checkpoint(ckpt)
    assert tokenizer.n_vocab == 50257 + 4 and model.cfg.vocab_size == 50261
    assert template_for(tokenizer, hparams) == GPTMINI
    emb = model.tok_emb.weight.detach()
    torch.testing.assert_close(emb[:50257], before, atol=1e-5, rtol=0)  # lr 1e-9: unchanged
    torch.testing.assert_close(emb[50257:], before.mean(0).expand(4, -1), atol=1e-5, rtol=0)

    assert evaluate_main(["--checkpoint", str(ckpt), "--responses", str(chat_file),
                          "--limit", "4"]) == 0
    out = capsys.readouterr().out
    tokens = 4 * (len(tokenizer.encode("Romeo.")) + len(tokenizer.encode("Paris, too.")) + 2)
    assert f"4 responses, {tokens} tokens, {4 * len('Romeo.Paris, too.')} bytes" in out


def test_the_books_records_train_a_model_from_scratch_with_the_books_prompt(tmp_path, corpus,
                                                                             capsys):
    args = tiny_args(tmp_path, corpus, "--data.chat.records", "book",
                     "--model.context_length", "96", "--data.chat.too_long", "drop",
                     "--trainer.max_steps", "4", "--checkpoint_every", "4")
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "chat records book, template book: " in said and "dropped as too long" not in said
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    _, tokenizer, hparams = load_checkpoint(ckpt)
    assert tokenizer.n_vocab == 50257 and template_for(tokenizer, hparams) == BOOK
    for responses in (["--responses"], []):  # a chat run's checkpoint: responses by default
        assert evaluate_main(["--checkpoint", str(ckpt), *responses, "--limit", "8"]) == 0
        assert "the test split of book (110 records), template book: 8 responses" in \
            capsys.readouterr().out


def test_a_missing_records_file_is_one_clear_line(tmp_path, corpus, capsys):
    assert main(tiny_args(tmp_path, corpus, "--data.chat.records", "nope.jsonl")) == 1
    assert "chat records nope.jsonl: no such file" in capsys.readouterr().err
