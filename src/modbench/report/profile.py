"""The report's "Learning-rate profile" section, for a study whose spec has an ``lr_profile``
block (:mod:`modbench.study.stages.profile`; docs/studies.md, "Learning-rate profiles"): per
scale the loss-against-rate figure (one colour per method, the seeds' interval as a band,
failed points marked), the profile table with the verdicts, and one sentence per method.

The stage writes what this reads (``lr_profile/profile.json``); the file names live here,
below the study layer that writes them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from modbench.analysis.results import StudyResults
from modbench.errors import ModbenchError
from modbench.report.blocks import Block
from modbench.report.blocks import fmt as _fmt
from modbench.report.plots import _save, method_colours, plt

PROFILE_DIR = "lr_profile"  # the profile's study folder, inside the frozen study's
PROFILE_FILE = "profile.json"  # in PROFILE_DIR: the profiles, verdicts and flags

#: a grid point's verdict in the table's compact column
MARKS = {"improver": "+", "degrader": "−", "within_noise": "·", "diverged": "d",
         "stalled": "s", "baseline": "=", "undetermined": "?", "dropped": "h"}


def read_profile(folder: str | Path) -> dict[str, Any] | None:
    """A study's ``lr_profile/profile.json`` (None: no profile, or not finished yet)."""
    path = Path(folder) / PROFILE_DIR / PROFILE_FILE
    if not path.is_file():
        return None
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModbenchError(f"cannot read the learning-rate profile of {folder} ({e}); run "
                            "`modbench study run` on it again to rewrite it") from None
    return data


def _g(v: Any, digits: int = 3) -> str:
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) \
        else f"{v:.{digits}g}"


def _ci(pair: Any, digits: int = 3) -> str:
    return f" [{_g(pair[0], digits)}, {_g(pair[1], digits)}]" if pair else ""


def profile_section(results: StudyResults, out: Path) -> list[Block]:
    """The section's blocks (none without a finished profile); figures into ``out``."""
    data = read_profile(results.folder)
    if data is None:
        return []
    blocks = [Block("h2", "Learning-rate profile"), Block("p", _intro(data))]
    for scale, per in data["scales"].items():
        blocks.append(Block("img", path=_figure(scale, per, data, results.baseline, out)))
        blocks.append(_table(scale, per, data, results.baseline))
        sentences = _sentences(per, data, results.baseline)
        if sentences:
            blocks.append(Block("ul", items=sentences))
    return blocks


def _intro(data: dict[str, Any]) -> str:
    where = ("multipliers " + ", ".join(data["points"]) + " of each run's own `recipe.lr`"
             if data.get("grid") is not None else "rates " + ", ".join(data["points"]))
    seeds = ", ".join(map(str, data["seeds"]))
    text = (f"Every method and the baseline were trained at the {where}, on seed(s) {seeds} "
            f"(the runs are in `{PROFILE_DIR}/`). Per method: the final `{data['loss']}` at "
            "each rate (mean, 95 % t interval over the seeds that trained; failed points "
            "marked ×), the best rate and loss (95 % bootstrap intervals over seeds), the "
            "learning-rate sensitivity of Wortsman et al. 2023 (arXiv:2309.14322: the mean "
            "over the grid of min(loss, loss at init) − best loss; lower is less sensitive), "
            f"the near-best basin (rates within {data['tolerance']:g} of the best loss, in "
            "log2 units) and the largest rate that trains on every seed. The sensitivity "
            "verdict judges the seeds' sensitivities against the baseline's by the study's "
            f"rule; the verdicts column is the study's verdict on `{data['metric']}` at each "
            "grid point (+ improver, − degrader, · within noise, d diverged, s stalled, h "
            "dropped by the halving rule). A "
            "method with an improver at one rate and a degrader at another is "
            "**rate-dependent**.")
    halving = data.get("halving")
    if halving:
        trained, planned = halving["steps_trained"], halving["steps_planned"]
        text += (f" Successive halving: at {', '.join(f'{a:g}' for a in halving['at'])} of "
                 "the steps, a point whose loss was above its method's best point's by more "
                 f"than {halving['margin']:g} on every seed stopped there (h; "
                 f"{len(halving['decisions'])} point(s) dropped; "
                 f"{trained:,} of {planned:,} planned steps trained, "
                 f"{trained / planned if planned else 0:.0%}); a dropped point enters the "
                 "sensitivity at its loss when dropped, so the sensitivity is approximate there "
                 "and the largest stable rate counts only points trained to the end.")
    if data.get("select_seeds"):
        text += (" Each method's own best rate was chosen on selection seed(s) "
                 f"{', '.join(map(str, data['select_seeds']))}, which the verdict at it does "
                 "not use.")
    return text


def _figure(scale: str, per: dict[str, Any], data: dict[str, Any], baseline: str,
            out: Path) -> Path:
    """Loss against rate (log axis), one colour per method, the seeds' interval as a band,
    a failed point as × at the top of the axis."""
    methods = list(per["profiles"])
    colours = method_colours(methods, baseline)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    finite = [c["mean"] for p in per["profiles"].values() for c in p["cells"]
              if c["mean"] is not None]
    top = max(finite) if finite else 1.0
    for m, prof in per["profiles"].items():
        cells = prof["cells"]
        xs = [c["rate"] for c in cells if c["mean"] is not None]
        ys = [c["mean"] for c in cells if c["mean"] is not None]
        ax.plot(xs, ys, "o-", color=colours[m], label=m, lw=1.6 if m == baseline else 1.2)
        band = [(c["rate"], c["lo"], c["hi"]) for c in cells if c["lo"] is not None]
        if band:
            ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band],
                            color=colours[m], alpha=0.15, lw=0)
        failed = [c["rate"] for c in cells if c["failed"]]
        if failed:
            ax.plot(failed, [top] * len(failed), "x", color=colours[m], ms=9, mew=2)
        dropped = [c["rate"] for c in cells if c.get("dropped")]
        if dropped:
            ax.plot(dropped, [top] * len(dropped), "v", color=colours[m], ms=7, mfc="none")
    ax.set_xscale("log", base=2)
    ticks = sorted({c["rate"] for p in per["profiles"].values() for c in p["cells"]})
    if len(ticks) <= 12:
        ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel("learning rate")
    ax.set_ylabel(f"final {data['loss']}")
    ax.set_title(f"Learning-rate profile — {scale} (× failed on a seed"
                 + (", ▽ dropped by halving)" if data.get("halving") else ")"))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return _save(fig, out / f"lr_profile_{scale}.png")


def _table(scale: str, per: dict[str, Any], data: dict[str, Any], baseline: str) -> Block:
    sens = {v["method"]: v for v in per["sensitivity"]}
    tuned = {r["method"]: r for r in (per.get("tuned") or {}).get("comparisons", [])}
    best_point = (per.get("tuned") or {}).get("best_point", {})
    rows = []
    for m, prof in per["profiles"].items():
        marks = " ".join(MARKS.get(str(next((r["verdict"] for r in point if r["method"] == m),
                                            "")), "–") for point in per["by_point"])
        s = sens.get(m)
        vs = ("" if m == baseline or s is None else
              f"{s['verdict'].replace('_', ' ')}: Δ {_g(s['delta'])}{_ci(s['ci'])}")
        row = [f"`{m}`", _g(prof["best_rate"]) + _ci(prof["best_rate_ci"]),
               _g(prof["best_loss"], 4) + _ci(prof["best_loss_ci"], 4),
               _g(prof["sensitivity"]) + _ci(prof["sensitivity_ci"]), vs,
               _fmt(prof["basin_log2"], 2), _g(prof["max_stable_rate"]), marks,
               "yes" if per["rate_dependent"].get(m) else ""]
        if tuned:
            t = tuned.get(m)
            row.append(f"{best_point.get(m, '–')}: {t['verdict']}" if t else "–")
        rows.append(row)
    header = ["method", "best rate", "best loss", "sensitivity", "vs baseline",
              "basin (log2)", "largest stable rate", "verdict at " + " ".join(data["points"]),
              "rate-dependent"]
    if tuned:
        header.append("at its own best rate")
    return Block("table", header=header, rows=rows)


def _points_phrase(labels: list[str], all_labels: list[str], word: str) -> str:
    if len(labels) == len(all_labels) and labels:
        return f"{word} at every rate from {labels[0]} to {labels[-1]}"
    return f"{word} only at {', '.join(labels)}"


def _sentences(per: dict[str, Any], data: dict[str, Any], baseline: str) -> list[str]:
    """One sentence per method: where it improves or degrades, and its sensitivity."""
    points = data["points"]
    sens = {v["method"]: v for v in per["sensitivity"]}
    out = []
    for m in per["profiles"]:
        if m == baseline:
            continue
        verdicts = [next((str(r["verdict"]) for r in point if r["method"] == m), "")
                    for point in per["by_point"]]
        both = [points[i] for i, point in enumerate(per["by_point"])
                if not any(r["verdict"] in ("diverged", "stalled", "dropped") for r in point
                           if r["method"] in (m, baseline))]
        better = [points[i] for i, v in enumerate(verdicts) if v == "improver"]
        worse = [points[i] for i, v in enumerate(verdicts) if v == "degrader"]
        parts = []
        if better:
            parts.append(_points_phrase(better, both, "improves"))
        if worse:
            parts.append(_points_phrase(worse, both, "degrades"))
        if not parts:
            parts.append("no decided difference at any rate where both train"
                         + (f" ({', '.join(both)})" if both else " (none)"))
        s = sens.get(m)
        if s is not None:
            word = {"less_sensitive": "less sensitive than the baseline",
                    "more_sensitive": "more sensitive than the baseline"}.get(
                s["verdict"], "sensitivity not shown to differ from the baseline's")
            parts.append(f"{word}: Δ {_g(s['delta'])}{_ci(s['ci'])}")
        flag = " **Rate-dependent.**" if per["rate_dependent"].get(m) else ""
        out.append(f"`{m}` " + "; ".join(parts) + "." + flag)
    return out
