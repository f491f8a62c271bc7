"""The report's "Frozen versus tuned" section, for a study whose spec has a ``tuning`` block
(:mod:`modbench.study.stages.tuning`; docs/studies.md, "Tuned versus frozen"; docs/statistics.md):
per scale and method, the tuning runs' score at each grid value, the best value, the frozen
verdict (the study's own, at the spec's value) beside the tuned verdict (every method and the
baseline at their own best values, on the same verdict seeds), with Δ and interval, and one
sentence per method.

The study stages write what this reads (``tuning/best.json``, ``tuned/verdicts.json``), so this
module never opens another study's index; the file names live here, below the study layer that
writes them.
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

TUNING_DIR = "tuning"  # stage 1's study folder, inside the frozen study's
TUNED_DIR = "tuned"  # stage 2's
BEST_FILE = "best.json"  # in TUNING_DIR: each (scale, method)'s grid scores and best value
VERDICTS_FILE = "verdicts.json"  # in TUNED_DIR: the tuned comparisons and the seeds read


def read_tuning(folder: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """A tuned study's ``best.json`` and ``verdicts.json`` (None while stage 2 has not
    finished); None for a study without a tuning stage."""
    root = Path(folder)
    best_path = root / TUNING_DIR / BEST_FILE
    if not best_path.is_file():
        return None
    verdicts_path = root / TUNED_DIR / VERDICTS_FILE
    try:
        best = json.loads(best_path.read_text(encoding="utf-8"))
        verdicts = (json.loads(verdicts_path.read_text(encoding="utf-8"))
                    if verdicts_path.is_file() else None)
    except (OSError, ValueError) as e:
        raise ModbenchError(f"cannot read the tuning results of {root} ({e}); run `modbench "
                            "study run` on it again to rewrite them") from None
    return best, verdicts


def _value(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _delta(r: dict[str, Any] | None) -> str:
    if r is None or r.get("is_baseline"):
        return ""
    lo, hi = r.get("ci") or (math.nan, math.nan)
    cell = _fmt(r.get("delta"))
    if isinstance(lo, float) and math.isfinite(lo) and isinstance(hi, float) and math.isfinite(hi):
        cell += f" [{_fmt(lo)}, {_fmt(hi)}]"
    return cell


def _verdict(r: dict[str, Any] | None) -> str:
    if r is None:
        return "not run"
    return str(r["verdict"])


_PHRASES = {"improver": "improves on the baseline", "degrader": "is worse than the baseline",
            "within_noise": "is within noise of the baseline", "diverged": "diverges",
            "stalled": "stalls", "undetermined": "is undetermined (no noise floor)",
            "baseline": "is the baseline", "not run": "has no verdict (not run)"}


def _phrase(r: dict[str, Any] | None, where: str) -> str:
    """``stalls at recipe.lr=0.003`` or ``is within noise of the baseline at recipe.lr=0.001
    (Δ -0.01 [-0.03, 0.01])``: the verdict, where, Δ with its interval when it has a finite
    one, and the verdict's note (why it is what it is) when it has one."""
    v = _verdict(r)
    delta = (r or {}).get("delta")
    shown = isinstance(delta, float) and math.isfinite(delta) and v not in ("diverged",
                                                                             "stalled")
    note = str((r or {}).get("note") or "")
    return (f"{_PHRASES.get(v, f'is {v}')}{' ' + where if where else ''}"
            + (f" (Δ {_delta(r)})" if shown else "") + (f" ({note})" if note else ""))


def _tried(entry: dict[str, Any]) -> str:
    parts = []
    for e in entry["tried"]:
        score = _fmt(e["mean"]) if e["mean"] is not None else "–"
        fails = f", {e['failed']} failed" if e["failed"] else ""
        mark = "**" if e["value"] == entry["best"] else ""
        parts.append(f"{mark}{_value(e['value'])}: {score}{fails}{mark}")
    return "; ".join(parts)


def tuning_section(results: StudyResults, out: Path) -> list[Block]:
    """The section's blocks (none for a study without a tuning stage); ``out`` unused (the
    section has no files of its own) but kept for the sections' common call."""
    del out
    found = read_tuning(results.folder)
    if found is None:
        return []
    best, verdicts = found
    key, base = best["key"], results.baseline
    blocks = [Block("h2", "Frozen versus tuned"), Block("p", (
        f"Each method and the baseline were also trained at every value of `{key}` in "
        f"{', '.join(_value(v) for v in best['grid'])} on tuning seed(s) "
        f"{', '.join(str(s) for s in best['seeds'])}, which no verdict uses (the tuning runs "
        f"are in `{TUNING_DIR}/`). Each took the value with the fewest failed tuning runs, "
        f"then the best mean `{best['metric']}` (ties: the frozen value). The tuned verdict "
        f"trains every method at its own best value on the study's verdict seeds (in "
        f"`{TUNED_DIR}/`) and judges it against the baseline at the baseline's best value, "
        "by the same rule as the frozen verdict (the study's own, every method at the "
        "spec's value). A verdict that changes between the two columns comes from the "
        f"recipe's `{key}`, not from the method alone."))]
    chosen = {scale: {m: e["best"] for m, e in per.items()} for scale, per in
              best["scales"].items()}
    if verdicts is not None and verdicts.get("values") != chosen:
        verdicts = None  # of an earlier choice: stage 2 has not finished for this one
    tuned = (verdicts or {}).get("comparisons", {})
    if verdicts is None:
        blocks.append(Block("p", "The tuned stage has not finished: run `modbench study run` "
                                 "on this study again for the tuned verdicts."))
    for scale, per_method in best["scales"].items():
        frozen_rows = {r.method: r.to_dict() for r in results.comparisons.get(scale, [])}
        tuned_rows = {r["method"]: r for r in tuned.get(scale, [])}
        body, sentences = [], []
        b_best = per_method.get(base, {}).get("best")
        for method, entry in per_method.items():
            fr, tr = frozen_rows.get(method), tuned_rows.get(method)
            body.append([f"`{method}`", _value(entry["frozen"]), _tried(entry),
                         _value(entry["best"]), _verdict(fr), _delta(fr), _verdict(tr),
                         _delta(tr)])
            if method == base:
                continue
            same = entry["best"] == entry["frozen"]
            own = f"{_value(entry['best'])}{', the frozen value' if same else ''}"
            at_frozen = f"at {key}={_value(entry['frozen'])}"
            sentences.append(f"`{method}` {_phrase(fr, at_frozen)}; at its own best {key} "
                             f"({own}), and the baseline at its own ({_value(b_best)}), it "
                             f"{_phrase(tr, '')}.")
        blocks.append(Block("p", f"{scale}: tuning scores (mean `{best['metric']}` over the "
                                 "tuning seeds; the best in bold) and both verdicts."))
        blocks.append(Block("table", header=[
            "method", f"frozen {key}", "tuning runs", f"best {key}", "frozen verdict",
            "frozen Δ [CI]", "tuned verdict", "tuned Δ [CI]"], rows=body))
        if sentences:
            blocks.append(Block("ul", items=sentences))
    return blocks
