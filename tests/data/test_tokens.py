"""The token cache: splits, hits and misses, parallel tokenizing, empty corpora."""

import errno
import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import tiktoken
from helpers import ENC, HANG_SECONDS, WORDS, joined, tokens_of, words
from hypothesis import given, settings
from hypothesis import strategies as st

import gptmini.data.tokens as tokens_module
from gptmini.data import (
    resolve_source,
    tokenize_corpus,
)
from gptmini.data.tokens import encode_in_pieces
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
    # The tokenizer counts by what it does, not by its name: the same vocabulary under
    # another name reuses the tokens; another vocabulary under the same name does not.
    monkeypatch.setattr(tokens_module, "get_tokenizer", lambda name="gpt2": get_tokenizer("gpt2"))
    renamed, hit = run("gpt2-copy")
    assert hit and renamed.directory == changed.directory
    monkeypatch.setattr(tokens_module, "get_tokenizer", lambda name="gpt2": gpt2_plus_a_special())
    other, hit = run("gpt2")
    assert not hit and other.directory != changed.directory
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 3  # no temporary leftovers


def gpt2_plus_a_special() -> tiktoken.Encoding:
    """GPT-2's vocabulary with one more special token: another tokenizer, named "gpt2"."""
    state = get_tokenizer("gpt2").__getstate__()
    specials = {**state["special_tokens"], "<|pad|>": 50257}
    return tiktoken.Encoding(name="gpt2", pat_str=state["pat_str"],
                             mergeable_ranks=state["mergeable_ranks"], special_tokens=specials)


def test_a_hub_dataset_is_cached_per_commit_and_read_at_that_commit(tmp_path, monkeypatch):
    """The defect: the key had no revision, so a new upstream revision was served stale."""
    import datasets

    upstream = {"commit": "a" * 40}
    looked_up, read_at = [], []

    def builder(name, config=None, revision=None):
        looked_up.append(revision)
        return SimpleNamespace(hash=upstream["commit"])  # what datasets resolves, or cached

    def load(name, config=None, split=None, revision=None, streaming=False):
        read_at.append(revision)
        return datasets.Dataset.from_dict({"text": [f"commit {revision[:6]}. " + words(30, 0)]})

    monkeypatch.setattr(datasets, "load_dataset_builder", builder)
    monkeypatch.setattr(datasets, "load_dataset", load)

    def tokenize(**kwargs):
        spec = resolve_source("someone/corpus", **kwargs)
        return tokenize_corpus(spec, cache_dir=tmp_path, quiet=True)

    first, again = tokenize(), tokenize()
    assert again.directory == first.directory and read_at == ["a" * 40]  # a hit: not re-read
    upstream["commit"] = "b" * 40
    newer = tokenize()
    assert newer.directory != first.directory and read_at[-1] == "b" * 40
    assert ENC.decode(newer.load("train")[:6].tolist()).startswith("commit bbbbbb.")
    assert looked_up == [None, None, None]
    pinned = tokenize(hub_revision="a" * 40)  # a commit hash needs no lookup
    assert pinned.directory == first.directory and looked_up == [None, None, None]

    def offline(name, config=None, revision=None):
        raise ConnectionError("Couldn't reach 'someone/corpus' on the Hub (offline)")

    monkeypatch.setattr(datasets, "load_dataset_builder", offline)
    with pytest.raises(ConnectionError, match="which revision .* --data.corpus.hub_revision"):
        tokenize(hub_revision="main")


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt is empty: 1 documents, 0 tokens"):
        tokens_of(tmp_path / "empty.txt", tmp_path / "c")


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab1 ,'\n\té")), max_size=80))
def test_long_documents_encode_in_pieces_to_exactly_the_ids_of_the_whole(text):
    pieces = encode_in_pieces(ENC, text, "uint32", piece=5)  # cut every few chars
    assert pieces.tolist() == ENC.encode_ordinary(text)


MEMORY = """
import resource, sys, time
import numpy as np
from gptmini.data import resolve_source, tokenize_corpus
from gptmini.tokenizer import get_tokenizer

path, cache = sys.argv[1], sys.argv[2]
get_tokenizer("gpt2")
spec = resolve_source(path)
import datasets  # imports done: what follows is the tokenizing itself
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ids = tokenize_corpus(spec, cache_dir=cache, quiet=True).load("train")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
whole = get_tokenizer("gpt2").encode_ordinary(open(path).read())
print((peak - before) * 1024, np.array_equal(ids, np.asarray(whole, dtype=ids.dtype)))
"""


@pytest.mark.slow
def test_a_50_mb_single_line_corpus_tokenizes_in_bounded_memory_to_the_same_ids(tmp_path):
    rng = np.random.default_rng(0)
    vocabulary = np.array([w + " " for w in WORDS] + ["caf\u00e9, ", "1984. ", "don't "])
    with open(tmp_path / "one_line.txt", "w") as f:
        for _ in range(65):
            f.write("".join(rng.choice(vocabulary, size=210_000)))  # about 1 MB a time
    assert (tmp_path / "one_line.txt").stat().st_size > 50_000_000
    proc = subprocess.run([sys.executable, "-c", MEMORY, str(tmp_path / "one_line.txt"),
                           str(tmp_path / "cache")], capture_output=True, text=True,
                          timeout=HANG_SECONDS, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    grew, same = proc.stdout.split()
    assert same == "True"
    assert int(grew) <= 300 * 2**20, f"{int(grew) / 2**20:.0f} MB above the baseline"


def test_a_full_disk_under_the_token_cache_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    """The OS error names no file ("[Errno 28] No space left on device", issue 48): the
    message names the cache and the setting that moves it; no half-written cache stays."""
    class FullDisk:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tokens_module, "open", lambda *a, **k: FullDisk(open(*a, **k)),
                        raising=False)
    corpus = tmp_path / "c.txt"
    corpus.write_text(words(300, 0))
    with pytest.raises(OSError, match=r"could not write the token cache .*cache.* \(No space "
                                      r"left on device\); free space, or set "
                                      r"--data.corpus.cache_dir") as caught:
        tokens_of(corpus, tmp_path / "cache")
    assert caught.value.errno == errno.ENOSPC
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
