"""Labelled examples for classification (the book's chapter 6): records with a text and a
label from JSONL, JSON or CSV/TSV files, and a task that ships, built from the embedded
corpus: which kind of work a passage of Shakespeare comes from.

The genre task. Every work of the embedded corpus is labelled by the First Folio's
(1623) three sections, Comedies, Histories and Tragedies, and the poems apart:
Cymbeline and Troilus and Cressida are tragedies as the Folio titles them; Pericles,
which the Folio left out, is a comedy, beside the late romances the Folio files there
(The Tempest, The Winter's Tale). 15 comedies, 10 histories, 12 tragedies, 5 poems. The
test split holds out whole works (`HELD_OUT`), so a passage is classified from a work the
classifier never saw in training: its names and plot do not give it away. A passage is a
run of consecutive non-empty lines of at least `PASSAGE_CHARS` characters; each work gives
at most `PASSAGES_PER_WORK`, spread evenly over it, after its title and cast list.
"""

import csv
import gzip
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tiktoken import Encoding
from torch import Tensor
from torch.utils.data import Dataset

from gptmini.data.corpus import EMBEDDED_CORPUS

__all__ = ["GENRES", "GENRE_TASK", "HELD_OUT", "LabeledDataset", "LabeledRecords", "Labels",
           "genre_records", "pad_batch", "read_records"]

GENRE_TASK = "shakespeare-genres"
GENRES: dict[str, str] = {
    **dict.fromkeys((
        "alls_well_that_ends_well", "as_you_like_it", "comedy_of_errors", "loves_labours_lost",
        "measure_for_measure", "merchant_of_venice", "merry_wives_of_windsor",
        "midsummer_nights_dream", "much_ado_about_nothing", "pericles", "taming_of_the_shrew",
        "tempest", "twelfth_night", "two_gentlemen_of_verona", "winters_tale"), "comedy"),
    **dict.fromkeys((
        "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1", "henry_vi_part_2",
        "henry_vi_part_3", "henry_viii", "john", "richard_ii", "richard_iii"), "history"),
    **dict.fromkeys((
        "antony_and_cleopatra", "coriolanus", "cymbeline", "hamlet", "julius_caesar", "lear",
        "macbeth", "othello", "romeo_and_juliet", "timon_of_athens",
        "tragedy_of_titus_andronicus", "troilus_and_cressida"), "tragedy"),
    **dict.fromkeys((
        "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece",
        "sonnets"), "poem"),
}
"""Each work of the embedded corpus (its file name without `_gut.txt.gz`) and its kind."""
HELD_OUT = ("as_you_like_it", "twelfth_night", "merchant_of_venice", "hamlet", "othello",
            "julius_caesar", "henry_v", "richard_ii", "rape_of_lucrece")
"""The genre task's test works: 3 comedies, 3 tragedies, 2 histories, 1 poem."""
PASSAGE_CHARS = 300
PASSAGES_PER_WORK = 40
SKIP_LINES = 40  # the title, the cast list and the scene of a play


@dataclass(frozen=True)
class LabeledRecords:
    """The texts and labels of a split, in file order."""

    texts: list[str]
    labels: list[str]

    def __len__(self) -> int:
        return len(self.texts)

    def class_names(self, field: str | None, where: str) -> list[str]:
        """The labels, sorted: the classes a head is built for.

        Raises:
            ValueError: most labels are held by one record alone (the text given as the
                label field, say): no class could be learned from its examples.
        """
        counts = Counter(self.labels)
        alone = sum(1 for n in counts.values() if n == 1)
        if len(counts) > 2 and alone > len(self) / 2:
            raise ValueError(
                f"{where}: the label field {field!r} gives {len(counts):,} classes to "
                f"{len(self):,} records, {alone:,} of them held by one record alone, and a "
                f"class cannot be learned from one example. Is {field!r} the text? Set "
                "--data.labels.label_field to the field that holds the classes (the text is "
                "--data.corpus.text_field)")
        return sorted(counts)


@dataclass(frozen=True)
class Labels:
    """Classification instead of language modelling: labelled records, a class head."""

    label_field: str | None = None
    """The field of each record (JSONL/JSON key, CSV/TSV column) holding its class; the
    text is in corpus.text_field, the files are corpus.source (and corpus.val_source, else
    corpus.val_fraction of the records). None: no classification."""
    task: str | None = None
    """A labelled task that ships, in place of files: "shakespeare-genres" (which kind of
    work, comedy, history, poem or tragedy, a passage comes from; held out by work)."""
    classes: list[str] | None = None
    """The class names, in the class head's order; None: the training records' labels,
    sorted (train.py fills them in, and the checkpoint keeps them)."""

    def __post_init__(self):
        if self.task not in (None, GENRE_TASK):
            raise ValueError(f"labels task={self.task!r}: the task that ships is {GENRE_TASK!r}"
                             "; for your own data set label_field and corpus.source instead")

    @property
    def active(self) -> bool:
        return self.task is not None or self.label_field is not None

    def splits(self, source: str | None, val_source: str | None, val_fraction: float,
               text_field: str) -> tuple[LabeledRecords, LabeledRecords]:
        """(training, validation) records: the task's train and test splits, or `source`'s
        records and `val_source`'s (else `val_fraction` of `source`'s, drawn with a fixed
        seed)."""
        if self.task is not None:
            return genre_records("train"), genre_records("test")
        if source is None:
            raise ValueError(f"--data.labels.label_field {self.label_field} needs labelled "
                             "files: pass them as --data.corpus.source (and val_source), or "
                             f"use --data.labels.task {GENRE_TASK}")
        records = read_records(source, text_field, self.label_field)
        if val_source is not None:
            return records, read_records(val_source, text_field, self.label_field)
        order = np.random.default_rng(0).permutation(len(records))
        n_val = round(len(records) * val_fraction)
        if n_val == 0 or n_val == len(records):
            raise ValueError(f"{source}: val_fraction={val_fraction} of {len(records)} records "
                             "leaves no validation or no training record; pass "
                             "--data.corpus.val_source or change val_fraction")
        pick = lambda idx: LabeledRecords([records.texts[i] for i in idx],  # noqa: E731
                                          [records.labels[i] for i in idx])
        return pick(sorted(order[n_val:])), pick(sorted(order[:n_val]))


def read_records(path: str | Path, text_field: str, label_field: str) -> LabeledRecords:
    """Texts and labels from a .jsonl, .json (a list of objects), .csv or .tsv file.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: another extension, or a record without the text or label field (named
            with its line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"labelled data {path} does not exist: pass a .jsonl, .json, "
                                ".csv or .tsv file as --data.corpus.source")
    suffix = path.suffix.lower()
    with open(path, newline="", encoding="utf-8") as file:
        if suffix == ".jsonl":
            rows = [(i, json.loads(line)) for i, line in enumerate(file, 1) if line.strip()]
        elif suffix == ".json":
            rows = list(enumerate(json.load(file), 1))
        elif suffix in (".csv", ".tsv"):
            rows = list(enumerate(csv.DictReader(file, delimiter="\t" if suffix == ".tsv"
                                                 else ","), 2))
        else:
            raise ValueError(f"labelled data {path}: use a .jsonl, .json, .csv or .tsv file "
                             f"(got {suffix or 'no extension'})")
    texts, labels = [], []
    for where, row in rows:
        missing = [f for f in (text_field, label_field) if not isinstance(row, dict)
                   or row.get(f) in (None, "")]
        if missing:
            found = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(
                f"{path}, record {where}: no {' or '.join(map(repr, missing))} (it has "
                f"{found}); set --data.corpus.text_field and --data.labels.label_field to the "
                "fields your records use")
        texts.append(str(row[text_field]))
        labels.append(str(row[label_field]))
    if not texts:
        raise ValueError(f"labelled data {path} holds no records")
    clash = next((spellings for spellings in _numbers(set(labels)).values()
                  if len(spellings) > 1), None)
    if clash:
        raise ValueError(f"labelled data {path}: the labels {' and '.join(clash)} are one "
                         f"number written {len(clash)} ways, which would train as "
                         f"{len(clash)} classes; write each label one way (e.g. {clash[0]})")
    return LabeledRecords(texts, labels)


def _numbers(labels: set[str]) -> dict[float, list[str]]:
    """The labels that read as finite numbers, by their value (each value's spellings)."""
    by_value: dict[float, list[str]] = {}
    for label in sorted(labels):
        try:
            value = float(label)
        except ValueError:
            continue
        if math.isfinite(value):
            by_value.setdefault(value, []).append(label)
    return by_value


def passages(text: str) -> list[str]:
    """A work's passages: runs of consecutive non-empty lines of PASSAGE_CHARS or more
    characters, after its first SKIP_LINES lines, at most PASSAGES_PER_WORK spread evenly."""
    lines = [line.rstrip() for line in text.splitlines()][SKIP_LINES:]
    found, current = [], []
    for line in lines:
        if line.strip():
            current.append(line)
        if sum(len(x) for x in current) >= PASSAGE_CHARS:
            found.append("\n".join(current))
            current = []
    if len(found) <= PASSAGES_PER_WORK:
        return found
    picks = np.linspace(0, len(found) - 1, PASSAGES_PER_WORK).round().astype(int)
    return [found[i] for i in picks]


def genre_records(split: str) -> LabeledRecords:
    """The genre task's "train" (every work but `HELD_OUT`) or "test" split, from the
    embedded corpus."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: use 'train' or 'test'")
    texts, labels = [], []
    for work, genre in sorted(GENRES.items()):
        if (work in HELD_OUT) != (split == "test"):
            continue
        with gzip.open(EMBEDDED_CORPUS / f"{work}_gut.txt.gz", "rt", encoding="utf-8") as file:
            found = passages(file.read())
        texts += found
        labels += [genre] * len(found)
    return LabeledRecords(texts, labels)


class LabeledDataset(Dataset):
    """Token ids (cut to `max_length`, the book's truncation: the text's start) and class
    indices of labelled records; `pad_batch` batches them. `cut` counts the texts that were
    longer than `max_length` and `dropped` the tokens past it, of `tokens` in all (the
    caller says so: they are classified from their start).

    Args:
        where: the records, for errors (a file; "the validation share of ...").
        fix: what the user can do about a label that is not among `classes`.
    """

    def __init__(self, records: LabeledRecords, tokenizer: Encoding, classes: list[str],
                 max_length: int, where: str = "labelled data",
                 fix: str = "list every class with --data.labels.classes"):
        index = {name: i for i, name in enumerate(classes)}
        unknown = sorted(set(records.labels) - set(index))
        if unknown:
            raise ValueError(f"{where} has labels {unknown} that are not among the model's "
                             f"classes {classes}{_respelled(unknown, classes)}; {fix}")
        encoded = [tokenizer.encode_ordinary(t) for t in records.texts]
        self.cut = sum(len(ids) > max_length for ids in encoded)
        self.dropped = sum(max(0, len(ids) - max_length) for ids in encoded)
        self.tokens = sum(len(ids) for ids in encoded)
        self.ids = [ids[:max_length] or [tokenizer.eot_token] for ids in encoded]
        self.labels = [index[label] for label in records.labels]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[list[int], int]:
        return self.ids[i], self.labels[i]


def _respelled(unknown: list[str], classes: list[str]) -> str:
    """Says which unknown labels are a class's number written another way ("1.0" for "1")."""
    ours = _numbers(set(classes))
    same = [f"{label} is the class {ours[value][0]}" for value, spellings
            in _numbers(set(unknown)).items() if value in ours for label in spellings]
    return f" ({', '.join(same)} written another way: write it the same way)" if same else ""


def cut_note(name: str, data: LabeledDataset, max_length: int) -> str | None:
    """A line saying how many of `data`'s texts were cut to the context, or None."""
    if not data.cut:
        return None
    return (f"{name}: {data.cut:,} of {len(data):,} texts are longer than the context "
            f"({max_length} tokens) and are classified from their first {max_length} (the "
            f"book's truncation): {data.dropped:,} of the {data.tokens:,} tokens "
            f"({data.dropped / data.tokens:.0%}) are not read; raise --model.context_length "
            "to read more of them")


def pad_batch(items: list[tuple[list[int], int]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """(ids, attention_mask, labels) of a batch: ids and mask (b, longest), right-padded
    with `pad_id` (mask 0 there), labels (b,)."""
    longest = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), longest), dtype=torch.long)
    for row, (tokens, _) in enumerate(items):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    return ids, mask, torch.tensor([label for _, label in items])
