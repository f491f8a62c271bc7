"""The report's "Replication" section (:mod:`modbench.study.stages.replication`; docs/studies.md,
"Replication"): per changed factor, each decided verdict beside its replication (verdict, Δ
and interval), whether the sign agrees and the verdict replicates, the agreement rate, and
whether the study's claim reads the same.

The stage writes what this reads (``replicate/<change>/replication.json``); the names live
here, below the study layer that writes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modbench.analysis.results import StudyResults
from modbench.errors import ModbenchError
from modbench.report.blocks import Block

REPLICATE_DIR = "replicate"  # STUDY/replicate/<change>/: one study folder per change
REPLICATION_FILE = "replication.json"


def read_replications(folder: str | Path) -> list[dict[str, Any]]:
    """Every finished replication of a study (none: an empty list), by change name."""
    root = Path(folder) / REPLICATE_DIR
    out = []
    for path in sorted(root.glob(f"*/{REPLICATION_FILE}")) if root.is_dir() else []:
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            raise ModbenchError(f"cannot read {path} ({e}); run `modbench study replicate` "
                                "again to rewrite it") from None
    return out


def _delta(r: dict[str, Any] | None) -> str:
    if r is None:
        return "–"
    ci = r.get("ci") or [None, None]
    lo, hi = ci[0], ci[1]
    text = f"{r['delta']:+.4g}" if isinstance(r.get("delta"), float) else "–"
    if isinstance(lo, float) and isinstance(hi, float) and lo == lo and hi == hi:
        text += f" [{lo:+.3g}, {hi:+.3g}]"
    return text


def replication_section(results: StudyResults, out: Path) -> list[Block]:
    """The section's blocks (none before a replication); ``out`` unused (no files of its
    own), kept for the sections' common call."""
    del out
    found = read_replications(results.folder)
    if not found:
        return []
    blocks = [Block("h2", "Replication"), Block("p", (
        "Every method with a decided verdict (improver, degrader, diverged, stalled) and the "
        "baseline were trained again with one factor changed (`modbench study replicate "
        f"--change`; the runs are in `{REPLICATE_DIR}/<change>/`) and judged by the same rule. "
        "A verdict **replicates** when the replication gives the same verdict; the sign "
        "agrees when Δ has the same sign (a failure: when the replication fails too). "
        "Thread count and oneDNN change only the order of floating-point sums: a verdict that "
        "does not replicate under them depends on the machine, not on the method."))]
    for data in found:
        rows = []
        for scale, pairs in data["scales"].items():
            for p in pairs:
                o, r = p["original"], p["replication"]
                rows.append([scale, f"`{p['method']}`", str(o["verdict"]), _delta(o),
                             str(r["verdict"]) if r else "missing", _delta(r),
                             "yes" if p["sign_agrees"] else "no",
                             "yes" if p["replicates"] else "**no**"])
        rate = data.get("agreement")
        blocks.append(Block("p", (
            f"**{data['change']}**, {data['what']}: {data['replicated']} of "
            f"{data['verdicts']} decided verdicts replicate"
            + (f" ({rate:.0%})" if isinstance(rate, float) else "") + ".")))
        if rows:
            blocks.append(Block("table", header=[
                "scale", "method", "verdict", "Δ [CI]", "replicated verdict", "Δ [CI]",
                "sign agrees", "replicates"], rows=rows))
        claim = data.get("claim")
        if claim:
            blocks.append(Block("p", (
                f"The claim check reads **{claim['replication']}** on the replication, "
                f"**{claim['original']}** on the study: "
                + ("the same outcome for every method." if claim["same"] else
                   "a different outcome for "
                   + ", ".join(f"`{m}` ({a} → {b})" for (m, a), (_, b) in
                               zip(claim["original_rows"], claim["replication_rows"],
                                   strict=False) if a != b) + "."))))
    return blocks
