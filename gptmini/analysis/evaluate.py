"""Scoring a checkpoint: loss, perplexity and bits per byte on a whole text, and accuracy on
multiple-choice tasks in HellaSwag's layout.

    python evaluate.py --checkpoint runs/shakespeare-cpu/checkpoints/best.ckpt
    python evaluate.py --checkpoint ... --data notes.txt
    python evaluate.py --checkpoint ... --choices hellaswag_val.jsonl     # or Rowan/hellaswag
    python evaluate.py --checkpoint ... --responses                       # the book's test split

Text is cut into windows of `context_length` that do not overlap, the last one shorter, so
every token after the first is predicted exactly once, from the tokens of its window before
it (training's validation windows, plus the tail they leave out). Bits per byte is
`val/bpb`'s definition: the nats of targets that stand for text over the bytes they stand
for (`token_byte_lengths`; `<|endoftext|>` stands for none), divided by ln 2.

Multiple choice, as lm-eval's `multiple_choice` tasks: each ending is scored by the summed
log-likelihood of " " + ending after the context; `acc` takes the ending with the highest
sum, `acc_norm` the highest sum divided by the ending's length in characters. The context
is the record's `ctx` (build-nanogpt's completion style; lm-eval's hellaswag also prefixes
the activity label and cleans the text).

Responses (a judge-free score of instruction following): each held-out record is rendered
by the model's chat template (`template_for`: the one it was tuned with, else the book's
prompt) and only the assistant's tokens are scored, as fine-tuning's loss counts them:
their mean loss (the stop token included) and bits per byte of the responses' text.
"""

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tiktoken import Encoding
from torch import nn

from gptmini.checkpoint import load_checkpoint
from gptmini.data import GPTDataModule, SlidingWindowDataset, resolve_source, tokenize_corpus
from gptmini.data.chat import read_records, render_records, split_records
from gptmini.data.settings import from_record
from gptmini.finetune.chat import ChatTemplate, template_for
from gptmini.tokenizer import save_tokenizer, token_byte_lengths


@dataclass(frozen=True)
class TextScore:
    loss: float
    """Mean nats per predicted token."""
    perplexity: float
    bpb: float
    """Bits per byte of the text the targets stand for."""
    tokens: int
    """Tokens predicted (all but the first)."""
    bytes: int


@dataclass(frozen=True)
class ResponseScore:
    loss: float
    """Mean nats per response token (stop tokens included)."""
    bpb: float
    """Bits per byte of the responses' text."""
    responses: int
    tokens: int
    bytes: int
    skipped: int
    """Records longer than the model's context, left out."""


@dataclass(frozen=True)
class ChoiceScore:
    acc: float
    acc_norm: float
    examples: int


def windows(tokens: np.ndarray, context_length: int, document_token: int | None = None):
    """(inputs, targets[, document ids]) of every window, each (1, n): full windows without
    overlap, then the tail they leave, so each token after the first is a target once."""
    if len(tokens) < 2:
        raise ValueError(f"the text has {len(tokens)} token(s); scoring needs at least 2")
    full = SlidingWindowDataset(tokens, context_length, context_length, document_token)
    for i in range(len(full)):
        yield tuple(t.unsqueeze(0) for t in full[i])
    tail = tokens[len(full) * context_length:]
    if len(tail) >= 2:
        last = SlidingWindowDataset(tail, len(tail) - 1, len(tail) - 1, document_token)
        yield tuple(t.unsqueeze(0) for t in last[0])


@torch.inference_mode()
def score_text(model: nn.Module, tokenizer: Encoding, tokens: np.ndarray, *,
               batch_size: int = 8, document_mask: bool = False,
               progress: bool = True) -> TextScore:
    """Loss, perplexity and bits per byte of `model` over all of `tokens` (see the module)."""
    from tqdm import tqdm

    device = next(model.parameters()).device
    length = model.cfg.context_length
    byte_lengths = torch.tensor(token_byte_lengths(tokenizer), device=device)
    nats = text_nats = torch.zeros((), dtype=torch.float64, device=device)
    count = num_bytes = 0
    batches = _batched(windows(tokens, length, tokenizer.eot_token if document_mask else None),
                       batch_size)
    full = len(range(0, max(len(tokens) - length, 0), length))
    total = math.ceil(full / batch_size) + (len(tokens) - full * length >= 2)
    for batch in tqdm(batches, total=total, desc="scoring", unit="batch", file=sys.stderr,
                      disable=not progress):
        inputs, targets, *documents = (t.to(device) for t in batch)
        loss = model(inputs, targets=targets, reduction="none",
                     document_ids=documents[0] if documents else None).double()
        counted = byte_lengths[targets]
        nats = nats + loss.sum()
        text_nats = text_nats + (loss * (counted > 0)).sum()
        count += targets.numel()
        num_bytes += int(counted.sum())
    loss = float(nats) / count
    bpb = float(text_nats) / max(num_bytes, 1) / math.log(2)
    return TextScore(loss, math.exp(loss), bpb, count, num_bytes)


def _batched(items: Iterable[tuple], size: int):
    """Stack consecutive windows of the same length into batches of up to `size`."""
    group: list[tuple] = []
    for item in items:
        if group and (len(group) == size or item[0].shape != group[0][0].shape):
            yield tuple(torch.cat(parts) for parts in zip(*group, strict=True))
            group = []
        group.append(item)
    if group:
        yield tuple(torch.cat(parts) for parts in zip(*group, strict=True))


@torch.inference_mode()
def score_responses(model: nn.Module, tokenizer: Encoding, template: ChatTemplate,
                    records: list[tuple[str, object]], *, batch_size: int = 8
                    ) -> ResponseScore:
    """Loss and bits per byte of the assistant's tokens alone over `records` (pairs of
    where and record, as `gptmini.data.chat.read_records` gives them)."""
    device = next(model.parameters()).device
    length = model.cfg.context_length
    examples, skipped = render_records(records, tokenizer, template, length, "drop")
    if not examples:
        raise ValueError(f"every one of the {len(records)} records is longer than the "
                         f"model's context ({length} tokens)")
    byte_lengths = torch.tensor(token_byte_lengths(tokenizer), device=device)
    nats = text_nats = torch.zeros((), dtype=torch.float64, device=device)
    count = num_bytes = 0
    for start in range(0, len(examples), batch_size):
        part = examples[start:start + batch_size]
        width = max(len(e.inputs) for e in part)
        inputs = torch.tensor([e.inputs + [0] * (width - len(e.inputs)) for e in part],
                              device=device)
        targets = torch.tensor([e.targets + [-100] * (width - len(e.targets)) for e in part],
                               device=device)
        loss = model(inputs, targets=targets, reduction="none").double()  # 0 at -100
        counted = targets != -100
        text = byte_lengths[targets.clamp(min=0)] * counted
        nats = nats + loss.sum()
        text_nats = text_nats + (loss * (text > 0)).sum()
        count += int(counted.sum())
        num_bytes += int(text.sum())
    return ResponseScore(float(nats) / count, float(text_nats) / max(num_bytes, 1) / math.log(2),
                         len(examples), count, num_bytes, skipped)


def held_out_records(source: str, hparams: dict) -> tuple[list[tuple[str, object]], str]:
    """The records --responses scores: "auto" takes the test share of the run's chat
    records (the book's 1,100 for a run without them); a file is scored whole."""
    if source != "auto":
        return read_records(source), source
    records_source = hparams.get("records") or "book"
    split = tuple(hparams.get("split") or (0.85, 0.05, 0.10))
    test = split_records(read_records(records_source), split)[2]
    if not test:
        raise ValueError(f"the run's split {list(split)} keeps no test records; pass "
                         "--responses FILE")
    return test, f"the test split of {records_source} ({len(test)} records)"


@torch.inference_mode()
def choice_logliks(model: nn.Module, tokenizer: Encoding, context: str,
                   endings: Sequence[str]) -> list[float]:
    """Summed log-likelihood of " " + ending after `context`, for each ending. A sequence
    longer than the model's context keeps its last `context_length` + 1 tokens."""
    device = next(model.parameters()).device
    prefix = tokenizer.encode_ordinary(context)
    rows = []
    for ending in endings:
        tail = tokenizer.encode_ordinary(" " + ending)
        ids = (prefix + tail)[-(model.cfg.context_length + 1):]
        targets = ids[1:]
        start = max(len(targets) - len(tail), 0)  # the ending's targets only
        rows.append((ids[:-1], [-100] * start + targets[start:]))
    width = max(len(inputs) for inputs, _ in rows)
    inputs = torch.tensor([x + [0] * (width - len(x)) for x, _ in rows], device=device)
    targets = torch.tensor([y + [-100] * (width - len(y)) for _, y in rows], device=device)
    nats = model(inputs, targets=targets, reduction="none")  # right padding: causal, unseen
    return (-nats.double().sum(dim=1)).tolist()


def score_choices(model: nn.Module, tokenizer: Encoding, examples: Iterable[dict], *,
                  total: int | None = None, progress: bool = True) -> ChoiceScore:
    """lm-eval's acc and acc_norm over records with `ctx`, `endings` and `label`."""
    from tqdm import tqdm

    right = right_norm = seen = 0
    for i, example in enumerate(tqdm(examples, total=total, desc="scoring", unit="example",
                                     file=sys.stderr, disable=not progress)):
        context, endings, label = _fields(example, i)
        lls = choice_logliks(model, tokenizer, context, endings)
        right += int(np.argmax(lls)) == label
        right_norm += int(np.argmax([ll / len(e) for ll, e in zip(lls, endings, strict=True)])
                          ) == label
        seen += 1
    if not seen:
        raise ValueError("no examples to score")
    return ChoiceScore(right / seen, right_norm / seen, seen)


def _fields(example: dict, index: int) -> tuple[str, list[str], int]:
    missing = [k for k in ("ctx", "endings", "label") if k not in example]
    if missing:
        raise ValueError(f"example {index + 1} has no {', '.join(missing)} (HellaSwag's layout: "
                         f"ctx, endings, label); its fields: {', '.join(sorted(example))}")
    endings, label = list(example["endings"]), int(example["label"])
    if not 0 <= label < len(endings) or not all(endings):
        raise ValueError(f"example {index + 1}: label {label} must index one of its "
                         f"{len(endings)} endings, none of them empty")
    return str(example["ctx"]), endings, label


def read_choices(source: str, split: str = "validation",
                 limit: int | None = None) -> tuple[list[dict], str]:
    """Records from a local .jsonl file, or a hub dataset through `datasets` (`split`)."""
    path = Path(source)
    if path.is_file():
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        records = []
        for number, line in enumerate(lines[:limit], 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not JSON ({err})") from None
        return records, str(path)
    if path.suffix in (".jsonl", ".json"):
        raise FileNotFoundError(f"--choices {source}: no such file")
    import datasets

    data = datasets.load_dataset(source, split=split)
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    return list(data), f"{source} ({split})"


def text_tokens(path: str, tokenizer: Encoding, hparams: dict, *, text_field: str = "text",
                cache_dir: str | None = None) -> tuple[np.ndarray, str]:
    """The tokens of `path` (a file, folder, glob or hub dataset; every document of it),
    or, with `path` None, of the run's own validation split, through the token cache."""
    with tempfile.TemporaryDirectory() as folder:
        vocab = str(save_tokenizer(tokenizer, Path(folder) / "tokenizer.json"))
        if path is None:
            saved = {k: v for k, v in hparams.items() if not k.startswith("_")}
            if not saved:
                raise ValueError("the checkpoint names no corpus (not a train.py checkpoint); "
                                 "pass --data PATH to score a text")
            data = GPTDataModule(*from_record({**saved, "tokenizer": vocab, "num_workers": 0}))
            data.setup("validate")  # tokenizes (quietly) only if the cache lost the corpus
            if data.val_dataset is None:
                raise ValueError("the run kept no validation split (val_fraction 0); pass "
                                 "--data PATH to score a text")
            return np.asarray(data.val_dataset.tokens), "the run's validation split"
        spec = resolve_source(path, text_field=text_field)
        cache = tokenize_corpus(spec, tokenizer=vocab, cache_dir=cache_dir, quiet=True)
        return np.asarray(cache.load("train")), spec.description


def evaluate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evaluate.py",
        description="Score a checkpoint: loss, perplexity and bits per byte on the run's whole "
                    "validation split or any text; accuracy on multiple-choice tasks.")
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="a train.py .ckpt or a Hugging Face GPT-2 directory")
    parser.add_argument("--data", default=None,
                        help="a text file, folder, glob or hub dataset to score (default: the "
                             "run's validation split)")
    parser.add_argument("--text_field", default="text", help="the text of json/hub records")
    parser.add_argument("--choices", default=None,
                        help="a .jsonl of HellaSwag-style records (ctx, endings, label) or a "
                             "hub dataset such as Rowan/hellaswag")
    parser.add_argument("--responses", nargs="?", const="auto", default=None,
                        help="score the assistant's responses alone (loss, bits per byte): "
                             "with no value the test split of the run's chat records (the "
                             "book's 10%% for other checkpoints), or a .jsonl/.json file of "
                             "chat or Alpaca records")
    parser.add_argument("--split", default="validation", help="the hub dataset's split")
    parser.add_argument("--limit", type=int, default=None, help="score the first N examples")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    return parser


def evaluate_main(argv: Sequence[str] | None = None) -> int:
    args = evaluate_parser().parse_args(argv)
    try:
        if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
            raise ValueError("--batch_size and --limit must be 1 or more")
        model, tokenizer, loaded_hparams = load_checkpoint(args.checkpoint,
                                                           torch.device(args.device))
        if args.choices is not None:
            examples, name = read_choices(args.choices, args.split, args.limit)
            score = score_choices(model, tokenizer, examples, total=len(examples))
            print(f"{name}: {score.examples:,} examples\n"
                  f"acc {score.acc:.4f}  acc_norm {score.acc_norm:.4f}")
            return 0
        hparams = run_data_settings(args.checkpoint)
        if args.responses is None and args.data is None and hparams.get("records"):
            args.responses = "auto"  # a run on chat records: its held-out responses
        if args.responses is not None:
            return _print_responses(model, tokenizer, loaded_hparams, args)
        tokens, name = text_tokens(args.data, tokenizer, hparams, text_field=args.text_field,
                                   cache_dir=hparams.get("cache_dir"))
        score = score_text(model, tokenizer, tokens, batch_size=args.batch_size,
                           document_mask=bool(hparams.get("document_mask")) and not args.data)
    except (ValueError, FileNotFoundError, ConnectionError, RuntimeError) as err:
        print(f"evaluate.py: error: {err}", file=sys.stderr)
        return 1
    print(f"{name}: {score.tokens:,} tokens predicted, {score.bytes:,} bytes\n"
          f"loss {score.loss:.4f}  perplexity {score.perplexity:.2f}  "
          f"bits per byte {score.bpb:.4f}")
    return 0


def _print_responses(model: nn.Module, tokenizer: Encoding, hparams: dict,
                     args: argparse.Namespace) -> int:
    template = template_for(tokenizer, hparams)
    records, name = held_out_records(args.responses, run_data_settings(args.checkpoint))
    score = score_responses(model, tokenizer, template, records[:args.limit],
                            batch_size=args.batch_size)
    skipped = (f", {score.skipped:,} longer than the context left out" if score.skipped
               else "")
    print(f"{name}, template {template.name}: {score.responses:,} responses, "
          f"{score.tokens:,} tokens, {score.bytes:,} bytes{skipped}\n"
          f"response loss {score.loss:.4f}  bits per byte {score.bpb:.4f}")
    return 0


def run_data_settings(path: str | Path) -> dict:
    """The data settings a train.py checkpoint was trained with ({} for other models)."""
    path = Path(path)
    if path.is_dir():
        return {}
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return dict(ckpt.get("datamodule_hyper_parameters") or {})
