"""Which BPE trainer fits gptmini's vocabularies: rustbpe or Hugging Face `tokenizers`.

Both fit a byte-level BPE with GPT-2's split pattern to the training split of the default
corpus (the embedded Shakespeare, ~5 MB), at several sizes, in one run on this machine;
each result is turned into a tiktoken `Encoding` the way gptmini would use it, and the
validation documents encoded with it. Printed: fit time (best of --repeat), bytes per
token on validation (higher: fewer tokens for the same text), and whether the two
trainers' vocabularies encode validation to the same number of tokens. Then gptmini's own
`fit_tokenizer` cold and from its cache.

    python bench/bench_tokenizer.py [--sizes 2048 4096 8192] [--repeat 3]
"""

import argparse
import json
import os
import tempfile
import time

import torch
from machine import cpu_description

from gptmini.data import resolve_source
from gptmini.data.documents import load_documents
from gptmini.data.tokens import is_validation
from gptmini.data.vocab import fit_tokenizer
from gptmini.tokenizer import GPT2_PATTERN, from_hf_tokenizer, train_bpe


def split_texts(val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    docs = load_documents(resolve_source(None))["text"]
    train = [t for i, t in enumerate(docs) if not is_validation(i, val_fraction)]
    val = [t for i, t in enumerate(docs) if is_validation(i, val_fraction)]
    return train, val


def train_hf(texts: list[str], vocab_size: int):
    """The same BPE through Hugging Face `tokenizers`, converted to tiktoken ranks."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return from_hf_tokenizer(json.loads(tok.to_str()), f"hf{vocab_size}")


def best_time(fn, repeat: int):
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    train, val = split_texts()
    val_bytes = sum(len(t.encode()) for t in val)
    print(f"CPU: {cpu_description()}; {os.cpu_count()} cores; torch {torch.__version__}")
    print(f"default corpus: {sum(len(t.encode()) for t in train) / 1e6:.2f} MB train "
          f"({len(train)} documents), {val_bytes / 1e6:.2f} MB val ({len(val)})\n")
    print(f"{'size':>6} {'trainer':>10} {'fit s':>7} {'val bytes/token':>16}")
    for size in args.sizes:
        counts = []
        for name, fit in (("rustbpe", train_bpe), ("tokenizers", train_hf)):
            seconds, enc = best_time(lambda fit=fit, size=size: fit(train, size), args.repeat)
            tokens = sum(len(ids) for ids in enc.encode_ordinary_batch(val))
            counts.append(tokens)
            print(f"{size:>6} {name:>10} {seconds:>7.2f} {val_bytes / tokens:>16.3f}")
        print(f"{'':>6} {'same token count' if counts[0] == counts[1] else 'counts differ'}")
    with tempfile.TemporaryDirectory() as cache:
        cold, _ = best_time(lambda: fit_tokenizer(resolve_source(None), 4096, val_fraction=0.05,
                                                  cache_dir=cache), 1)
        warm, _ = best_time(lambda: fit_tokenizer(resolve_source(None), 4096, val_fraction=0.05,
                                                  cache_dir=cache), 1)
    print(f"\nfit_tokenizer bpe:4096 (reading the corpus included): {cold:.2f} s cold, "
          f"{warm:.3f} s from the cache")


if __name__ == "__main__":
    main()
