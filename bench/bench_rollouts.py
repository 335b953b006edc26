"""GRPO's rollouts: the engine against one-by-one `generate()`, at the same group size.

A GRPO step samples G completions of each of P prompts at temperature 1, each from its own
seed. `gptmini.generate.rollouts.rollout` puts all P x G into one `Engine` (continuous
batching over a paged KV cache; a group shares its prompt's blocks through the prefix
cache); the baseline calls the book's loop, `generate(..., use_cache=True)`, once per
sample. Both draw the same number of tokens (no stop token, so every completion runs to
--new_tokens); tokens/s counts the generated tokens over the wall time, prefill included.
The model is the default run's shape (4 layers, emb 256, Qwen3's blocks, one key/value head,
its 4,096-token vocabulary) with random weights, or --checkpoint's.

    python bench/bench_rollouts.py [--prompts 8] [--group 8] [--prompt_tokens 48] [--new_tokens 16]
"""

import argparse
import os
import time

import torch
from machine import cpu_description  # bench/machine.py (the script's own folder)

from gptmini.generate.loop import generate
from gptmini.generate.rollouts import rollout
from gptmini.generate.sampling import SamplingParams
from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights

DEFAULT_SHAPE = dict(vocab_size=4096, context_length=128, emb_dim=256, n_heads=4, n_layers=4,
                     n_kv_heads=1, attention_backend="explicit", drop_rate=0.0, tie_weights=True,
                     position="rope", norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", qk_norm=True,
                     bias=False)
"""The default run's model (gptmini/configs/shakespeare-cpu.yaml)."""


def one_by_one(model, prompts, group, new_tokens, seed) -> float:
    """Seconds to sample every completion with its own generate() call."""
    start = time.perf_counter()
    for i, prompt in enumerate(p for p in prompts for _ in range(group)):
        params = SamplingParams(temperature=1.0, seed=seed + i, max_new_tokens=new_tokens)
        out = generate(model, torch.tensor([prompt]), new_tokens, sampling=params,
                       use_cache=True)
        assert out.shape[1] == len(prompt) + new_tokens
    return time.perf_counter() - start


def through_the_engine(model, prompts, group, new_tokens, seed) -> float:
    start = time.perf_counter()
    runs = rollout(model, prompts, group, max_new_tokens=new_tokens, stop_ids=[], seed=seed)
    assert runs.num_tokens == len(prompts) * group * new_tokens
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="P: prompts per step")
    parser.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    parser.add_argument("--prompt_tokens", type=int, default=48)
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--checkpoint", default=None, help="a .ckpt (default: random weights)")
    args = parser.parse_args()

    if args.checkpoint:
        from gptmini.checkpoint import load_checkpoint
        model = load_checkpoint(args.checkpoint).model.eval()
    else:
        torch.manual_seed(0)
        model = init_gpt2_weights(GPTModel(GPTConfig(**DEFAULT_SHAPE))).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.cfg.vocab_size, (args.prompts, args.prompt_tokens),
                            generator=gen).tolist()
    tokens = args.prompts * args.group * args.new_tokens
    print(f"machine: {cpu_description()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{args.prompts} prompts of {args.prompt_tokens} tokens x group {args.group}, "
          f"{args.new_tokens} new tokens each ({tokens} tokens a step), temperature 1, "
          f"float32, best of {args.repeats}")
    through_the_engine(model, prompts[:1], 2, 2, 0)  # warm-up: kernels, allocator
    one_by_one(model, prompts[:1], 1, 2, 0)
    engine = min(through_the_engine(model, prompts, args.group, args.new_tokens, 1)
                 for _ in range(args.repeats))
    alone = min(one_by_one(model, prompts, args.group, args.new_tokens, 1)
                for _ in range(args.repeats))
    print(f"  {'':<28} {'seconds':>8} {'tokens/s':>9}")
    print(f"  {'one-by-one generate()':<28} {alone:>8.2f} {tokens / alone:>9.0f}")
    print(f"  {'engine (rollout)':<28} {engine:>8.2f} {tokens / engine:>9.0f}")
    ratio = alone / engine
    print(f"engine / one-by-one: {ratio:.1f}x (goal >= 3x: {'met' if ratio >= 3 else 'MISSED'})")


if __name__ == "__main__":
    main()
