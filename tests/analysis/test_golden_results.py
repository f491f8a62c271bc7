"""Golden results: the verdicts of real studies, recomputed from their stored runs by the code
of the day, must be the files those studies wrote, byte for byte.

Each folder under ``tests/analysis/golden/`` is a finished study cut to what its verdicts are
computed from (``golden/keep.py`` says what is kept and how; ``golden/README.md`` how each
study was made). For each, without training anything, this test recomputes:

* ``report/results.json``: every scale's comparisons with the baseline and each method's
  verdicts over training, as ``modbench study report`` writes them. Its ``"rule"`` record,
  which says which rule produced them, is checked on its own (it is the study's rule, and its
  alpha is the one each interval was drawn at) and left out of the bytes compared: the
  goldens were written before there was one, and it is the file's last key;
* ``sequential.json`` (a study run with ``--until-decided``): every look replayed on the
  seeds it saw, given the looks before it;
* ``tuned/verdicts.json`` (a study with a ``tuning`` block): the tuned comparisons (its
  ``"rule"`` record checked on its own, as ``results.json``'s);
* ``claim.json``: the claim check.

No field is dropped for time or paths: none of these files records either.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from modbench.analysis.results import (
    ALPHA,
    RunRow,
    StudyResults,
    looks_json,
    metric_table,
    read_looks,
    rule_record,
    verdict_options,
)
from modbench.analysis.stats import Look, sequential_look

GOLDEN = Path(__file__).resolve().parent / "golden"
STUDIES = sorted(p.name for p in GOLDEN.iterdir() if (p / "index.sqlite").is_file())


def dump(data: Any) -> str:
    """JSON as the study writes its files (``indent=1``, ``default=str``, a final newline)."""
    return json.dumps(data, indent=1, default=str) + "\n"


def same(got: str, want: str, what: str) -> None:
    """``got == want``, else an AssertionError with the first lines of the difference."""
    if got != want:
        diff = difflib.unified_diff(want.splitlines(), got.splitlines(), "golden", "now",
                                    lineterm="", n=2)
        raise AssertionError(f"{what} differs from its golden:\n" + "\n".join(
            line for _, line in zip(range(60), diff, strict=False)))


def results_json(results: StudyResults) -> dict[str, Any]:
    """``report/results.json``'s content, as the report writes it."""
    from modbench.report.build import results_json as content
    from modbench.report.trajectory import trajectories, with_trajectories

    return content(results, with_trajectories(results.comparisons, trajectories(results)))


def check_rule(rule: dict[str, Any], data: dict[str, Any], looks: dict[str, list[Look]]
               ) -> None:
    """The rule record is the study's rule, and each interval of ``data`` (the comparisons)
    was drawn at its alpha (a sequential scale's: the alpha of its last look)."""
    assert rule == rule_record(looks)
    for scale, rows in data.items():
        alpha = rule.get("sequential", {}).get(scale, {}).get("alpha", rule["alpha"])
        levels = [r["ci_level"] for r in rows if math.isfinite(r["ci_level"])]
        assert all(math.isclose(level, 1.0 - alpha) for level in levels), (scale, levels)


def replay_looks(results: StudyResults, looks: dict[str, list[Look]]) -> dict[str, list[Look]]:
    """Each recorded look again, on the finished runs it saw (each group's first seeds, as
    many as the look records) and the looks before it, with the runner's arguments."""
    from modbench.study.results import load_spec_of

    spec = load_spec_of(results.folder)
    assert spec is not None
    out: dict[str, list[Look]] = {}
    for scale, history in looks.items():
        rows = [r for r in results.rows if r.scale == scale and r.state == "done"]
        again = out.setdefault(scale, [])
        for k, look in enumerate(history):
            seen: list[RunRow] = []
            for method, n in look.seeds.items():
                seen += sorted((r for r in rows if r.method == method), key=lambda r: r.seed)[:n]
            table = metric_table(seen, scale, results.metric, results.baseline)
            again.append(sequential_look(
                table, history[:k], look.cap, baseline=results.baseline, alpha=ALPHA,
                spending=look.spending, n_resamples=1,
                **verdict_options(seen, scale, results.metric, list(spec.seeds.anchors),
                                  table)))
    return out


def check_study(golden: Path, work: Path) -> list[str]:
    """Recompute the golden study ``golden`` (copied into ``work`` first: opening its index
    may write beside it) and compare each kept file; returns what was compared."""
    from modbench.study.results import load_results, load_rows, load_spec_of
    from modbench.study.stages.tuning import tuned_runs, tuned_verdicts

    folder = work / golden.name
    shutil.copytree(golden, folder)
    checked = []
    results = load_results(folder)
    data = results_json(results)
    assert list(data)[-1] == "rule"
    rule = data.pop("rule")
    looks = read_looks(folder)
    check_rule(rule, data, looks)
    same(dump(data), (golden / "report" / "results.json").read_text(encoding="utf-8"),
         f"{golden.name}/report/results.json")
    verdicts = sorted({str(r["verdict"]) for rs in data.values() for r in rs})
    checked.append(f"results.json: {sum(len(rs) for rs in data.values())} comparisons at "
                   f"{len(data)} scales ({', '.join(verdicts)})")
    if looks:
        same(looks_json(replay_looks(results, looks)),
             (golden / "sequential.json").read_text(encoding="utf-8"),
             f"{golden.name}/sequential.json")
        checked.append(f"sequential.json: {sum(map(len, looks.values()))} looks replayed")
    if (golden / "tuned" / "verdicts.json").is_file():
        spec = load_spec_of(folder)
        assert spec is not None
        best = json.loads((folder / "tuning" / "best.json").read_text(encoding="utf-8"))
        tuned = tuned_verdicts(spec, load_rows(folder / "tuned"), tuned_runs(spec, best))
        assert list(tuned)[-1] == "rule"  # as results.json's, newer than the golden file
        check_rule(tuned.pop("rule"), tuned["comparisons"], {})
        same(dump(tuned), (golden / "tuned" / "verdicts.json").read_text(encoding="utf-8"),
             f"{golden.name}/tuned/verdicts.json")
        checked.append("tuned/verdicts.json")
    if (golden / "claim.json").is_file():
        assert results.claim is not None
        same(dump(dataclasses.asdict(results.claim)),
             (golden / "claim.json").read_text(encoding="utf-8"), f"{golden.name}/claim.json")
        checked.append(f"claim.json: {results.claim.summary}")
    return checked


def test_the_goldens_are_real_studies() -> None:
    """The kept studies (README.md beside them says how each was made)."""
    assert {"builtin-cpu", "smoke-tiny", "ladder-smoke", "tiny-seq", "tiny-tuned"} <= set(STUDIES)


@pytest.mark.parametrize("name", STUDIES)
def test_verdicts_of_a_recorded_study_are_unchanged(name: str, tmp_path: Path) -> None:
    assert check_study(GOLDEN / name, tmp_path)
