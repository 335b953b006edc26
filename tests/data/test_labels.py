"""The genre task that ships: every work labelled, whole works held out, passages of text;
your own labels: what would train the wrong classes is refused, naming the file and field,
and texts cut to the context are said."""

import gzip
import json

import pytest

from gptmini.data import Corpus, GPTDataModule
from gptmini.data.corpus import EMBEDDED_CORPUS
from gptmini.data.labels import (
    GENRES,
    HELD_OUT,
    PASSAGES_PER_WORK,
    LabeledDataset,
    LabeledRecords,
    Labels,
    cut_note,
    genre_records,
    read_records,
)
from gptmini.tokenizer import get_tokenizer


def text_of(work: str) -> str:
    with gzip.open(EMBEDDED_CORPUS / f"{work}_gut.txt.gz", "rt", encoding="utf-8") as file:
        return file.read()


def test_every_embedded_work_has_a_kind_and_the_test_split_holds_out_whole_works():
    works = {p.name.removesuffix("_gut.txt.gz") for p in EMBEDDED_CORPUS.glob("*.txt.gz")}
    assert set(GENRES) == works and len(works) == 42
    assert {GENRES[w] for w in HELD_OUT} == {"comedy", "history", "tragedy", "poem"}
    train, test = genre_records("train"), genre_records("test")
    assert set(train.labels) == set(test.labels) == {"comedy", "history", "tragedy", "poem"}
    # Hamlet is held out: its passages (runs of its lines) are in the test split alone.
    hamlet = {line.rstrip() for line in text_of("hamlet").splitlines() if line.strip()}

    def in_hamlet(passage: str) -> bool:
        return set(passage.splitlines()) <= hamlet

    assert not any(in_hamlet(t) for t in train.texts)
    from_hamlet = [label for t, label in zip(test.texts, test.labels, strict=True)
                   if in_hamlet(t)]
    assert from_hamlet == ["tragedy"] * PASSAGES_PER_WORK


# --- your own labels: what would train the wrong classes is refused, naming the file


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_one_number_written_two_ways_is_refused_not_made_two_classes(tmp_path):
    path = write_jsonl(tmp_path / "l.jsonl", [{"text": f"t{i}", "label": [1, 1.0, 0][i % 3]}
                                              for i in range(9)])
    with pytest.raises(ValueError, match=r"l.jsonl: the labels 1 and 1.0 are one number "
                                         "written 2 ways"):
        read_records(path, "text", "label")


def test_the_text_as_the_label_field_is_refused_naming_the_field(tmp_path):
    path = write_jsonl(tmp_path / "l.jsonl", [{"text": f"passage {i}", "label": "ab"[i % 2]}
                                              for i in range(20)])

    def classes(field: str) -> list[str]:
        return GPTDataModule(Corpus(source=str(path), tokenizer="byte"),
                             labels=Labels(label_field=field)).class_names()

    with pytest.raises(ValueError, match="l.jsonl: the label field 'text' gives 1[0-9] classes "
                                         "to 1[0-9] records.*Is 'text' the text"):
        classes("text")
    assert classes("label") == ["a", "b"]


def test_texts_past_the_context_are_counted_and_said(tmp_path):
    records = LabeledRecords(["a b", "a " * 20, "b " * 30], ["x", "y", "x"])
    data = LabeledDataset(records, get_tokenizer("byte"), ["x", "y"], max_length=8)
    assert data.cut == 2 and [len(ids) for ids in data.ids] == [3, 8, 8]
    assert (data.dropped, data.tokens) == (40 - 8 + 60 - 8, 3 + 40 + 60)  # a byte a token
    assert cut_note("train.jsonl", data, 8) == (
        "train.jsonl: 2 of 3 texts are longer than the context (8 tokens) and are classified "
        "from their first 8 (the book's truncation): 84 of the 103 tokens (82%) are not read; "
        "raise --model.context_length to read more of them")


def test_a_validation_label_no_training_record_has_names_the_validation_file(tmp_path):
    rows = [{"text": f"t {i}", "label": "ab"[i % 2]} for i in range(10)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    val = write_jsonl(tmp_path / "val.jsonl", [*rows, {"text": "u", "label": "c"}])
    data = GPTDataModule(Corpus(source=str(train), val_source=str(val), tokenizer="byte"),
                         labels=Labels(label_field="label"))
    with pytest.raises(ValueError, match=r"val.jsonl has labels \['c'\] .*add training "
                                         "records of it, or drop those validation records"):
        data.setup_labelled(data.class_names())
    # the fix it names works: the classes listed, the head has a class for each label
    data.setup_labelled(["a", "b", "c"])
    assert len(data.val_dataset) == 11


def test_a_class_written_another_way_is_said():
    records = LabeledRecords(["t", "u"], ["1.0", "0"])
    with pytest.raises(ValueError, match=r"\(1.0 is the class 1 written another way"):
        LabeledDataset(records, get_tokenizer("byte"), ["0", "1"], max_length=8)
