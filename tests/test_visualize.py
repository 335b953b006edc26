import csv
import struct
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import WandbLogger

from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import get_tokenizer
from gptmini.visualize import (
    PAD_LABEL,
    PLOT_INSTALL_HINT,
    AttentionMapCallback,
    attention_figure,
    attention_weights,
    load_metrics,
    main,
    plot_attention,
    plot_curves,
)

PROMPT = "ROMEO: But soft, what light through yonder window breaks?"


def tiny(**overrides) -> GPTConfig:
    fields = dict(vocab_size=50257, context_length=32, emb_dim=16, n_heads=2, n_layers=2,
                  drop_rate=0.0)
    return GPTConfig(**{**fields, **overrides})


@pytest.fixture
def model() -> GPTModel:
    return GPTModel(tiny()).eval()


@pytest.fixture
def tokenizer():
    return get_tokenizer("gpt2")


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG signature and IHDR chunk."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# --- attention weights -----------------------------------------------------------------


def test_weights_are_the_models_explicit_path_weights(model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    idx = torch.tensor([ids])
    _, per_layer = model(idx, return_weights=True)

    # Recompute layer 1 by hand: embeddings, block 0, then block 1's attention module.
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(len(ids)))
    x = model.trf_blocks[0](x)
    _, direct = model.trf_blocks[1].att(model.trf_blocks[1].norm1(x), return_weights=True)

    for layer, expected in [(0, per_layer[0]), (1, per_layer[1]), (-1, direct)]:
        weights, labels = attention_weights(model, tokenizer, PROMPT, layer)
        assert weights.shape == (2, len(ids), len(ids))
        torch.testing.assert_close(weights, expected[0], rtol=0, atol=1e-7)
    assert labels[:4] == ["ROM", "EO", ":", "␣But"]

    # What the figure draws is those weights, head by head.
    fig = attention_figure(weights, labels, layer=1)
    drawn = [ax.images[0].get_array() for ax in fig.axes if ax.images]
    assert len(drawn) == 2
    for head, image in enumerate(drawn):
        assert torch.equal(torch.from_numpy(image.data), weights[head])
    single = attention_figure(weights, labels, layer=1, head=-1)
    image = next(ax.images[0] for ax in single.axes if ax.images)
    assert torch.equal(torch.from_numpy(image.get_array().data), weights[1])
    assert [t.get_text() for t in single.axes[0].get_xticklabels()] == labels


@pytest.mark.parametrize("window_size", [None, 3])
def test_rows_sum_to_one_over_allowed_keys_and_masked_keys_are_zero(tokenizer, window_size):
    model = GPTModel(tiny(window_size=window_size, drop_rate=0.5)).train()
    for layer in range(2):
        weights, _ = attention_weights(model, tokenizer, PROMPT, layer)
        n = weights.shape[-1]
        query, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = key <= query
        if window_size is not None:
            allowed &= key > query - window_size
        assert torch.all(weights[:, ~allowed] == 0)  # exactly zero, not merely small
        assert torch.all(weights[:, allowed] > 0)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, n))  # dropout is off
    assert model.training  # the caller's mode is back


def test_left_padding_gives_zero_rows_and_columns(model, tokenizer):
    alone, labels = attention_weights(model, tokenizer, PROMPT, 1)
    padded, padded_labels = attention_weights(model, tokenizer, PROMPT, 1, left_pad=3)
    assert padded_labels == [PAD_LABEL] * 3 + labels
    assert torch.all(padded[:, :3, :] == 0) and torch.all(padded[:, :, :3] == 0)
    # Positions count from the first real token, so the real block is the unpadded map.
    torch.testing.assert_close(padded[:, 3:, 3:], alone)


def test_empty_prompt_starts_from_end_of_text(model, tokenizer):
    weights, labels = attention_weights(model, tokenizer, "", 0)
    assert labels == ["<|endoftext|>"]
    assert torch.equal(weights, torch.ones(2, 1, 1))


def test_bad_layer_head_or_prompt_gives_a_clear_error(model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"layer 2 is out of range.*valid: 0 to 1"):
        attention_weights(model, tokenizer, PROMPT, 2)
    with pytest.raises(ValueError, match=r"layer -3 is out of range"):
        attention_weights(model, tokenizer, PROMPT, -3)
    weights, labels = attention_weights(model, tokenizer, PROMPT, 0)
    with pytest.raises(ValueError, match=r"head 2 is out of range.*valid: 0 to 1"):
        plot_attention(weights, labels, tmp_path / "a.png", layer=0, head=2)
    with pytest.raises(ValueError, match="context_length is 32; shorten it"):
        attention_weights(model, tokenizer, "to be or not " * 20, 0)
    assert not (tmp_path / "a.png").exists()


def test_plot_attention_writes_a_png_of_the_expected_size(model, tokenizer, tmp_path):
    weights, labels = attention_weights(model, tokenizer, PROMPT, 0)
    out = plot_attention(weights, labels, tmp_path / "sub" / "one.png", layer=0, head=1,
                         figsize=(6.0, 5.0), dpi=50)
    assert png_size(out) == (300, 250)
    grid = plot_attention(weights, labels, tmp_path / "grid.png", layer=0)
    fig = attention_figure(weights, labels, layer=0)  # the default size grows with tokens
    width, height = fig.get_size_inches() * fig.dpi
    assert png_size(grid) == (round(width), round(height))

    # A long prompt labels every k-th token rather than overprinting them all.
    long = torch.softmax(torch.randn(1, 130, 130), dim=-1)
    fig = attention_figure(long, [f"t{i}" for i in range(130)], layer=0, head=0)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()][:2] == ["t0", "t3"]

    import matplotlib.image

    pixels = matplotlib.image.imread(out)
    assert pixels.shape[:2] == (250, 300) and pixels.std() > 0  # decodes, and is not blank


# --- training curves -------------------------------------------------------------------


def write_metrics(path: Path, rows: list[dict]):
    columns = ["epoch", "step", "train/grad_norm", "train/loss", "train/lr", "val/loss",
               "val/ppl"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, columns)
        writer.writeheader()
        writer.writerows(rows)


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run stopped after step 30, resumed from its step-20 checkpoint, up to step 50."""
    run = tmp_path / "runs" / "demo"
    first, second = [], []
    for step in range(10, 31, 10):
        first.append({"epoch": 0, "step": step, "train/loss": 9 - step / 10, "train/lr": 1e-3})
    first.append({"epoch": 0, "step": 20, "val/loss": 8.5, "val/ppl": 4914.8})
    for step in range(20, 51, 10):  # steps 20 and 30 run again after the resume
        second.append({"epoch": 0, "step": step, "train/loss": 5 - step / 100, "train/lr": 5e-4})
    second.append({"epoch": 1, "step": 40, "val/loss": 4.0, "val/ppl": 54.6})
    write_metrics(run / "logs" / "version_0" / "metrics.csv", first)
    write_metrics(run / "logs" / "version_1" / "metrics.csv", second)
    return run


def test_metrics_merge_versions_and_resumed_steps_replace_the_first_attempt(run_dir):
    metrics, resumes = load_metrics(run_dir)
    assert metrics["train/loss"] == ([10, 20, 30, 40, 50], [8.0, 4.8, 4.7, 4.6, 4.5])
    assert metrics["val/loss"] == ([40], [4.0])  # step 20's value came from the lost timeline
    assert metrics["train/lr"][0] == [10, 20, 30, 40, 50]
    assert resumes == [20]
    assert load_metrics(run_dir / "logs")[0] == metrics


def test_plot_curves_writes_a_png(run_dir, tmp_path):
    out = plot_curves(run_dir, tmp_path / "curves.png")
    assert png_size(out) == (800, 600)
    assert png_size(plot_curves(run_dir, tmp_path / "small.png", figsize=(4, 3), dpi=50)) == (
        200,
        150,
    )


def test_curves_command_and_its_errors(run_dir, tmp_path, capsys):
    assert main(["curves", str(run_dir), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").is_file()
    assert main(["curves", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metrics under" in err


# --- matplotlib missing ----------------------------------------------------------------


def test_missing_matplotlib_names_the_install_command(model, tokenizer, run_dir, monkeypatch,
                                                      capsys, tmp_path):
    weights, labels = attention_weights(model, tokenizer, PROMPT, 0)  # needs only torch
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ImportError, match=PLOT_INSTALL_HINT.replace("[", r"\[")):
        plot_attention(weights, labels, tmp_path / "a.png", layer=0)
    assert main(["curves", str(run_dir), "--out", str(tmp_path / "c.png")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and PLOT_INSTALL_HINT in err

    callback = AttentionMapCallback(every_n_steps=1)
    trainer, module = fake_trainer(tmp_path, model)
    with pytest.warns(UserWarning, match="gptmini\\[plot\\]"):
        callback.on_fit_start(trainer, module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, then silent
        callback.on_fit_start(trainer, module)
        callback.on_train_batch_end(trainer, module, None, None, 0)
    assert not (tmp_path / "attention").exists()


# --- callback ---------------------------------------------------------------------------


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
                             device=torch.device("cpu"))
    return trainer, module


def test_callback_logs_to_wandb_every_n_steps_without_touching_the_run(model, tmp_path):
    wandb = RecordingWandbLogger()
    trainer, module = fake_trainer(tmp_path, model.train(), [wandb])
    callback = AttentionMapCallback(every_n_steps=2, layer=-1)
    callback.on_fit_start(trainer, module)
    rng = torch.get_rng_state()
    for step in [0, 1, 2, 2, 3, 4]:  # 0 and 2 twice: gradient accumulation's micro-batches
        trainer.global_step = step
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
    trainer.global_step = 1
    callback.on_train_batch_end(trainer, module, None, None, 0)
    assert not (tmp_path / "attention").exists()


def test_callback_in_a_real_training_run_saves_maps_and_changes_nothing(tmp_path):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from gptmini.lit_module import GPTLitModule

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


# --- command line -----------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    cfg = tiny()
    path = tmp_path / "tiny.ckpt"
    torch.save({"state_dict": {"model." + k: v for k, v in GPTModel(cfg).state_dict().items()},
                "hyper_parameters": {**cfg.to_dict(), "tokenizer": "gpt2"}}, path)
    return path


def test_attention_command(checkpoint, tmp_path, capsys):
    out = tmp_path / "att.png"
    args = ["attention", "--checkpoint", str(checkpoint), "--prompt", PROMPT, "--out", str(out)]
    assert main([*args, "--layer", "1", "--head", "1"]) == 0
    assert "layer 1, head 1" in capsys.readouterr().out
    single = png_size(out)
    assert main([*args, "--all_heads", "--left_pad", "2"]) == 0
    assert png_size(out) != single
    assert main([*args, "--head", "5"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "head 5 is out of range" in err
    assert main([*args, "--layer", "7"]) == 1
    assert "valid: 0 to 1" in capsys.readouterr().err


def test_attention_command_on_a_hugging_face_directory(tmp_path, capsys):
    from gptmini.convert import export_hf

    model = GPTModel(tiny(qkv_bias=True, tie_weights=True))
    export_hf(model, tmp_path / "hf")
    out = tmp_path / "hf.png"
    assert main(["attention", "--hf", str(tmp_path / "hf"), "--prompt", PROMPT, "--layer", "0",
                 "--all_heads", "--out", str(out)]) == 0
    assert png_size(out)[0] > 0 and "layer 0, all heads" in capsys.readouterr().out
