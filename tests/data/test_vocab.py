"""Fitting a vocabulary to a corpus: training split only, deterministic, cached, isolated."""

import random

import pytest

import gptmini.data.vocab as vocab
from gptmini.data import fit_tokenizer, resolve_source, tokenize_corpus
from gptmini.tokenizer import byte_tokenizer, get_tokenizer, save_tokenizer, train_bpe


def write_documents(directory, val_word: str = "zyzzyva"):
    """20 documents; with val_fraction 0.1 the 10th and 20th are validation, and only they
    hold `val_word`, so often that any BPE fitted on them would make it one token."""
    rng = random.Random(1)
    directory.mkdir()
    for i in range(20):
        words = [rng.choice(["moon", "sun", "night", "Romeo", "Juliet", "fair"])
                 for _ in range(300)]
        if i in (9, 19):
            words += [val_word] * 300
        (directory / f"doc{i:02d}.txt").write_text(" ".join(words))
    return directory


def test_the_vocabulary_is_fitted_on_the_training_documents_only(tmp_path):
    spec = resolve_source(str(write_documents(tmp_path / "docs")))
    enc = get_tokenizer(str(fit_tokenizer(spec, 300, val_fraction=0.1,
                                          cache_dir=tmp_path / "cache")))
    assert len(enc.encode_ordinary(" Juliet")) == 1  # a training word
    assert len(enc.encode_ordinary(" zyzzyva")) > 2  # the validation word: never merged whole
    leaky = get_tokenizer(str(fit_tokenizer(spec, 300, val_fraction=0.0,
                                            cache_dir=tmp_path / "cache")))
    assert len(leaky.encode_ordinary(" zyzzyva")) == 1  # the oracle: seen, it would be


def test_a_single_document_leaves_out_its_last_fraction(tmp_path):
    text = "moon sun night " * 2000 + "zyzzyva " * 300  # the tail: 8% of the characters
    (tmp_path / "book.txt").write_text(text)
    spec = resolve_source(str(tmp_path / "book.txt"))
    enc = get_tokenizer(str(fit_tokenizer(spec, 300, val_fraction=0.1,
                                          cache_dir=tmp_path / "cache")))
    assert len(enc.encode_ordinary(" zyzzyva")) > 2
    whole = get_tokenizer(str(fit_tokenizer(spec, 300, cache_dir=tmp_path / "cache")))
    assert len(whole.encode_ordinary(" zyzzyva")) == 1


def test_fitting_is_deterministic_and_cached(tmp_path, monkeypatch):
    spec = resolve_source(str(write_documents(tmp_path / "docs")))
    first = fit_tokenizer(spec, 300, val_fraction=0.1, cache_dir=tmp_path / "a")
    other_cache = fit_tokenizer(spec, 300, val_fraction=0.1, cache_dir=tmp_path / "b")
    assert first.read_bytes() == other_cache.read_bytes()

    def refit(*args, **kwargs):
        raise AssertionError("fitted again instead of reading the cache")

    monkeypatch.setattr(vocab, "train_bpe", refit)
    assert fit_tokenizer(spec, 300, val_fraction=0.1, cache_dir=tmp_path / "a") == first
    with pytest.raises(AssertionError, match="fitted again"):  # another size: another file
        fit_tokenizer(spec, 280, val_fraction=0.1, cache_dir=tmp_path / "a")


def test_tokens_cached_under_one_tokenizer_are_never_read_under_another(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("But soft, what light through yonder window breaks? " * 200)
    spec = resolve_source(str(corpus))
    path = tmp_path / "tokenizer.json"  # one path, three vocabularies over time
    seen = {}
    for name, enc in (("gpt2", get_tokenizer("gpt2")), ("byte", byte_tokenizer()),
                      ("fitted", train_bpe([corpus.read_text()], 280))):
        save_tokenizer(enc, path)
        cache = tokenize_corpus(spec, tokenizer=str(path), cache_dir=tmp_path / "cache",
                                quiet=True)
        assert cache.load("train").tolist() == enc.encode_ordinary(corpus.read_text()), name
        seen[name] = cache.directory
    assert len(set(seen.values())) == 3


def test_bpe_spelling_is_checked():
    assert vocab.parse_bpe("bpe:4096") == 4096 and vocab.parse_bpe("bpe:8_192") == 8192
    assert vocab.parse_bpe("gpt2") is None
    with pytest.raises(ValueError, match="bpe:N with N the vocabulary size"):
        vocab.parse_bpe("bpe:big")
