"""Instruction and chat records to training examples, packed or padded.

Records are read as chat messages by `gptmini.chat` (OpenAI's chat records or the book's
Alpaca records; `--data.chat.records book` is the book's 1,100), or are worked examples of a
verifiable task (`task:addition`: its prompts with their right answers, the fine-tune
before GRPO; never the prompts an RL run of the task holds out). Each conversation is
rendered once by its chat template (`gptmini.chat.render_chat`) into ids and the
assistant's mask; the targets are -100 wherever the next token is not the assistant's, so
the loss counts the responses alone. Examples then become rows either way:

    packed   whole examples back to back in rows of max_length tokens, each token with its
             example's number: the document mask keeps every example to itself, and
             positions restart at each (so an example looks as it will when served)
    padded   one example per row, right-padded to the batch's longest; causal attention
             never sees the padding after a token, so no mask is needed

bench/bench_chat.py measures both in useful (unpadded) tokens per second.
"""

import random
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import torch
from torch.utils.data import Dataset

from gptmini.chat import ChatDataError, ChatTemplate, read_records, render_chat, to_messages
from gptmini.chat.records import Record
from gptmini.data.rl import RL
from gptmini.data.verifiable import TASKS, load_task, split_problems


@dataclass(frozen=True)
class Chat:
    """Fine-tuning on instruction or chat records instead of a corpus (`--data.chat.*`)."""

    records: str | None = None
    """"book" (the book's 1,100 Alpaca examples, shipped), or a .jsonl/.json file of OpenAI
    chat records ({"messages": [...]}) or Alpaca records (instruction, input, output).
    None: language modelling on --data.corpus."""
    val_records: str | None = None
    """A separate validation file (same forms); None takes `split`'s validation share."""
    split: tuple[float, float, float] = (0.85, 0.05, 0.10)
    """Shares of `records` for training, validation and test, cut in the records' order
    as the book cuts them: training first, then test, then validation. evaluate.py
    --responses scores the test share."""
    template: str = "auto"
    """The chat template: "auto" (the source model's own when --model.init_from has one;
    else "book" for Alpaca records and "gptmini" for chat records), "gptmini" (four new
    special tokens), "book" (the book's prompt), a Hugging Face directory with a chat
    template, or a template's .json file."""
    packing: bool = True
    """Pack whole examples into rows with document masks; False pads one example per row."""
    too_long: str = "error"
    """A record longer than the context: "error" names it, "drop" leaves it out (counted)."""

    def __post_init__(self):
        if self.too_long not in ("error", "drop"):
            raise ValueError(f"too_long={self.too_long!r}: use 'error' or 'drop'")
        if len(self.split) != 3 or any(s < 0 for s in self.split) or not (
                0 < self.split[0] and abs(sum(self.split) - 1) < 1e-6):
            raise ValueError(f"split={list(self.split)} must be three shares (training, "
                             "validation, test) adding up to 1, training above 0, e.g. "
                             "[0.85, 0.05, 0.1]")

    @property
    def active(self) -> bool:
        return self.records is not None


# ------------------------------------------------------------------------------ examples


@dataclass(frozen=True)
class Example:
    """One rendered record: inputs and targets (-100 where the next token is not the
    assistant's), each of length len(ids) - 1."""

    inputs: list[int]
    targets: list[int]


def render_records(records: list[Record], tokenizer: tiktoken.Encoding,
                   template: ChatTemplate, max_length: int, too_long: str = "error"
                   ) -> tuple[list[Example], int]:
    """(examples, how many were dropped for being longer than `max_length` + 1 tokens).

    Raises:
        ChatDataError: a bad record, or (too_long "error") a record past the context,
            naming it.
    """
    examples, dropped = [], 0
    for where, record in records:
        rendered = render_chat(to_messages(record, where), tokenizer, template, where=where)
        if len(rendered.ids) > max_length + 1:
            if too_long == "drop":
                dropped += 1
                continue
            raise ChatDataError(
                f"{where}: the record is {len(rendered.ids)} tokens, past the context of "
                f"{max_length} (+1 for the last target); shorten it, raise "
                "--model.context_length (up to the source model's), or pass "
                "--data.chat.too_long drop to leave such records out")
        inputs, targets = rendered.inputs_and_targets()
        if all(t == -100 for t in targets):
            raise ChatDataError(f"{where}: no assistant token to learn (the first token "
                                "cannot be a target); give the assistant a message")
        examples.append(Example(inputs, targets))
    return examples, dropped


def pack(examples: list[Example], max_length: int, seed: int = 0) -> list[list[int]]:
    """Rows of example indices whose tokens fit in `max_length`: first fit over the
    examples in a seeded random order, so a row mixes short and long ones (sorting by
    length would pack tighter, but put all the long answers in the same steps)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        size = len(examples[i].inputs)
        fit = next((r for r, free in enumerate(room) if free >= size), None)
        if fit is None:
            rows.append([i])
            room.append(max_length - size)
        else:
            rows[fit].append(i)
            room[fit] -= size
    return rows


class PackedExamples(Dataset):
    """Rows of `max_length` tokens, each whole examples back to back and padding after:
    (inputs, targets, document ids), each int64 of shape (max_length,). An example's tokens
    share a document id, the padding has one of its own, and its targets are -100."""

    def __init__(self, examples: list[Example], max_length: int, pad_id: int, seed: int = 0):
        self.examples, self.max_length, self.pad_id = examples, max_length, pad_id
        self.rows = pack(examples, max_length, seed)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs, targets, documents = [], [], []
        for doc, i in enumerate(self.rows[index]):
            example = self.examples[i]
            inputs += example.inputs
            targets += example.targets
            documents += [doc] * len(example.inputs)
        pad = self.max_length - len(inputs)
        inputs += [self.pad_id] * pad
        targets += [-100] * pad
        documents += [len(self.rows[index])] * pad
        return torch.tensor(inputs), torch.tensor(targets), torch.tensor(documents)

    @staticmethod
    def collate(batch: list[tuple]) -> tuple[torch.Tensor, ...]:
        return tuple(torch.stack(parts) for parts in zip(*batch, strict=True))


class PaddedExamples(Dataset):
    """One example per item, (inputs, targets) as int64 of its own length; `collate`
    right-pads a batch to its longest (targets -100 at the padding)."""

    def __init__(self, examples: list[Example], pad_id: int):
        self.examples, self.pad_id = examples, pad_id

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        example = self.examples[index]
        return torch.tensor(example.inputs), torch.tensor(example.targets)

    def collate(self, batch: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(inputs) for inputs, _ in batch)
        inputs = torch.full((len(batch), width), self.pad_id)
        targets = torch.full((len(batch), width), -100)
        for row, (x, y) in enumerate(batch):
            inputs[row, :len(x)], targets[row, :len(y)] = x, y
        return inputs, targets


def split_records(records: list, shares: tuple[float, float, float]
                  ) -> tuple[list, list, list]:
    """(training, validation, test) in the book's way: the first `shares[0]` of the records
    train, the next `shares[2]` test, the rest validate (its chapter 7 cut, in order)."""
    n = len(records)
    train_end = int(n * shares[0])
    test_end = train_end + int(n * shares[2])
    return records[:train_end], records[test_end:], records[train_end:test_end]


TASK_RECORDS = 20_000
"""Worked examples a `task:NAME` source draws (the chat split then cuts them)."""


def read_chat_records(source: str | Path) -> list[Record]:
    """The records --data.chat.records names: "book" or a file (`gptmini.chat.read_records`),
    or "task:NAME" ("task:NAME:SIZE"): TASK_RECORDS worked examples of a shipped verifiable
    task (`gptmini.data.verifiable`), drawn from seed 0 as an RL run draws its training
    prompts, so that none is a prompt it holds out."""
    if not str(source).startswith("task:"):
        return read_records(source)
    name, _, size = str(source)[len("task:"):].partition(":")
    if name not in TASKS or (size and not size.isdigit()):
        raise ValueError(f"chat records {source}: use task:NAME or task:NAME:SIZE with a "
                         f"shipped task ({', '.join(TASKS)}) and a whole size")
    task = load_task(name, size=int(size) if size else None)
    train, _ = split_problems(task, TASK_RECORDS, RL().heldout, RL().seed)
    return [(f"{source} #{i}", record) for i, record in enumerate(task.worked_from(train))]


def chat_datasets(chat: Chat, tokenizer: tiktoken.Encoding, template: ChatTemplate,
                  max_length: int, seed: int = 0) -> tuple[Dataset, Dataset | None, str]:
    """(training rows, validation rows or None, a line saying what was read and dropped)."""
    records = read_chat_records(chat.records)
    train, val, _ = split_records(records, chat.split)
    if chat.val_records is not None:
        train, val = records, read_chat_records(chat.val_records)
    if not train:
        raise ValueError(f"chat records {chat.records}: no training records after the split "
                         f"{list(chat.split)} of {len(records)}")
    pad = tokenizer.eot_token
    built, said = [], []
    for part, name in ((train, "training"), (val, "validation")):
        if not part:
            built.append(None)
            continue
        examples, dropped = render_records(part, tokenizer, template, max_length, chat.too_long)
        if not examples:
            raise ValueError(f"every {name} record is longer than the context ({max_length})")
        tokens = sum(sum(t != -100 for t in e.targets) for e in examples)
        said.append(f"{len(examples):,} {name} examples ({tokens:,} response tokens"
                    + (f", {dropped:,} dropped as too long" if dropped else "") + ")")
        built.append(PackedExamples(examples, max_length, pad, seed) if chat.packing
                     else PaddedExamples(examples, pad))
    line = f"chat records {chat.records}, template {template.name}: {'; '.join(said)}"
    return built[0], built[1], line
