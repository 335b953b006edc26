"""Chat and instruction records: read from a file, each as chat messages.

Records come as OpenAI's chat records (`{"messages": [{"role", "content"}, ...]}`, one per
line of a .jsonl file) or as the book's Alpaca records (`{"instruction", "input",
"output"}`, a .json list or .jsonl lines); the book's 1,100 ship in the package
(`BOOK_RECORDS`, `--data.chat.records book`). An Alpaca record becomes a user message (the
instruction, and its input under the book's "### Input:") and the assistant's answer. Each
record keeps where it is ("FILE line N"), so that every error names it.
"""

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

from gptmini.chat.render import check_messages
from gptmini.chat.templates import ChatDataError

BOOK_RECORDS = Path(__file__).parents[1] / "assets" / "instructions" / "instruction-data.json"
"""The book's chapter 7 data: 1,100 Alpaca records (Apache-2.0, see the NOTICE beside it)."""

Record = tuple[str, object]
"""A record and where it is ("FILE line N")."""


def read_records(source: str | Path) -> list[Record]:
    """Every record of a .json list or a .jsonl file, each with where it is ("FILE line N")."""
    path = BOOK_RECORDS if str(source) == "book" else Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"chat records {source}: no such file; give 'book' or a "
                                ".jsonl/.json file of chat or Alpaca records")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err}); convert it") from None
    if text.lstrip().startswith("["):
        return list(_array_records(text, path))
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append((f"{path} line {number}", json.loads(line)))
            except json.JSONDecodeError as err:
                whole = _one_object(text, path)
                if whole is not None:
                    return [whole]
                raise ValueError(f"{path} line {number}: not JSON ({err.msg}); each line "
                                 "must be one record") from None
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def _one_object(text: str, path: Path) -> Record | None:
    """A file that is one JSON object over several lines (pretty-printed): one record when
    it is a record, None when it is not JSON at all.

    Raises:
        ValueError: an object that is no record (a wrapper of records, say), naming its keys.
    """
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(whole, Mapping) and ("messages" in whole or "instruction" in whole):
        return f"{path} line 1", whole
    found = sorted(whole)[:6] if isinstance(whole, Mapping) else type(whole).__name__
    raise ValueError(f"{path} is one JSON value ({found}), not chat records: give a JSON list "
                     "of records ([{...}, ...]) or one record per line (.jsonl)")


def _array_records(text: str, path: Path) -> Iterator[Record]:
    """The items of a JSON array, each with the line it starts on."""
    decoder, at = json.JSONDecoder(), text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return
        try:
            record, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {err.lineno}: not JSON ({err.msg})") from None
        yield f"{path} line {text.count(chr(10), 0, at) + 1}", record
        at = end


def to_messages(record: object, where: str) -> list[dict]:
    """A record as chat messages: its `messages`, or an Alpaca record's instruction (and
    input, under the book's "### Input:") as the user's and its output as the assistant's.

    Raises:
        ChatDataError: neither form, or a field of the wrong type (naming `where`).
    """
    if isinstance(record, Mapping) and "messages" in record:
        return check_messages(record["messages"], where, need_assistant=True)
    if not isinstance(record, Mapping) or "instruction" not in record or "output" not in record:
        found = sorted(record) if isinstance(record, Mapping) else type(record).__name__
        raise ChatDataError(f"{where}: a record needs 'messages' (a chat record) or "
                            f"'instruction' and 'output' (an Alpaca record); found {found}")
    fields = {k: record.get(k, "") for k in ("instruction", "input", "output")}
    for key, value in fields.items():
        if not isinstance(value, str):
            raise ChatDataError(f"{where}: '{key}' must be a string, got "
                                f"{type(value).__name__}")
    user = fields["instruction"] + (f"\n\n### Input:\n{fields['input']}" if fields["input"]
                                    else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": fields["output"]}]


def is_alpaca(records: list[Record]) -> bool:
    """Whether the records are Alpaca's (judged by the first): "auto" picks the book's
    prompt for them."""
    first = records[0][1]
    return isinstance(first, Mapping) and "messages" not in first
