"""Preference pairs to training rows: a prompt, a chosen and a rejected response.

Records come in two layouts:

    the book's   {"instruction", "input", "chosen", "rejected"} (chapter 7's bonus on
                 Direct Preference Optimization; "output" and other keys are ignored)
    chat         {"prompt": str | messages, "chosen", "rejected"}, or "messages" (the
                 conversation before the response) instead of "prompt"; each response a
                 string, an assistant message, or a list ending with one (TRL's layout)

The book's 1,100 pairs ship in the package (`PREFERENCE_RECORDS`, `records: book`). A pair
is rendered twice by the run's chat template, the prompt followed by either response; the
targets are -100 everywhere but the response's own tokens (its stop token included), so a
sequence's log-probability sums the response alone (tests/data/test_preference.py proves
it by gradients). Every error names the record ("FILE line N"), the field and the fix.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import torch
from torch import Tensor
from torch.utils.data import Dataset

from gptmini.chat import ChatDataError, ChatTemplate, check_messages, read_records, render_chat
from gptmini.data.chat import split_records

PREFERENCE_RECORDS = (Path(__file__).parents[1] / "assets" / "preference"
                      / "instruction-data-with-preference.json")
"""The book's chapter 7 preference data: 1,100 pairs (Apache-2.0, see the NOTICE beside it);
6 of them have the same chosen and rejected text, left out when read as "book"."""


@dataclass(frozen=True)
class Preference:
    """Preference tuning (DPO) on pairs of responses (`--data.preference.*`)."""

    records: str | None = None
    """"book" (the book's 1,100 pairs, shipped), or a .jsonl/.json file of pairs in the
    book's layout (instruction, input, chosen, rejected) or the chat layout (prompt or
    messages, chosen, rejected). None: not a preference run."""
    val_records: str | None = None
    """A separate validation file (same layouts); None takes `split`'s validation share."""
    split: tuple[float, float, float] = (0.85, 0.05, 0.10)
    """Shares of `records` for training, validation and test, cut in order as the book
    cuts them (training, then test, then validation)."""
    template: str = "auto"
    """The chat template, as --data.chat.template: "auto" keeps the source model's own
    (else the book's prompt for the book's layout, gptmini's for chat records)."""
    too_long: str = "error"
    """A pair with a response past the context: "error" names it, "drop" leaves it out."""
    identical: str = "error"
    """A pair whose chosen and rejected are the same: "error" names it, "drop" leaves it
    out (counted). The shipped book's 6 such pairs are always left out, and counted."""

    def __post_init__(self):
        for name in ("too_long", "identical"):
            if getattr(self, name) not in ("error", "drop"):
                raise ValueError(f"--data.preference.{name} {getattr(self, name)!r}: use "
                                 "'error' or 'drop'")
        if len(self.split) != 3 or any(s < 0 for s in self.split) or not (
                0 < self.split[0] and abs(sum(self.split) - 1) < 1e-6):
            raise ValueError(f"--data.preference.split {list(self.split)} must be three "
                             "shares (training, validation, test) adding up to 1, training "
                             "above 0, e.g. [0.85, 0.05, 0.1]")

    @property
    def active(self) -> bool:
        return self.records is not None


# ------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class PreferencePair:
    """One record: the conversation before the response, and the two responses."""

    prompt: list[dict]
    chosen: str
    rejected: str
    where: str
    """The record's place ("FILE line N"), for every later error."""


def to_pair(record: object, where: str) -> PreferencePair:
    """A record of either layout as a `PreferencePair`.

    Raises:
        ChatDataError: a missing or empty field, a response that is not text, a prompt
            that ends with the assistant, or chosen equal to rejected (naming `where`,
            the field and the fix).
    """
    if not isinstance(record, Mapping) or not {"chosen", "rejected"} <= set(record) or not (
            {"instruction", "prompt", "messages"} & set(record)):
        found = sorted(record) if isinstance(record, Mapping) else type(record).__name__
        raise ChatDataError(
            f"{where}: a preference record needs 'chosen', 'rejected' and a prompt "
            f"('instruction' with 'input', the book's layout; or 'prompt' or 'messages'); "
            f"found {found}")
    prompt = _prompt(record, where)
    chosen, rejected = (_response(record[k], f"{where}: '{k}'") for k in ("chosen", "rejected"))
    if chosen == rejected:
        raise ChatDataError(
            f"{where}: 'chosen' and 'rejected' are the same text, so the pair teaches nothing "
            "(its DPO loss is log 2 whatever the weights); fix one of them, remove the record, "
            "or pass --data.preference.identical drop to leave such pairs out")
    return PreferencePair(prompt, chosen, rejected, where)


def _prompt(record: Mapping, where: str) -> list[dict]:
    """The messages before the response, from either layout."""
    if "instruction" in record:
        parts = {k: record.get(k, "") for k in ("instruction", "input")}
        for key, value in parts.items():
            if not isinstance(value, str):
                raise ChatDataError(f"{where}: '{key}' must be a string, got "
                                    f"{type(value).__name__}")
        user = parts["instruction"] + (f"\n\n### Input:\n{parts['input']}" if parts["input"]
                                       else "")
        messages = [{"role": "user", "content": user}]
    else:
        key = "prompt" if "prompt" in record else "messages"
        value = record[key]
        messages = ([{"role": "user", "content": value}] if isinstance(value, str)
                    else check_messages(value, f"{where}: '{key}'"))
    if not any(m["content"].strip() for m in messages):
        raise ChatDataError(f"{where}: the prompt is empty; give the instruction (or the "
                            "user's message) the responses answer")
    if messages[-1]["role"] == "assistant":
        raise ChatDataError(f"{where}: the prompt ends with an assistant message; it must end "
                            "with the user's (the responses are the assistant's next turn)")
    return messages


def _response(value: object, at: str) -> str:
    """A response's text: a string, an assistant message, or a list ending with one."""
    if isinstance(value, list) and value:
        value = value[-1]
    if isinstance(value, Mapping):
        if value.get("role") != "assistant":
            raise ChatDataError(f"{at} must be the assistant's message, got role "
                                f"{value.get('role')!r}")
        value = check_messages([value], at)[0]["content"]
    if not isinstance(value, str):
        raise ChatDataError(f"{at} must be a string (the response), an assistant message, or "
                            f"a list ending with one; got {type(value).__name__}")
    if not value.strip():
        raise ChatDataError(f"{at} is empty: a pair compares two responses; write it, or "
                            "remove the record")
    return value


def read_pairs(source: str | Path) -> list[tuple[str, object]]:
    """The records of "book" (the shipped pairs) or of a .json/.jsonl file, each with where
    it is ("FILE line N"), in order; `to_pairs` checks them."""
    path = PREFERENCE_RECORDS if str(source) == "book" else Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"preference records {source}: no such file; give 'book' or a "
                                ".jsonl/.json file of pairs (chosen, rejected and a prompt)")
    return read_records(path)


def is_book_layout(records: list[tuple[str, object]]) -> bool:
    """Whether the records are in the book's layout (judged by the first): "auto" renders
    them with the book's prompt, as the instruction data."""
    first = records[0][1] if records else None
    return isinstance(first, Mapping) and "instruction" in first


def to_pairs(records: list[tuple[str, object]], identical: str = "error"
             ) -> tuple[list[PreferencePair], int]:
    """(the records as pairs, in order; how many identical pairs were left out).

    The book's file holds 6 pairs whose chosen and rejected are the same text: those are
    always left out (and counted); any other file's are with `identical="drop"`, and
    otherwise the first raises, naming it.
    """
    pairs, dropped = [], 0
    for where, record in records:
        try:
            pairs.append(to_pair(record, where))
        except ChatDataError as err:
            shipped = where.startswith(str(PREFERENCE_RECORDS))
            if "are the same text" not in str(err) or not (shipped or identical == "drop"):
                raise
            dropped += 1
    return pairs, dropped


# ------------------------------------------------------------------------------ rendering


@dataclass(frozen=True)
class RenderedPair:
    """A pair as next-token rows: inputs and targets (-100 but on the response's tokens) of
    the prompt followed by each response."""

    chosen_inputs: list[int]
    chosen_targets: list[int]
    rejected_inputs: list[int]
    rejected_targets: list[int]

    @property
    def longest(self) -> int:
        return max(len(self.chosen_inputs), len(self.rejected_inputs))

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's ids, up to where the response starts."""
        start = next(i for i, t in enumerate(self.chosen_targets) if t != -100)
        return self.chosen_inputs[:start + 1]


def render_pair(pair: PreferencePair, tokenizer: tiktoken.Encoding, template: ChatTemplate
                ) -> RenderedPair:
    """The pair rendered with `template`: each response's targets are its own tokens and its
    stop token (the last assistant turn's, not an earlier turn of the prompt)."""
    rows = []
    for response in (pair.chosen, pair.rejected):
        messages = [*pair.prompt, {"role": "assistant", "content": response}]
        rendered = render_chat(messages, tokenizer, template, where=pair.where)
        mask = _last_run(rendered.assistant_mask)
        targets = [t if keep else -100 for t, keep in zip(rendered.ids[1:], mask[1:],
                                                          strict=True)]
        rows += [rendered.ids[:-1], targets]
    return RenderedPair(*rows)


def _last_run(mask: list[bool]) -> list[bool]:
    """Only the last run of True in `mask`: the final assistant turn."""
    end = max(i for i, m in enumerate(mask) if m) + 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return [start <= i < end for i in range(len(mask))]


def render_pairs(pairs: list[PreferencePair], tokenizer: tiktoken.Encoding,
                 template: ChatTemplate, max_length: int, too_long: str = "error"
                 ) -> tuple[list[RenderedPair], int]:
    """(the rendered pairs, how many were left out as longer than `max_length` inputs).

    Raises:
        ChatDataError: (too_long "error") a pair past the context, naming it and the fix.
    """
    rendered, dropped = [], 0
    for pair in pairs:
        row = render_pair(pair, tokenizer, template)
        if row.longest > max_length:
            if too_long == "drop":
                dropped += 1
                continue
            raise ChatDataError(
                f"{pair.where}: the prompt with its longer response is {row.longest + 1} "
                f"tokens, past the context of {max_length} (+1 for the last target); shorten "
                "it, raise --model.context_length (up to the source model's), or pass "
                "--data.preference.too_long drop to leave such pairs out")
        rendered.append(row)
    return rendered, dropped


class PreferencePairs(Dataset):
    """Rendered pairs; `collate` right-pads a batch into (chosen inputs, chosen targets,
    rejected inputs, rejected targets), each (b, width), targets -100 in the padding."""

    def __init__(self, pairs: list[RenderedPair], pad_id: int):
        self.pairs, self.pad_id = pairs, pad_id

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> RenderedPair:
        return self.pairs[index]

    def collate(self, batch: list[RenderedPair]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        width = max(p.longest for p in batch)
        out = []
        for name in ("chosen", "rejected"):
            inputs = torch.full((len(batch), width), self.pad_id)
            targets = torch.full((len(batch), width), -100)
            for row, pair in enumerate(batch):
                x, y = getattr(pair, f"{name}_inputs"), getattr(pair, f"{name}_targets")
                inputs[row, :len(x)], targets[row, :len(y)] = torch.tensor(x), torch.tensor(y)
            out += [inputs, targets]
        return tuple(out)


def preference_datasets(settings: Preference, tokenizer: tiktoken.Encoding,
                        template: ChatTemplate, max_length: int
                        ) -> tuple[PreferencePairs, PreferencePairs | None, str]:
    """(training pairs, validation pairs or None, a line saying what was read and left out)."""
    records = read_pairs(settings.records)
    train, val, _ = split_records(records, settings.split)  # the book's cut, of its records
    if settings.val_records is not None:
        train, val = records, read_pairs(settings.val_records)
    (train, left_train), (val, left_val) = (to_pairs(part, settings.identical)
                                            for part in (train, val))
    identical = left_train + left_val
    if not train:
        raise ValueError(f"preference records {settings.records}: no training pairs after "
                         f"the split {list(settings.split)} of {len(records)}")
    built, said = [], []
    for part, name in ((train, "training"), (val, "validation")):
        if not part:
            built.append(None)
            continue
        rendered, dropped = render_pairs(part, tokenizer, template, max_length,
                                         settings.too_long)
        if not rendered:
            raise ValueError(f"every {name} pair is longer than the context ({max_length})")
        said.append(f"{len(rendered):,} {name} pairs"
                    + (f" ({dropped:,} left out as too long)" if dropped else ""))
        built.append(PreferencePairs(rendered, tokenizer.eot_token))
    if identical:
        said.append(f"{identical} left out whose chosen and rejected are the same")
    line = f"preference records {settings.records}, template {template.name}: {'; '.join(said)}"
    return built[0], built[1], line
