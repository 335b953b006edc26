"""A training run's curves: its CSV metrics read back (merged over the logger's version
folders, as resumes leave them) and drawn as train/val loss and learning rate against steps.

    load_metrics   a run's metrics: name -> (steps, values), and the steps it resumed at
    plot_curves    those metrics written to a PNG
"""

import csv
import re
import warnings
from pathlib import Path

from gptmini.analysis.plots import require_matplotlib, save_png

__all__ = ["load_metrics", "plot_curves"]


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
    """Every metric a run logged, as (steps, values) in step order; a step is the number
    of optimizer steps the weights had taken (a validation after step 1,000 is at 1,000).

    Each invocation of train.py (a resume too) writes its own `logs/version_N/metrics.csv`.
    A later version replaces whatever earlier ones logged from its first step on: those
    steps were run again after the resume, and the first attempt is not the run's history.

    A row that cannot be read is skipped, with one warning per file naming it and the
    lines: a last line without its line end (the file was cut mid-row, by a kill or a full
    disk: its last number may be cut short too), a row whose cells are not numbers, or a
    cell over csv's size limit. A cell that says nan or inf is kept as it is.

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
        rows = _read_rows(path)
        if not rows:
            continue
        first = min(step for step, _ in rows)
        if i > 0 and merged:
            resumes.append(first)
        for values in merged.values():
            for step in [s for s in values if s >= first]:
                del values[step]
        for step, cells in rows:
            for name, value in cells.items():
                merged.setdefault(name, {})[step] = value
    # Lightning writes a validation on the row of the step before it (0-based: the one after
    # step 1,000 on row 999), a training loss on the row of the steps its weights had taken.
    # Moved by one, every metric's step is the number of optimizer steps taken, as the
    # report, the curves and the page say it.
    metrics = {
        name: ([s + name.startswith("val/") for s in sorted(v)], [v[s] for s in sorted(v)])
        for name, v in merged.items() if v
    }
    return metrics, resumes


def _read_rows(path: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, {column: value}) of each readable row of one metrics.csv; see `load_metrics`
    for what is skipped (and warned about)."""
    with open(path, newline="", encoding="utf-8", errors="replace") as file:
        lines = file.read().splitlines(keepends=True)
    if not lines:
        return []
    header = next(csv.reader([lines[0]]), [])
    rows, skipped = [], []
    for number, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        try:
            if not line.endswith(("\n", "\r")):
                raise ValueError("no line end: cut short")
            cells = next(csv.reader([line]))
            if len(cells) != len(header):
                raise ValueError(f"{len(cells)} cells under {len(header)} columns")
            row = dict(zip(header, cells, strict=True))
            if not (row.get("step") or "").strip():
                continue  # a row without a step (none of train.py's): nothing to place
            step = float(row["step"])
            if not step.is_integer():
                raise ValueError(f"step {row['step']!r}")
            values = {name: float(cell) for name, cell in row.items()
                      if name not in ("step", "epoch") and cell.strip()}
        except (ValueError, csv.Error):  # csv.Error: a cell over csv's field size limit
            skipped.append(number)
            continue
        rows.append((int(step), values))
    if skipped:
        lines_said = ", ".join(map(str, skipped[:5])) + (" ..." if len(skipped) > 5 else "")
        warnings.warn(f"{path}: skipped {len(skipped)} row(s) that are not metrics (line "
                      f"{lines_said}): cut short, or cells that are not numbers", stacklevel=3)
    return rows


def plot_curves(
    run_dir: str | Path,
    out: str | Path = "curves.png",
    *,
    figsize: tuple[float, float] = (8.0, 8.0),
    dpi: int = 100,
) -> Path:
    """Train and validation loss (top), validation bits per byte (middle: or what `MIDDLE`
    picks for the run), an RL run's rollouts (`ROLLOUTS`) and the learning rate (bottom)
    against optimizer steps.

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
    rollouts = any(name in metrics for name, _, _ in ROLLOUTS)
    loss_ax, bpb_ax, *rollout_ax, lr_ax = fig.subplots(
        3 + rollouts, 1, sharex=True, height_ratios=[2, 1, 1] + [1] * rollouts)
    _plot_losses(loss_ax, metrics)
    _plot_headline(bpb_ax, metrics)
    for ax in rollout_ax:
        _plot_rollouts(ax, metrics)
    if _plot_or_say(lr_ax, metrics, "train/lr", color="tab:green", lw=1.2):
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("step")
    for ax in (loss_ax, bpb_ax, *rollout_ax, lr_ax):
        ax.grid(alpha=0.3)
        for step in resumes:
            ax.axvline(step, color="gray", ls=":", lw=1)
    if resumes:
        loss_ax.plot([], [], color="gray", ls=":", lw=1, label="resumed")
        loss_ax.legend()
    name = Path(run_dir).resolve()
    fig.suptitle(f"Training curves: {name.parent.name if name.is_file() else name.name}")
    return save_png(fig, out)


MIDDLE = (("val/bpb", "val bits per byte", None), ("val/accuracy", "val preference accuracy",
          "val/margin"), ("val/acc", "val accuracy", None), ("val/pass_at_1", "val pass@1",
                                                              "train/reward"))
"""The middle panel, by what the run logged: bits per byte (which compares runs whatever
their tokenizers), DPO's preference accuracy with its margin, a classifier's accuracy, or
RL's held-out pass@1 with the mean reward of its samples; else on its right the benchmarks
scored at each validation (val/tasks, their centred mean)."""


ROLLOUTS = (("train/zero_variance", "zero-variance groups", "tab:red"),
            ("train/clip_fraction", "clip fraction", "tab:blue"),
            ("train/response_length", "response tokens", "tab:gray"))
"""An RL run's panel above the learning rate: the shares of groups whose rewards are all
alike (they teach nothing) and of tokens the clip held, and on the right the mean response
length, so that a run that is not learning says so while it runs."""


def _plot_rollouts(ax, metrics: dict[str, tuple[list[int], list[float]]]) -> None:
    """The rollouts' panel (`ROLLOUTS`): the shares on the left, the length on the right."""
    *shares, (length, length_label, length_color) = ROLLOUTS
    plotted = [ax.plot(*metrics[name], lw=1.0, color=color, label=label)
               for name, label, color in shares if name in metrics]
    ax.set_ylim(-0.05, 1.05)
    ax.set_ylabel("share")
    if plotted:
        ax.legend(loc="upper left", fontsize=8)
    if length in metrics:
        twin = ax.twinx()
        twin.plot(*metrics[length], lw=1.0, color=length_color)
        twin.set_ylabel(length_label, color=length_color)


def _plot_headline(ax, metrics: dict[str, tuple[list[int], list[float]]]) -> None:
    """The middle panel (`MIDDLE`), and its second metric on the right-hand axis."""
    name, label, second = next((m for m in MIDDLE if m[0] in metrics), MIDDLE[0])
    _plot_or_say(ax, metrics, name, "o-", color="tab:orange", ms=3.5, lw=1.5)
    ax.set_ylabel(label)
    second = second if second in metrics else "val/tasks"  # in-loop benchmarks' mean
    if second in metrics:
        twin = ax.twinx()
        twin.plot(*metrics[second], color="tab:purple", lw=1.0, alpha=0.8)
        twin.set_ylabel(second.replace("/", " "), color="tab:purple")


def _plot_losses(ax, metrics: dict[str, tuple[list[int], list[float]]]) -> None:
    """Train and validation loss, the best validation loss named in the panel's title."""
    if "train/loss" in metrics:
        ax.plot(*metrics["train/loss"], lw=1.0, alpha=0.8, label="train loss")
    if "val/loss" in metrics:
        steps, values = metrics["val/loss"]
        ax.plot(steps, values, "o-", ms=3.5, lw=1.5, label="val loss")
        best = min(range(len(values)), key=values.__getitem__)
        ax.set_title(f"best val loss {values[best]:.3f} at step {steps[best]}", fontsize=10)
    objective = "train/margin" in metrics or "train/reward" in metrics  # DPO's, GRPO's
    ax.set_ylabel("loss" if objective else "cross-entropy (nats/token)")
    ax.legend()


def _plot_or_say(ax, metrics: dict[str, tuple[list[int], list[float]]], name: str, *style,
                 **line) -> bool:
    """Plot metric `name` on `ax`, or say in the panel that it was not logged; whether it was."""
    if name in metrics:
        ax.plot(*metrics[name], *style, **line)
        return True
    ax.text(0.5, 0.5, f"no {name} logged", ha="center", va="center", transform=ax.transAxes)
    return False
