"""The report's "Verdicts over training" section: Δ against the baseline with the verdict's
interval at every validation step where every seed has a validation loss, one figure per scale
(one line per method, its interval as a band, the zero line), a warning for each method whose
verdict changed in the last third of training (:mod:`modbench.analysis.trajectory`, Wen et al.
2025, arXiv:2509.02046), and, for a study whose seeds were added sequentially
(``--until-decided``), what its looks spent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from modbench.analysis.results import (
    ALPHA,
    Comparisons,
    StudyResults,
    comparisons_json,
    metric_table,
    read_looks,
    verdict_options,
)
from modbench.analysis.stats import Look, sequential_alpha
from modbench.analysis.trajectory import Curves, StepVerdict, late_flips, trajectory
from modbench.report.blocks import Block
from modbench.runtime.runfolder import curves


def scale_curves(results: StudyResults, scale: str) -> Curves:
    """``{method: {seed: validation curve, None for a failed run}}`` of the finished runs at
    ``scale`` (from each run's metrics.jsonl)."""
    out: dict[str, dict[int, Any]] = {}
    for r in results.rows:
        if r.scale != scale or r.state != "done":
            continue
        pts = curves(r.run_dir)["val_loss"] if r.run_dir is not None else []
        out.setdefault(r.method, {})[r.seed] = None if r.failed else pts
    return out


def trajectories(results: StudyResults) -> dict[str, list[StepVerdict]]:
    """Per scale of the comparisons, the verdicts over training on the validation loss, by the
    study's verdict rule (at :data:`~modbench.analysis.results.ALPHA` at every step)."""
    out: dict[str, list[StepVerdict]] = {}
    for scale in results.comparisons:
        cv = scale_curves(results, scale)
        table = metric_table(results.rows, scale, "val_loss", results.baseline)
        kw = verdict_options(results.rows, scale, "val_loss", results.anchors, table)
        out[scale] = trajectory(cv, results.baseline, alpha=ALPHA, **kw)
    return out


def with_trajectories(comparisons: Comparisons, traj: dict[str, list[StepVerdict]]
                      ) -> dict[str, list[dict[str, Any]]]:
    """results.json: each method's comparison (:func:`~modbench.analysis.results.
    comparisons_json`) with, but for the baseline's, a ``trajectory`` table (step, n, delta,
    ci, verdict at each common validation step)."""
    extra = {scale: {r.method: {"trajectory": [
        {k: v for k, v in p.to_dict().items() if k != "method"}
        for p in traj.get(scale, []) if p.method == r.method]}
        for r in res if not r.is_baseline} for scale, res in comparisons.items()}
    return comparisons_json(comparisons, extra)


def trajectory_plot(points: list[StepVerdict], title: str, path: Path) -> Path:
    """Δ (validation loss, method − baseline) against step, one line per method, the
    verdict's interval as a band, and the zero line."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in dict.fromkeys(p.method for p in points):
        ps = [p for p in points if p.method == m and math.isfinite(p.delta)]
        if not ps:
            continue
        xs = [p.step for p in ps]
        line = ax.plot(xs, [p.delta for p in ps], label=m, linewidth=1.2)[0]
        band = [(p.step, p.ci[0], p.ci[1]) for p in ps
                if math.isfinite(p.ci[0]) and math.isfinite(p.ci[1])]
        if band:
            bx, lo, hi = zip(*band, strict=True)
            ax.fill_between(bx, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("Δ validation loss vs baseline")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def futility_words(looks: Sequence[Look]) -> str:
    """``, futility below 0.1: 2 stopped`` for looks of a design with a futility rule
    (``--futility``); ``""`` without one."""
    futility = looks[-1].futility if looks else None
    if futility is None:
        return ""
    return f", futility below {futility:g}: {sum(len(lk.futile) for lk in looks)} stopped"


def sequential_section(results: StudyResults) -> list[Block]:
    """The "Sequential seeds" section of a study run with ``--until-decided`` (its looks, read
    from the study folder; none: nothing), the sequential stage's part of the report
    (:mod:`modbench.study.stages.sequential`)."""
    looks = read_looks(results.folder)
    lines = []
    for scale, ls in looks.items():
        if ls:
            last = ls[-1]
            lines.append(
                f"{scale}: {len(ls)} looks (--until-decided {last.cap}, {last.spending} "
                f"spending{futility_words(ls)}), α spent {last.alpha_spent:.3g} of "
                f"{ALPHA:g}; the final verdicts use the α spent at the last look that tested, "
                f"{sequential_alpha(ls):.2g}, and a method decided at an earlier look keeps "
                "that verdict" + ("; a method stopped for futility keeps the verdict its "
                                  "seeds give, never improver or degrader"
                                  if last.futility is not None else ""))
    if not lines:
        return []
    return [Block("h2", "Sequential seeds"),
            Block("p", "This study was sequential: its seeds were added in looks "
                       "(`modbench study run --until-decided`), each the verdict's own test at "
                       "the α that look spends (Lan–DeMets α-spending); the looks' α add up to "
                       "at most α, so the family-wise rate holds across looks. Each method's "
                       "note says at which look it was decided."),
            Block("ul", items=lines)]


def trajectory_section(results: StudyResults, out: Path, blocks: list[Block]
                       ) -> dict[str, list[StepVerdict]]:
    """Append the section to ``blocks`` (figures into ``out``) and return the trajectories
    (for results.json, :func:`with_trajectories`)."""
    traj = trajectories(results)
    if not any(traj.values()):
        return traj
    blocks += [Block("h2", "Verdicts over training"), Block(
        "p", "Δ of each method's validation loss against the baseline, with the verdict's "
             "interval, at every validation step where every seed has a validation loss "
             f"(the verdict rule at α = {ALPHA:g} at each step, each step its own family: "
             "descriptive, not a repeated test). Rankings can flip as the learning rate "
             "decays (Wen et al. 2025, arXiv:2509.02046): a verdict that changed late may "
             "not have settled.")]
    warnings = []
    for scale, pts in traj.items():
        if not pts:
            continue
        path = trajectory_plot(pts, f"Δ vs {results.baseline} over training — {scale}",
                               out / f"trajectory_{scale}.png")
        blocks.append(Block("img", f"Δ validation loss against the baseline over training, "
                                   f"{scale}", path=path))
        warnings += [f"{scale}: {f.sentence()}" for f in late_flips(pts)]
    if warnings:
        blocks.append(Block("p", "**Warning: verdicts that changed late in training.**"))
        blocks.append(Block("ul", items=warnings))
    return traj
