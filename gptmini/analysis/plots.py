"""Pictures of what a model attends to: attention heatmaps (a run's curves: curves.py).

The attention weights come from `GPTModel.attention_weights`, which runs the
attention module's explicit path: they are the weights the output was computed from, with
the causal zeros above the diagonal, the zeros outside a sliding window and the zero rows
and columns of left padding all in place.

    attention_weights   prompt -> (n_heads, num_tokens, num_tokens) weights of one layer
    attention_figure    those weights as a heatmap of one head or a grid of all heads
    plot_attention      the same, written to a PNG

matplotlib is a dependency, imported only when a picture is drawn (an install without it
still trains: `pip install matplotlib` to draw). Figures are built with the
object-oriented API and the Agg canvas, never pyplot, so plotting neither opens windows nor
changes the backend of a notebook that imports this module.
"""

import math
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
    "save_png",
    "plot_attention",
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
        model: a `GPTModel` (anything with `.cfg` and `attention_weights`).
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
            weights = model.attention_weights(idx, mask)
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
    return save_png(fig, out)


def save_png(fig: "Figure", out: str | Path) -> Path:
    """Write `fig` to `out` as a PNG of exactly figsize x dpi pixels; the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # No bbox_inches="tight": the image stays exactly figsize * dpi pixels.
    fig.savefig(out, format="png")
    return out
