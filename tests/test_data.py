"""Tests for gptmini.data: windows against the book, corpus formats, cache, errors, DDP, resume."""

import glob
import gzip
import json
import logging
import pickle

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import gptmini.data as data
from gptmini.data import (
    EMBEDDED_CORPUS,
    GPTDataModule,
    ResumableSampler,
    SlidingWindowDataset,
    create_dataloader,
    load_documents,
    resolve_source,
    tokenize_corpus,
)
from gptmini.tokenizer import get_tokenizer

ENC = get_tokenizer("gpt2")
EOT = ENC.eot_token
WORDS = "the of and to in a is that for it as was with be by on not he I this".split()


class BookGPTDatasetV1(Dataset):
    """The book's GPTDatasetV1 (chapter 2), restated from its loop as the test oracle."""

    def __init__(self, token_ids, max_length, stride):
        self.input_ids, self.target_ids = [], []
        for i in range(0, len(token_ids) - max_length, stride):
            self.input_ids.append(torch.tensor(token_ids[i : i + max_length]))
            self.target_ids.append(torch.tensor(token_ids[i + 1 : i + max_length + 1]))

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, idx):
        return self.input_ids[idx], self.target_ids[idx]


def words(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, size=n))


def joined(docs: list[str]) -> list[int]:
    """What the token file should hold: documents' ids with <|endoftext|> between them."""
    out: list[int] = []
    for doc in docs:
        if out:
            out.append(EOT)
        out += ENC.encode_ordinary(doc)
    return out


def tokens_of(path, cache_dir, val_fraction=0.0, **kwargs) -> tuple[list[int], list[int]]:
    spec = resolve_source(str(path), **kwargs)
    cache = tokenize_corpus(spec, val_fraction=val_fraction, cache_dir=cache_dir, quiet=True)
    return cache.load("train").tolist(), cache.load("val").tolist()


# --------------------------------------------------------------------------- windows


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(0, 50256), max_size=120),
    max_length=st.integers(1, 40),
    stride=st.integers(1, 50),
)
def test_windows_match_the_books_gptdatasetv1(ids, max_length, stride):
    book = BookGPTDatasetV1(ids, max_length, stride)
    ours = SlidingWindowDataset(np.asarray(ids, dtype=np.uint16), max_length, stride)
    assert len(ours) == len(book)
    for i in range(len(book)):
        x, y = ours[i]
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x, book[i][0]) and torch.equal(y, book[i][1])


def test_windows_read_a_memmap_and_pickle_by_file_name(tmp_path):
    ids = np.arange(1000, dtype=np.uint16)
    ids.tofile(tmp_path / "t.bin")
    tokens = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    ds = SlidingWindowDataset(tokens, max_length=16, stride=5)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the file name travels to workers, not the 2000-byte corpus
    again = pickle.loads(blob)
    assert isinstance(again.tokens, np.memmap)
    for i in (0, 7, len(ds) - 1):
        assert torch.equal(again[i][0], ds[i][0]) and torch.equal(again[i][1], ds[i][1])
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_create_dataloader_gives_the_books_batches():
    text = words(600, seed=1) + " <|endoftext|> " + words(100, seed=2)
    ids = ENC.encode(text, allowed_special={"<|endoftext|>"})
    torch.manual_seed(123)
    book = list(
        DataLoader(BookGPTDatasetV1(ids, 32, 16), batch_size=4, shuffle=True, drop_last=True)
    )
    torch.manual_seed(123)
    ours = list(create_dataloader(text, batch_size=4, max_length=32, stride=16))
    assert len(ours) == len(book) > 1
    for (x, y), (bx, by) in zip(ours, book, strict=True):
        assert x.shape == (4, 32) and x.dtype == torch.int64
        assert torch.equal(x, bx) and torch.equal(y, by)


@pytest.mark.parametrize("name", ["max_length", "stride"])
def test_max_length_and_stride_below_one_are_refused(name, tmp_path):
    args = {"max_length": 4, "stride": 2, name: 0}
    with pytest.raises(ValueError, match=f"{name}=0"):
        SlidingWindowDataset(np.arange(10), **args)
    with pytest.raises(ValueError, match=f"{name}=0"):
        create_dataloader(words(50, 0), **args)
    with pytest.raises(ValueError, match=f"{name}=-1"):
        GPTDataModule(cache_dir=str(tmp_path), **{**args, name: -1})


def test_create_dataloader_says_how_many_tokens_it_has_and_needs():
    n = len(ENC.encode("to be, or"))
    with pytest.raises(ValueError, match=rf"has {n} tokens; max_length=256 needs at least 257"):
        create_dataloader("to be, or")


# --------------------------------------------------------------------------- corpora


def test_embedded_corpus_loads_through_the_text_builder_from_gz(tmp_path):
    files = sorted(EMBEDDED_CORPUS.glob("*.txt.gz"))
    assert len(files) == 42 and (EMBEDDED_CORPUS.parent / "NOTICE").is_file()
    spec = resolve_source(None)
    assert spec.files == tuple(f.resolve() for f in files)
    docs = load_documents(spec, tmp_path)
    assert docs.column_names == ["text"] and len(docs) == 42
    for i in (0, 17, 41):  # one document per work, decompressed, byte for byte
        assert docs[i]["text"] == gzip.decompress(files[i].read_bytes()).decode("utf-8")


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


def test_two_tokenizing_processes_write_the_same_file(tmp_path):
    for i in range(6):
        (tmp_path / f"{i}.txt").write_text(words(40, i))
    spec = resolve_source(str(tmp_path))
    one = tokenize_corpus(spec, cache_dir=tmp_path / "one", num_proc=1, quiet=True)
    two = tokenize_corpus(spec, cache_dir=tmp_path / "two", num_proc=2, quiet=True)
    assert one.meta["dtype"] == "uint16"
    assert np.array_equal(one.load("train"), two.load("train"))


# --------------------------------------------------------------------------- validation


def test_validation_takes_a_fraction_of_documents(tmp_path):
    docs = [f"document {i}. " + words(10, i) for i in range(10)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train, val = tokens_of(tmp_path / "d.jsonl", tmp_path / "c", val_fraction=0.2)
    # every fifth document: the 5th and the 10th
    assert val == joined([docs[4], docs[9]])
    assert train == joined([d for i, d in enumerate(docs) if i not in (4, 9)])


def test_single_document_corpora_split_by_tokens(tmp_path):
    (tmp_path / "book.txt").write_text(words(400, 0))
    train, val = tokens_of(tmp_path / "book.txt", tmp_path / "c", val_fraction=0.1)
    whole = ENC.encode_ordinary(words(400, 0))
    assert train + val == whole and len(val) == round(0.1 * len(whole))


def test_a_separate_validation_source(tmp_path):
    (tmp_path / "train.txt").write_text(words(300, 0))
    (tmp_path / "val.txt").write_text(words(80, 1))
    dm = GPTDataModule(
        str(tmp_path / "train.txt"),
        val_source=str(tmp_path / "val.txt"),
        max_length=8,
        batch_size=2,
        cache_dir=str(tmp_path / "c"),
    )
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_dataset.tokens.tolist() == ENC.encode_ordinary(words(300, 0))
    assert dm.val_dataset.tokens.tolist() == ENC.encode_ordinary(words(80, 1))
    # validation windows do not overlap and come in order
    batches = [x for x, _ in dm.val_dataloader()]
    assert torch.cat(batches).flatten().tolist() == dm.val_dataset.tokens[:72].tolist()
    assert dm.val_dataset.stride == 8 and len(dm.val_dataset) == 9


# --------------------------------------------------------------------------- cache


def test_cache_hit_on_second_run_and_miss_when_source_or_tokenizer_changes(
    tmp_path, caplog, monkeypatch
):
    caplog.set_level(logging.INFO, logger="gptmini.data")
    corpus = tmp_path / "c.txt"
    corpus.write_text(words(100, 0))

    def run(tokenizer="gpt2"):
        caplog.clear()
        cache = tokenize_corpus(
            resolve_source(str(corpus)), tokenizer=tokenizer, cache_dir=tmp_path / "cache"
        )
        return cache, "cache hit" in caplog.text

    first, hit = run()
    assert not hit
    again, hit = run()
    assert hit and again.directory == first.directory
    corpus.write_text(words(101, 0))  # a changed source is a new cache entry
    changed, hit = run()
    assert not hit and changed.directory != first.directory
    assert changed.load("train").tolist() == ENC.encode_ordinary(words(101, 0))
    # a second tokenizer (same vocabulary, other name): tiktoken's others need a download
    monkeypatch.setattr(data, "get_tokenizer", lambda name="gpt2": get_tokenizer("gpt2"))
    other, hit = run("gpt2-copy")
    assert not hit and other.directory != changed.directory
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 3  # no temporary leftovers


def test_default_datamodule_trains_on_the_embedded_corpus(tmp_path):
    dm = GPTDataModule(max_length=64, batch_size=4, cache_dir=str(tmp_path))
    dm.prepare_data()
    dm.setup("fit")
    n = len(dm.train_dataset.tokens)
    assert n > 1_000_000 and len(dm.train_dataset) == len(range(0, n - 64, 64))
    assert (
        isinstance(dm.train_dataset.tokens, np.memmap)
        and dm.train_dataset.tokens.dtype == np.uint16
    )
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert len(dm.val_dataset) > 0


# --------------------------------------------------------------------------- bad input


def test_missing_path_is_named_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'nowhere/corpus.txt' does not exist.*embedded"):
        resolve_source("nowhere/corpus.txt")
    with pytest.raises(FileNotFoundError, match="matches no files"):
        resolve_source(str(tmp_path / "*.txt"))
    with pytest.raises(FileNotFoundError, match="holds no corpus files"):
        resolve_source(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GPTDataModule(source=str(tmp_path / "gone.jsonl"), cache_dir=str(tmp_path)).prepare_data()


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt is empty: 1 documents, 0 tokens"):
        tokens_of(tmp_path / "empty.txt", tmp_path / "c")


def test_too_short_corpus_says_how_many_tokens_it_has_and_needs(tmp_path):
    text = "To be, or not to be: that is the question."
    (tmp_path / "short.txt").write_text(text)
    n = len(ENC.encode_ordinary(text))
    dm = GPTDataModule(
        str(tmp_path / "short.txt"), val_fraction=0, max_length=64, cache_dir=str(tmp_path)
    )
    dm.prepare_data()
    with pytest.raises(ValueError, match=rf"has {n} tokens; max_length=64 needs at least 65"):
        dm.setup("fit")


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


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("n", [1, 37, 40])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_are_disjoint_and_together_complete(n, world):
    for shuffle, drop_last in ((True, True), (False, False)):
        shares = [
            list(
                ResumableSampler(
                    n,
                    shuffle=shuffle,
                    seed=7,
                    rank=r,
                    world_size=world,
                    drop_last=drop_last,
                    epoch=3,
                )
            )
            for r in range(world)
        ]
        seen = [i for s in shares for i in s]
        assert len(seen) == len(set(seen))  # disjoint
        assert [len(s) for s in shares] == [
            len(ResumableSampler(n, rank=r, world_size=world, drop_last=drop_last))
            for r in range(world)
        ]
        if drop_last:  # training: equal shares, at most world - 1 windows left for next epoch
            assert len({len(s) for s in shares}) == 1 and n - len(seen) == n % world
        else:  # validation: complete, in order within each rank
            assert sorted(seen) == list(range(n)) and all(s == sorted(s) for s in shares)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**40), epoch=st.integers(0, 1000))
def test_permute_is_a_permutation(n, seed, epoch):
    order = data.permute(np.arange(n), n, seed, epoch)
    assert sorted(order.tolist()) == list(range(n))
    tail = data.permute(np.arange(n // 2, n), n, seed, epoch)  # any slice, on its own
    assert np.array_equal(tail, order[n // 2 :])


def test_order_is_a_pure_function_of_seed_and_epoch():
    def order(seed, epoch):
        return list(ResumableSampler(50, seed=seed, epoch=epoch))

    assert order(1, 0) == order(1, 0) and sorted(order(1, 0)) == list(range(50))
    assert order(1, 0) != order(1, 1) and order(1, 0) != order(2, 0)
    s = ResumableSampler(50, seed=1, skip=20)
    assert list(s) == order(1, 0)[20:] and len(s) == 50  # a skip applies to its epoch only
    s.set_epoch(1)
    assert list(s) == order(1, 1)


class FakeTrainer:
    """What GPTDataModule reads from a Trainer: rank, world size, epoch, stage."""

    def __init__(self, rank=0, world=1):
        self.global_rank, self.world_size, self.current_epoch, self.training = rank, world, 0, True
        self.limit_train_batches = 1.0


def small_datamodule(tmp_path, **kwargs) -> GPTDataModule:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(words(400, 0))
    args = dict(val_fraction=0.0, max_length=8, batch_size=3, cache_dir=str(tmp_path / "c"))
    dm = GPTDataModule(str(corpus), **{**args, **kwargs})
    dm.prepare_data()
    return dm


def test_datamodule_shards_between_ranks(tmp_path):
    windows = []
    for rank in range(2):
        dm = small_datamodule(tmp_path)
        dm.trainer = FakeTrainer(rank, 2)
        dm.setup("fit")
        windows.append([tuple(row) for x, _ in dm.train_dataloader() for row in x.tolist()])
    n = len(dm.train_dataset)
    assert not set(windows[0]) & set(windows[1])
    assert len(windows[0]) == len(windows[1]) == (n // 2) // 3 * 3


def test_state_dict_resumes_on_the_windows_not_yet_seen(tmp_path):
    def run(dm, stop=None):
        seen = []
        for i, batch in enumerate(dm.train_dataloader()):
            if i == stop:
                break
            dm.on_after_batch_transfer(batch, 0)
            seen.append(batch[0].tolist())
        return seen

    whole = run(small_datamodule(tmp_path))
    first = small_datamodule(tmp_path)
    first.trainer = FakeTrainer()
    head = run(first, stop=5)
    state = first.state_dict()
    assert state["epoch"] == 0 and state["batches"] == 5
    second = small_datamodule(tmp_path)
    second.load_state_dict(state)
    assert head + run(second) == whole


def test_resume_under_another_world_size_keeps_the_same_windows(tmp_path):
    # Two ranks consume 4 batches each; one rank resumes: the union of what was seen
    # plus what is left is the whole epoch, nothing twice (batch * world sizes divide).
    seen = set()
    for rank in range(2):
        dm = small_datamodule(tmp_path, batch_size=2)
        dm.trainer = FakeTrainer(rank, 2)
        for i, batch in enumerate(dm.train_dataloader()):
            if i == 4:
                break
            dm.on_after_batch_transfer(batch, 0)
            seen |= {tuple(r) for r in batch[0].tolist()}
    single = small_datamodule(tmp_path, batch_size=2)
    single.trainer = FakeTrainer(0, 1)
    with pytest.warns(UserWarning, match="different data settings"):
        single.load_state_dict(dm.state_dict())
        rest = [tuple(r) for x, _ in single.train_dataloader() for r in x.tolist()]
    everything = {
        tuple(single.train_dataset[i][0].tolist()) for i in range(len(single.train_dataset))
    }
    assert not seen & set(rest) and len(seen) == 16
    assert len(everything - seen - set(rest)) < 2  # at most the last partial batch


# --------------------------------------------------------------------------- resume, for real


class Recorder(L.LightningModule):
    """Trains nothing; writes down every batch it is given."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.seen.append(x.tolist())
        return self.w.sum() * x.float().mean()

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, max_steps, num_workers, ckpt_path=None, save_every=None, limit=1.0):
    dm = small_datamodule(
        tmp_path, num_workers=num_workers, batch_size=6, val_source=str(tmp_path / "val.txt")
    )
    callbacks = []
    if save_every:
        callbacks = [
            ModelCheckpoint(
                dirpath=tmp_path / "ckpt", every_n_train_steps=save_every, save_top_k=-1
            )
        ]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        enable_checkpointing=bool(callbacks), callbacks=callbacks, val_check_interval=3,
        num_sanity_val_steps=1, limit_train_batches=limit,
    )  # fmt: skip
    model = Recorder()
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen, len(dm.train_dataloader())


@pytest.mark.parametrize(
    ("where", "num_workers"),
    [("mid", 0), ("mid", 2), ("end", 0), ("end", 2), ("second", 0), ("limited", 2)],
)
def test_a_resumed_trainer_sees_exactly_the_batches_it_had_not_seen(tmp_path, where, num_workers):
    (tmp_path / "val.txt").write_text(words(60, 9))
    per_epoch = len(small_datamodule(tmp_path, batch_size=6).train_dataloader())
    # The checkpoint lands mid-epoch 0, on epoch 0's last batch, mid-epoch 1, or at the end
    # of an epoch cut short by limit_train_batches; run A and the resumed half of run B
    # cross at least one epoch boundary in every case.
    limit = per_epoch - 3 if where == "limited" else 1.0
    n = {"mid": per_epoch - 2, "end": per_epoch, "second": per_epoch + 2, "limited": limit}[where]
    epoch_length = limit if where == "limited" else per_epoch
    straight, _ = fit(tmp_path, 2 * n, num_workers, limit=limit)
    before, _ = fit(tmp_path, n, num_workers, save_every=n, limit=limit)
    (ckpt,) = glob.glob(str(tmp_path / "ckpt" / f"*step={n}.ckpt"))
    state = torch.load(ckpt, weights_only=True)["GPTDataModule"]
    expected = (0, n) if where in ("end", "limited") else divmod(n, per_epoch)
    assert (state["epoch"], state["batches"]) == expected
    after, _ = fit(tmp_path, 2 * n, num_workers, ckpt_path=ckpt, limit=limit)
    assert len(straight) == 2 * n and len(before) == len(after) == n
    assert before + after == straight
    # epochs differ: the boundary really was crossed and the new epoch reshuffled
    assert straight[epoch_length] != straight[0]
