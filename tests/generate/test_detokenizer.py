"""The detokenizer against decoding every token again: the same text, grown only at its end."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gptmini.generate.engine import Detokenizer
from gptmini.tokenizer import byte_tokenizer, get_tokenizer

BYTES = byte_tokenizer()


def cut_at_first_stop(tokens, stops, enc):
    """The oracle: decode the tokens one more at a time, stop at the first stop string."""
    for k in range(1, len(tokens) + 1):
        text = enc.decode(tokens[:k])
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return text[:min(found)], k
    return enc.decode(tokens), None


# Bytes of "aé€😀" and stray continuation or lead bytes: characters split over tokens.
token_lists = st.lists(st.sampled_from(list(b"ab \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\x80\xff")),
                       max_size=40)


@settings(max_examples=300, deadline=None)
@given(tokens=token_lists, stops=st.lists(st.sampled_from(["a", "ab", "b a", "é", "€b"]),
                                           max_size=2))
def test_text_equals_cutting_the_full_decode_and_only_grows(tokens, stops):
    detok, expected, stop_at = Detokenizer(BYTES, tuple(stops)), *cut_at_first_stop(
        tokens, stops, BYTES)
    everything = BYTES.decode(tokens)
    for k, token in enumerate(tokens, 1):
        before = detok.text
        stopped = detok.add(token)
        if not stopped:  # grows only at its end, never showing half a character as "\ufffd"
            assert detok.text.startswith(before) and everything.startswith(detok.text)
        if stopped:
            assert k == stop_at
            break
    detok.finish()
    assert detok.text == expected and detok.stopped == (stop_at is not None)


def test_gpt2_text_matches_decode_across_multibyte_tokens():
    enc = get_tokenizer("gpt2")
    tokens = enc.encode("naïve café — 東京 😀 done")
    detok = Detokenizer(enc)
    for token in tokens:
        detok.add(token)
    detok.finish()
    assert detok.text == enc.decode(tokens)
