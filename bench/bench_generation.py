"""Generation throughput: KV cache against full recompute, batch 1 and batch 8, one run.

Random weights (speed does not depend on them), greedy, a 16-token prompt and 48 new
tokens per row, for a small config and the GPT-2 124M shape. New tokens/s counts the
whole `generate` call, prefill included. The roofline: decoding one token reads every
weight once, so at batch 1 the machine's memory read bandwidth over the weights' bytes is
the most tokens/s any implementation can reach (a batch of b shares each read).

Past the context (--past, on by default): a rotary model of the default run's shape (4
layers, emb 256, its 4,096-token BPE vocabulary) at context 128 and 1024 generates past its
context_length, sliding by recomputing the last
context_length tokens for every new one, against rolling the KV cache (dropping its oldest
entry; exact with rotary positions). The prompt fills the context, so every new token slides.

    python bench/bench_generation.py [--new_tokens 48] [--prompt_tokens 16] [--past 64]
"""

import argparse
import os
import time

import torch
from machine import cpu_name  # bench/machine.py (the script's own folder)

from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights
from gptmini.model.flops import num_parameters

CONFIGS = {
    "small (cpu-small: 4L, emb 256, ctx 128)": GPTConfig.from_preset("cpu-small", drop_rate=0.0),
    "GPT-2 124M shape": GPTConfig.from_preset("gpt2-124m"),
}
BATCHES = (1, 8)


def read_bandwidth() -> float:
    """Bytes/s of summing a 512 MB float32 tensor (far larger than any cache), best of 5."""
    data = torch.ones(128 * 1024 * 1024)
    data.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def tokens_per_sec(model, batch, prompt_tokens, new_tokens, use_cache, repeats) -> float:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.cfg.vocab_size, (batch, prompt_tokens), generator=gen)
    generate(model, idx, 2, use_cache=use_cache)  # warm-up: kernels, allocator
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate(model, idx, new_tokens, use_cache=use_cache)
        best = min(best, time.perf_counter() - start)
    assert out.shape == (batch, prompt_tokens + new_tokens)
    return batch * new_tokens / best


def past_the_context(new_tokens: int) -> None:
    """Tokens/s past context_length: slide="recompute" against slide="roll"."""
    print(f"past the context: the default run's shape (vocab 4096) with rotary positions, "
          f"batch 1, greedy, prompt = context_length, {new_tokens} new tokens (all slide)")
    print(f"  {'context':>7} {'recompute tok/s':>16} {'roll tok/s':>11} {'speed-up':>9}")
    for context in (128, 1024):
        cfg = GPTConfig.from_preset("cpu-small", drop_rate=0.0, position="rope",
                                    vocab_size=4096, context_length=context)
        torch.manual_seed(0)
        model = init_gpt2_weights(GPTModel(cfg)).eval()
        idx = torch.randint(0, cfg.vocab_size, (1, context))
        rates = {}
        for slide in ("recompute", "roll"):
            generate(model, idx, 2, use_cache=True, slide=slide)  # warm-up
            start = time.perf_counter()
            generate(model, idx, new_tokens, use_cache=True, slide=slide)
            rates[slide] = new_tokens / (time.perf_counter() - start)
        print(f"  {context:>7} {rates['recompute']:>16.1f} {rates['roll']:>11.1f} "
              f"{rates['roll'] / rates['recompute']:>8.1f}x", flush=True)
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new_tokens", type=int, default=48)
    parser.add_argument("--prompt_tokens", type=int, default=16)
    parser.add_argument("--past", type=int, default=64,
                        help="new tokens past the context per slide mode (0: skip)")
    parser.add_argument("--only_past", action="store_true",
                        help="run only the past-the-context comparison")
    args = parser.parse_args()

    bandwidth = read_bandwidth()
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, BLAS {torch.backends.mkl.is_available() and 'MKL'}")
    print(f"memory read bandwidth (sum of 512 MB): {bandwidth / 1e9:.1f} GB/s")
    print(f"greedy, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens per row; "
          "tok/s = new tokens of all rows / wall time of the generate call\n")
    if args.past:
        past_the_context(args.past)
    if args.only_past:
        return

    results = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        model = init_gpt2_weights(GPTModel(cfg)).eval()
        params = num_parameters(model)
        ceiling = bandwidth / (params * 4)
        print(f"{name}: {params / 1e6:.1f}M parameters, {params * 4 / 1e6:.0f} MB fp32; "
              f"roofline {params * 4 / 1e6:.0f} MB / {bandwidth / 1e9:.1f} GB/s = "
              f"{ceiling:.0f} tok/s per row at batch 1")
        print(f"  {'batch':>5} {'recompute tok/s':>16} {'KV cache tok/s':>15} {'speed-up':>9} "
              f"{'cache vs roofline':>18}")
        for batch in BATCHES:
            slow = tokens_per_sec(model, batch, args.prompt_tokens, args.new_tokens, False, 1)
            fast = tokens_per_sec(model, batch, args.prompt_tokens, args.new_tokens, True, 3)
            results[name, batch] = fast
            print(f"  {batch:>5} {slow:>16.1f} {fast:>15.1f} {fast / slow:>8.1f}x "
                  f"{fast / batch / ceiling:>17.0%}", flush=True)
        print()

    b1, b8 = results["GPT-2 124M shape", 1], results["GPT-2 124M shape", 8]
    print(f"goal >= 30 tok/s at 124M batch 1: {b1:.1f} tok/s, {'met' if b1 >= 30 else 'MISSED'}")
    print(f"goal batch 8 >= 5x batch 1 at 124M: {b8 / b1:.1f}x, "
          f"{'met' if b8 >= 5 * b1 else 'MISSED'}")


if __name__ == "__main__":
    main()
