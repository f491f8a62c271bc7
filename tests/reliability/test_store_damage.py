"""The study index as a cache of the run folders (modbench.study.store): a zero-length,
truncated or garbled ``index.sqlite``, or one of another schema, is moved aside and rebuilt
from the run folders with a one-line notice, an index whose rows were deleted gets them back
from the folders, and the report made from the repaired index equals the one before;
``study report`` never replaces a report with one that has fewer finished runs."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.helpers import cli

SPEC = {"name": "damage", "methods": ["qknorm"], "scales": ["tiny"],
        "seeds": {"default": [0], "noise_floor": [0]},
        "overrides": ["train.steps=2", "train.eval_every=0", "train.threads=1"],
        "evaluation": {"probes": False}}


def _modbench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "modbench", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pristine copy of the study, which ran (and wrote its report) at ``study.parent /
    "s"``: the damage tests restore that folder from this copy, so the report they compare
    with names the folder they damage, with no ``study report`` process to write it again."""
    tmp = tmp_path_factory.mktemp("store")
    spec = tmp / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    r = _modbench("study", "run", str(spec), "--out", str(tmp / "s"), "--workers", "1",
                  "--no-progress")
    assert r.returncode == 0, r.stderr
    shutil.copytree(tmp / "s", tmp / "pristine")
    return tmp / "pristine"


#: well-formed SQLite whose schema is not the store's (issue 47: sqlite3.OperationalError
#: tracebacks from `study status` and `study report`), each as statements run on the index
SCHEMAS = {
    "missing-columns": ["DROP TABLE runs", "CREATE TABLE runs (key TEXT PRIMARY KEY, x INT)"],
    "key-not-unique": ["ALTER TABLE runs RENAME TO old",
                       "CREATE TABLE runs AS SELECT * FROM old", "DROP TABLE old"],
    "wrong-type": ["ALTER TABLE runs RENAME TO old",
                   "CREATE TABLE runs (key TEXT PRIMARY KEY, scale TEXT NOT NULL, method TEXT "
                   "NOT NULL, seed BLOB, state TEXT NOT NULL DEFAULT 'pending', status TEXT, "
                   "worker TEXT, claimed_at REAL, finished_at REAL, summary TEXT, eval TEXT, "
                   "error TEXT, lease TEXT)", "INSERT INTO runs SELECT * FROM old",
                   "DROP TABLE old"],
    "a-view": ["ALTER TABLE runs RENAME TO old", "CREATE VIEW runs AS SELECT * FROM old"],
    "a-trigger": ["CREATE TRIGGER no BEFORE UPDATE ON runs BEGIN SELECT RAISE(ABORT, 'no'); "
                  "END"],
    "no-table": ["DROP TABLE runs", "CREATE TABLE other (x INT)"],
}


def _damage(index: Path, how: str) -> None:
    if how in SCHEMAS or how == "rows-deleted":
        with sqlite3.connect(index) as db:
            for statement in SCHEMAS.get(how, ["DELETE FROM runs"]):
                db.execute(statement)
        return
    for side in ("-wal", "-shm"):
        index.with_name(index.name + side).unlink(missing_ok=True)
    data = index.read_bytes()
    if how == "zero":
        index.write_bytes(b"")
    elif how == "half":
        index.write_bytes(data[: len(data) // 2])
    elif how == "garbled":
        index.write_bytes(bytes((b * 7 + 13) % 256 for b in data))


@pytest.mark.parametrize("how", ["zero", "half", "garbled", *SCHEMAS, "rows-deleted"])
def test_damaged_index_rebuilt_and_report_unchanged(study: Path, how: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    s = study.parent / "s"  # where the study ran and wrote its report
    shutil.rmtree(s, ignore_errors=True)  # what an earlier damage mode left
    shutil.copytree(study, s)
    before = {n: (s / "report" / n).read_text() for n in ("report.md", "results.csv")}
    with sqlite3.connect(s / "index.sqlite") as db:  # fold the WAL into the file first
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    _damage(s / "index.sqlite", how)
    # status and report in process (tests.helpers.cli); the study ran in a child (the fixture)
    code, out, err = cli(capsys, "study", "status", str(s))
    assert code == 0, err
    words = "added them back" if how == "rows-deleted" else "rebuilt from 2 run folder(s)"
    assert len(err.strip().splitlines()) == 1 and words in err, err
    if how in SCHEMAS:
        assert "of the wrong schema" in err
    assert "2 runs — 2 completed" in out, out
    # kept aside, not deleted (an index that lost rows keeps the rows it has: not moved)
    assert bool(list(s.glob("index.sqlite.damaged-*"))) == (how != "rows-deleted")
    code, out, err = cli(capsys, "study", "report", str(s))
    assert code == 0, err
    assert err.strip() == ""  # repaired once
    after = {n: (s / "report" / n).read_text() for n in ("report.md", "results.csv")}
    assert after == before


def test_report_with_fewer_finished_runs_is_refused(study: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    s = tmp_path / "s"
    shutil.copytree(study, s)
    before = (s / "report" / "report.md").read_text()
    with sqlite3.connect(s / "index.sqlite") as db:  # as a kill after summary.json leaves it
        db.execute("UPDATE runs SET state='running', status=NULL, summary=NULL")
    code, _, err = cli(capsys, "study", "report", str(s))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "report was kept" in err
    assert (s / "report" / "report.md").read_text() == before
