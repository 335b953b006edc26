"""evaluate.py: loss, perplexity and bits per byte over every token of a text, and lm-eval's
acc and acc_norm on multiple-choice records, checked against answers worked out by hand."""

import json
import math

import numpy as np
import pytest
import torch
from helpers import make_model, save_checkpoint, tiny_args

from gptmini.analysis.evaluate import (
    choice_logliks,
    evaluate_main,
    read_choices,
    score_choices,
    score_text,
)
from gptmini.tokenizer import get_tokenizer

BYTE = get_tokenizer("byte")


def uniform_model(context_length: int = 4):
    """Every weight 0: the logits are 0, so every one of the 257 ids has probability 1/257."""
    model = make_model(vocab_size=257, context_length=context_length)
    for p in model.parameters():
        torch.nn.init.zeros_(p)
    return model


def test_every_token_is_scored_once_and_bpb_follows_by_hand():
    # 11 tokens, windows of 4: targets 1-4, 5-8, then the tail's 9-10: 10 predictions.
    text = "hello<|endoftext|>world"
    tokens = np.array(BYTE.encode(text, allowed_special="all"))
    score = score_text(uniform_model(), BYTE, tokens, batch_size=2, progress=False)
    assert score.tokens == len(tokens) - 1 == 10
    assert score.bytes == 9  # <|endoftext|> stands for no text
    assert score.loss == pytest.approx(math.log(257), rel=1e-6)  # the model's float32 loss
    assert score.perplexity == pytest.approx(257, rel=1e-6)
    assert score.bpb == pytest.approx(math.log2(257), rel=1e-6)  # 1 byte a token


def test_text_score_equals_one_pass_over_the_whole_text():
    torch.manual_seed(0)
    tokens = np.array(BYTE.encode("ROMEO: But soft, what light"))
    model = make_model(vocab_size=257, context_length=64).double()
    score = score_text(model, BYTE, tokens, progress=False)
    ids = torch.tensor(tokens)
    logp = torch.log_softmax(model(ids[None, :-1]), -1)[0]
    expected = -logp.gather(1, ids[1:, None]).mean().item()
    assert score.loss == pytest.approx(expected, rel=1e-6)  # the model's loss is float32
    assert score.bpb == pytest.approx(expected / math.log(2), rel=1e-6)


def test_acc_and_acc_norm_are_lm_evals_worked_out_by_hand():
    """Uniform model: " " + ending scores -(len + 1) ln 257, so acc takes the shortest ending
    and acc_norm (divided by the ending's characters) the longest."""
    endings = ["a", "bbb", "cc", "dddd"]
    examples = [{"ctx": "Q:", "endings": endings, "label": 0},   # acc right, acc_norm wrong
                {"ctx": "Q:", "endings": endings, "label": "3"},  # hub labels are strings
                {"ctx": "Q:", "endings": ["y", "xx"], "label": 1}]  # acc wrong, acc_norm right
    # Dividing by tokens (or by characters with the space) would tie every ending here and
    # take the first: acc_norm 1/3, not 2/3.
    lls = choice_logliks(uniform_model(16), BYTE, "Q:", endings)
    assert lls == pytest.approx([-(len(e) + 1) * math.log(257) for e in endings], rel=1e-6)
    score = score_choices(uniform_model(16), BYTE, examples, progress=False)
    assert (score.acc, score.acc_norm, score.examples) == (pytest.approx(1 / 3),
                                                           pytest.approx(2 / 3), 3)


def test_a_choice_longer_than_the_context_keeps_its_last_tokens():
    lls = choice_logliks(uniform_model(4), BYTE, "Q:", ["dddd", "eeeeeeee"])
    assert lls == pytest.approx([-4 * math.log(257)] * 2, rel=1e-6)  # 4 targets fit


def test_choice_logliks_equal_each_ending_scored_alone():
    """Endings of different lengths share a batch (right-padded): each must score as alone."""
    torch.manual_seed(0)
    model = make_model(vocab_size=257, context_length=64).double()
    context, endings = "JULIET: O Romeo,", ["Romeo", "wherefore art thou", "no"]
    prefix = BYTE.encode(context)
    for ending, ll in zip(endings, choice_logliks(model, BYTE, context, endings), strict=True):
        ids = torch.tensor(prefix + BYTE.encode(" " + ending))
        logp = torch.log_softmax(model(ids[None, :-1]), -1)[0]
        alone = logp.gather(1, ids[1:, None])[len(prefix) - 1:].sum().item()
        assert ll == pytest.approx(alone, rel=1e-6)  # the model's loss is float32


def test_records_come_from_a_jsonl_file_or_through_datasets(tmp_path, monkeypatch):
    import datasets

    records = [{"ctx": "a", "endings": ["b", "c"], "label": "1"}] * 3
    (tmp_path / "mc.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert read_choices(str(tmp_path / "mc.jsonl"), limit=2)[0] == records[:2]
    asked = {}

    def load_dataset(name, split):
        asked.update(name=name, split=split)
        return datasets.Dataset.from_list(records)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    rows, name = read_choices("Rowan/hellaswag", "validation", limit=2)
    assert rows == records[:2] and asked == {"name": "Rowan/hellaswag", "split": "validation"}
    assert name == "Rowan/hellaswag (validation)"


def test_evaluate_py_scores_a_runs_whole_validation_split_and_names_bad_records(
    tmp_path, corpus, capsys
):
    from gptmini.train.command import main

    assert main(tiny_args(tmp_path, corpus, "--trainer.max_steps", "10")) == 0
    best = tmp_path / "runs" / "tiny" / "checkpoints" / "best.ckpt"
    capsys.readouterr()
    assert evaluate_main(["--checkpoint", str(best)]) == 0
    out = capsys.readouterr().out
    val = torch.load(best, weights_only=True)["datamodule_hyper_parameters"]
    assert val["val_fraction"] == 0.1
    assert out.startswith("the run's validation split: 312 tokens predicted")  # 313 tokens
    assert "bits per byte" in out

    assert evaluate_main(["--checkpoint", str(best), "--data", str(corpus)]) == 0
    assert f"{corpus}: " in capsys.readouterr().out

    (tmp_path / "mc.jsonl").write_text(
        json.dumps({"ctx": "Romeo said", "endings": [" hello", " moon"], "label": 0}) + "\n")
    assert evaluate_main(["--checkpoint", str(best), "--choices", str(tmp_path / "mc.jsonl")]) == 0
    assert "1 examples\nacc " in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text(json.dumps({"context": "x", "endings": ["a"]}) + "\n")
    assert evaluate_main(["--checkpoint", str(best), "--choices", str(tmp_path / "bad.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "example 1 has no ctx, label (HellaSwag's layout" in err and "context" in err


def test_a_checkpoint_without_a_corpus_asks_for_data(tmp_path, capsys):
    ckpt = save_checkpoint(make_model(vocab_size=257), tmp_path / "m.ckpt", tokenizer="byte")
    assert evaluate_main(["--checkpoint", str(ckpt)]) == 1
    assert "pass --data PATH" in capsys.readouterr().err
