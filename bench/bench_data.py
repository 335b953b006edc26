"""Benchmark gptmini.data: stride-1 windows over 50M tokens beside the book's GPTDatasetV1.

Prints the machine, then:
  * windows at stride 1 over a 50M-token memmap: build time, peak RSS per token, random
    window reads through the shuffled sampler, and one full epoch of sampler indices;
  * the book's GPTDatasetV1 (a list of tensors per window) on a sample it can hold, with a
    linear extrapolation to the same 50M tokens;
  * tokenizing the embedded Shakespeare corpus (and 4 copies of it) with num_proc 1 and 2,
    and the cache hit that follows.

Each measurement runs in a fresh process so its peak RSS is its own. Tokens are random
uint16 ids (the windows do not care what the ids are); only tokenizing reads real text.

    OMP_NUM_THREADS=1 python bench/bench_data.py [--tokens 50000000] [--book-tokens 200000]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_name  # bench/machine.py (the script's own folder)

MAX_LENGTH = 256


def rss_kib(field: str = "VmRSS") -> int:
    """Resident set size (or its peak, VmHWM) of this process in KiB, from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def reset_peak() -> int:
    """Restart peak-RSS accounting here (Linux clear_refs 5); returns the RSS now, KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_kib()


def machine() -> dict:
    cpu = cpu_name()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import datasets
    import numpy
    import tiktoken
    import torch

    return {
        "cpu": cpu,
        "cores": f"{os.cpu_count()} logical, {len(os.sched_getaffinity(0))} usable",
        "ram": f"{ram:.1f} GiB",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "datasets": datasets.__version__,
        "tiktoken": tiktoken.__version__,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
        "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def stage_ours(path: str, windows_to_read: int) -> dict:
    import numpy as np
    from torch.utils.data import DataLoader

    from gptmini.data import ResumableSampler, SlidingWindowDataset

    base = reset_peak()
    anon, file = rss_kib("RssAnon"), rss_kib("RssFile")
    start = time.perf_counter()
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    dataset = SlidingWindowDataset(tokens, MAX_LENGTH, 1)
    sampler = ResumableSampler(len(dataset), seed=0)
    build_s = time.perf_counter() - start
    build_kib = rss_kib("VmHWM") - base

    loader = DataLoader(dataset, batch_size=64, sampler=sampler, drop_last=True)
    start = time.perf_counter()
    read = 0
    for x, _ in loader:
        read += len(x)
        if read >= windows_to_read:
            break
    read_s = time.perf_counter() - start
    read_kib = rss_kib("VmHWM") - base
    # what that peak is made of: the memmap's pages (file-backed, the kernel can drop them)
    # and the process's own memory
    read_anon_kib, read_file_kib = rss_kib("RssAnon") - anon, rss_kib("RssFile") - file

    start = time.perf_counter()
    count = sum(1 for _ in sampler)  # one whole shuffled epoch of indices
    epoch_s = time.perf_counter() - start
    return {
        "tokens": len(tokens),
        "windows": len(dataset),
        "build_s": build_s,
        "build_peak_kib": build_kib,
        "read_windows": read,
        "read_s": read_s,
        "read_peak_kib": read_kib,
        "read_anon_kib": read_anon_kib,
        "read_file_kib": read_file_kib,
        "epoch_indices": count,
        "epoch_indices_s": epoch_s,
        "epoch_peak_kib": rss_kib("VmHWM") - base,
    }


def stage_book(path: str, n_tokens: int) -> dict:
    import numpy as np
    import torch

    # The book's chapter-2 dataset, restated: two tensors per window, built up front.
    class GPTDatasetV1(torch.utils.data.Dataset):
        def __init__(self, token_ids, max_length, stride):
            self.input_ids, self.target_ids = [], []
            for i in range(0, len(token_ids) - max_length, stride):
                self.input_ids.append(torch.tensor(token_ids[i : i + max_length]))
                self.target_ids.append(torch.tensor(token_ids[i + 1 : i + max_length + 1]))

    ids = np.fromfile(path, dtype=np.uint16, count=n_tokens).tolist()  # the book's list of ids
    base = reset_peak()
    start = time.perf_counter()
    dataset = GPTDatasetV1(ids, MAX_LENGTH, 1)
    return {
        "tokens": n_tokens,
        "windows": len(dataset.input_ids),
        "build_s": time.perf_counter() - start,
        "build_peak_kib": rss_kib("VmHWM") - base,
    }


def stage_tokenize(num_proc: int, copies: int) -> dict:
    import gzip

    from gptmini.data import load_documents, resolve_source, tokenize_corpus

    with tempfile.TemporaryDirectory() as root:
        spec = resolve_source(None)
        texts = [gzip.decompress(f.read_bytes()) for f in spec.files]
        if copies > 1:  # a bigger corpus: the 42 works `copies` times, as plain .txt files
            corpus = Path(root, "corpus")
            corpus.mkdir()
            for c in range(copies):
                for f, text in zip(spec.files, texts, strict=True):
                    (corpus / f"{c}-{f.name.removesuffix('.gz')}").write_bytes(text)
            spec = resolve_source(str(corpus))
        load_documents(spec, root)  # datasets' Arrow copy first, so only tokenizing is timed
        start = time.perf_counter()
        cache = tokenize_corpus(spec, cache_dir=root, num_proc=num_proc, quiet=True)
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        tokenize_corpus(spec, cache_dir=root, num_proc=num_proc, quiet=True)
        hit_s = time.perf_counter() - start
        tokens = sum(cache.meta["tokens"].values())
    return {
        "num_proc": num_proc,
        "bytes": sum(len(t) for t in texts) * copies,
        "tokens": tokens,
        "s": seconds,
        "hit_s": hit_s,
    }


def run_stage(*args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run(
        [sys.executable, __file__, "--stage", *args],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--book-tokens", type=int, default=200_000)
    parser.add_argument("--read-windows", type=int, default=100_000)
    parser.add_argument("--stage", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.stage:
        name, *rest = args.stage
        if name == "ours":
            result = stage_ours(rest[0], int(rest[1]))
        elif name == "book":
            result = stage_book(rest[0], int(rest[1]))
        else:
            result = stage_tokenize(int(rest[0]), int(rest[1]))
        print(json.dumps(result))
        return

    print("machine")
    for key, value in machine().items():
        print(f"  {key:16} {value}")

    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokens.bin")
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:  # random GPT-2 ids, written 1M at a time
            for start in range(0, args.tokens, 1 << 20):
                size = min(1 << 20, args.tokens - start)
                f.write(rng.integers(0, 50257, size=size, dtype=np.uint16).tobytes())

        ours = run_stage("ours", path, str(args.read_windows))
        n = ours["tokens"]
        print(
            f"\nwindows at stride 1, max_length {MAX_LENGTH}, over {n:,} tokens "
            f"({os.path.getsize(path) / 2**20:.0f} MiB uint16 memmap)"
        )
        print(f"  gptmini SlidingWindowDataset + ResumableSampler: {ours['windows']:,} windows")
        print(
            f"    build                {ours['build_s'] * 1e3:9.2f} ms   peak RSS "
            f"+{ours['build_peak_kib'] / 1024:8.1f} MiB = "
            f"{ours['build_peak_kib'] * 1024 / n:.3f} B/token"
        )
        rate = ours["read_windows"] / ours["read_s"]
        print(
            f"    read {ours['read_windows']:,} shuffled windows (batch 64) "
            f"{ours['read_s']:6.2f} s = {rate:,.0f} windows/s   peak RSS "
            f"+{ours['read_peak_kib'] / 1024:.1f} MiB = "
            f"{ours['read_peak_kib'] * 1024 / n:.3f} B/token"
        )
        print(
            f"      of which file-backed (memmap pages) +{ours['read_file_kib'] / 1024:.1f} MiB, "
            f"anonymous +{ours['read_anon_kib'] / 1024:.1f} MiB"
        )
        print(
            f"    one epoch of shuffled indices ({ours['epoch_indices']:,}) "
            f"{ours['epoch_indices_s']:6.2f} s   peak RSS "
            f"+{ours['epoch_peak_kib'] / 1024:.1f} MiB = "
            f"{ours['epoch_peak_kib'] * 1024 / n:.3f} B/token"
        )

        book = run_stage("book", path, str(args.book_tokens))
        scale = n / book["tokens"]
        per_token = book["build_peak_kib"] * 1024 / book["tokens"]
        print(
            f"  book GPTDatasetV1 on a {book['tokens']:,}-token sample: {book['windows']:,} windows"
        )
        print(
            f"    build                {book['build_s']:9.2f} s    peak RSS "
            f"+{book['build_peak_kib'] / 1024:8.1f} MiB = {per_token:,.0f} B/token"
        )
        print(
            f"    extrapolated (linear) to {n:,} tokens: {book['build_s'] * scale / 60:,.0f} "
            f"min, {per_token * n / 2**30:,.0f} GiB"
        )

    for copies in (1, 4):
        what = (
            "the embedded Shakespeare corpus (.txt.gz)"
            if copies == 1
            else (f"{copies} copies of it as .txt files")
        )
        print(f"\ntokenizing {what} (tiktoken gpt2 in datasets.map, one thread per process)")
        for num_proc in (1, 2):
            r = run_stage("tokenize", str(num_proc), str(copies))
            print(
                f"  num_proc={num_proc}: {r['tokens']:,} tokens from {r['bytes'] / 2**20:.1f} MiB "
                f"in {r['s']:.2f} s = {r['tokens'] / r['s'] / 1e6:.2f} M tokens/s "
                f"({r['bytes'] / r['s'] / 2**20:.1f} MiB/s); cache hit {r['hit_s'] * 1e3:.1f} ms"
            )


if __name__ == "__main__":
    main()
