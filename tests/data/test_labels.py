"""The genre task that ships: every work labelled, whole works held out, passages of text."""

import gzip

from gptmini.data.corpus import EMBEDDED_CORPUS
from gptmini.data.labels import GENRES, HELD_OUT, PASSAGES_PER_WORK, genre_records


def text_of(work: str) -> str:
    with gzip.open(EMBEDDED_CORPUS / f"{work}_gut.txt.gz", "rt", encoding="utf-8") as file:
        return file.read()


def test_every_embedded_work_has_a_kind_and_the_test_split_holds_out_whole_works():
    works = {p.name.removesuffix("_gut.txt.gz") for p in EMBEDDED_CORPUS.glob("*.txt.gz")}
    assert set(GENRES) == works and len(works) == 42
    assert {GENRES[w] for w in HELD_OUT} == {"comedy", "history", "tragedy", "poem"}
    train, test = genre_records("train"), genre_records("test")
    assert set(train.labels) == set(test.labels) == {"comedy", "history", "tragedy", "poem"}
    # Hamlet is held out: its passages (runs of its lines) are in the test split alone.
    hamlet = {line.rstrip() for line in text_of("hamlet").splitlines() if line.strip()}

    def in_hamlet(passage: str) -> bool:
        return set(passage.splitlines()) <= hamlet

    assert not any(in_hamlet(t) for t in train.texts)
    from_hamlet = [label for t, label in zip(test.texts, test.labels, strict=True)
                   if in_hamlet(t)]
    assert from_hamlet == ["tragedy"] * PASSAGES_PER_WORK
