"""Tokenizers, all as tiktoken `Encoding`s: GPT-2's, bytes, and BPE fitted to a corpus.

`tiktoken.get_encoding("gpt2")` downloads its vocabulary on first use; gptmini ships that
file (gptmini/assets/gpt2.tiktoken, see NOTICE there) and builds the same `Encoding`
from it, so tokenizing never needs a network. Other tiktoken encodings are loaded by name
through tiktoken, which may download them.

A model trained on its own text learns more per CPU minute from a vocabulary fitted to
that text: the default model's output head is most of its compute with GPT-2's 50,257
ids. `train_bpe` fits a byte-level BPE with GPT-2's split pattern (rustbpe, the trainer
nanochat uses) and hands its merges to tiktoken, so encoding stays tiktoken's; `byte`
is 256 byte ids for character-style runs. Both end with `<|endoftext|>`, and are saved as
one small JSON file (`save_tokenizer`) that runs and checkpoints carry.

One spelling names them all (`--model.tokenizer`): "gpt2", "byte", a saved tokenizer's
path, or another tiktoken encoding name. "bpe:N" (N ids, `<|endoftext|>` included) is
fitted by train.py on the run's corpus (see `gptmini.data.fit_tokenizer`).
"""

import base64
import hashlib
import json
import os
import warnings
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import tiktoken

ASSETS = Path(__file__).parent / "assets"
GPT2_VOCAB = ASSETS / "gpt2.tiktoken"
GPT2_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
END_OF_TEXT = "<|endoftext|>"
FORMAT = "gptmini-tokenizer/1"
"""The `format` field of a saved tokenizer file."""

# GPT-2's pre-tokenizer split pattern (the one tiktoken's "gpt2" encoding uses).
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
DIGITS_PATTERN = (
    r"""\p{N}|'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
)
"""GPT-2's split after each digit is cut off alone (Hugging Face's `Digits` pre-tokenizer
before `ByteLevel`, llama.cpp's `smollm`): spaces before a digit stay one piece, as they end
a piece when the digits are cut first."""
MIN_BPE, MAX_BPE = 257, 2**20
"""The smallest fitted vocabulary is the 256 bytes and `<|endoftext|>`."""


def get_tokenizer(name: str = "gpt2") -> tiktoken.Encoding:
    """The tokenizer `name` spells: "gpt2" (built from the vendored file), "byte", the path
    of a saved tokenizer (see `save_tokenizer`), or a tiktoken encoding name.

    Raises:
        RuntimeError: the vendored vocabulary is missing or altered.
        ValueError: an unknown name, an unreadable tokenizer file, or "bpe:N" (fitted on a
            corpus: train.py does it, or `gptmini.data.fit_tokenizer`).
        ConnectionError: another encoding could not be fetched (no network).
    """
    is_file = name.endswith(".json") or os.sep in name or Path(name).is_file()
    if name not in ("gpt2", "byte") and is_file:
        try:  # read again when the file changes
            stat = os.stat(name)
        except OSError:
            stat = None
        return _named(name, stat and (stat.st_mtime_ns, stat.st_size))
    return _named(name)


@cache
def _named(name: str, version: tuple[int, int] | None = None) -> tiktoken.Encoding:
    if name == "gpt2":
        return gpt2_tokenizer()
    if name == "byte":
        return byte_tokenizer()
    if name.startswith("bpe:"):
        raise ValueError(
            f"tokenizer {name!r} is fitted on a corpus, so it has no vocabulary on its own: "
            "train.py fits it on the run's corpus and saves it in the run directory; in "
            "Python, call gptmini.data.fit_tokenizer and pass the path it returns"
        )
    if version is not None or name.endswith(".json") or os.sep in name:
        return load_tokenizer(name)
    try:
        return tiktoken.get_encoding(name)
    except ValueError as err:  # unknown name
        known = ", ".join(sorted(tiktoken.list_encoding_names()))
        raise ValueError(
            f"unknown tokenizer {name!r}: use gpt2 (shipped, offline), byte, bpe:N (e.g. "
            f"bpe:4096, fitted on the corpus), a saved tokenizer's path, or one of tiktoken's "
            f"encodings ({known})"
        ) from err
    except Exception as err:  # network errors come in many types (requests, urllib, ...)
        raise ConnectionError(
            f"tokenizer {name!r} needs its vocabulary from the internet and could not get it "
            f"({type(err).__name__}: {err}). Use tokenizer 'gpt2', which gptmini ships, or "
            "connect once so tiktoken caches the file (TIKTOKEN_CACHE_DIR)."
        ) from err


def gpt2_tokenizer(vocab: Path = GPT2_VOCAB) -> tiktoken.Encoding:
    """GPT-2's encoding built offline from the vocabulary file gptmini ships (what
    `get_tokenizer("gpt2")` returns, cached), after checking the file's sha256.

    Raises:
        RuntimeError: `vocab` is missing, or not GPT-2's vocabulary byte for byte.
    """
    if not vocab.is_file():
        raise RuntimeError(
            f"the GPT-2 vocabulary {vocab} is missing; reinstall gptmini "
            "(pip install -e .) so its assets are in place"
        )
    contents = vocab.read_bytes()
    digest = hashlib.sha256(contents).hexdigest()
    if digest != GPT2_SHA256:
        raise RuntimeError(
            f"the GPT-2 vocabulary {vocab} is altered (sha256 {digest}, expected "
            f"{GPT2_SHA256}); restore it from the gptmini repository"
        )
    # Parsed here, as tiktoken's load_tiktoken_bpe parses it, which would also write a copy
    # to tiktoken's cache (a needless write that fails on a full disk, naming no file).
    ranks = {base64.b64decode(token): int(rank)
             for token, rank in (line.split() for line in contents.splitlines() if line)}
    return _encoding("gpt2", ranks)


def _encoding(name: str, ranks: dict[bytes, int], pattern: str = GPT2_PATTERN
              ) -> tiktoken.Encoding:
    """A tiktoken encoding of `ranks` with `<|endoftext|>` as the id after them."""
    return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens={END_OF_TEXT: len(ranks)},
                             explicit_n_vocab=len(ranks) + 1)


def encode_prompt(enc: tiktoken.Encoding, text: str) -> list[int]:
    """The ids of a prompt, by the one rule generate.py, serve.py, visualize.py and the
    training samples share: a special token written in the text (`<|endoftext|>`, and any
    other the encoding defines) is that token, never its characters; an empty prompt is
    `<|endoftext|>` alone. (Training text is the other way round: see data/tokens.py.)"""
    return enc.encode(text, allowed_special="all") or [enc.eot_token]


def byte_tokenizer() -> tiktoken.Encoding:
    """256 ids, one per byte value, and `<|endoftext|>` (id 256): every character is one to
    four tokens, as in nanoGPT's character-level Shakespeare but for any Unicode text."""
    return _encoding("byte", {bytes([b]): b for b in range(256)})


def train_bpe(texts: Iterable[str], vocab_size: int) -> tiktoken.Encoding:
    """Fit a byte-level BPE of `vocab_size` ids (`<|endoftext|>` included) to `texts`.

    GPT-2's split pattern cuts the text into words first, so no token crosses a word
    boundary; merges are learned greedily by pair count (rustbpe), deterministic for the
    same texts. The 256 single bytes are always in the vocabulary, so any text encodes.
    A text too small for `vocab_size` (every word already one token) gives fewer ids, and
    a warning.

    Raises:
        ValueError: `vocab_size` outside [257, 2**20].
    """
    import rustbpe

    if not MIN_BPE <= vocab_size <= MAX_BPE:
        raise ValueError(
            f"a BPE vocabulary of {vocab_size} ids is impossible: it needs at least the 256 "
            f"bytes and <|endoftext|> ({MIN_BPE}) and at most {MAX_BPE}; e.g. bpe:4096"
        )
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), vocab_size - 1, pattern=GPT2_PATTERN)
    ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
    if len(ranks) + 1 < vocab_size:
        warnings.warn(f"the text has too few distinct byte pairs for {vocab_size} ids: every "
                      f"word is one token at {len(ranks) + 1}, the vocabulary's size",
                      stacklevel=2)
    return _encoding(f"bpe{len(ranks) + 1}", ranks)


def tokenizer_to_dict(enc: tiktoken.Encoding) -> dict:
    """`enc` as plain data (JSON-ready): what a saved tokenizer file and a checkpoint hold.

    A registered encoding ("gpt2", tiktoken's names) is saved by name only; any other by
    its whole definition: split pattern, tokens in rank order, special tokens.
    """
    state = enc.__getstate__()  # tiktoken's pickling protocol: the encoding's definition
    if enc.name == "gpt2" or isinstance(state, str):
        return {"format": FORMAT, "name": enc.name}
    ranks = state["mergeable_ranks"]
    tokens = sorted(ranks, key=ranks.__getitem__)
    if [ranks[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError(f"tokenizer {enc.name!r}: its ranks are not 0..n-1, cannot save it")
    return {"format": FORMAT, "name": enc.name, "pattern": state["pat_str"],
            "tokens": [base64.b64encode(t).decode("ascii") for t in tokens],
            "special_tokens": state["special_tokens"]}


def tokenizer_from_dict(data: dict, where: str = "tokenizer") -> tiktoken.Encoding:
    """The encoding `tokenizer_to_dict` described (`where` names it in errors)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{where} is not a gptmini tokenizer (no \"format\": \"{FORMAT}\")")
    if "tokens" not in data:
        return get_tokenizer(data["name"])
    ranks = {base64.b64decode(t): rank for rank, t in enumerate(data["tokens"])}
    specials = {str(k): int(v) for k, v in data["special_tokens"].items()}
    return tiktoken.Encoding(name=data["name"], pat_str=data["pattern"],
                             mergeable_ranks=ranks, special_tokens=specials,
                             explicit_n_vocab=len(ranks) + len(specials))


def save_tokenizer(enc: tiktoken.Encoding, path: str | os.PathLike) -> Path:
    """Write `enc` to `path` as JSON, atomically (a reader never sees half a file).

    Raises:
        OSError: the file could not be written (a full disk), naming it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(tokenizer_to_dict(enc)))
        os.replace(tmp, path)
    except OSError as err:  # a full or read-only disk: name the file (the OS error does not)
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, f"could not write the tokenizer {path} ({err.strerror or err})"
                      "; free space or fix the disk, then run again") from err
    return path


def load_tokenizer(path: str | os.PathLike) -> tiktoken.Encoding:
    """Read a tokenizer `save_tokenizer` wrote.

    Raises:
        ValueError: the file is missing, not JSON, or not a gptmini tokenizer.
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as err:
        raise ValueError(
            f"tokenizer file {path} does not exist; give gpt2, byte, bpe:N or the path of a "
            "tokenizer.json a run saved"
        ) from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"tokenizer file {path} is not readable JSON ({err})") from err
    return tokenizer_from_dict(data, where=f"tokenizer file {path}")


def special_tokens(enc: tiktoken.Encoding) -> dict[str, int]:
    """`enc`'s special tokens by text, with their ids (`<|endoftext|>`, a chat template's).

    tiktoken keeps them in a private attribute; this module is the one place that reads it.
    """
    return dict(enc._special_tokens)


def with_special_tokens(enc: tiktoken.Encoding, tokens: Iterable[str], name: str
                        ) -> tiktoken.Encoding:
    """`enc` with `tokens` as special tokens after its ids (in the order given; those it
    has already keep their ids), named `name`; `enc` itself when it has them all. Its
    ordinary tokens and split pattern are `enc`'s, so it encodes text to the same ids."""
    specials = special_tokens(enc)
    missing = [t for t in dict.fromkeys(tokens) if t not in specials]
    if not missing:
        return enc
    n = enc.n_vocab
    specials.update({token: n + k for k, token in enumerate(missing)})
    return tiktoken.Encoding(name=name, pat_str=enc._pat_str,
                             mergeable_ranks=enc._mergeable_ranks, special_tokens=specials,
                             explicit_n_vocab=n + len(missing))


def token_byte_lengths(enc: tiktoken.Encoding) -> list[int]:
    """Bytes of text each id stands for; 0 for special tokens (bits per byte skips them)."""
    specials = set(special_tokens(enc).values())
    return [0 if i in specials else len(enc.decode_single_token_bytes(i))
            for i in range(enc.n_vocab)]


def _byte_chars() -> dict[int, str]:
    """GPT-2's table from bytes to printable characters, which Hugging Face's byte-level
    tokenizers write their tokens in: printable bytes stand for themselves, the others
    (controls, space) for the characters from U+0100 on, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable},
            **{b: chr(256 + i) for i, b in enumerate(others)}}


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens whose merge made `token`: its bytes merged again as tiktoken does
    (lowest rank first), with only the tokens ranked before it, end in exactly two."""
    parts, limit = [token[i:i + 1] for i in range(len(token))], ranks[token]
    while len(parts) > 2:
        pairs = [(ranks.get(parts[i] + parts[i + 1], limit), i) for i in range(len(parts) - 1)]
        rank, i = min(pairs)
        if rank >= limit:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} is not the merge of two earlier tokens")
    return parts[0], parts[1]


def to_hf_tokenizer(enc: tiktoken.Encoding) -> dict:
    """`enc` as a Hugging Face `tokenizer.json` (byte-level BPE, GPT-2's split pattern):
    `transformers.PreTrainedTokenizerFast(tokenizer_file=...)` encodes text to the same ids.

    Raises:
        ValueError: `enc` is not a byte-level BPE (its ranks do not start with all 256
            bytes merged in order).
    """
    ranks = tiktoken_ranks(enc)
    chars = _byte_chars()

    def spell(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    merges = [[spell(a), spell(b)] for token, _ in sorted(ranks.items(), key=lambda kv: kv[1])
              if len(token) > 1 for a, b in [_merge_of(token, ranks)]]
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for s, i in special_tokens(enc).items()]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split_pattern(enc) or GPT2_PATTERN},
             "behavior": "Isolated", "invert": False}, byte_level]},
        "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {spell(t): r for t, r in ranks.items()}, "merges": merges},
    }


def from_hf_tokenizer(data: dict, name: str = "hf") -> tiktoken.Encoding:
    """The tiktoken encoding of a byte-level BPE `tokenizer.json` (as `to_hf_tokenizer`
    writes, or GPT-2's on the hub): ranks are the vocabulary's ids, special tokens its
    added tokens; the split its pre-tokenizer's (a `Split` regex, or GPT-2's for `ByteLevel`,
    with each digit apart after `Digits`).

    Raises:
        ValueError: not a byte-level BPE with GPT-2's or an explicit split pattern.
    """
    to_byte = {c: b for b, c in _byte_chars().items()}
    try:
        specials = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        ranks = {bytes(to_byte[c] for c in token): rank
                 for token, rank in data["model"]["vocab"].items()
                 if rank not in specials.values()}
        pre = data["pre_tokenizer"]
        steps = pre["pretokenizers"] if pre["type"] == "Sequence" else [pre]
        pattern = next(GPT2_PATTERN if p["type"] == "ByteLevel" else p["pattern"]["Regex"]
                       for p in steps if p["type"] == "Split"
                       or (p["type"] == "ByteLevel" and p.get("use_regex", True)))
        if pattern == GPT2_PATTERN and any(p["type"] == "Digits" and p.get("individual_digits")
                                           for p in steps):  # SmolLM2's
            pattern = DIGITS_PATTERN
    except (KeyError, TypeError, AttributeError, StopIteration) as err:
        raise ValueError(f"not a byte-level BPE tokenizer.json with a split pattern ({err!r})"
                         ) from None
    return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens=specials,
                             explicit_n_vocab=len(ranks) + len(specials))


def tiktoken_ranks(enc: tiktoken.Encoding) -> dict[bytes, int]:
    """`enc`'s mergeable tokens and their ranks, for any encoding (registered ones too)."""
    specials = set(special_tokens(enc).values())
    return {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab)
            if i not in specials}


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


def token_text(enc: tiktoken.Encoding, token: int) -> str:
    """A token as OpenAI's logprobs name it: its text, or "bytes:\\xe2\\x80" for a token
    that is part of a character (distinct ids never share a name)."""
    raw = enc.decode_single_token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
