"""Serving many prompts: the engine (paged KV cache, continuous batching) against
`generate()` one prompt at a time and static padded batches of 8, in one run.

64 seeded requests with lengths scaled to the model's context: the small CPU model
(context 128) gets prompts and outputs uniform in 8..64; the GPT-2 124M shape (context
1024) prompts in 16..512 and outputs in 16..256. Random weights in float32 (speed does not
depend on them), greedy, no stop token, so every request generates exactly its length.
Generated tokens/s counts the useful tokens only (a static batch runs until its longest
row ends). Time to first token: one request arriving at a warm, idle engine, with its
prompt's blocks cached or not. KV memory: the engine's allocated blocks against the tokens
they hold, sampled at every step; a static batch allocates rows x (longest prompt + longest
output).

A long prompt among decodes (the small shape with a context of 1024): 16 requests decode;
then a 512-token prompt arrives. Its time to first token, and the longest step the 16 wait
for a token meanwhile, against a decode step's time, for a step budget that prefills it at
once (528 tokens) and ones that chunk it.

    python bench/bench_serving.py [--shapes small 124m] [--requests 64] [--max_batch 64]
"""

import argparse
import os
import random
import statistics
import time

import torch
from machine import cpu_description

from gptmini.generate.engine import Engine
from gptmini.generate.loop import generate, left_pad
from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights

SHAPES = {
    "small": (GPTConfig.from_preset("cpu-small", drop_rate=0.0), (8, 64), (8, 64)),
    "124m": (GPTConfig.from_preset("gpt2-124m"), (16, 512), (16, 256)),
}


def workload(cfg, prompts, outputs, n, seed=0):
    rng = random.Random(seed)
    return [([rng.randrange(cfg.vocab_size) for _ in range(rng.randint(*prompts))],
             rng.randint(*outputs)) for _ in range(n)]


def one_by_one(model, requests) -> float:
    start = time.perf_counter()
    for prompt, new in requests:
        generate(model, torch.tensor([prompt]), new, use_cache=True)
    return sum(new for _, new in requests) / (time.perf_counter() - start)


def static_batches(model, requests, size=8) -> tuple[float, float]:
    """(useful tokens/s, KV slots allocated per slot used)."""
    start, allocated, used = time.perf_counter(), 0, 0
    for i in range(0, len(requests), size):
        group = requests[i:i + size]
        idx, mask = left_pad([p for p, _ in group])
        longest = max(new for _, new in group)
        generate(model, idx, longest, attention_mask=mask, use_cache=True)
        allocated += len(group) * (idx.shape[1] + longest)
        used += sum(len(p) + new for p, new in group)
    return sum(new for _, new in requests) / (time.perf_counter() - start), allocated / used


def engine_run(model, requests, max_batch, block_size) -> dict:
    engine = Engine(model, block_size=block_size, max_batch=max_batch)
    waste, ratio = [], []
    start = time.perf_counter()
    for prompt, new in requests:
        engine.add_request(prompt, max_new_tokens=new)
    while engine.has_work:
        engine.step()
        if engine.running:
            held = engine.blocks.in_use() * block_size
            cached = sum(r.num_cached for r in engine.running)
            waste.append((held - cached) / block_size / len(engine.running))
            ratio.append(held / max(cached, 1))
    took = time.perf_counter() - start
    # Time to first token at a warm, idle engine: a new prompt, then one seen before.
    ttft = {}
    for label, prompt in (("cold", requests[0][0][::-1]), ("cached", requests[1][0])):
        times = []
        for i in range(5):
            p = prompt if label == "cached" else [(t + i + 1) % model.cfg.vocab_size
                                                  for t in prompt]
            request = engine.add_request(p, max_new_tokens=1)
            t0 = time.perf_counter()
            while not request.tokens:
                engine.step()
            times.append(time.perf_counter() - t0)
        ttft[label] = statistics.median(times)
    return {"tok/s": sum(new for _, new in requests) / took, "waste": max(waste),
            "mean_waste": statistics.mean(waste), "ratio": statistics.mean(ratio),
            "preemptions": engine.num_preemptions, **ttft}


def long_prompt_among_decodes(budgets=(528, 256, 128)) -> None:
    cfg = GPTConfig.from_preset("cpu-small", drop_rate=0.0, context_length=1024)
    model, rng = init_gpt2_weights(GPTModel(cfg)).eval(), random.Random(1)
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(512)]
    print("a 512-token prompt arriving while 16 requests decode (small shape, context 1024):")
    for budget in budgets:
        engine = Engine(model, max_batch=32, max_step_tokens=budget)
        decoding = [engine.add_request([rng.randrange(cfg.vocab_size) for _ in range(64)],
                                       max_new_tokens=300) for _ in range(16)]
        for _ in range(5):  # all prefilled and decoding
            engine.step()
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        request, longest, t0 = engine.add_request(prompt, max_new_tokens=1), 0.0, None
        t0 = time.perf_counter()
        while not request.done:
            t1 = time.perf_counter()
            engine.step()
            longest = max(longest, time.perf_counter() - t1)
        ttft = time.perf_counter() - t0
        assert all(len(r.tokens) > 5 for r in decoding)
        print(f"  budget {budget:4d} tokens/step: decode step {step * 1e3:6.1f} ms, time to "
              f"first token {ttft * 1e3:7.1f} ms ({ttft / step:4.1f} steps), longest wait "
              f"of the decoding 16: {longest * 1e3:6.1f} ms ({longest / step:4.1f} steps)",
              flush=True)
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["small"], choices=list(SHAPES))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max_batch", type=int, default=64)
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--no_long_prompt", action="store_true",
                        help="skip the 512-token prompt among decodes")
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}; {os.cpu_count()} cores, torch threads "
          f"{torch.get_num_threads()}; torch {torch.__version__}; float32, greedy\n")
    torch.manual_seed(0)
    for name in args.shapes:
        cfg, prompts, outputs = SHAPES[name]
        model = init_gpt2_weights(GPTModel(cfg)).eval()
        requests = workload(cfg, prompts, outputs, args.requests)
        generate(model, torch.tensor([requests[0][0]]), 2, use_cache=True)  # warm-up
        engine = engine_run(model, requests, args.max_batch, args.block_size)
        static, static_ratio = static_batches(model, requests)
        single = one_by_one(model, requests)
        print(f"{name}: {args.requests} requests, prompts {prompts[0]}..{prompts[1]}, outputs "
              f"{outputs[0]}..{outputs[1]} tokens (context {cfg.context_length})")
        print(f"  one by one, generate(use_cache=True)  {single:8.1f} tok/s")
        print(f"  static padded batches of 8            {static:8.1f} tok/s   KV allocated / "
              f"used {static_ratio:.2f}")
        print(f"  engine (max_batch {args.max_batch}, block {args.block_size})      "
              f"{engine['tok/s']:8.1f} tok/s   KV allocated / used {engine['ratio']:.2f}; "
              f"waste per running sequence {engine['mean_waste']:.2f} blocks mean, "
              f"{engine['waste']:.2f} max; {engine['preemptions']} preemptions")
        print(f"  engine / one by one {engine['tok/s'] / single:.2f}x, / static "
              f"{engine['tok/s'] / static:.2f}x; time to first token at a warm engine: "
              f"{engine['cold'] * 1e3:.1f} ms new prompt, {engine['cached'] * 1e3:.1f} ms "
              "prompt cached\n", flush=True)
    if not args.no_long_prompt:
        long_prompt_among_decodes()


if __name__ == "__main__":
    main()
