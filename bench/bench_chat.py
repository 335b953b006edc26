"""Packing against padding for instruction tuning: useful (unpadded) tokens per second.

The book's 1,100 instruction records in its prompt, rendered in the default run's vocabulary
(the BPE fitted to the Shakespeare corpus, cached) and trained by the default model
(forward, backward, AdamW step; bf16 autocast where the CPU has it), batch 8, in two ways:

    packed   whole examples back to back in rows of the context, with document masks
    padded   one example per row, padded to the batch's longest

at the default context (128 tokens; longer records left out) and at 512, where several
examples fit a row. Each way runs `--steps` steps, alternating, `--rounds` times; the
median is printed, with the useful share of the tokens computed and the machine. The rate
is per second of this process's CPU time, on one thread by default: on a shared machine
wall-clock rates swung 20x between rounds, CPU time measures the work itself.

    python bench/bench_chat.py [--steps 20] [--rounds 3] [--contexts 128 512] [--threads 1]
"""

import argparse
import statistics
import time

import torch
from machine import cpu_description
from torch.utils.data import DataLoader

from gptmini.chat import BOOK
from gptmini.data import resolve_source
from gptmini.data.chat import PackedExamples, PaddedExamples, read_records, render_records
from gptmini.data.vocab import fit_tokenizer
from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights, lm_loss
from gptmini.runtime import auto_precision
from gptmini.tokenizer import load_tokenizer

DEFAULT_MODEL = dict(emb_dim=256, n_heads=4, n_layers=4, drop_rate=0.0, tie_weights=True,
                     position="rope", norm="rmsnorm", norm_eps=1e-6, mlp="swiglu",
                     qk_norm=True, bias=False)


def useful_tokens_per_second(model, loader, steps: int, bf16: bool) -> tuple[float, float]:
    """(useful tokens per CPU second, useful share of the tokens computed) over `steps`
    batches."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = iter(loader)
    useful = computed = 0
    start = time.process_time()
    for _ in range(steps):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        inputs, targets, *documents = batch
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = lm_loss(model, inputs, targets,
                           document_ids=documents[0] if documents else None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # <|endoftext|> pads, and a single-turn book record has it only as its last target
        real = inputs != loader.dataset.pad_id
        useful += int(real.sum())
        computed += inputs.numel()
    return useful / (time.process_time() - start), useful / computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bf16 = auto_precision("cpu")[0] == "bf16-mixed"
    tokenizer = load_tokenizer(fit_tokenizer(resolve_source(None), 4096, val_fraction=0.05))
    print(f"machine: {cpu_description()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, {'bf16 autocast' if bf16 else 'float32'}")
    records = read_records("book")[:935]  # the training share
    for context in args.contexts:
        examples, dropped = render_records(records, tokenizer, BOOK, context, "drop")
        torch.manual_seed(0)
        model = init_gpt2_weights(GPTModel(GPTConfig(
            vocab_size=tokenizer.n_vocab, context_length=context, **DEFAULT_MODEL)))
        ways = {"packed": PackedExamples(examples, context, tokenizer.eot_token),
                "padded": PaddedExamples(examples, tokenizer.eot_token)}
        loaders = {name: DataLoader(data, batch_size=8, shuffle=True, collate_fn=data.collate,
                                    generator=torch.Generator().manual_seed(0))
                   for name, data in ways.items()}
        speeds = {name: [] for name in ways}
        shares = {}
        useful_tokens_per_second(model, loaders["padded"], 3, bf16)  # warm up
        for _ in range(args.rounds):
            for name, loader in loaders.items():
                speed, shares[name] = useful_tokens_per_second(model, loader, args.steps, bf16)
                speeds[name].append(speed)
        print(f"\ncontext {context}: {len(examples)} examples ({dropped} longer left out), "
              f"{len(ways['packed'])} packed rows")
        for name in ways:
            print(f"  {name:7s} {statistics.median(speeds[name]):8,.0f} useful tokens/CPU s  "
                  f"({shares[name]:.0%} of the tokens computed are useful; runs "
                  f"{', '.join(f'{s:,.0f}' for s in speeds[name])})")


if __name__ == "__main__":
    main()
