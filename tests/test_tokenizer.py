import errno
import json
import os
import random
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

import gptmini.tokenizer as tok
from gptmini.tokenizer import get_tokenizer


def test_known_ids_from_the_book():
    """Book section 2.5: tiktoken's gpt2 encoding gives these ids."""
    text = "Hello, do you like tea? <|endoftext|> In the sunlit terraces of someunknownPlace."
    ids = get_tokenizer().encode(text, allowed_special={"<|endoftext|>"})
    assert ids == [15496, 11, 466, 345, 588, 8887, 30, 220, 50256, 554, 262, 4252, 18250,
                   8812, 2114, 286, 617, 34680, 27271, 13]
    assert get_tokenizer().decode(ids) == text


def test_vocabulary_is_gpt2s():
    enc = get_tokenizer()
    assert enc.n_vocab == 50257
    assert enc.eot_token == 50256
    assert enc.encode("Akwirw ier") == [33901, 86, 343, 86, 220, 959]  # book, unknown words


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_any_text(text):
    enc = get_tokenizer()
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_altered_vocabulary_is_refused(tmp_path):
    # "gpt2" is this offline build of the shipped file, whose hash is checked
    shipped = tok.tokenizer_fingerprint(tok.gpt2_tokenizer())
    assert shipped == tok.tokenizer_fingerprint(get_tokenizer("gpt2"))
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(tok.GPT2_VOCAB.read_bytes()[:-10])
    with pytest.raises(RuntimeError, match="is altered"):
        tok.gpt2_tokenizer(bad)
    with pytest.raises(RuntimeError, match="is missing; reinstall"):
        tok.gpt2_tokenizer(tmp_path / "missing.tiktoken")


def test_other_encodings_without_network_give_a_clear_error(monkeypatch):
    def offline(name):
        raise ConnectionError("network unreachable")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    # (a name no test loads: get_tokenizer caches the encodings it could build)
    with pytest.raises(ConnectionError, match="'p50k_base' needs its vocabulary from the internet"):
        get_tokenizer("p50k_base")


def test_unknown_encoding_name(monkeypatch):
    def unknown(name):
        raise ValueError(f"Unknown encoding {name}")

    monkeypatch.setattr(tiktoken, "get_encoding", unknown)
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'.*bpe:N"):
        get_tokenizer("nope")


# --- fitted and byte tokenizers

SAMPLE = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and "
          "Juliet is the sun. Arise, fair sun, and kill the envious moon. " * 40)


def texts() -> list[str]:
    rng = random.Random(0)
    made_up = " ".join("".join(rng.choices("abcdefghij", k=rng.randint(2, 7)))
                       for _ in range(3000))
    return [SAMPLE, "héllo wörld, 日本語 🙂 " * 20, made_up]


@pytest.fixture(scope="module")
def fitted():
    return tok.train_bpe(texts(), 400)


def test_a_fitted_vocabulary_has_the_size_asked_with_endoftext_last(fitted):
    assert fitted.n_vocab == 400 and fitted.eot_token == 399
    assert fitted.encode("<|endoftext|>", allowed_special="all") == [399]
    # Merges learned from the text: its frequent words are one token, unseen bytes still encode.
    assert len(fitted.encode_ordinary(" Juliet")) == 1
    assert len(fitted.encode_ordinary("zqx")) == 3


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_fitted_and_byte_tokenizers_round_trip_any_text(fitted, text):
    for enc in (fitted, tok.byte_tokenizer()):
        assert enc.decode(enc.encode_ordinary(text)) == text
    assert tok.byte_tokenizer().encode_ordinary(text) == list(text.encode("utf-8"))


def test_the_same_texts_give_the_same_vocabulary(fitted):
    again = tok.train_bpe(texts(), 400)
    assert tok.tokenizer_to_dict(again) == tok.tokenizer_to_dict(fitted)


def test_a_saved_tokenizer_loads_as_the_same_encoding_and_changes_are_seen(fitted, tmp_path):
    path = tok.save_tokenizer(fitted, tmp_path / "tokenizer.json")
    loaded = tok.get_tokenizer(str(path))
    assert tok.tokenizer_fingerprint(loaded) == tok.tokenizer_fingerprint(fitted)
    assert loaded.encode(SAMPLE[:300]) == fitted.encode(SAMPLE[:300])
    tok.save_tokenizer(tok.byte_tokenizer(), path)  # the same path, another vocabulary
    assert tok.get_tokenizer(str(path)).n_vocab == 257


@pytest.mark.parametrize(("name", "message"), [
    ("bpe:4096", "fitted on a corpus"),
    ("missing/tokenizer.json", "does not exist"),
])
def test_names_without_a_vocabulary_say_what_to_do(name, message):
    with pytest.raises(ValueError, match=message):
        tok.get_tokenizer(name)


def test_a_text_too_small_for_the_size_gives_fewer_ids_and_says_so():
    with pytest.warns(UserWarning, match="too few distinct byte pairs"):
        small = tok.train_bpe(["the cat sat on the mat"], 1000)
    assert 257 < small.n_vocab < 1000
    assert small.encode_ordinary(" cat") == [small.encode_single_token(b" cat")]


def test_impossible_bpe_sizes_are_refused():
    with pytest.raises(ValueError, match="at least the 256 bytes"):
        tok.train_bpe(["text"], 100)


def test_a_file_that_is_not_a_tokenizer_is_named(tmp_path):
    (tmp_path / "t.json").write_text('{"vocab": {}}')
    with pytest.raises(ValueError, match="t.json is not a gptmini tokenizer"):
        tok.get_tokenizer(str(tmp_path / "t.json"))


def test_token_byte_lengths_count_text_bytes_and_zero_for_specials(fitted):
    lengths = tok.token_byte_lengths(fitted)
    assert lengths[fitted.eot_token] == 0
    ids = fitted.encode_ordinary(SAMPLE[:500])
    assert sum(lengths[i] for i in ids) == len(SAMPLE[:500].encode())
    assert tok.token_byte_lengths(tok.get_tokenizer("gpt2"))[15496] == len(b"Hello")


@pytest.mark.parametrize("which", ["fitted", "byte", "gpt2"])
def test_the_hugging_face_tokenizer_json_encodes_to_the_same_ids(fitted, tmp_path, which):
    transformers = pytest.importorskip("transformers")
    enc = {"fitted": fitted, "byte": tok.byte_tokenizer(),
           "gpt2": tok.get_tokenizer("gpt2")}[which]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tok.to_hf_tokenizer(enc)))
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    for text in (SAMPLE[:400], "  a\n\n\tb  1234 héllo 日本語 🙂<|endoftext|>Next", ""):
        assert theirs.encode(text) == enc.encode(text, allowed_special="all")
    back = tok.from_hf_tokenizer(json.loads(path.read_text()))
    assert tok.tokenizer_fingerprint(back) == tok.tokenizer_fingerprint(enc)


def test_a_prompt_encodes_special_tokens_written_in_it_as_those_tokens():
    """One rule for every prompt (generate.py, serve.py, visualize.py): a special token
    written in the text is that token, whichever special tokens the encoding has; an empty
    prompt is <|endoftext|> alone."""
    byte = tok.byte_tokenizer()
    two = tiktoken.Encoding(name="two-specials", pat_str=tok.split_pattern(byte),
                            mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={"<|endoftext|>": 256, "<|pad|>": 257})
    assert tok.encode_prompt(byte, "a<|endoftext|>b") == [97, 256, 98]
    assert tok.encode_prompt(two, "a<|pad|>b<|endoftext|>") == [97, 257, 98, 256]
    assert tok.encode_prompt(two, "") == [256] and tok.encode_prompt(byte, "") == [256]
    assert tok.encode_prompt(get_tokenizer(), "<|endoftext|>") == [50256]


def test_a_tokenizer_that_cannot_be_saved_is_named(tmp_path, monkeypatch):
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    path = tmp_path / "run" / "tokenizer.json"
    with pytest.raises(OSError, match=f"could not write the tokenizer {path} \\(No space"):
        tok.save_tokenizer(get_tokenizer("byte"), path)
    assert list(path.parent.iterdir()) == []
