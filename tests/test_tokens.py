"""The token cache: splits, hits and misses, parallel tokenizing, empty corpora."""



import json
import logging

import numpy as np
import pytest
from helpers import ENC, joined, tokens_of, words

import gptmini.data.tokens as tokens_module
from gptmini.data import (
    resolve_source,
    tokenize_corpus,
)
from gptmini.tokenizer import get_tokenizer


def test_two_tokenizing_processes_write_the_same_file(tmp_path):
    for i in range(6):
        (tmp_path / f"{i}.txt").write_text(words(40, i))
    spec = resolve_source(str(tmp_path))
    one = tokenize_corpus(spec, cache_dir=tmp_path / "one", num_proc=1, quiet=True)
    two = tokenize_corpus(spec, cache_dir=tmp_path / "two", num_proc=2, quiet=True)
    assert one.meta["dtype"] == "uint16"
    assert np.array_equal(one.load("train"), two.load("train"))

def test_validation_takes_a_fraction_of_documents(tmp_path):
    docs = [f"document {i}. " + words(10, i) for i in range(10)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train, val = tokens_of(tmp_path / "d.jsonl", tmp_path / "c", val_fraction=0.2)
    # every fifth document: the 5th and the 10th
    assert val == joined([docs[4], docs[9]])
    assert train == joined([d for i, d in enumerate(docs) if i not in (4, 9)])

def test_single_document_corpora_split_by_tokens(tmp_path):
    (tmp_path / "book.txt").write_text(words(400, 0))
    train, val = tokens_of(tmp_path / "book.txt", tmp_path / "c", val_fraction=0.1)
    whole = ENC.encode_ordinary(words(400, 0))
    assert train + val == whole and len(val) == round(0.1 * len(whole))

def test_cache_hit_on_second_run_and_miss_when_source_or_tokenizer_changes(
    tmp_path, caplog, monkeypatch
):
    caplog.set_level(logging.INFO, logger="gptmini.data")
    corpus = tmp_path / "c.txt"
    corpus.write_text(words(100, 0))

    def run(tokenizer="gpt2"):
        caplog.clear()
        cache = tokenize_corpus(
            resolve_source(str(corpus)), tokenizer=tokenizer, cache_dir=tmp_path / "cache"
        )
        return cache, "cache hit" in caplog.text

    first, hit = run()
    assert not hit
    again, hit = run()
    assert hit and again.directory == first.directory
    corpus.write_text(words(101, 0))  # a changed source is a new cache entry
    changed, hit = run()
    assert not hit and changed.directory != first.directory
    assert changed.load("train").tolist() == ENC.encode_ordinary(words(101, 0))
    # a second tokenizer (same vocabulary, other name): tiktoken's others need a download
    monkeypatch.setattr(tokens_module, "get_tokenizer", lambda name="gpt2": get_tokenizer("gpt2"))
    other, hit = run("gpt2-copy")
    assert not hit and other.directory != changed.directory
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 3  # no temporary leftovers

def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt is empty: 1 documents, 0 tokens"):
        tokens_of(tmp_path / "empty.txt", tmp_path / "c")
