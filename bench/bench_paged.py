"""Reading a paged KV cache: the ways one layer of a decode step can attend over blocks.

A decode step's queries (one per sequence) attend to keys that sit in a pool of blocks, in
each sequence's own scattered slots. Side by side, per layer:

    index      gather the keys and values by slot with a (num_seqs, num_keys) index tensor
    select     the same gather with index_select on the flattened slots
    buffer     index_select into a buffer reused from step to step (no allocation; what
               gptmini.generate.engine.paged does)
    pool       no gather: every query against the whole pool, the other slots masked out

each followed by SDPA over what it read (the pool way: over all slots). Shapes: the small
CPU model's layer (4 heads of 64), sequences of `--keys` tokens in blocks of 16, a pool
with room for 64 sequences of 512 tokens, blocks handed out shuffled.

    python bench/bench_paged.py [--seqs 16 64] [--keys 128 512]
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from machine import cpu_description


def timed(fn, repeats: int = 30) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def measure(keys: torch.Tensor, values: torch.Tensor, seqs: int, num_keys: int,
            block: int = 16) -> list[float]:
    """Seconds per layer of each way (index, select, buffer, pool), checked equal first."""
    num_slots, heads, head_dim = keys.shape
    torch.manual_seed(0)
    blocks = torch.randperm(num_slots // block)[:seqs * num_keys // block]
    tables = blocks.view(seqs, num_keys // block)
    token = torch.arange(num_keys)
    read = tables[:, token // block] * block + token % block  # (seqs, num_keys)
    flat, shape = read.flatten(), (seqs, num_keys, heads, head_dim)
    queries = torch.randn(seqs, heads, 1, head_dim)
    k_buffer, v_buffer = torch.empty(flat.numel(), heads, head_dim), torch.empty(
        flat.numel(), heads, head_dim)

    def attend(k, v, mask=None):
        return F.scaled_dot_product_attention(queries, k.transpose(1, 2),
                                              v.transpose(1, 2), attn_mask=mask)

    def by_index():
        return attend(keys[read], values[read])

    def by_select():
        return attend(keys.index_select(0, flat).view(shape),
                      values.index_select(0, flat).view(shape))

    def into_buffer():
        torch.index_select(keys, 0, flat, out=k_buffer)
        torch.index_select(values, 0, flat, out=v_buffer)
        return attend(k_buffer.view(shape), v_buffer.view(shape))

    owner = torch.full((num_slots,), -1)
    owner[flat] = torch.arange(seqs).repeat_interleave(num_keys)
    pool_mask = (owner[None] == torch.arange(seqs)[:, None])[:, None, None]

    def whole_pool():
        return F.scaled_dot_product_attention(
            queries, keys[None].transpose(1, 2).expand(seqs, -1, -1, -1),
            values[None].transpose(1, 2).expand(seqs, -1, -1, -1), attn_mask=pool_mask)

    want = by_index()
    for way in (by_select, into_buffer, whole_pool):
        torch.testing.assert_close(way(), want)
    return [timed(w) for w in (by_index, by_select, into_buffer, whole_pool)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--keys", type=int, nargs="+", default=[128, 512])
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}; {os.cpu_count()} cores, torch threads "
          f"{torch.get_num_threads()}; torch {torch.__version__}; float32\n")
    heads, head_dim, block = 4, 64, 16
    num_slots = 64 * 512
    keys = torch.randn(num_slots, heads, head_dim)
    values = torch.randn(num_slots, heads, head_dim)
    print(f"{'seqs':>5} {'keys':>5}  " + "  ".join(f"{w:>9}" for w in
                                                 ("index", "select", "buffer", "pool"))
          + "   (ms per layer: read + attention)")
    for seqs in args.seqs:
        for num_keys in args.keys:
            times = measure(keys, values, seqs, num_keys, block)
            print(f"{seqs:5d} {num_keys:5d}  " + "  ".join(f"{t * 1e3:9.2f}" for t in times),
                  flush=True)


if __name__ == "__main__":
    main()
