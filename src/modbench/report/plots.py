"""PNG figures of a study report (matplotlib, Agg backend, no display needed)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.colors import to_hex

Curve = list[tuple[int, float]]


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # a legend outside the axes included
    plt.close(fig)
    return path


def method_of(label: str) -> str:
    """The method of a ``method/s<seed>`` curve label (the label itself otherwise)."""
    head, sep, seed = label.rpartition("/s")
    return head if sep and seed.isdigit() else label


def method_colours(methods: Sequence[str], baseline: str | None = None) -> dict[str, str]:
    """One colour per method: the baseline black, the others in turn from matplotlib's
    10-colour cycle (``tab10``; ``tab20`` beyond ten methods, then repeating)."""
    others = [m for m in dict.fromkeys(methods) if m != baseline]
    cmap = plt.get_cmap("tab10" if len(others) <= 10 else "tab20")
    colours = {m: to_hex(cmap(i % cmap.N)) for i, m in enumerate(others)}
    if baseline is not None and baseline in methods:
        colours[baseline] = "#000000"
    return colours


def smoothed(ys: Sequence[float], window: int, log: bool = False) -> list[float]:
    """The trailing moving average of ``ys`` over ``window`` points (fewer at the start);
    ``log``: averaged in log space (a geometric mean, for positive series drawn on a log
    axis)."""
    vals = [math.log(y) if log and y > 0 else y for y in ys]
    out: list[float] = []
    total = 0.0
    for i, v in enumerate(vals):
        total += v
        if i >= window:
            total -= vals[i - window]
        mean = total / min(i + 1, window)
        out.append(math.exp(mean) if log else mean)
    return out


SMOOTH_POINTS = 25  # a curve of n points is smoothed over n // SMOOTH_POINTS of them


def curves_plot(series: dict[str, Curve], title: str, ylabel: str, path: Path,
                log_y: bool = False, *, baseline: str | None = None,
                level: float | None = None, level_label: str = "unigram level") -> Path:
    """A per-step quantity for every run, labelled ``method/s<seed>``: one colour per method
    (:func:`method_colours`), each seed a thin line of it, smoothed (trailing mean over
    1/:data:`SMOOTH_POINTS` of its points) with the raw points faint behind; the legend, one
    entry per method with its seed count, outside the axes. ``level``: a horizontal line
    labelled ``level_label`` (the unigram level, where stalled runs sit)."""
    groups: dict[str, list[Curve]] = {}
    for label, pts in sorted(series.items()):
        if pts:
            groups.setdefault(method_of(label), []).append(pts)
    colours = method_colours(list(groups), baseline)
    fig, ax = plt.subplots(figsize=(9, 4))
    for method, runs in groups.items():
        c = colours[method]
        for k, pts in enumerate(runs):
            xs, ys = zip(*pts, strict=True)
            window = len(ys) // SMOOTH_POINTS
            if window > 1:
                ax.plot(xs, ys, color=c, linewidth=0.5, alpha=0.15)
                ys = tuple(smoothed(ys, window, log=log_y))
            ax.plot(xs, ys, color=c, linewidth=1.0, alpha=0.85,
                    label=f"{method} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"
                    if k == 0 else None)
    if level is not None and math.isfinite(level):
        ax.axhline(level, color="0.35", linestyle="--", linewidth=1.0, label=level_label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if groups:  # a legend needs at least one line
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                  frameon=False)
    return _save(fig, path)


def scatter_plot(points: dict[str, tuple[float, float]], xlabel: str, ylabel: str, title: str,
                 path: Path) -> Path:
    """Validation loss against a downstream score, one labelled point per method."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, (x, y) in sorted(points.items()):
        if math.isfinite(x) and math.isfinite(y):
            ax.scatter([x], [y], s=30)
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def heatmap(rows: Sequence[str], cols: Sequence[str], values: list[list[float]], title: str,
            path: Path) -> Path:
    """Per-task Δ vs baseline (methods × tasks), diverging colour map centred on 0."""
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * max(len(cols), 1), 1.0 + 0.35 * len(rows)))
    finite = [abs(v) for r in values for v in r if math.isfinite(v)]
    lim = max(finite) if finite else 1.0
    im = ax.imshow(values, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    for i, r in enumerate(values):
        for j, v in enumerate(r):
            if math.isfinite(v):
                ax.text(j, i, f"{v:+.3f}", ha="center", va="center", fontsize=6)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, shrink=0.8)
    return _save(fig, path)


Series = Mapping[str, Sequence[float | None]]


def depth_plot(panels: Sequence[tuple[str, Series, bool]], ticks: Sequence[str], title: str,
               path: Path, xlabel: str | None = None) -> Path:
    """Figures against depth (``modbench diagnose``, the report's depth profiles): one panel
    per ``(y label, series by label, log y)``, sharing an x axis of named positions (layers,
    sublayers, matrices) labelled ``xlabel``; a ``None`` is a gap, and a panel with no value
    says so."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 0.8 + 2.2 * len(panels)),
                             sharex=True, squeeze=False)
    xs = list(range(len(ticks)))
    for ax, (ylabel, series, log_y) in zip(axes[:, 0], panels, strict=True):
        finite: list[float] = []
        for label, ys in series.items():
            vals = [math.nan if v is None else float(v) for v in ys]
            ok = [v for v in vals if math.isfinite(v)]
            if ok:
                ax.plot(xs[:len(vals)], vals, marker="o", markersize=3, linewidth=1.2,
                        label=label)
                finite += ok
        if not finite:
            ax.text(0.5, 0.5, "not available (see null_reasons in diagnostics.json)",
                    transform=ax.transAxes, ha="center", va="center", fontsize=8,
                    color="gray")
        elif log_y and any(v > 0 for v in finite):
            ax.set_yscale("log")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        if finite and len(series) > 1:
            ax.legend(fontsize=7, ncol=min(len(series), 4))
    axes[-1, 0].set_xticks(xs, list(ticks), rotation=45 if len(ticks) > 12 else 0,
                           ha="right" if len(ticks) > 12 else "center", fontsize=7)
    if xlabel:
        axes[-1, 0].set_xlabel(xlabel)
    axes[0, 0].set_title(title)
    return _save(fig, path)
