"""Where the loss is compiled: one training step (forward and backward) of the default run's
model, three ways, alternated in rounds in one run.

    lm_loss compiled   torch.compile(lm_loss) beside model.compile(), as Task.compile does:
                       the pass, the head and the cross-entropy in one graph
    forward compiled   model.compile(): the pass and the head compiled, the cross-entropy
                       eager on the logits it returns (a float32 copy of them, unfused)
    eager              neither

Prints the CPU, the precision (bf16 autocast where the CPU has bf16 units, and float32),
and each way's median and min milliseconds a step.

    python bench/bench_loss.py [--rounds 30] [--batch 24] [--precision both]
"""

import argparse
import copy
import time

import torch
from machine import cpu_description  # bench/machine.py (the script's own folder)

from gptmini.model import GPTConfig, GPTModel, cross_entropy, init_gpt2_weights, lm_loss
from gptmini.runtime import cpu_has_bf16

# the default run's model (gptmini/configs/shakespeare-cpu.yaml) and its 4,096-token BPE
DEFAULT_RUN = dict(vocab_size=4096, context_length=128, emb_dim=256, n_heads=4, n_layers=4,
                   n_kv_heads=1, attention_backend="explicit", drop_rate=0.0, tie_weights=True,
                   position="rope", norm="rmsnorm", norm_eps=1e-6, mlp="swiglu",
                   qk_norm=True, bias=False)


def ways(base: GPTModel) -> dict:
    """Each way's (model, step function), each with its own copy of the weights."""
    fused, split, eager = (copy.deepcopy(base) for _ in range(3))
    fused.compile()
    split.compile()
    compiled_loss = torch.compile(lm_loss)
    return {
        "lm_loss compiled": (fused, lambda x, t: compiled_loss(fused, x, t)),
        "forward compiled": (split, lambda x, t: cross_entropy(split(x), t)),
        "eager": (eager, lambda x, t: lm_loss(eager, x, t)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="rounds not counted (compiling)")
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--precision", choices=["bf16", "32", "both"], default="both")
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    precisions = ["bf16", "32"] if args.precision == "both" else [args.precision]
    if "bf16" in precisions and not cpu_has_bf16():
        print("bf16: skipped (this CPU has no bf16 units; the default run trains float32)")
        precisions.remove("bf16")
    torch.manual_seed(0)
    base = init_gpt2_weights(GPTModel(GPTConfig(**DEFAULT_RUN)))
    x = torch.randint(0, 4096, (args.batch, 128))
    t = torch.randint(0, 4096, (args.batch, 128))
    for precision in precisions:
        torch._dynamo.reset()
        steps = ways(base)
        times = {name: [] for name in steps}
        for r in range(args.warmup + args.rounds):
            for name, (model, step) in steps.items():
                start = time.perf_counter()
                with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
                    loss = step(x, t)
                loss.backward()
                model.zero_grad(set_to_none=True)
                if r >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        print(f"\nprecision {precision}, batch {args.batch} x 128, one step (forward, backward):")
        fused = sorted(times["lm_loss compiled"])[args.rounds // 2]
        for name, seconds in times.items():
            seconds = sorted(seconds)
            median = seconds[len(seconds) // 2]
            print(f"  {name:17s} median {median * 1e3:7.1f} ms   min {seconds[0] * 1e3:7.1f} ms"
                  f"   {median / fused:4.2f}x lm_loss compiled")


if __name__ == "__main__":
    main()
