"""evaluate.py: loss, perplexity and bits per byte over every token of a text, and lm-eval's
acc and acc_norm on multiple-choice records, checked against answers worked out by hand."""

import json
import math
import re
from pathlib import Path

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
from gptmini.finetune import add_class_head
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
    assert "bad.jsonl, line 1 has no ctx, label (HellaSwag's layout" in err
    assert err.rstrip().endswith("its fields: context, endings")


def test_a_checkpoint_without_a_corpus_asks_for_data(tmp_path, capsys):
    ckpt = save_checkpoint(make_model(vocab_size=257), tmp_path / "m.ckpt", tokenizer="byte")
    assert evaluate_main(["--checkpoint", str(ckpt)]) == 1
    assert "pass --data PATH" in capsys.readouterr().err


# --- what is not a score is refused, by name ----------------------------------------------

LAYOUT_RECORDS = {
    "endings a string (iterated as characters)": ({"ctx": "Q", "endings": "abc", "label": 0},
                                                  "endings must be a list of non-empty strings, "
                                                  "got a string"),
    "endings null": ({"ctx": "Q", "endings": None, "label": 0}, "endings must be a list"),
    "endings numbers": ({"ctx": "Q", "endings": [1, 2], "label": 0},
                        "got a list holding an integer"),
    "endings one": ({"ctx": "Q", "endings": ["a"], "label": 0}, "a choice needs at least 2"),
    "label a float": ({"ctx": "Q", "endings": ["a", "b"], "label": 1.0},
                      "label must be an integer in 0..1 (the index of the right ending), got "
                      "1.0 (a number)"),
    "label a boolean": ({"ctx": "Q", "endings": ["a", "b"], "label": True}, "(a boolean)"),
    "label null": ({"ctx": "Q", "endings": ["a", "b"], "label": None}, "got None (null)"),
    "label out of range": ({"ctx": "Q", "endings": ["a", "b"], "label": "2"}, "got 2"),
    "ctx an object": ({"ctx": {"text": "Q"}, "endings": ["a", "b"], "label": 0},
                      "ctx must be a string, got an object"),
    "a record that is a number": (5, "a record must be a JSON object, got an integer"),
}


@pytest.mark.parametrize("case", LAYOUT_RECORDS)
def test_a_record_of_the_wrong_json_type_is_refused_naming_its_line_and_field(case, tmp_path):
    """Before: a string of endings, a float or boolean label or an object as context each
    gave an accuracy; null endings or label, and a number as record, a traceback."""
    record, said = LAYOUT_RECORDS[case]
    good = {"ctx": "Q", "endings": ["a", "b"], "label": 1}
    path = tmp_path / "mc.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError) as refused:
        read_choices(str(path))
    assert str(refused.value).startswith(f"{path}, line 3: ")  # the blank line 2 counts
    assert said in str(refused.value)
    with pytest.raises(ValueError, match="^example 2: "):  # a caller's own records
        score_choices(uniform_model(), BYTE, [good, record], progress=False)


def nan_model():
    """One NaN weight in the head: every logit, so every loss, is NaN (as a model whose
    scores overflow would give; loading refuses a checkpoint holding one)."""
    torch.manual_seed(0)
    model = make_model(vocab_size=257, context_length=16)
    with torch.no_grad():
        model.out_head.weight[:, 0] = float("nan")
    return model


def test_a_score_that_is_not_finite_is_an_error_not_a_result():
    """Before: evaluate.py printed `loss nan ... bits per byte nan` and exited 0."""
    model = nan_model()
    tokens = np.array(BYTE.encode("hello world, hello moon"))
    with pytest.raises(ValueError, match=r"loss over the text is nan \(not finite\)"):
        score_text(model, BYTE, tokens, progress=False)
    with pytest.raises(ValueError, match="example 1: the model gives its endings"):
        score_choices(model, BYTE, [{"ctx": "Q", "endings": ["a", "b"], "label": 0}],
                      progress=False)


@pytest.fixture
def byte_checkpoint(tmp_path):
    return save_checkpoint(uniform_model(8), tmp_path / "m.ckpt", tokenizer="byte")


def test_ctrl_c_while_scoring_stops_in_one_line(byte_checkpoint, tmp_path, capsys,
                                                 monkeypatch):
    import gptmini.analysis.evaluate as evaluate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "score_text", interrupted)
    (tmp_path / "t.txt").write_text("hello moon " * 20)
    assert evaluate_main(["--checkpoint", str(byte_checkpoint), "--data",
                          str(tmp_path / "t.txt"), "--cache_dir", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "evaluate.py: stopped (Ctrl-C) before the score was complete; nothing was written")


def test_a_token_cache_that_cannot_be_written_is_worked_around(byte_checkpoint, tmp_path,
                                                              capsys, monkeypatch):
    """A read-only file system under the cache: tokenized in a temporary folder instead,
    the same score, and one line saying so (before: an OSError traceback)."""
    import errno

    import gptmini.analysis.evaluate as evaluate

    text = tmp_path / "t.txt"
    text.write_text("hello moon " * 20)
    args = ["--checkpoint", str(byte_checkpoint), "--data", str(text)]
    assert evaluate_main([*args, "--cache_dir", str(tmp_path / "cache")]) == 0
    cached = capsys.readouterr().out
    readonly = tmp_path / "readonly"
    real = evaluate.tokenize_corpus

    def tokenize(spec, *, cache_dir, **kwargs):
        if Path(cache_dir) == readonly:
            raise OSError(errno.EROFS, "Read-only file system", str(readonly / "tokens"))
        return real(spec, cache_dir=cache_dir, **kwargs)

    monkeypatch.setattr(evaluate, "tokenize_corpus", tokenize)
    assert evaluate_main([*args, "--cache_dir", str(readonly)]) == 0
    out = capsys.readouterr()
    assert out.out == cached
    assert (f"the token cache cannot be written ({readonly / 'tokens'}: Read-only file system)"
            in out.err)


def test_a_full_stdout_is_one_line_and_a_failure(byte_checkpoint, tmp_path, capsys,
                                                monkeypatch):
    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

    text = tmp_path / "t.txt"
    text.write_text("hello moon " * 20)
    monkeypatch.setattr("sys.stdout", Full())
    assert evaluate_main(["--checkpoint", str(byte_checkpoint), "--data", str(text),
                          "--cache_dir", str(tmp_path)]) == 1
    assert "could not write the score to stdout (No space left on device)" in (
        capsys.readouterr().err)


def test_a_text_that_is_not_utf8_is_told_evaluates_own_flag(byte_checkpoint, tmp_path, capsys):
    """Before: the advice named --data.corpus.encoding_errors, a flag of train.py that
    evaluate.py rejects."""
    text = tmp_path / "latin1.txt"
    text.write_bytes("caf\u00e9 au lait ".encode("latin-1") * 20)
    args = ["--checkpoint", str(byte_checkpoint), "--data", str(text), "--cache_dir",
            str(tmp_path)]
    assert evaluate_main(args) == 1
    err = capsys.readouterr().err
    assert "--encoding_errors replace" in err and "--data.corpus" not in err
    assert evaluate_main([*args, "--encoding_errors", "replace"]) == 0
    assert evaluate_main(["--checkpoint", str(byte_checkpoint), "--data",
                          str(tmp_path / "nope.txt")]) == 1
    assert "--data " in capsys.readouterr().err.splitlines()[-1]  # not train.py's flag


@pytest.mark.parametrize("classes", [["comedy", "history", "poem", "tragedy"],
                                     ["ham", "spam"], ["a-very-long-class-name", "b"]])
def test_every_count_of_the_confusion_table_ends_under_its_class(classes):
    """Before: the first column was sized to the class names, not to "true \\ predicted",
    so the header slid 7 characters right of the counts beneath it."""
    import re

    from gptmini.analysis.evaluate import ClassScore

    k = len(classes)
    confusion = [[(i * 37 + j * 101) % 1000 for j in range(k)] for i in range(k)]
    lines = ClassScore(0.5, confusion, classes).table().splitlines()
    ends = [[m.end() for m in re.finditer(r"\S+", line)][-k:] for line in lines]
    assert all(row == ends[0] for row in ends), "\n".join(lines)
    assert [line.split()[-k:] for line in lines[1:]] == [[str(n) for n in row]
                                                         for row in confusion]


def classifier_checkpoint(path: Path, classes: list[str], context_length: int = 8) -> Path:
    model = add_class_head(make_model(vocab_size=257, context_length=context_length),
                           len(classes))
    save_checkpoint(model, path, tokenizer="byte")
    saved = torch.load(path, weights_only=True)
    saved["hyper_parameters"]["classes"] = classes
    torch.save(saved, path)
    return path


def test_a_classifier_on_labels_it_never_learned_names_the_file_and_evaluates_fix(
        tmp_path, capsys):
    """Not train.py's --model.classes (issue 48): the classifier's classes are fixed."""
    ckpt = classifier_checkpoint(tmp_path / "c.ckpt", ["ham", "spam"])
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"text": "hi " * 9, "label": label}) + "\n"
                            for label in ("ham", "eggs")))
    assert evaluate_main(["--checkpoint", str(ckpt), "--data", str(data),
                          "--label_field", "label"]) == 1
    err = capsys.readouterr().err
    assert f"{data} has labels ['eggs'] that are not among the model's classes" in err
    assert "score records of them (drop or relabel the others)" in err
    assert "--model.classes" not in err and "--data.labels" not in err
    data.write_text(json.dumps({"text": "hi " * 9, "label": "ham"}) + "\n")
    assert evaluate_main(["--checkpoint", str(ckpt), "--data", str(data),
                          "--label_field", "label"]) == 0
    said = capsys.readouterr().out
    assert "1 examples (1 longer than the context of 8 tokens, classified from their" in said
    assert re.search(r"start as in training: [1-9][\d,]* tokens not read\)", said), said
