"""Corpora in: formats, the embedded corpus, decoding errors, missing paths, the hub offline."""


import dataclasses
import gzip
import json
import logging
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ENC, EOT, joined, tokens_of, words

from gptmini.data import (
    EMBEDDED_CORPUS,
    Corpus,
    GPTDataModule,
    fit_tokenizer,
    load_documents,
    resolve_source,
    tokenize_corpus,
)
from gptmini.data.documents import TextFiles, read_documents


def test_embedded_corpus_loads_through_the_text_builder_from_gz(tmp_path):
    files = sorted(EMBEDDED_CORPUS.glob("*.txt.gz"))
    assert len(files) == 42 and (EMBEDDED_CORPUS.parent / "NOTICE").is_file()
    spec = resolve_source(None)
    assert spec.files == tuple(f.resolve() for f in files)
    docs = load_documents(spec, tmp_path)
    assert docs.column_names == ["text"] and len(docs) == 42
    for i in (0, 17, 41):  # one document per work, decompressed, byte for byte
        assert docs[i]["text"] == gzip.decompress(files[i].read_bytes()).decode("utf-8")


def test_plain_text_is_read_without_datasets_as_its_text_builder_reads_it(tmp_path):
    """The tokenizing stages read plain-text files themselves (a GPU machine may lack
    datasets); datasets' text builder, the oracle, must see the same documents."""
    raw = {"crlf.txt": b"one\r\ntwo\rthree\n", "bom.md": b"\xef\xbb\xbfTitle\n\nbody",
           "bad.txt": b"caf\xe9 au lait\r\n", "empty.txt": b"",
           "crlf.txt.gz": gzip.compress(b"four\r\nfive\r")}
    for name, data in raw.items():
        (tmp_path / "docs" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "docs" / name).write_bytes(data)
    embedded = resolve_source(None)
    for spec in (resolve_source(str(tmp_path / "docs" / "*.txt"), encoding_errors="replace"),
                 resolve_source(str(tmp_path / "docs"), encoding_errors="strict"),
                 dataclasses.replace(embedded, files=embedded.files[:3])):
        if spec.encoding_errors == "strict":  # bad.txt is not UTF-8
            spec = dataclasses.replace(spec, files=tuple(
                f for f in spec.files if f.name != "bad.txt"))
        plain = read_documents(spec)
        assert isinstance(plain, TextFiles)
        ours = [text for batch in plain.iter(batch_size=2) for text in batch["text"]]
        assert ours == load_documents(spec, tmp_path / "hf")["text"] and len(plain) == len(ours)


def test_the_embedded_corpus_tokenizes_and_fits_a_vocabulary_without_datasets(
        tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises
    spec = resolve_source(None)
    cache = tokenize_corpus(spec, val_fraction=0.05, cache_dir=tmp_path, quiet=True)
    assert cache.meta["documents"] == 42 and cache.meta["tokens"]["val"] > 0
    assert fit_tokenizer(spec, 300, val_fraction=0.05, cache_dir=tmp_path).is_file()
    with pytest.raises(ImportError):
        load_documents(dataclasses.replace(spec, streaming=True), tmp_path)


def test_text_and_markdown_files_one_document_each(tmp_path):
    docs = [words(30, 1), "# Title\n\nSome *markdown*.\n", words(20, 3)]
    for name, doc in zip(["a.txt", "b.md", "c.txt.gz"], docs, strict=True):
        raw = doc.encode()
        (tmp_path / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    for source in (tmp_path, tmp_path / "*"):  # a directory and a glob
        train, val = tokens_of(source, tmp_path / "cache")
        assert train == joined(docs) and val == []
        assert train.count(EOT) == 2  # between the three documents, not after the last


def test_json_jsonl_and_parquet_with_a_text_field(tmp_path):
    docs = [words(12, i) for i in range(5)]
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"body": d, "id": 1}) + "\n" for d in docs)
    )
    (tmp_path / "b.json").write_text(json.dumps([{"body": d} for d in docs]))
    pq.write_table(pa.table({"body": docs, "n": list(range(5))}), tmp_path / "c.parquet")
    for name in ("a.jsonl", "b.json", "c.parquet"):
        train, _ = tokens_of(tmp_path / name, tmp_path / "cache", text_field="body")
        assert train == joined(docs), name


def test_streaming_reads_the_same_tokens(tmp_path):
    # The hub path (load_dataset(..., streaming=True)) exercised on local files.
    docs = [words(15, i) for i in range(25)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    kept = tokenize_corpus(
        resolve_source(str(tmp_path / "d.jsonl")),
        val_fraction=0.1,
        cache_dir=tmp_path / "a",
        quiet=True,
    )
    streamed = tokenize_corpus(
        resolve_source(str(tmp_path / "d.jsonl"), streaming=True),
        val_fraction=0.1,
        cache_dir=tmp_path / "b",
        quiet=True,
    )
    for split in ("train", "val"):
        assert np.array_equal(kept.load(split), streamed.load(split))


def test_missing_path_is_named_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'nowhere/corpus.txt' does not exist.*embedded"):
        resolve_source("nowhere/corpus.txt")
    with pytest.raises(FileNotFoundError, match="matches no files"):
        resolve_source(str(tmp_path / "*.txt"))
    with pytest.raises(FileNotFoundError, match="holds no corpus files"):
        resolve_source(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GPTDataModule(Corpus(str(tmp_path / "gone.jsonl"), cache_dir=str(tmp_path))).prepare_data()


@pytest.mark.parametrize("name", ["latin1.txt", "latin1.txt.gz", "latin1.jsonl"])
def test_file_that_is_not_utf8_is_named_and_replace_works(tmp_path, name):
    good = tmp_path / "good.txt"
    good.write_text("fine text. " * 3)
    raw = "caf\u00e9 cr\u00e8me".encode("latin-1")  # é is 0xe9 in latin-1, invalid UTF-8 here
    if name.endswith(".jsonl"):
        raw = b'{"text": "' + raw + b'"}\n'
    (tmp_path / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    source = str(tmp_path / "*")
    with pytest.raises(ValueError, match=rf"{name} is not valid UTF-8 \(byte 0xe9.*'replace'"):
        tokens_of(source, tmp_path / "c")
    train, _ = tokens_of(source, tmp_path / "c", encoding_errors="replace")
    assert "caf\ufffd cr\ufffdme" in ENC.decode(train)


@pytest.mark.parametrize(("content", "kind"), [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "a PNG image"),
    (b"%PDF-1.7\n\xe2\xe3\xcf\xd3\n", "a PDF document"),
    (b"model weights \x00\x01\xff\x00\xee", r"a binary file \(it holds NUL bytes\)"),
])
def test_a_binary_file_is_called_binary_not_latin1(tmp_path, content, kind):
    (tmp_path / "data.txt").write_bytes(content)
    with pytest.raises(ValueError, match=rf"data.txt is not text: it is {kind}") as caught:
        tokens_of(tmp_path / "data.txt", tmp_path / "c")
    assert "latin" not in str(caught.value).lower()


def test_not_utf8_while_streaming(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"ok \xff no")
    with pytest.raises(ValueError, match=r"bad\.txt is not valid UTF-8 \(byte 0xff near offset 3"):
        tokens_of(tmp_path / "bad.txt", tmp_path / "c", streaming=True)


def test_missing_json_field_lists_the_fields(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"body": "hello", "id": 1}\n')
    with pytest.raises(ValueError, match=r"no field 'text'; its fields are \['body', 'id'\]"):
        tokens_of(tmp_path / "d.jsonl", tmp_path / "c")
    with pytest.raises(ValueError, match=r"holds Value\('int64'\), not text"):
        tokens_of(tmp_path / "d.jsonl", tmp_path / "c", text_field="id")


def test_hub_name_offline_says_so_and_points_to_local_files(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    spec = resolve_source("someone/tiny-corpus", hub_config="en", hub_split="train")
    assert spec.hub_name == "someone/tiny-corpus" and spec.files == ()
    with pytest.raises(ConnectionError, match=r"cannot reach the Hugging Face hub.*local files"):
        load_documents(spec, tmp_path)


@pytest.mark.parametrize("streaming", [False, True])
def test_records_without_the_text_field_are_refused_by_count_and_first_line(
    tmp_path, caplog, streaming
):
    """Before: they were dropped silently (150 of 300 in one case)."""
    lines = [json.dumps({"text": words(8, i)} if i % 3 else {"body": "no text"}) for i in range(30)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"10 of 30 records in .*d\.jsonl have no 'text' field "
                                         r"\(the first is .*d\.jsonl line 1\).*skip_missing_text"):
        tokens_of(tmp_path / "d.jsonl", tmp_path / "c", streaming=streaming)
    caplog.set_level(logging.INFO, logger="gptmini.data")
    train, _ = tokens_of(tmp_path / "d.jsonl", tmp_path / "c", streaming=streaming,
                         skip_missing_text=True)
    assert "skipping 10 of 30 records" in caplog.text
    assert train == joined([words(8, i) for i in range(30) if i % 3])


def test_the_first_missing_record_is_found_past_blank_lines_and_across_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "three"}\n\n\n{"id": 4}\n')
    with pytest.raises(ValueError, match=r"1 of 4 records .*the first is .*b\.jsonl line 4"):
        tokens_of(tmp_path / "*.jsonl", tmp_path / "c")
