"""The DataModule: a corpus as (input, target) windows for Lightning, resumable mid-epoch."""

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from gptmini.data.corpus import CorpusSpec, resolve_source
from gptmini.data.tokens import TokenCache, tokenize_corpus
from gptmini.data.vocab import fit_tokenizer
from gptmini.data.windows import ResumableSampler, SlidingWindowDataset, check_positive
from gptmini.tokenizer import get_tokenizer


class GPTDataModule(L.LightningDataModule):
    """A text corpus as (input, target) windows for Lightning, resumable mid-epoch.

    `prepare_data` tokenizes once (rank 0 of each node; later runs hit the cache) and
    `setup` memory-maps the token files. Training windows are shuffled by (seed, epoch)
    and split between DDP ranks by `ResumableSampler`; validation windows come in order,
    without overlap (stride = max_length unless `val_stride` says otherwise), also split.

    Exact resume: `state_dict` records the epoch and the training batches consumed in it,
    counted in `on_after_batch_transfer` while the trainer trains, i.e. batches that
    reached `training_step`, not batches prefetched by the loader or its workers. After
    `load_state_dict` the next `train_dataloader` starts from that epoch, skipping exactly
    those windows, and still reports the full epoch length, as Lightning's restored batch
    counter expects. Create the Trainer with ``use_distributed_sampler=False``, and do not
    override `on_after_batch_transfer` in the LightningModule (Lightning would call only the
    DataModule's). Exactness holds for the same data, batch size and world size; a change
    of world size keeps the same set of windows seen when batch * world sizes divide evenly.

    Args:
        source: corpus file, directory, glob or hub dataset name; None for the embedded
            Shakespeare corpus.
        val_source: a separate validation corpus (same forms); None splits `source`.
        val_fraction: share of documents (of tokens, for corpora with fewer than
            1 / val_fraction documents) kept for validation; 0 for none. Not used with
            `val_source` or `hub_val_split`.
        text_field: the field holding the text in json/jsonl/parquet files and hub datasets.
        hub_config: hub dataset configuration (subset) name.
        hub_split: hub dataset split to train on.
        streaming: read the corpus as a stream (tokenizing needs no Arrow copy of it).
        tokenizer: "gpt2" (offline), "byte", a saved tokenizer's path or a tiktoken name
            (see `gptmini.tokenizer.get_tokenizer`); train.py turns "bpe:N" into the path
            of the vocabulary it fits (`fit_tokenizer`).
        max_length: tokens per window (the model's context length).
        stride: tokens between training windows; None means max_length (no overlap).
        batch_size: windows per batch, per rank.
        num_workers: DataLoader worker processes.
        seed: training shuffle seed; epoch e's order depends only on (seed, e).
        cache_dir: folder for token files (and datasets' Arrow copies of local files);
            None means $GPTMINI_CACHE or ~/.cache/gptmini.
        num_proc: processes that tokenize.
        encoding_errors: bytes that are not UTF-8: "strict" raises naming the file,
            "replace" reads them as U+FFFD, "ignore" drops them.
        val_stride: tokens between validation windows; None means max_length.
        hub_val_split: validate on this split of the hub dataset (e.g. "validation")
            instead of splitting off `val_fraction`; also the split of a hub `val_source`.
        hub_revision: branch, tag or commit of the hub dataset (None: its main branch); the
            token cache is keyed on the commit it resolves to.
        skip_missing_text: train on the json/parquet records that have `text_field` when
            some lack it, saying how many were left out; by default such a corpus is refused,
            naming the count and the first one.
        document_mask: give every window the document ids of its tokens (<|endoftext|>
            opens the next document, as a BOS token), so that no token attends across a
            document's edge and positions restart at each document.
    """

    def __init__(
        self,
        source: str | None = None,
        val_source: str | None = None,
        val_fraction: float = 0.05,
        text_field: str = "text",
        hub_config: str | None = None,
        hub_split: str = "train",
        streaming: bool = False,
        tokenizer: str = "gpt2",
        max_length: int = 256,
        stride: int | None = None,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 1234,
        cache_dir: str | None = None,
        num_proc: int = 1,
        encoding_errors: str = "strict",
        val_stride: int | None = None,
        hub_val_split: str | None = None,
        hub_revision: str | None = None,
        skip_missing_text: bool = False,
        document_mask: bool = False,
    ):
        super().__init__()
        check_positive(
            max_length=max_length,
            stride=stride,
            batch_size=batch_size,
            num_proc=num_proc,
            val_stride=val_stride,
        )
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} is invalid: use 0 or more")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1); 0 disables it")
        self.save_hyperparameters()
        self.source, self.val_source = source, val_source
        self.val_fraction, self.text_field = val_fraction, text_field
        self.hub_config, self.hub_split, self.hub_val_split = hub_config, hub_split, hub_val_split
        self.hub_revision, self.skip_missing_text = hub_revision, skip_missing_text
        self.document_mask = document_mask
        self.streaming, self.tokenizer = streaming, tokenizer
        self.max_length = max_length
        self.stride = stride or max_length
        self.val_stride = val_stride or max_length
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.cache_dir, self.num_proc, self.encoding_errors = cache_dir, num_proc, encoding_errors
        self.train_dataset: SlidingWindowDataset | None = None
        self.val_dataset: SlidingWindowDataset | None = None
        self._train_sampler: ResumableSampler | None = None
        self._resume: dict[str, int] | None = None
        self._consumed: tuple[int, int] = (0, 0)  # (epoch, training batches taken in it)

    # -- tokens

    def _spec(self, source: str | None, split: str) -> CorpusSpec:
        return resolve_source(
            source,
            text_field=self.text_field,
            hub_config=self.hub_config,
            hub_split=split,
            hub_revision=self.hub_revision,
            streaming=self.streaming,
            encoding_errors=self.encoding_errors,
            skip_missing_text=self.skip_missing_text,
        )

    def _token_arrays(self, quiet: bool) -> tuple[np.ndarray, np.ndarray, str, str]:
        """(train tokens, val tokens, train description, val description), building caches."""

        def tokenize(spec: CorpusSpec, val_fraction: float) -> TokenCache:
            return tokenize_corpus(
                spec,
                tokenizer=self.tokenizer,
                val_fraction=val_fraction,
                cache_dir=self.cache_dir,
                num_proc=self.num_proc,
                quiet=quiet,
            )

        train_spec = self._spec(self.source, self.hub_split)
        if self.val_source is not None or (train_spec.hub_name and self.hub_val_split):
            val_spec = self._spec(
                self.val_source or self.source, self.hub_val_split or self.hub_split
            )
            train = tokenize(train_spec, 0.0).load("train")
            val = tokenize(val_spec, 0.0).load("train")
            return train, val, train_spec.description, val_spec.description
        cache = tokenize(train_spec, self.val_fraction)
        name = train_spec.description
        return cache.load("train"), cache.load("val"), name, f"{name} (validation split)"

    def fit_tokenizer(self, vocab_size: int) -> Path:
        """Fit a BPE of `vocab_size` ids to this corpus's training split (cached); its path."""
        separate_val = self.val_source is not None or self.hub_val_split is not None
        return fit_tokenizer(self._spec(self.source, self.hub_split), vocab_size,
                             val_fraction=0.0 if separate_val else self.val_fraction,
                             cache_dir=self.cache_dir)

    def prepare_data(self) -> None:
        """Tokenize the corpus into the cache (Lightning calls this on one process per node)."""
        self._token_arrays(quiet=False)

    def setup(self, stage: str | None = None) -> None:
        """Memory-map the token files and build the window datasets.

        Raises:
            ValueError: the training (or validation) tokens are fewer than max_length + 1.
        """
        train, val, train_name, val_name = self._token_arrays(quiet=True)
        need = self.max_length + 1
        for tokens, name, what in ((train, train_name, "training"), (val, val_name, "validation")):
            if what == "validation" and len(tokens) == 0 and self.val_fraction == 0:
                continue
            if len(tokens) < need:
                fix = (
                    "use a larger corpus or a smaller max_length"
                    if what == "training"
                    else "raise val_fraction, pass a larger val_source, or lower max_length"
                )
                raise ValueError(
                    f"{what} corpus {name} has {len(tokens)} tokens; max_length="
                    f"{self.max_length} needs at least {need} for one window: {fix}"
                )
        starts = get_tokenizer(self.tokenizer).eot_token if self.document_mask else None
        self.train_dataset = SlidingWindowDataset(train, self.max_length, self.stride, starts)
        self.val_dataset = (
            SlidingWindowDataset(val, self.max_length, self.val_stride, starts)
            if len(val) else None
        )

    # -- loaders

    def _rank_and_world(self) -> tuple[int, int]:
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        return 0, 1

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches of this rank's share, resuming where a checkpoint left off."""
        if self.train_dataset is None:
            self.setup("fit")
        rank, world = self._rank_and_world()
        n = len(self.train_dataset)
        per_rank = n // world
        if per_rank < self.batch_size:
            raise ValueError(
                f"{n} training windows give each of {world} rank(s) {per_rank}, fewer than "
                f"batch_size={self.batch_size}: lower batch_size or stride, or use more data"
            )
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        epoch, skip = self._take_resume(epoch, n, world)
        self._train_sampler = ResumableSampler(
            n, shuffle=True, seed=self.seed, rank=rank, world_size=world, epoch=epoch, skip=skip
        )
        self._consumed = (epoch, skip // self.batch_size)
        return self._loader(self.train_dataset, self._train_sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches in order, this rank's share; [] when there is no validation."""
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        rank, world = self._rank_and_world()
        sampler = ResumableSampler(
            len(self.val_dataset), shuffle=False, rank=rank, world_size=world, drop_last=False
        )
        return self._loader(self.val_dataset, sampler, drop_last=False)

    def _loader(self, dataset: Dataset, sampler: ResumableSampler, drop_last: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            # A loader without a generator draws its workers' seed from the global one,
            # shifting the dropout stream by a draw at moments that differ after a resume.
            generator=torch.Generator().manual_seed(self.seed),
        )

    # -- resume

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count training batches as they reach the model (see the class docstring)."""
        trainer = self.trainer
        if trainer is not None and trainer.training and self._train_sampler is not None:
            epoch = self._train_sampler.iter_epoch
            taken = self._consumed[1] if epoch == self._consumed[0] else 0
            self._consumed = (epoch, taken + 1)
        return batch

    def rewind(self, batches: int) -> None:
        """Forget the last `batches` training batches, so that a checkpoint taken now has
        them replayed on resume (a partial gradient accumulation given up on a signal)."""
        epoch, taken = self._consumed
        self._consumed = (epoch, max(0, taken - batches))

    def state_dict(self) -> dict[str, int]:
        """Where training stands: the epoch and the batches per rank consumed in it."""
        if self._resume is not None:  # restored but not yet resumed: pass it on unchanged
            return dict(self._resume)
        rank, world = self._rank_and_world()
        epoch, batches = self._consumed
        n = len(self.train_dataset) if self.train_dataset is not None else -1
        return {
            "epoch": epoch,
            "batches": batches,
            "batch_size": self.batch_size,
            "world_size": world,
            "num_windows": n,
            "seed": self.seed,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Remember a checkpoint's position; the next `train_dataloader` resumes from it."""
        self._resume = dict(state_dict)
        # Lightning warns that a plain DataLoader cannot resume mid-epoch; this one can.
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended")

    def _take_resume(self, epoch: int, num_windows: int, world: int) -> tuple[int, int]:
        """(epoch to start, windows of this rank's share to skip), consuming the saved state."""
        state, self._resume = self._resume, None
        if state is None:
            return epoch, 0
        mine = (num_windows, self.seed, self.batch_size, world)
        saved = (state["num_windows"], state["seed"], state["batch_size"], state["world_size"])
        if mine != saved:
            warnings.warn(
                "resuming with different data settings than the checkpoint's "
                f"(windows, seed, batch_size, world_size) {saved} -> {mine}: the epoch continues "
                "after the same number of windows, but not exactly the windows left",
                stacklevel=2,
            )
        windows = state["batches"] * state["batch_size"] * state["world_size"] // world
        batches_per_epoch = num_windows // world // self.batch_size
        limit = self.trainer.limit_train_batches if self.trainer is not None else 1.0
        # An epoch cut short by Trainer(limit_train_batches) ends where Lightning ends it.
        if isinstance(limit, int):
            batches_per_epoch = min(batches_per_epoch, limit)
        elif limit < 1.0:
            batches_per_epoch = int(batches_per_epoch * limit)
        if windows // self.batch_size >= batches_per_epoch:
            return state["epoch"] + 1, 0  # the checkpoint's epoch was finished
        return state["epoch"], windows
