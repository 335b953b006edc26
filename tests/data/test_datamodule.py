"""The DataModule: validation sources, sharding between ranks, exact mid-epoch resume."""

import glob

import lightning as L
import numpy as np
import pytest
import torch
from helpers import ENC, words
from lightning.pytorch.callbacks import ModelCheckpoint

from gptmini.data import Corpus, GPTDataModule, Loader, Windows
from gptmini.data.settings import from_record


def test_a_separate_validation_source(tmp_path):
    (tmp_path / "train.txt").write_text(words(300, 0))
    (tmp_path / "val.txt").write_text(words(80, 1))
    dm = GPTDataModule(
        Corpus(str(tmp_path / "train.txt"), val_source=str(tmp_path / "val.txt"),
               cache_dir=str(tmp_path / "c")),
        Windows(max_length=8),
        Loader(batch_size=2),
    )
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_dataset.tokens.tolist() == ENC.encode_ordinary(words(300, 0))
    assert dm.val_dataset.tokens.tolist() == ENC.encode_ordinary(words(80, 1))
    # validation windows do not overlap and come in order
    batches = [x for x, _ in dm.val_dataloader()]
    assert torch.cat(batches).flatten().tolist() == dm.val_dataset.tokens[:72].tolist()
    assert dm.val_dataset.stride == 8 and len(dm.val_dataset) == 9


def test_the_sample_prompt_is_the_corpus_own_words(tmp_path):
    """Before: every corpus was sampled (and its attention drawn) with "ROMEO:"."""
    (tmp_path / "train.txt").write_text("import os\n\nprint(os.getcwd())\n" * 40)
    (tmp_path / "val.txt").write_text("def main():\n    return 42\n")
    dm = GPTDataModule(Corpus(str(tmp_path / "train.txt"), val_source=str(tmp_path / "val.txt"),
                              cache_dir=str(tmp_path / "c")), Windows(max_length=8))
    dm.prepare_data()
    dm.setup("fit")
    assert dm.sample_prompt(8, "ROMEO:") == "def main():"  # the first line of validation
    assert dm.sample_prompt(2, "ROMEO:") == "def main"  # a token budget, not the whole line
    embedded = GPTDataModule(Corpus(cache_dir=str(tmp_path / "c")))
    assert embedded.sample_prompt(8, "ROMEO:") == "ROMEO:"  # read without tokenizing


def test_default_datamodule_trains_on_the_embedded_corpus(tmp_path):
    dm = GPTDataModule(Corpus(cache_dir=str(tmp_path)), Windows(max_length=64),
                       Loader(batch_size=4))
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


def test_too_short_corpus_says_how_many_tokens_it_has_and_needs(tmp_path):
    text = "To be, or not to be: that is the question."
    (tmp_path / "short.txt").write_text(text)
    n = len(ENC.encode_ordinary(text))
    dm = GPTDataModule(
        Corpus(str(tmp_path / "short.txt"), val_fraction=0, cache_dir=str(tmp_path)),
        Windows(max_length=64),
    )
    dm.prepare_data()
    with pytest.raises(ValueError, match=rf"has {n} tokens; max_length=64 needs at least 65"):
        dm.setup("fit")


# datamodule_hyper_parameters of a checkpoint train.py wrote before the settings were grouped
OLD_RECORD = {
    "source": "/tmp/oldck/corpus.txt", "val_source": None, "val_fraction": 0.1,
    "text_field": "text", "hub_config": None, "hub_split": "train", "streaming": False,
    "stride": 4, "batch_size": 4, "num_workers": 0, "seed": 1234, "cache_dir": "/tmp/c",
    "num_proc": 1, "encoding_errors": "strict", "val_stride": None, "hub_val_split": None,
    "hub_revision": None, "skip_missing_text": False, "document_mask": False,
    "max_length": 16, "tokenizer": "gpt2",
    "_instantiator": "lightning.pytorch.cli.instantiate_module",
}


def test_the_checkpoints_record_is_flat_as_before_the_settings_were_grouped():
    dm = GPTDataModule(
        Corpus("/tmp/oldck/corpus.txt", val_fraction=0.1, cache_dir="/tmp/c"),
        Windows(max_length=16, stride=4),
        Loader(batch_size=4),
    )
    assert dict(dm.hparams) == {k: v for k, v in OLD_RECORD.items() if k != "_instantiator"}
    assert from_record(OLD_RECORD) == (dm.corpus, dm.windows, dm.loader, dm.labels, dm.chat,
                                       dm.preference, dm.rl)
    with pytest.raises(ValueError, match="data setting 'batch' is unknown"):
        from_record({"batch": 4})


class FakeTrainer:
    """What GPTDataModule reads from a Trainer: rank, world size, epoch, stage."""

    def __init__(self, rank=0, world=1):
        self.global_rank, self.world_size, self.current_epoch, self.training = rank, world, 0, True
        self.limit_train_batches = 1.0


def small_datamodule(tmp_path, val_source=None, **loader) -> GPTDataModule:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(words(400, 0))
    dm = GPTDataModule(
        Corpus(str(corpus), val_source=val_source, val_fraction=0.0, cache_dir=str(tmp_path / "c")),
        Windows(max_length=8),
        Loader(**{"batch_size": 3, **loader}),
    )
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
