"""Pictures of what a model does: attention heatmaps and training curves.

The attention weights come from `GPTModel.forward(..., return_weights=True)`, which runs the
attention module's explicit path: they are the weights the output was computed from, with
the causal zeros above the diagonal, the zeros outside a sliding window and the zero rows
and columns of left padding all in place.

    attention_weights   prompt -> (n_heads, num_tokens, num_tokens) weights of one layer
    attention_figure    those weights as a heatmap of one head or a grid of all heads
    plot_attention      the same, written to a PNG
    load_metrics        a run's CSV metrics, merged over the logger's version folders
    plot_curves         train/val loss and learning rate against steps, written to a PNG

matplotlib is a dependency, imported only when a picture is drawn (an install without it
still trains: `pip install matplotlib` to draw). Figures are built with the
object-oriented API and the Agg canvas, never pyplot, so plotting neither opens windows nor
changes the backend of a notebook that imports this module.
"""

import csv
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from gptmini.tokenizer import encode_prompt

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from tiktoken import Encoding

__all__ = [
    "attention_figure",
    "attention_weights",
    "check_index",
    "require_matplotlib",
    "load_metrics",
    "plot_attention",
    "plot_curves",
    "token_labels",
]

PLOT_INSTALL_HINT = "pip install matplotlib"
PAD_LABEL = "<pad>"
# Visible stand-ins for whitespace, so " the" and "the" do not look alike on an axis.
_VISIBLE_WHITESPACE = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"})


def require_matplotlib():
    """matplotlib, or an ImportError that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            f"plotting needs matplotlib, which is not installed: {PLOT_INSTALL_HINT}"
        ) from None
    return matplotlib


# --- attention -------------------------------------------------------------------------


def check_index(name: str, index: int, count: int, what: str) -> int:
    """`index` as a non-negative index into `count` items (negative counts from the end)."""
    if not -count <= index < count:
        raise ValueError(
            f"{name} {index} is out of range: the model has {count} {what} "
            f"(valid: 0 to {count - 1}, or -{count} to -1 from the end)"
        )
    return index % count


def token_labels(tokenizer: "Encoding", ids: Sequence[int]) -> list[str]:
    """Each token decoded on its own, with whitespace made visible (" the" -> "␣the").

    A token holding part of a multi-byte character shows as the replacement character.
    """
    labels = []
    for token in ids:
        text = tokenizer.decode_single_token_bytes(token).decode("utf-8", errors="replace")
        labels.append(text.translate(_VISIBLE_WHITESPACE))
    return labels


def attention_weights(
    model: nn.Module,
    tokenizer: "Encoding",
    prompt: str,
    layer: int = -1,
    *,
    left_pad: int = 0,
) -> tuple[Tensor, list[str]]:
    """The attention weights one layer of `model` gives the tokens of `prompt`.

    The model runs once, in eval mode (no dropout) and without gradients; its train/eval
    mode is restored afterwards and no random numbers are drawn.

    Args:
        model: a `GPTModel` (anything with `.cfg` and `forward(..., return_weights=True)`).
        tokenizer: the model's tiktoken encoding.
        prompt: text to look at; special tokens such as <|endoftext|> are allowed, and an
            empty prompt becomes <|endoftext|> alone.
        layer: transformer block, counted from 0; negative counts from the last.
        left_pad: put this many padding positions before the prompt (masked out through
            `attention_mask`), to see what padding does to the weights.

    Returns:
        The weights (n_heads, num_tokens, num_tokens) as float32 on the CPU, query i in
        row i and key j in column j, and the `num_tokens` axis labels.

    Raises:
        ValueError: `layer` is out of range, or the padded prompt is longer than the model's
            context_length.
    """
    cfg = model.cfg
    layer = check_index("layer", layer, cfg.n_layers, "layers")
    if left_pad < 0:
        raise ValueError(f"left_pad must be 0 or more, got {left_pad}")
    ids = encode_prompt(tokenizer, prompt)
    num_tokens = left_pad + len(ids)
    if num_tokens > cfg.context_length:
        raise ValueError(
            f"the prompt is {len(ids)} tokens"
            + (f" plus {left_pad} of padding" if left_pad else "")
            + f", but the model's context_length is {cfg.context_length}; shorten it"
        )
    device = next(model.parameters()).device
    idx = torch.tensor([[tokenizer.eot_token] * left_pad + ids], device=device)
    mask = None
    if left_pad:
        mask = torch.tensor([[0] * left_pad + [1] * len(ids)], device=device)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _, weights = model(idx, mask, return_weights=True)
    finally:
        model.train(was_training)
    labels = [PAD_LABEL] * left_pad + token_labels(tokenizer, ids)
    return weights[layer][0].float().cpu(), labels  # (n_heads, num_tokens, num_tokens)


def attention_figure(
    weights: Tensor,
    labels: Sequence[str],
    *,
    layer: int,
    head: int | None = None,
    title: str | None = None,
    figsize: tuple[float, float] | None = None,
    dpi: int = 100,
) -> "Figure":
    """A heatmap of one head's weights, or a grid of all heads when `head` is None.

    Queries run down, keys across, both labelled with the tokens. The color scale is fixed
    to [0, 1] in every panel, so heads (and training steps) compare at a glance.

    Args:
        weights: (n_heads, num_tokens, num_tokens) from `attention_weights`.
        labels: num_tokens axis labels.
        layer: the layer the weights come from, for the title.
        head: the head to draw; negative counts from the last; None draws them all.
        title: overrides the default title.
        figsize: figure size in inches; the default grows with the number of tokens.
        dpi: dots per inch; the PNG is figsize * dpi pixels.

    Raises:
        ValueError: `head` is out of range or the shapes do not match.
        ImportError: matplotlib is not installed.
    """
    require_matplotlib()
    from matplotlib.figure import Figure

    if weights.dim() != 3 or weights.shape[1] != weights.shape[2]:
        raise ValueError(
            f"weights must be (n_heads, num_tokens, num_tokens), got {tuple(weights.shape)}"
        )
    n_heads, num_tokens, _ = weights.shape
    if len(labels) != num_tokens:
        raise ValueError(f"got {len(labels)} labels for {num_tokens} tokens")
    heads = list(range(n_heads))
    if head is not None:
        heads = [check_index("head", head, n_heads, "heads per layer")]
    grid = _Grid.of(len(heads), labels, figsize)
    fig = Figure(figsize=grid.figsize, dpi=dpi, layout="constrained")
    axes = fig.subplots(grid.nrows, grid.ncols, squeeze=False)
    data = weights.detach().float().cpu().numpy()
    image = None
    for i, ax in enumerate(axes.flat):
        if i >= len(heads):
            ax.set_axis_off()
            continue
        image = ax.imshow(data[heads[i]], cmap="viridis", vmin=0.0, vmax=1.0,
                          interpolation="nearest")
        if len(heads) > 1:  # a single head is named in the figure's title
            ax.set_title(f"head {heads[i]}", fontsize=grid.fontsize + 2)
        # Tokens label the left column's rows and the columns of the lowest panels only.
        grid.label(ax, left=i % grid.ncols == 0, bottom=i + grid.ncols >= len(heads))
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    if title is None:
        which = f"head {heads[0]}" if head is not None else f"all {n_heads} heads"
        title = f"Attention weights, layer {layer}, {which}"
    fig.suptitle(title)
    return fig


@dataclass(frozen=True)
class _Grid:
    """How a figure of square heatmap panels, one per head, is laid out and labelled."""

    nrows: int
    ncols: int
    figsize: tuple[float, float]
    fontsize: float
    ticks: range
    tick_labels: list[str]

    @classmethod
    def of(cls, panels: int, labels: Sequence[str],
           figsize: tuple[float, float] | None) -> "_Grid":
        """The most square grid of `panels`, sized for the token `labels` unless `figsize`."""
        num_tokens = len(labels)
        ncols = math.ceil(math.sqrt(panels))
        nrows = math.ceil(panels / ncols)
        if figsize is None:
            # About a quarter inch per token keeps labels legible; grid panels a little less.
            if panels == 1:
                side = min(max(1.2 + 0.25 * num_tokens, 5.0), 12.0)
            else:
                side = min(max(1.2 + 0.2 * num_tokens, 3.0), 8.0)
            # Room beside the panels for token labels and colorbar, below for labels, titles.
            figsize = (ncols * side + 2.0, nrows * (side + 0.3) + 1.6)
        fontsize = max(4.0, min(9.0, 160.0 / num_tokens / max(1, ncols - 1) ** 0.5))
        # Past about 64 tokens the labels would overprint each other: label every k-th token.
        ticks = range(0, num_tokens, math.ceil(num_tokens / 64))
        return cls(nrows, ncols, figsize, fontsize, ticks, [labels[t] for t in ticks])

    def label(self, ax, *, left: bool, bottom: bool) -> None:
        """Token labels on a panel's axes: queries down the left, keys along the bottom."""
        ax.set_xticks(self.ticks, self.tick_labels if bottom else [], rotation=90,
                      fontsize=self.fontsize)
        ax.set_yticks(self.ticks, self.tick_labels if left else [], fontsize=self.fontsize)
        ax.tick_params(length=0)
        if left:
            ax.set_ylabel("query", fontsize=self.fontsize + 1)
        if bottom:
            ax.set_xlabel("key", fontsize=self.fontsize + 1)


def plot_attention(
    weights: Tensor,
    labels: Sequence[str],
    out: str | Path,
    *,
    layer: int,
    head: int | None = None,
    title: str | None = None,
    figsize: tuple[float, float] | None = None,
    dpi: int = 100,
) -> Path:
    """Write `attention_figure(...)` to the PNG `out` (parents created); returns its path."""
    fig = attention_figure(
        weights, labels, layer=layer, head=head, title=title, figsize=figsize, dpi=dpi
    )
    return _save(fig, out)


def _save(fig: "Figure", out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # No bbox_inches="tight": the image stays exactly figsize * dpi pixels.
    fig.savefig(out, format="png")
    return out


# --- training curves -------------------------------------------------------------------


def _metric_files(run_dir: Path) -> list[Path]:
    if run_dir.is_file():
        return [run_dir]
    for folder in (run_dir / "logs", run_dir):
        versions = [p for p in folder.glob("version_*/metrics.csv") if p.is_file()]
        if versions:
            return sorted(versions, key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0))
    if (run_dir / "metrics.csv").is_file():
        return [run_dir / "metrics.csv"]
    raise FileNotFoundError(
        f"no metrics under {run_dir}: expected {run_dir}/logs/version_N/metrics.csv, which "
        "train.py's CSV logger writes"
    )


def load_metrics(run_dir: str | Path) -> tuple[dict[str, tuple[list[int], list[float]]], list[int]]:
    """Every metric a run logged, as (steps, values) in step order.

    Each invocation of train.py (a resume too) writes its own `logs/version_N/metrics.csv`.
    A later version replaces whatever earlier ones logged from its first step on: those
    steps were run again after the resume, and the first attempt is not the run's history.

    Args:
        run_dir: the run directory (holding `logs/`), its `logs/` folder, or one
            `metrics.csv`.

    Returns:
        The metrics by column name (`train/loss`, `val/loss`, `train/lr`, ...), and the
        steps at which a version after the first began (where the run was resumed).
    """
    merged: dict[str, dict[int, float]] = {}
    resumes = []
    for i, path in enumerate(_metric_files(Path(run_dir))):
        rows = []
        with open(path, newline="") as file:
            for row in csv.DictReader(file):
                if (row.get("step") or "").strip():
                    rows.append(row)
        if not rows:
            continue
        first = min(int(float(row["step"])) for row in rows)
        if i > 0 and merged:
            resumes.append(first)
        for values in merged.values():
            for step in [s for s in values if s >= first]:
                del values[step]
        for row in rows:
            step = int(float(row["step"]))
            for name, cell in row.items():
                if name in ("step", "epoch") or name is None or not (cell or "").strip():
                    continue
                merged.setdefault(name, {})[step] = float(cell)
    metrics = {
        name: (sorted(v), [v[s] for s in sorted(v)]) for name, v in merged.items() if v
    }
    return metrics, resumes


def plot_curves(
    run_dir: str | Path,
    out: str | Path = "curves.png",
    *,
    figsize: tuple[float, float] = (8.0, 8.0),
    dpi: int = 100,
) -> Path:
    """Train and validation loss (top), validation bits per byte (middle) and learning rate
    (bottom) against optimizer steps.

    Args:
        run_dir: see `load_metrics`.
        out: the PNG to write (parents created).
        figsize: figure size in inches; the PNG is figsize * dpi pixels.
        dpi: dots per inch.

    Returns:
        The path written.

    Raises:
        FileNotFoundError: no metrics.csv under `run_dir`.
        ValueError: the metrics hold no loss to plot.
        ImportError: matplotlib is not installed.
    """
    require_matplotlib()
    from matplotlib.figure import Figure

    metrics, resumes = load_metrics(run_dir)
    if "train/loss" not in metrics and "val/loss" not in metrics:
        raise ValueError(
            f"the metrics of {run_dir} hold no train/loss or val/loss yet (columns: "
            f"{', '.join(sorted(metrics)) or 'none'}); train for at least log_every_n_steps"
        )
    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    loss_ax, bpb_ax, lr_ax = fig.subplots(3, 1, sharex=True, height_ratios=[2, 1, 1])
    _plot_losses(loss_ax, metrics)
    # bits per byte compares runs whatever their tokenizers
    _plot_or_say(bpb_ax, metrics, "val/bpb", "o-", color="tab:orange", ms=3.5, lw=1.5)
    bpb_ax.set_ylabel("val bits per byte")
    if _plot_or_say(lr_ax, metrics, "train/lr", color="tab:green", lw=1.2):
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("step")
    for ax in (loss_ax, bpb_ax, lr_ax):
        ax.grid(alpha=0.3)
        for step in resumes:
            ax.axvline(step, color="gray", ls=":", lw=1)
    if resumes:
        loss_ax.plot([], [], color="gray", ls=":", lw=1, label="resumed")
        loss_ax.legend()
    name = Path(run_dir).resolve()
    fig.suptitle(f"Training curves: {name.parent.name if name.is_file() else name.name}")
    return _save(fig, out)


def _plot_losses(ax, metrics: dict[str, tuple[list[int], list[float]]]) -> None:
    """Train and validation loss, the best validation loss named in the panel's title."""
    if "train/loss" in metrics:
        ax.plot(*metrics["train/loss"], lw=1.0, alpha=0.8, label="train loss")
    if "val/loss" in metrics:
        steps, values = metrics["val/loss"]
        ax.plot(steps, values, "o-", ms=3.5, lw=1.5, label="val loss")
        best = min(range(len(values)), key=values.__getitem__)
        ax.set_title(f"best val loss {values[best]:.3f} at step {steps[best]}", fontsize=10)
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()


def _plot_or_say(ax, metrics: dict[str, tuple[list[int], list[float]]], name: str, *style,
                 **line) -> bool:
    """Plot metric `name` on `ax`, or say in the panel that it was not logged; whether it was."""
    if name in metrics:
        ax.plot(*metrics[name], *style, **line)
        return True
    ax.text(0.5, 0.5, f"no {name} logged", ha="center", va="center", transform=ax.transAxes)
    return False
