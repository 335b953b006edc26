"""Attention weights, heatmaps and training curves as pictures."""

import math

import pytest
import torch
from helpers import PROMPT, png_size, tiny

from gptmini.analysis.curves import load_metrics, plot_curves
from gptmini.analysis.plots import (
    PAD_LABEL,
    attention_figure,
    attention_weights,
    plot_attention,
)
from gptmini.model import GPTModel
from gptmini.tokenizer import get_tokenizer


@pytest.fixture
def model() -> GPTModel:
    return GPTModel(tiny()).eval()


@pytest.fixture
def tokenizer():
    return get_tokenizer("gpt2")


def test_weights_are_the_models_explicit_path_weights(model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    idx = torch.tensor([ids])
    per_layer = model.attention_weights(idx)

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


def test_metrics_merge_versions_and_resumed_steps_replace_the_first_attempt(run_dir):
    metrics, resumes = load_metrics(run_dir)
    assert metrics["train/loss"] == ([10, 20, 30, 40, 50], [8.0, 4.8, 4.7, 4.6, 4.5])
    assert metrics["val/loss"] == ([40], [4.0])  # step 30's value came from the lost timeline
    assert metrics["train/lr"][0] == [10, 20, 30, 40, 50]
    assert resumes == [20]
    assert load_metrics(run_dir / "logs")[0] == metrics


def test_plot_curves_writes_a_png(run_dir, tmp_path):
    out = plot_curves(run_dir, tmp_path / "curves.png")
    assert png_size(out) == (800, 800)
    assert png_size(plot_curves(run_dir, tmp_path / "small.png", figsize=(4, 3), dpi=50)) == (
        200,
        150,
    )


def test_a_metrics_file_cut_mid_row_keeps_its_whole_rows_and_names_the_file(run_dir):
    """Before: a resumed run trained, saved, then exited 1 with "could not convert string to
    float" from the report, naming no file. A last line without its line end may have lost
    digits too (4.6 from 4.65): it is skipped, not read."""
    path = run_dir / "logs" / "version_0" / "metrics.csv"
    whole, original = load_metrics(path)[0], path.read_text()
    path.write_text(original + "0,40,,4.6")  # a row cut short mid-number
    with pytest.warns(UserWarning, match=rf"{path}: skipped 1 row\(s\).*line 6"):
        assert load_metrics(path)[0] == whole
    path.write_text(original + "0,40,,4.6e-\r\n")  # a number cut, the line end kept
    with pytest.warns(UserWarning, match="cells that are not numbers"):
        assert load_metrics(path)[0] == whole


def test_a_cell_over_csvs_size_limit_or_binary_bytes_are_skipped_not_raised(run_dir):
    """Before: serve.py refused to start on a run whose metrics held a 128 KB cell
    (_csv.Error from the page's checkpoint panel)."""
    path = run_dir / "logs" / "version_1" / "metrics.csv"
    whole, resumes = load_metrics(run_dir)
    with open(path, "a", newline="") as file:
        file.write('0,60,,"' + "9" * 200_000 + '",,,\r\n')
    with open(path, "ab") as file:
        file.write(b"\x00\xff\xfe,\x89PNG\r\n")
    with pytest.warns(UserWarning, match="skipped 2 row"):
        assert load_metrics(run_dir) == (whole, resumes)


def test_non_finite_values_are_kept_as_logged(run_dir):
    path = run_dir / "logs" / "version_1" / "metrics.csv"
    with open(path, "a", newline="") as file:
        file.write("1,60,,nan,,inf,\r\n")
    metrics, _ = load_metrics(run_dir)
    assert math.isnan(metrics["train/loss"][1][-1]) and metrics["val/loss"][1][-1] == math.inf
