"""Small matplotlib helpers for the backtest and comparison reports: files only, no pyplot state."""

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: no display, no global figure registry to leak


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def bar_plot(
    labels: Sequence[str], values: Sequence[float], *, xlabel: str, ylabel: str, title: str, path: Path
) -> Path:
    fig = Figure(figsize=(max(5.0, 0.25 * len(values)), 4))
    ax = fig.subplots()
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, rotation=90 if len(values) > 10 else 0, fontsize=7)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def line_plot(
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    path: Path,
    marker: str = "",
    log_x: bool = False,
) -> Path:
    """One line per label: series[label] = (x, y)."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for label, (x, y) in series.items():
        ax.plot(x, y, marker=marker, label=label)
    if log_x:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    return _save(fig, path)


def scatter_plot(
    points: dict[str, tuple[float, float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    path: Path,
    log_x: bool = True,
) -> Path:
    """One labelled point per entry: points[label] = (x, y)."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for label, (x, y) in points.items():
        ax.scatter([x], [y])
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if log_x and points and all(x > 0 for x, _ in points.values()):
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    return _save(fig, path)
