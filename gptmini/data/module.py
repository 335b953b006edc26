"""The DataModule: a corpus as (input, target) windows for Lightning, resumable mid-epoch."""

import warnings
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import tiktoken
import torch
from torch.utils.data import DataLoader, Dataset

from gptmini.chat import AUTO, ChatTemplate, choose_template, is_alpaca
from gptmini.data.chat import Chat, chat_datasets, read_chat_records
from gptmini.data.labels import LabeledDataset, LabeledRecords, Labels, cut_note, pad_batch
from gptmini.data.preference import (
    Preference,
    RenderedPair,
    is_book_layout,
    preference_datasets,
    read_pairs,
)
from gptmini.data.rl import RL, ProblemBatch, ProblemBatches, rl_datasets
from gptmini.data.settings import Corpus, Loader, Windows, as_record
from gptmini.data.verifiable import VerifiableTask
from gptmini.data.windows import ResumableSampler
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
        corpus: the text, where validation comes from, and how it becomes tokens.
        windows: the windows cut from the tokens (max_length follows the model's
            context length in train.py).
        loader: batch size, loader workers and the shuffle seed.
        labels: classification instead of language modelling: labelled records become
            (ids, attention mask, label) batches, right-padded with <|endoftext|>.
        chat: fine-tuning on instruction or chat records instead of the corpus: rendered
            by a chat template, the loss on the assistant's tokens only, packed with
            document masks or padded (see `gptmini.data.chat`).
        preference: preference tuning (DPO) on pairs of responses instead of the corpus:
            (chosen inputs, chosen targets, rejected inputs, rejected targets) batches
            (see `gptmini.data.preference`).
        rl: reinforcement learning on a task whose answers a program checks: batches of
            prompts (`ProblemBatch`, one loader item each), held-out prompts for pass@1
            (see `gptmini.data.rl`).
        encoding: the tokenizer itself, as train.py's plan resolved it (not a flag); None:
            `corpus.tokenizer` names it.
        chat_template: the template for `chat`'s records (or `preference`'s, or `rl`'s
            prompts), as train.py's plan chose it (not a flag); None: `chat.template` names
            it, "auto" chosen by the same rule (`gptmini.chat.choose_template`; a data
            module built without a plan knows of no source model, so "auto" picks by the
            records).
        verifier: `rl`'s task, as train.py's plan loaded it (not a flag); None: `rl` names it.

    `hparams` (a checkpoint's ``datamodule_hyper_parameters``) is one flat dict of the three
    parts' fields, as it was before they were grouped; `settings.from_record` reads it back.
    """

    # Frozen dataclasses make safe defaults, and jsonargparse reads each field's default
    # off them (a None default would make every part optional and break the links).
    def __init__(
        self,
        corpus: Corpus = Corpus(),  # noqa: B008
        windows: Windows = Windows(),  # noqa: B008
        loader: Loader = Loader(),  # noqa: B008
        labels: Labels = Labels(),  # noqa: B008
        chat: Chat = Chat(),  # noqa: B008
        preference: Preference = Preference(),  # noqa: B008
        rl: RL = RL(),  # noqa: B008
        *,
        encoding: tiktoken.Encoding | None = None,
        chat_template: ChatTemplate | None = None,
        verifier: VerifiableTask | None = None,
    ):
        super().__init__()
        self.corpus, self.windows, self.loader = corpus, windows, loader
        self.labels, self.chat, self.preference, self.rl = labels, chat, preference, rl
        kinds = [f"--data.{name}" for name, part in (("labels", labels), ("chat", chat),
                 ("preference", preference), ("rl", rl)) if part.active]
        if len(kinds) > 1:
            raise ValueError(f"{' and '.join(kinds)} are different kinds of fine-tune: set one "
                             "(labels classify records; chat tunes on conversations; "
                             "preference on pairs of responses; rl on a checked task)")
        self.save_hyperparameters(as_record(corpus, windows, loader, labels, chat, preference,
                                            rl))
        self.verifier = verifier
        self._tokenizer = encoding
        self.chat_template = chat_template
        """The template of a fine-tune on records (checkpoints carry it); None until set
        up when not given."""
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self._train_sampler: ResumableSampler | None = None
        self._resume: dict[str, int] | None = None
        self._consumed: tuple[int, int] = (0, 0)  # (epoch, training batches taken in it)

    # -- tokens

    @property
    def tokenizer(self) -> tiktoken.Encoding:
        """The run's tokenizer, which `corpus.tokenizer` names (the token cache's key)."""
        if self._tokenizer is None:  # read when first needed: "bpe:N" names none until fitted
            self._tokenizer = get_tokenizer(self.corpus.tokenizer)
        return self._tokenizer

    def fit_tokenizer(self, vocab_size: int) -> Path:
        """Fit a BPE of `vocab_size` ids to this corpus's training split (cached); its path."""
        return self.corpus.fit_tokenizer(vocab_size)

    def prepare_data(self) -> None:
        """Tokenize the corpus into the cache (Lightning calls this on one process per node)."""
        if not self.on_records:  # records are read in setup
            self.corpus.tokens(quiet=False)

    @property
    def on_records(self) -> bool:
        """Whether the run reads records (labels, chat, pairs, prompts), not the corpus."""
        return any(p.active for p in (self.labels, self.chat, self.preference, self.rl))

    def labelled_splits(self) -> tuple[LabeledRecords, LabeledRecords]:
        """(training, validation) records of a classification run (see `Labels.splits`)."""
        c = self.corpus
        return self.labels.splits(c.source, c.val_source, c.val_fraction, c.text_field)

    def class_names(self) -> list[str]:
        """A classification run's classes: the training records' labels, sorted (see
        `LabeledRecords.class_names`, which refuses labels that are not classes)."""
        return self.labelled_splits()[0].class_names(self.labels.label_field,
                                                     self.split_names()[0])

    def split_names(self) -> tuple[str, str]:
        """How messages name a classification run's training and validation records."""
        c, task = self.corpus, self.labels.task
        if task:
            return f"the training works of {task}", f"the held-out works of {task}"
        val = (c.val_source if c.val_source is not None else
               f"the validation share (--data.corpus.val_fraction {c.val_fraction}) of {c.source}")
        return str(c.source), str(val)

    def setup_labelled(self, classes: list[str]) -> None:
        """The datasets of a classification run, with `classes` in the model's order."""
        enc, max_length = self.tokenizer, self.windows.max_length
        train, val = self.labelled_splits()
        train_name, val_name = self.split_names()
        self.train_dataset = LabeledDataset(
            train, enc, classes, max_length, train_name,
            fix="add them to --data.labels.classes, or leave it out (the classes are then "
                "the training records' labels)")
        self.val_dataset = LabeledDataset(
            val, enc, classes, max_length, val_name,
            fix="the classifier learns the training records' labels, and a class no "
                "training record has is never learned: add training records of it, or drop "
                "those validation records (--data.labels.classes listing every class keeps "
                "them, scored against a class that never trained)")
        notes = [cut_note(name, data, max_length) for name, data in
                 ((train_name, self.train_dataset), (val_name, self.val_dataset))]
        if self.trainer is None or self.trainer.is_global_zero:
            for note in filter(None, notes):
                print(note, flush=True)

    def setup_chat(self) -> None:
        """The datasets of a fine-tune on records (see `gptmini.data.chat`)."""
        enc = self.tokenizer
        if self.chat_template is None:
            alpaca = self.chat.template == AUTO and is_alpaca(read_chat_records(self.chat.records))
            self.chat_template = choose_template(self.chat.template, enc, alpaca=alpaca)
        self.train_dataset, self.val_dataset, said = chat_datasets(
            self.chat, enc, self.chat_template, self.windows.max_length, self.loader.seed)
        if self.trainer is None or self.trainer.is_global_zero:
            print(said, flush=True)

    def _template(self, name: str, alpaca: bool) -> ChatTemplate:
        if self.chat_template is None:
            self.chat_template = choose_template(name, self.tokenizer, alpaca=alpaca)
        return self.chat_template

    def setup_preference(self) -> None:
        """The datasets of preference tuning (see `gptmini.data.preference`)."""
        pref = self.preference
        book_layout = pref.template == AUTO and is_book_layout(read_pairs(pref.records))
        self.train_dataset, self.val_dataset, said = preference_datasets(
            pref, self.tokenizer, self._template(pref.template, book_layout),
            self.windows.max_length)
        self._say(said)

    def setup_rl(self) -> None:
        """The datasets of RL on a verifiable task (see `gptmini.data.rl`)."""
        self.verifier = self.verifier or self.rl.load()
        self.train_dataset, self.val_dataset, said = rl_datasets(
            self.rl, self.verifier, self.tokenizer, self._template(self.rl.template, False),
            self.loader.batch_size, self.windows.max_length)
        self._say(said)

    def _say(self, line: str) -> None:
        if self.trainer is None or self.trainer.is_global_zero:
            print(line, flush=True)

    def setup(self, stage: str | None = None) -> None:
        """Memory-map the token files and build the window datasets.

        Raises:
            ValueError: the training (or validation) tokens are fewer than max_length + 1.
        """
        if self.labels.active:
            self.setup_labelled(self.labels.classes or self.class_names())
            return
        for part, build in ((self.chat, self.setup_chat),
                            (self.preference, self.setup_preference), (self.rl, self.setup_rl)):
            if part.active:
                if self.train_dataset is None:
                    build()
                return
        train, val, train_name, val_name = self.corpus.tokens(quiet=True)
        max_length = self.windows.max_length
        for tokens, name, what in ((train, train_name, "training"), (val, val_name, "validation")):
            if what == "validation" and len(tokens) == 0 and self.corpus.val_fraction == 0:
                continue
            if len(tokens) < max_length + 1:
                fix = (
                    "use a larger corpus or a smaller max_length"
                    if what == "training"
                    else "raise val_fraction, pass a larger val_source, or lower max_length"
                )
                raise ValueError(
                    f"{what} corpus {name} has {len(tokens)} tokens; max_length="
                    f"{max_length} needs at least {max_length + 1} for one window: {fix}"
                )
        eot = self.tokenizer.eot_token if self.windows.document_mask else None
        self.train_dataset = self.windows.over(train, document_token=eot)
        self.val_dataset = (
            self.windows.over(val, validation=True, document_token=eot) if len(val) else None
        )

    def sample_prompt(self, num_tokens: int, shakespeare: str) -> str:
        """A prompt in this corpus's own words, for the samples and attention maps of a run.

        `shakespeare` on the embedded corpus; elsewhere the first `num_tokens` tokens of
        the first validation document (of the training split when there is none), up to the
        end of its first line when that line has a few characters. Before, every corpus got
        "ROMEO:", which a model trained on code may answer with nothing. Call after `setup`.
        """
        if self.corpus.source is None:
            return shakespeare
        dataset = self.val_dataset or self.train_dataset
        if dataset is None or len(dataset) == 0:
            return shakespeare
        tokenizer = self.tokenizer
        ids = first_ids(dataset[0])[:num_tokens]
        if tokenizer.eot_token in ids:  # a short first document: its own words only
            ids = ids[:ids.index(tokenizer.eot_token)]
        text = tokenizer.decode(ids)
        line = text.split("\n", 1)[0].rstrip()
        text = line if len(line.strip()) >= 3 else text.rstrip()
        return text if text.strip() else shakespeare

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
        if per_rank < self._unit:
            raise ValueError(
                f"{n} training windows give each of {world} rank(s) {per_rank}, fewer than "
                f"batch_size={self.loader.batch_size}: lower batch_size or stride, or use more data"
            )
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        epoch, skip = self._take_resume(epoch, n, world)
        # RL's batches are drawn in a seeded order already, and each comes inner_steps times
        # in a row: never shuffled apart.
        shuffle = not isinstance(self.train_dataset, ProblemBatches)
        self._train_sampler = ResumableSampler(
            n, shuffle=shuffle, seed=self.loader.seed, rank=rank, world_size=world, epoch=epoch,
            skip=skip,
        )
        self._consumed = (epoch, skip // self._unit)
        return self._data_loader(self.train_dataset, self._train_sampler, drop_last=True)

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
        return self._data_loader(self.val_dataset, sampler, drop_last=False)

    @property
    def _unit(self) -> int:
        """Items of the training dataset per batch: an RL dataset's items are whole batches."""
        return 1 if isinstance(self.train_dataset, ProblemBatches) else self.loader.batch_size

    def _data_loader(self, dataset: Dataset, sampler: ResumableSampler,
                     drop_last: bool) -> DataLoader:
        collate = None
        if isinstance(dataset, LabeledDataset):
            collate = partial(pad_batch, pad_id=self.tokenizer.eot_token)
        batched = isinstance(dataset, ProblemBatches)  # an item is a batch: taken as it is
        return DataLoader(
            dataset,
            collate_fn=as_is if batched else collate or getattr(dataset, "collate", None),
            batch_size=None if batched else self.loader.batch_size,
            sampler=sampler,
            drop_last=drop_last and not batched,
            num_workers=self.loader.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.loader.num_workers > 0,
            # A loader without a generator draws its workers' seed from the global one,
            # shifting the dropout stream by a draw at moments that differ after a resume.
            generator=torch.Generator().manual_seed(self.loader.seed),
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
            "batch_size": self._unit,
            "world_size": world,
            "num_windows": n,
            "seed": self.loader.seed,
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
        mine = (num_windows, self.loader.seed, self._unit, world)
        saved = (state["num_windows"], state["seed"], state["batch_size"], state["world_size"])
        if mine != saved:
            warnings.warn(
                "resuming with different data settings than the checkpoint's "
                f"(windows, seed, batch_size, world_size) {saved} -> {mine}: the epoch continues "
                "after the same number of windows, but not exactly the windows left",
                stacklevel=2,
            )
        windows = state["batches"] * state["batch_size"] * state["world_size"] // world
        batches_per_epoch = num_windows // world // self._unit
        limit = self.trainer.limit_train_batches if self.trainer is not None else 1.0
        # An epoch cut short by Trainer(limit_train_batches) ends where Lightning ends it.
        if isinstance(limit, int):
            batches_per_epoch = min(batches_per_epoch, limit)
        elif limit < 1.0:
            batches_per_epoch = int(batches_per_epoch * limit)
        if windows // self._unit >= batches_per_epoch:
            return state["epoch"] + 1, 0  # the checkpoint's epoch was finished
        return state["epoch"], windows


def first_ids(item: Any) -> list[int]:
    """The token ids an item of any dataset here starts with: a window's or a record's
    inputs, a pair's prompt, a batch's first prompt."""
    if isinstance(item, RenderedPair):
        return item.prompt_ids
    if isinstance(item, ProblemBatch):
        return item.prompts[0]
    return torch.as_tensor(item[0]).tolist()


def as_is(item: Any) -> Any:
    """The loader's collate for datasets whose items are whole batches."""
    return item
