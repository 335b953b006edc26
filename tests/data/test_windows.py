"""Sliding windows against the book's GPTDatasetV1, and the resumable sampler."""

import pickle

import numpy as np
import pytest
import torch
from helpers import ENC, words
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

import gptmini.data as data
from gptmini.data import (
    ResumableSampler,
    SlidingWindowDataset,
    Windows,
    create_dataloader,
)


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
def test_max_length_and_stride_below_one_are_refused(name):
    args = {"max_length": 4, "stride": 2, name: 0}
    with pytest.raises(ValueError, match=f"{name}=0"):
        SlidingWindowDataset(np.arange(10), **args)
    with pytest.raises(ValueError, match=f"{name}=0"):
        create_dataloader(words(50, 0), **args)
    with pytest.raises(ValueError, match=f"{name}=-1"):
        Windows(**{**args, name: -1})


def test_create_dataloader_says_how_many_tokens_it_has_and_needs():
    n = len(ENC.encode("to be, or"))
    with pytest.raises(ValueError, match=rf"has {n} tokens; max_length=256 needs at least 257"):
        create_dataloader("to be, or")


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
