"""Keep a finished study as a golden for tests/analysis/test_golden_results.py.

    python tests/analysis/golden/keep.py STUDY_FOLDER NAME

copies into ``tests/analysis/golden/NAME/`` what the verdicts are computed from, and nothing
the analysis does not read: ``spec.yaml``; ``index.sqlite`` (compacted with ``VACUUM INTO``:
the same rows); each run's ``metrics.jsonl`` cut to its validation records (the report's
verdicts over training read the validation loss, nothing else of it); ``sequential.json``
(the looks of ``--until-decided``); for a study with a ``tuning`` block, ``tuning/best.json``
and the ``tuned/`` stage the same way. The files that hold verdicts are kept as the study wrote
them: ``report/results.json`` and ``tuned/verdicts.json``. ``claim.json`` is the claim check
(``StudyResults.claim``) by the code that keeps the study. Checkpoints, logs and the rest of
the report stay behind. It then checks that the kept folder gives the kept files again.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _copy_stage(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("spec.yaml", "sequential.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    db = sqlite3.connect(src / "index.sqlite")
    db.execute("VACUUM INTO ?", (str(dst / "index.sqlite"),))
    db.close()
    for run in sorted((src / "runs").iterdir()):
        metrics = run / "metrics.jsonl"
        if not metrics.is_file():
            continue
        lines = [ln for ln in metrics.read_text(encoding="utf-8").splitlines(keepends=True)
                 if json.loads(ln).get("kind") == "val"]
        (dst / "runs" / run.name).mkdir(parents=True)
        (dst / "runs" / run.name / "metrics.jsonl").write_text("".join(lines), encoding="utf-8")


def keep(src: Path, name: str) -> Path:
    dst = HERE / name
    if dst.exists():
        raise SystemExit(f"{dst} exists; remove it first")
    _copy_stage(src, dst)
    (dst / "report").mkdir()
    shutil.copy2(src / "report" / "results.json", dst / "report" / "results.json")
    if (src / "tuning" / "best.json").is_file():
        (dst / "tuning").mkdir()
        shutil.copy2(src / "tuning" / "best.json", dst / "tuning" / "best.json")
        _copy_stage(src / "tuned", dst / "tuned")
        shutil.copy2(src / "tuned" / "verdicts.json", dst / "tuned" / "verdicts.json")
    from modbench.study.results import load_results

    with tempfile.TemporaryDirectory() as work:  # opening the index writes beside it
        claim = load_results(shutil.copytree(dst, Path(work) / name)).claim
    if claim is not None:
        (dst / "claim.json").write_text(json.dumps(dataclasses.asdict(claim), indent=1)
                                        + "\n", encoding="utf-8")
    return dst


if __name__ == "__main__":
    kept = keep(Path(sys.argv[1]), sys.argv[2])
    sys.path.insert(0, str(HERE.parents[2]))
    from tests.analysis.test_golden_results import check_study

    with tempfile.TemporaryDirectory() as work:
        checked = check_study(kept, Path(work))
    for line in checked:
        print(line)
    size = sum(p.stat().st_size for p in kept.rglob("*") if p.is_file())
    print(f"kept {kept} ({size / 1024:.0f} KiB)")
