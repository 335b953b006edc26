"""Training callbacks: attention maps, and the progress bar's metrics."""


import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import PROMPT, tiny
from lightning.pytorch.loggers import WandbLogger

from gptmini.analysis.plots import PLOT_INSTALL_HINT, attention_weights, plot_attention
from gptmini.analysis.visualize import visualize_main
from gptmini.model import GPTModel
from gptmini.tokenizer import get_tokenizer
from gptmini.train.callbacks import AttentionMapCallback, EveryNSteps
from gptmini.train.steps import OptimizerSteps


@pytest.fixture
def model() -> GPTModel:
    return GPTModel(tiny()).eval()


@pytest.fixture
def tokenizer():
    return get_tokenizer("gpt2")


def test_missing_matplotlib_names_the_install_command(model, tokenizer, run_dir, monkeypatch,
                                                      capsys, tmp_path):
    weights, labels = attention_weights(model, tokenizer, PROMPT, 0)  # needs only torch
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ImportError, match=PLOT_INSTALL_HINT.replace("[", r"\[")):
        plot_attention(weights, labels, tmp_path / "a.png", layer=0)
    assert visualize_main(["curves", str(run_dir), "--out", str(tmp_path / "c.png")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and PLOT_INSTALL_HINT in err

    callback = AttentionMapCallback(every_n_steps=1)
    trainer, module = fake_trainer(tmp_path, model)
    with pytest.warns(UserWarning, match=PLOT_INSTALL_HINT):
        callback.on_fit_start(trainer, module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, then silent
        callback.on_fit_start(trainer, module)
        callback.on_train_batch_end(trainer, module, None, None, 0)
    assert not (tmp_path / "attention").exists()


class RecordingWandbLogger(WandbLogger):
    """Passes isinstance(..., WandbLogger) without starting wandb."""

    def __init__(self):
        self.images = []

    def log_image(self, key, images, step=None, **kwargs):
        self.images.append((key, images, step))


def fake_trainer(tmp_path: Path, model: GPTModel, loggers=()):
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, loggers=list(loggers),
                              log_dir=None, default_root_dir=str(tmp_path))
    module = SimpleNamespace(model=model, hparams=SimpleNamespace(tokenizer="gpt2"),
                             tokenizer=get_tokenizer("gpt2"), device=torch.device("cpu"),
                             optimizer_steps=OptimizerSteps())
    module.optimizer_steps.start(trainer)
    return trainer, module


def micro_batch(trainer, module, step_after: int) -> None:
    """One training batch as Lightning runs it, up to its on_train_batch_end: the batch
    starts, then its optimizer step (if any) moves global_step to `step_after`."""
    module.optimizer_steps.batch_started(trainer)
    trainer.global_step = step_after


def test_callback_logs_to_wandb_every_n_steps_without_touching_the_run(model, tmp_path):
    wandb = RecordingWandbLogger()
    trainer, module = fake_trainer(tmp_path, model.train(), [wandb])
    callback = AttentionMapCallback(every_n_steps=2, layer=-1)
    callback.on_fit_start(trainer, module)
    rng = torch.get_rng_state()
    for step in [0, 1, 2, 2, 3, 4]:  # 0 and 2 twice: gradient accumulation's micro-batches
        micro_batch(trainer, module, step)
        callback.on_train_batch_end(trainer, module, None, None, 0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training
    steps = (2, 4)
    paths = [tmp_path / "attention" / f"step_{n}.png" for n in steps]
    assert wandb.images == [("attention", [str(p)], n) for p, n in zip(paths, steps, strict=True)]
    assert all(p.is_file() for p in paths)
    assert sorted(p.name for p in (tmp_path / "attention").iterdir()) == ["step_2.png",
                                                                           "step_4.png"]


def test_callback_warns_and_stays_off_for_a_prompt_longer_than_the_context(model, tmp_path):
    trainer, module = fake_trainer(tmp_path, model)
    callback = AttentionMapCallback(every_n_steps=1, prompt="to be or not " * 20)
    with pytest.warns(UserWarning, match="longer than context_length 32"):
        callback.on_fit_start(trainer, module)
    micro_batch(trainer, module, 1)
    callback.on_train_batch_end(trainer, module, None, None, 0)
    assert not (tmp_path / "attention").exists()


def test_callback_in_a_real_training_run_saves_maps_and_changes_nothing(tmp_path):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from gptmini.train.module import GPTLitModule

    def run(callbacks, root):
        L.seed_everything(0, verbose=False)
        module = GPTLitModule(context_length=16, emb_dim=16, n_heads=2, n_layers=2,
                              drop_rate=0.1, warmup_steps=1, peak_flops=1e12)
        tokens = torch.randint(0, 50257, (8, 17), generator=torch.Generator().manual_seed(0))
        data = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2
        )
        trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=CSVLogger(root, name="logs"),
                            callbacks=callbacks, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=root)
        trainer.fit(module, data)
        return module, trainer

    with_maps, trainer = run([AttentionMapCallback(every_n_steps=2)], tmp_path / "a")
    without, _ = run([], tmp_path / "b")
    assert (Path(trainer.log_dir) / "attention" / "step_2.png").is_file()
    assert not (Path(trainer.log_dir) / "attention" / "step_1.png").exists()
    for p, q in zip(with_maps.parameters(), without.parameters(), strict=True):
        assert torch.equal(p, q)  # same dropout masks: the callback drew no random numbers


def test_progress_bar_shows_loss_lr_and_tokens_per_second_with_their_digits():
    from types import SimpleNamespace

    from gptmini.train.progress import progress_bar

    # The losses are tensors among the callback metrics; lr and tok/s plain progress-bar numbers.
    trainer = SimpleNamespace(
        loggers=[], progress_bar_metrics={"train/lr": 1e-4, "train/tokens_per_sec": 1180.4},
        callback_metrics={"train/loss": torch.tensor(5.4321), "val/loss": torch.tensor(5.5),
                          "train/lr": torch.tensor(1e-4)})
    shown = progress_bar().get_metrics(trainer, None)
    assert shown == {"loss": "5.432", "lr": "1.00e-04", "tok/s": "1180", "val_loss": "5.500"}


def test_samples_come_once_per_optimizer_step_under_gradient_accumulation(tmp_path, capsys):
    """The defect: with accumulate_grad_batches 4 and sample_every 2, steps 0 and 2 were
    sampled 3 and 4 times (once per micro-batch)."""
    import lightning as L

    from gptmini.train.callbacks import SampleCallback
    from gptmini.train.module import GPTLitModule

    module = GPTLitModule(context_length=16, emb_dim=16, n_heads=2, n_layers=2, drop_rate=0.0,
                          warmup_steps=1, peak_flops=1e12)
    tokens = torch.randint(0, 50257, (40, 17), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2
    )
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=4, accelerator="cpu",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[SampleCallback(every_n_steps=2, max_new_tokens=2)])
    trainer.fit(module, data)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[step")]
    assert [line.split("]")[0] for line in printed] == ["[step 2", "[step 4"]


def test_the_step_signal_is_once_per_step_the_same_to_every_reader_and_not_for_a_resume():
    guard = EveryNSteps(every_n_steps=2)
    trainer = SimpleNamespace(global_step=10, is_global_zero=True)
    module = SimpleNamespace(optimizer_steps=OptimizerSteps())
    module.optimizer_steps.start(trainer)  # resumed at step 10, already acted on before
    ends = [10, 10, 10, 11, 11, 11, 11, 12, 12, 12, 12, 13]  # 4 micro-batches a step
    stepped, fired, since = [], [], []
    for step in ends:
        micro_batch(trainer, module, step)
        readings = {module.optimizer_steps.stepped(trainer) for _ in range(3)}  # 3 hooks
        assert len(readings) == 1
        stepped.append(readings.pop())
        fired.append(guard.due(trainer, module))
        since.append(module.optimizer_steps.since_step(trainer))
    assert [step for step, moved in zip(ends, stepped, strict=True) if moved] == [11, 12, 13]
    assert [step for step, due in zip(ends, fired, strict=True) if due] == [12]
    assert since == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0]  # what a signal mid-step rewinds
    trainer.is_global_zero = False
    micro_batch(trainer, module, 14)
    assert module.optimizer_steps.stepped(trainer) and not guard.due(trainer, module)  # rank 0 only


def test_progress_bar_counts_steps_of_the_run_across_epochs_and_resumes(tmp_path, corpus,
                                                                        capsys):
    """Before: "Epoch 1: 850/860" (batches of each epoch), and "Training: 1000/?" without an
    ETA after a resume. Now: steps out of max_steps, one bar, from the step resumed."""
    import re

    from helpers import tiny_args

    from gptmini.train.command import main

    args = tiny_args(tmp_path, corpus, "--trainer.enable_progress_bar", "true",
                     "--trainer.max_steps", "20", "--trainer.log_every_n_steps", "5",
                     "--data.loader.batch_size", "16")  # about 2 epochs of the corpus
    assert main(args) == 0
    first = capsys.readouterr().out.replace("\r", "\n")
    assert main([*args, "--trainer.max_steps", "30", "--ckpt_path", "last"]) == 0
    second = capsys.readouterr().out.replace("\r", "\n")
    shown = [re.findall(r"^Training:.*?\| *(\d+)/(\S+) \[[^<]*<([^,]*),", out, re.M)
             for out in (first, second)]
    assert [(n, total) for n, total, _ in shown[0]][-1] == ("20", "20")
    assert {total for _, total, _ in shown[0]} == {"20"} and "Epoch" not in first
    assert shown[1][0][:2] == ("20", "30") and shown[1][-1][:2] == ("30", "30")
    assert {total for _, total, _ in shown[1]} == {"30"}
    assert all(eta != "?" for n, _, eta in shown[1] if int(n) > 20)  # an ETA after resuming


def test_the_bars_tokens_per_second_is_the_interval_just_logged(tmp_path, corpus, capsys):
    """Before: the bar refreshed before the module logged the interval's throughput (the
    callbacks' on_train_batch_end runs first), so it showed the previous interval's tok/s."""
    import re

    from helpers import read_metrics, tiny_args

    from gptmini.train.command import main

    args = tiny_args(tmp_path, corpus, "--trainer.enable_progress_bar", "true",
                     "--trainer.max_steps", "15", "--trainer.log_every_n_steps", "5",
                     "--trainer.val_check_interval", "100")
    assert main(args) == 0
    out = capsys.readouterr().out.replace("\r", "\n")
    shown = dict(re.findall(r"^Training:.*?\| *(\d+)/15 .*?tok/s=(\d+)", out, re.M))
    logged = {int(row["step"]) + 1: f"{float(row['train/tokens_per_sec']):.0f}"
              for row in read_metrics(tmp_path / "runs" / "tiny")
              if row.get("train/tokens_per_sec")}
    assert sorted(logged) == [5, 10, 15]
    assert {int(step): value for step, value in shown.items()} == logged
