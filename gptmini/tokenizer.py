"""GPT-2 byte-pair encoding through tiktoken, built offline from the vendored vocabulary.

`tiktoken.get_encoding("gpt2")` downloads its vocabulary on first use; gptmini ships that
file (gptmini/assets/gpt2.tiktoken, see NOTICE there) and builds the same `Encoding`
from it, so tokenizing never needs a network. Other tiktoken encodings are loaded by name
through tiktoken, which may download them.
"""

import hashlib
import json
from functools import cache
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

ASSETS = Path(__file__).parent / "assets"
GPT2_VOCAB = ASSETS / "gpt2.tiktoken"
GPT2_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
END_OF_TEXT = "<|endoftext|>"

# GPT-2's pre-tokenizer split pattern (the one tiktoken's "gpt2" encoding uses).
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


@cache
def get_tokenizer(name: str = "gpt2") -> tiktoken.Encoding:
    """The tiktoken `Encoding` called `name`; "gpt2" is built from the vendored file.

    Raises:
        RuntimeError: the vendored vocabulary is missing or altered.
        ConnectionError: another encoding could not be fetched (no network).
    """
    if name == "gpt2":
        return _gpt2_offline()
    try:
        return tiktoken.get_encoding(name)
    except ValueError as err:  # unknown name
        known = ", ".join(sorted(tiktoken.list_encoding_names()))
        raise ValueError(
            f"unknown tokenizer {name!r}: tiktoken knows {known}; gptmini ships 'gpt2' for "
            "offline use"
        ) from err
    except Exception as err:  # network errors come in many types (requests, urllib, ...)
        raise ConnectionError(
            f"tokenizer {name!r} needs its vocabulary from the internet and could not get it "
            f"({type(err).__name__}: {err}). Use tokenizer 'gpt2', which gptmini ships, or "
            "connect once so tiktoken caches the file (TIKTOKEN_CACHE_DIR)."
        ) from err


def _gpt2_offline() -> tiktoken.Encoding:
    if not GPT2_VOCAB.is_file():
        raise RuntimeError(
            f"the GPT-2 vocabulary {GPT2_VOCAB} is missing; reinstall gptmini "
            "(pip install -e .) so its assets are in place"
        )
    digest = hashlib.sha256(GPT2_VOCAB.read_bytes()).hexdigest()
    if digest != GPT2_SHA256:
        raise RuntimeError(
            f"the GPT-2 vocabulary {GPT2_VOCAB} is altered (sha256 {digest}, expected "
            f"{GPT2_SHA256}); restore it from the gptmini repository"
        )
    ranks = load_tiktoken_bpe(str(GPT2_VOCAB))
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={END_OF_TEXT: len(ranks)},
        explicit_n_vocab=len(ranks) + 1,
    )


@cache
def tokenizer_fingerprint(enc: tiktoken.Encoding) -> str:
    """A short hash of what `enc` does, not of its name: split pattern, merges, specials.

    Token caches are keyed by it, so tokens made by one vocabulary are never read under
    another, whatever the names. Read through tiktoken's pickling protocol, which holds an
    encoding's whole definition (a registered encoding is defined by its name).
    """
    state = enc.__getstate__()
    if isinstance(state, str):
        content = state
    else:
        ranks = sorted((rank, token.hex()) for token, rank in state["mergeable_ranks"].items())
        specials = sorted(state["special_tokens"].items())
        content = json.dumps([state["pat_str"], ranks, specials])
    return hashlib.sha256(content.encode()).hexdigest()[:16]


def split_pattern(enc: tiktoken.Encoding) -> str | None:
    """The regex `enc` splits text with before merging (None: a registered encoding, known to
    tiktoken by name only)."""
    state = enc.__getstate__()  # tiktoken's pickling protocol: the encoding's definition
    return None if isinstance(state, str) else state["pat_str"]
