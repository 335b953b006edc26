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


def test_altered_vocabulary_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(tok.GPT2_VOCAB.read_bytes()[:-10])
    monkeypatch.setattr(tok, "GPT2_VOCAB", bad)
    tok.get_tokenizer.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="is altered"):
            tok.get_tokenizer("gpt2")
        monkeypatch.setattr(tok, "GPT2_VOCAB", tmp_path / "missing.tiktoken")
        with pytest.raises(RuntimeError, match="is missing; reinstall"):
            tok.get_tokenizer("gpt2")
    finally:
        tok.get_tokenizer.cache_clear()


def test_other_encodings_without_network_give_a_clear_error(monkeypatch):
    def offline(name):
        raise ConnectionError("network unreachable")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(ConnectionError, match="needs its vocabulary from the internet"):
        tok.get_tokenizer.__wrapped__("cl100k_base")


def test_unknown_encoding_name(monkeypatch):
    def unknown(name):
        raise ValueError(f"Unknown encoding {name}")

    monkeypatch.setattr(tiktoken, "get_encoding", unknown)
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'"):
        tok.get_tokenizer.__wrapped__("nope")
