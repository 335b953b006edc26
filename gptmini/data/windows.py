"""Sliding windows over a token file, and the resumable sampler that shuffles them."""

import mmap
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from tiktoken import Encoding
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from gptmini.tokenizer import END_OF_TEXT, get_tokenizer


class SlidingWindowDataset(Dataset):
    """The book's `GPTDatasetV1` windows, read lazily from a token array or memmap.

    Window i starts at token ``i * stride``: input is ``tokens[start : start + max_length]``
    and target the same shifted by one. For the same ids, `max_length` and `stride` it gives
    the same windows in the same order as ``for i in range(0, len(ids) - max_length,
    stride)``, but stores nothing: each item is sliced from `tokens` when asked for, so
    building it is O(1) in time and memory (the book's list of tensors needs 2 * max_length
    int64s per window).

    Args:
        tokens: token ids, shape (n,): an np.memmap (kept mapped, reopened by name in
            worker processes), any numpy array, a 1-D tensor or a sequence of ints.
        max_length: tokens per window (the model's context length).
        stride: tokens between the starts of consecutive windows; max_length for no
            overlap, 1 for every position.
        document_token: the token that starts each document (<|endoftext|>, which sits
            between documents): with it, each window also gives the document id of every
            input token, for document masks (None: windows are (input, target) only).

    Raises:
        ValueError: `max_length` or `stride` below 1.
    """

    def __init__(
        self, tokens: np.ndarray | torch.Tensor | Sequence[int], max_length: int, stride: int,
        document_token: int | None = None,
    ):
        check_positive(max_length=max_length, stride=stride)
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        elif not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.max_length = max_length
        self.stride = stride
        self.document_token = document_token
        self._len = len(range(0, max(len(tokens) - max_length, 0), stride))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        """Window `index` as (input, target), each int64 of shape (max_length,), and with a
        document_token the inputs' document ids (0 for the first document in the window)."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} out of range for {self._len} windows")
        start = index * self.stride
        # One copy of max_length + 1 tokens; input and target are views into it.
        window = torch.from_numpy(self.tokens[start : start + self.max_length + 1].astype(np.int64))
        if self.document_token is None:
            return window[:-1], window[1:]
        inputs = window[:-1]
        return inputs, window[1:], (inputs == self.document_token).cumsum(0)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        t = self.tokens
        # Pickling a memmap would copy the whole corpus into every spawned worker; send the
        # file name instead. Only a memmap of a whole mapping (not a slice) has its own .base.
        if isinstance(t, np.memmap) and t.filename and isinstance(t.base, mmap.mmap):
            state["tokens"] = ("memmap", t.filename, t.dtype.str, t.offset, t.shape)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        t = state["tokens"]
        if isinstance(t, tuple) and t[0] == "memmap":
            _, name, dtype, offset, shape = t
            state["tokens"] = np.memmap(
                name, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape
            )
        self.__dict__.update(state)


def check_positive(**values: int | None) -> None:
    """Raise ValueError naming the first of `values` that is not a positive integer."""
    for name, value in values.items():
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"{name}={value!r} is invalid: use an integer of 1 or more")


def create_dataloader(
    text: str,
    batch_size: int = 4,
    max_length: int = 256,
    stride: int = 128,
    shuffle: bool = True,
    drop_last: bool = True,
    num_workers: int = 0,
    tokenizer: str | Encoding = "gpt2",
) -> DataLoader:
    """The book's `create_dataloader_v1`: windows of one text in batches of (input, target).

    Tokenizes like the book (``encode(text, allowed_special={"<|endoftext|>"})``), so with
    the same `torch.manual_seed` it yields the same batches, each a pair of int64 tensors of
    shape (batch_size, max_length).

    Raises:
        ValueError: the text has fewer than max_length + 1 tokens; an argument below 1.
    """
    check_positive(batch_size=batch_size, max_length=max_length, stride=stride)
    enc = tokenizer if isinstance(tokenizer, Encoding) else get_tokenizer(tokenizer)
    ids = enc.encode(text, allowed_special={END_OF_TEXT})
    if len(ids) < max_length + 1:
        raise ValueError(
            f"the text has {len(ids)} tokens; max_length={max_length} needs at least "
            f"{max_length + 1} for one (input, target) window. Use a longer text or a smaller "
            "max_length"
        )
    dataset = SlidingWindowDataset(ids, max_length, stride)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        num_workers=num_workers,
    )



def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Where `positions` go under a pseudo-random permutation of range(n) keyed by (seed, epoch).

    A keyed bijection (a 6-round Feistel network on the smallest even number of bits that
    holds n, with cycle walking to stay below n) instead of a shuffled array: any slice of
    the epoch's order is computed on its own, so shuffling 50M stride-1 windows takes no
    memory, and skipping to the middle of an epoch takes no time.

    Args:
        positions: positions in the epoch's order, shape (k,), each in [0, n).
        n: size of the permuted range.
        seed, epoch: the key; the permutation is a pure function of them.

    Returns:
        The window indices at those positions, shape (k,), int64.
    """
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng([seed % 2**63, epoch]).integers(0, 2**63, size=6, dtype=np.uint64)
    shift = np.uint64(half)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << shift) | right

    x = feistel(positions.astype(np.uint64))
    # Cycle walking: values that land in [n, 2^bits) step again until they are in range; as
    # 2^bits < 4n, a few steps at most, and the walk keeps the map a bijection of range(n).
    while (out := x >= n).any():
        x[out] = feistel(x[out])
    return x.astype(np.int64)


def _mix(z: np.ndarray) -> np.ndarray:
    # splitmix64's finalizer: every input bit flips about half the output bits.
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class ResumableSampler(DistributedSampler):
    """Window indices for one rank: a pure function of (seed, epoch), skippable for resume.

    Epoch e's order is `permute(range(n), n, seed, e)` (or 0..n-1 without shuffling); rank r
    takes positions r, r + world_size, r + 2 * world_size, ..., so ranks are disjoint and,
    together, complete. With `drop_last` the positions stop at a multiple of `world_size`
    (at most world_size - 1 windows a epoch left out, different ones each epoch) so every
    rank gets the same count, which DDP needs to keep gradient syncs in step; without it
    (validation) ranks may differ by one window and nothing is left out or repeated.

    Interleaving has a property resume relies on: after every rank has taken k windows, the
    first ``k * world_size`` positions of the epoch's order are used, whatever the world size.
    Memory is constant: indices are computed 64k at a time.

    It subclasses `DistributedSampler` so that Lightning, seeing a sampler that already
    shards, never wraps it in another; still create the Trainer with
    ``use_distributed_sampler=False`` to say so.

    Args:
        num_windows: the dataset's length.
        shuffle: permute each epoch; False gives 0, 1, 2, ... in order.
        seed: permutation seed.
        rank, world_size: this process's place among the DDP processes.
        drop_last: equal shares (training) rather than complete ones (validation).
        epoch: the epoch to iterate until `set_epoch` says otherwise.
        skip: windows of this rank's share to leave out at the start of `skip_epoch`.
        skip_epoch: the epoch `skip` applies to; None means `epoch`.
    """

    def __init__(
        self,
        num_windows: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        epoch: int = 0,
        skip: int = 0,
        skip_epoch: int | None = None,
    ):
        super().__init__(
            range(num_windows),
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.num_windows = num_windows
        self.epoch = epoch
        self.skip = skip
        self.skip_epoch = epoch if skip_epoch is None else skip_epoch
        self.iter_epoch: int | None = None
        """The epoch of the most recent `__iter__` (the order batches are coming from)."""

    def __len__(self) -> int:
        """Windows of this rank's full share; a resumed epoch yields `skip` fewer."""
        if self.drop_last:
            return self.num_windows // self.num_replicas
        return len(range(self.rank, self.num_windows, self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        skip = self.skip if self.epoch == self.skip_epoch else 0
        self.iter_epoch = self.epoch
        return self._indices(self.epoch, skip)

    def _indices(self, epoch: int, skip: int, chunk: int = 1 << 16) -> Iterator[int]:
        count = len(self)
        for first in range(skip, count, chunk):
            # this rank's k-th window sits at position rank + k * world_size of the order
            k = np.arange(first, min(first + chunk, count), dtype=np.int64)
            positions = self.rank + k * self.num_replicas
            if self.shuffle:
                positions = permute(positions, self.num_windows, self.seed, epoch)
            yield from positions.tolist()

