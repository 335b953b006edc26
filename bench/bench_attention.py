"""One attention layer per backend: forward + backward time and peak memory, side by side.

Lengths 1k to 16k, batch 1, 4 heads of 64 (emb 256), float32, under a causal mask and under
a document + window mask (documents of 128 to 1024 tokens, window 512). Each case runs in a
fresh process, so its peak memory is its own (the maximum resident size above the inputs).
flex has no backward on CPU, so there it times the forward pass alone; the explicit path is
skipped past 8k, where its score matrices would not fit. tiled-noskip is the tiled kernel
computing every tile (masked) instead of skipping those the mask hides. The modern rows
are causal with rotary queries and keys (causal+rope), ALiBi's bias (causal+alibi: SDPA
takes it as a float mask) and soft-capped scores (causal+softcap: SDPA has no hook for it,
so that backend computes the scores itself).

    python bench/bench_attention.py [--lengths 1024 2048 4096 8192 16384] [--device cpu]
                                    [--masks causal document+window causal+rope ...]
"""

import argparse
import json
import os
import subprocess
import sys
import time

from machine import cpu_name  # bench/machine.py (the script's own folder)

CASE = r"""
import json, resource, sys, time, torch
import gptmini.attention.kernels.tiled as tiled_kernel
from gptmini.attention import MultiHeadAttention
from gptmini.attention.kernels.tiled import tiled_attention

backend, mask, n, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
options = {"rope": {"rope_theta": 10000.0}, "alibi": {"alibi": True},
           "softcap": {"softcap": 50.0}}.get(mask.removeprefix("causal+"), {})
mha = MultiHeadAttention(256, 256, n, 0.0, num_heads=4, window_size=512
                         if mask == "document+window" else None,
                         backend=backend.removesuffix("-noskip"), **options).to(device)
x = torch.randn(1, n, 256, device=device, requires_grad=backend != "flex")
documents = None
if mask == "document+window":
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(128, 1025, (n // 128 + 1,), generator=gen)
    documents = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:n][None].to(device)
if backend == "tiled-noskip":
    real = tiled_attention
    tiled_kernel.tiled_attention = lambda *a, **k: real(*a, **{**k, "skip_tiles": False})
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def step():
    with torch.set_grad_enabled(backend != "flex"):
        out = mha(x, document_ids=documents)
        if backend != "flex":
            out.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()


step()  # warm-up (and compilation, for flex)
times = []
for _ in range(2):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
if device == "cuda":
    peak = torch.cuda.max_memory_allocated() // 1024
print(json.dumps({"seconds": min(times), "peak_mb": peak / 1024}))
"""

BACKENDS = ["explicit", "sdpa", "flex", "tiled", "tiled-noskip"]
MASKS = ["causal", "document+window", "causal+rope", "causal+alibi", "causal+softcap"]


def run(backend: str, mask: str, n: int, device: str) -> dict | None:
    if backend == "explicit" and n > 8192:
        return None  # 4 heads x 16k x 16k float32 scores, their softmax and gradients: > 16 GB
    proc = subprocess.run([sys.executable, "-c", CASE, backend, mask, str(n), device],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1][:80]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backends", nargs="+", default=BACKENDS)
    parser.add_argument("--masks", nargs="+", default=MASKS,
                        help="causal, document+window, and causal with one modern option: "
                             "causal+rope, causal+alibi (a float bias), causal+softcap")
    args = parser.parse_args()
    import torch

    machine = cpu_name() if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"machine: {machine}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{os.environ.get('OMP_NUM_THREADS', 'all')} threads; float32, batch 1, 4 heads of 64")
    print("cells: seconds for forward + backward (flex on CPU: forward only) / peak MB above "
          "the inputs\n")
    for mask in args.masks:
        print(f"mask: {mask}")
        print(f"{'length':>7}" + "".join(f"{b:>22}" for b in args.backends))
        results = {}
        for n in args.lengths:
            cells = []
            for backend in args.backends:
                start = time.perf_counter()
                result = run(backend, mask, n, args.device)
                results[backend, n] = result
                if result is None:
                    cells.append("skipped")
                elif "error" in result:
                    cells.append(result["error"][:20])
                else:
                    cells.append(f"{result['seconds']:.3f} s / {result['peak_mb']:,.0f}")
                del start
            print(f"{n:>7}" + "".join(f"{c:>22}" for c in cells), flush=True)
        ratios = []
        for n in args.lengths:
            tiled, noskip = results.get(("tiled", n)), results.get(("tiled-noskip", n))
            explicit = results.get(("explicit", n))
            if tiled and noskip and "seconds" in tiled and "seconds" in noskip:
                ratios.append(f"{n}: {noskip['seconds'] / tiled['seconds']:.2f}x faster")
            if n == 8192 and explicit and tiled and "peak_mb" in explicit:
                print(f"  tiled's peak memory at 8k: {tiled['peak_mb'] / explicit['peak_mb']:.1%} "
                      "of the explicit path's (goal <= 10%)")
        print(f"  skipping tiles vs computing them all: {', '.join(ratios)}\n")


if __name__ == "__main__":
    main()
