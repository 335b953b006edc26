"""Two public-domain corpora that are not Shakespeare, split for bench/vs_nanogpt.py: the
default recipe was tuned on the embedded plays, these measure it on text it never saw.

    jargon   The Jargon File 4.4.7 (Eric S. Raymond et al., public domain), 1.68 MB: the
             Debian package jargon-text. Cut into blocks of 100 lines; every tenth block
             (the sixth of each ten) is validation: 1.51 MB train, 0.18 MB validation.
    kjv      The King James Bible (public domain in the US), its first 27 books, 3.0 MB
             without verse numbers: the Debian package bible-kjv-text, read out by its
             `bible` program (bible-kjv). Every tenth book (Joshua, Nehemiah, Ezekiel) is
             validation: 2.67 MB train, 0.36 MB validation.

    apt-get install jargon-text bible-kjv        # Debian or Ubuntu, as root
    python bench/corpora.py --out corpora        # corpora/{jargon,kjv}_{train,val}.txt
    python bench/vs_nanogpt.py --train corpora/kjv_train.txt --val corpora/kjv_val.txt
"""

import argparse
import gzip
import re
import subprocess
from pathlib import Path

JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")


def jargon() -> tuple[str, str]:
    """The Jargon File's (train, validation) texts."""
    lines = gzip.open(JARGON, "rt").read().splitlines(keepends=True)
    return split(["".join(lines[i:i + 100]) for i in range(0, len(lines), 100)])


def kjv(size: float = 3.0e6) -> tuple[str, str]:
    """The King James Bible's first books up to `size` characters: (train, validation)."""
    verses = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, check=True).stdout.splitlines()
    books: dict[str, list[str]] = {}
    for verse in verses:  # "Ge1:1 In the beginning ...": the book, then the verse's text
        book, words = re.fullmatch(r"(\d?[A-Za-z]+)\d+:\d+ (.*)", verse).groups()
        books.setdefault(book, []).append(words + "\n")
    taken, total = [], 0
    for text in books.values():
        if total > size:
            break
        taken.append("".join(text))
        total += len(taken[-1])
    return split(taken)


def split(pieces: list[str]) -> tuple[str, str]:
    """(train, validation): every tenth piece, the sixth of each ten, is validation."""
    return ("".join(p for i, p in enumerate(pieces) if i % 10 != 5),
            "".join(p for i, p in enumerate(pieces) if i % 10 == 5))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("corpora"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, make in (("jargon", jargon), ("kjv", kjv)):
        try:
            train, val = make()
        except (FileNotFoundError, subprocess.CalledProcessError) as error:
            print(f"{name}: skipped ({error}): apt-get install jargon-text bible-kjv")
            continue
        for split, text in (("train", train), ("val", val)):
            (args.out / f"{name}_{split}.txt").write_text(text)
        print(f"{name}: {len(train.encode()):,} training bytes, {len(val.encode()):,} "
              f"validation -> {args.out}/{name}_{{train,val}}.txt")


if __name__ == "__main__":
    main()
