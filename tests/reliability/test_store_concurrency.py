"""Many worker processes on one results store: 4 and 16 processes claiming and finishing
runs concurrently lose nothing and duplicate nothing; a worker that dies holding a claim has
its run finished by another; and two real `study run` processes on one study folder train
every run exactly once.

The 4- and 16-worker tests exercise the store itself (claims, finishes, releases: what the
runner's workers do around training), so they stay light enough for CI.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.reliability.checks import run_child, strip_metrics
from tests.reliability.conftest import long_points, long_variant
from tests.reliability.harness import run_study_child, study_child
from tests.reliability.test_study_kills import SPEC

import modbench.study.store as store_mod
from modbench.study.store import Store, worker_gone

WORKER = Path(__file__).with_name("store_worker.py")


def shared_store(tmp: Path, workers: int, keys: int, dying: int, seed: int) -> dict[str, Any]:
    """``workers`` processes on one store with ``keys`` runs, ``dying`` of them killing
    themselves holding a claim; returns the figures and raises on any loss or duplicate."""
    root = tmp / "store"
    store = Store(root)
    names = [f"run{i:04d}" for i in range(keys)]
    for i, k in enumerate(names):
        store.register(k, "tiny", "baseline", i)
    (tmp / "keys.json").write_text(json.dumps(names))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = []
    t0 = time.perf_counter()
    for w in range(workers):
        extra = ["--die-holding", "1"] if w < dying else []
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(root), str(tmp / "keys.json"),
             str(tmp / f"w{w}.json"), str(seed * 100 + w), *extra], env=env))
    deadline = time.monotonic() + 120
    while not all((tmp / f"w{w}.ready").exists() for w in range(workers)):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.005)
    (tmp / "go-die").touch()  # the dying ones first: each dies holding its first claim
    assert all(p.wait(60) == -9 for p in procs[:dying])
    (tmp / "go").touch()
    codes = [p.wait(300) for p in procs]
    seconds = time.perf_counter() - t0
    dead = {p.pid for p, c in zip(procs, codes, strict=True) if c == -9}
    assert len(dead) == dying and all(c == 0 for c in codes if c != -9), codes
    # the index: every run exactly once, done, its summary the one on disk
    db = sqlite3.connect(root / "index.sqlite")
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    rows = store.rows()
    assert sorted(r["key"] for r in rows) == names
    assert all(r["state"] == "done" for r in rows)
    for r in rows:
        assert r["summary"] == json.loads((root / "runs" / r["key"] / "summary.json")
                                          .read_text())
    # each run finished by one worker, which claimed it; any other claimer died holding it
    finished = {r["key"]: r["summary"]["worker"] for r in rows}
    for w, p in enumerate(procs):
        if p.pid not in dead:
            mine = json.loads((tmp / f"w{w}.json").read_text())
            assert sorted(mine) == sorted(k for k, pid in finished.items() if pid == p.pid)
    taken_over = 0
    for k in names:
        claimers = {int(p.name.split("-")[-1]) for p in (root / "runs" / k).glob("claimed-by-*")}
        assert finished[k] in claimers and claimers - {finished[k]} <= dead, (k, claimers)
        taken_over += len(claimers) - 1
    assert taken_over == dying
    return {"workers": workers, "runs": keys, "dying_holding_a_claim": dying,
            "taken_over": taken_over, "lost": 0, "duplicated": 0,
            "seconds": round(seconds, 1)}


@pytest.mark.parametrize("workers,keys", [(4, 200), (16, 320)])
def test_concurrent_workers_lose_and_duplicate_nothing(workers: int, keys: int, tmp_path: Path,
                                                       record: Any) -> None:
    record(shared_store(tmp_path, workers, keys, dying=0, seed=workers))


@pytest.mark.parametrize("workers,keys,dying", [(4, 60, 1), (16, 160, 3)])
def test_a_worker_dying_holding_a_claim_is_taken_over(workers: int, keys: int, dying: int,
                                                      tmp_path: Path, record: Any) -> None:
    record(shared_store(tmp_path, workers, keys, dying=dying, seed=workers + 1))


@long_variant
@pytest.mark.parametrize("workers", [4, 16])
def test_shared_store_long(workers: int, tmp_path: Path, record: Any) -> None:
    rounds = max(1, long_points() // 50)
    figures = [shared_store(tmp_path / f"r{i}", workers, 40 * workers, dying=1 + i % 3,
                            seed=1000 + i) for i in range(rounds)]
    record({"rounds": rounds, "workers": workers,
            "runs": sum(f["runs"] for f in figures),
            "dying_holding_a_claim": sum(f["dying_holding_a_claim"] for f in figures),
            "taken_over": sum(f["taken_over"] for f in figures), "lost": 0, "duplicated": 0})


def test_release_dead_never_releases_a_claim_taken_since(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes release the same dead claim at once: the one that looks later must not
    reset the claim a third process made in between (before the fix it did, and a fourth
    could then train the run beside the third)."""
    store = Store(tmp_path)
    store.register("k", "tiny", "baseline", 0)
    host = socket.gethostname()
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("UPDATE runs SET state='running', worker=? WHERE key='k'", (f"{host}:999999999",))
    db.commit()
    real = store_mod.worker_gone

    def racing(worker: str | None, h: str | None = None) -> bool:
        # meanwhile, another process releases the dead claim and a live worker claims it
        db.execute("UPDATE runs SET state='running', worker=? WHERE key='k'",
                   (f"{host}:{os.getpid()}",))
        db.commit()
        return real(worker, h)

    monkeypatch.setattr(store_mod, "worker_gone", racing)
    assert store.release_dead() == 0
    row = store.rows()[0]
    assert (row["state"], row["worker"]) == ("running", f"{host}:{os.getpid()}")
    db.close()


def test_a_zombie_worker_counts_as_gone() -> None:
    """A killed worker not yet reaped (a zombie, as orphans are under a container init that
    reaps late) answers signal 0; its claims must still be released."""
    p = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{p.pid}/stat").read_text().split(") ")[1][0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert worker_gone(f"{socket.gethostname()}:{p.pid}")
    p.wait()
    assert worker_gone(f"{socket.gethostname()}:{p.pid}")
    assert not worker_gone(f"{socket.gethostname()}:{os.getpid()}")
    assert not worker_gone(f"elsewhere:{p.pid}")  # other hosts are never judged from here


def test_a_stale_claim_is_taken_over(tmp_path: Path) -> None:
    """A claim of a worker on another host (which release_dead cannot judge) is taken over
    once it is older than the staleness limit."""
    store = Store(tmp_path)
    store.register("k", "tiny", "baseline", 0)
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("UPDATE runs SET state='running', worker='elsewhere:1', claimed_at=? "
               "WHERE key='k'", (time.time() - 3600,))
    db.commit()
    db.close()
    assert store.release_dead() == 0
    assert not store.claim("k")  # an hour old: still held
    assert store.claim("k", stale_after_s=1800)  # stale: taken over
    assert store.rows()[0]["worker"] == f"{socket.gethostname()}:{os.getpid()}"


def test_two_study_processes_on_one_folder_train_each_run_once(forkserver: Any,
                                                               tmp_path: Path,
                                                               record: Any) -> None:
    """Two `run_study` processes started together on one study folder: the runs are split
    between them (each claims what it trains), none is trained twice, and every run equals
    the one a single process trains."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    assert run_child(forkserver, study_child, (str(spec), str(tmp_path / "ref"), None,
                                               None)) == 0
    a = forkserver.Process(target=run_study_child,
                           args=(str(spec), str(tmp_path / "s"), str(tmp_path / "a.json")))
    b = forkserver.Process(target=run_study_child,
                           args=(str(spec), str(tmp_path / "s"), str(tmp_path / "b.json")))
    a.start()
    b.start()
    a.join(300)
    b.join(300)
    assert a.exitcode == b.exitcode == 0
    ca, cb = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ab")
    assert ca["trained"] + cb["trained"] == 5 and not ca["failures"] and not cb["failures"]
    rows = Store(tmp_path / "s").rows()
    assert len(rows) == 5 and all(r["state"] == "done" for r in rows)
    for r in rows:
        run, ref = tmp_path / "s" / "runs" / r["key"], tmp_path / "ref" / "runs" / r["key"]
        assert strip_metrics(run) == strip_metrics(ref)
    record({"processes": 2, "runs": 5, "trained": [ca["trained"], cb["trained"]],
            "busy": [ca["busy"], cb["busy"]], "duplicated": 0})


def test_a_job_whose_worker_keeps_dying_is_lost_without_touching_live_claims(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local executor's last requeue (runner._requeue at WORKER_DEATHS): the runs the
    dead worker held are released and recorded as failed, a run it finished is reported
    trained, and a run another live worker claimed meanwhile is left to it (busy)."""
    import collections

    from modbench.study import runner

    store = Store(tmp_path)
    for key in ("held", "done", "taken"):
        store.register(key, "tiny", "m", 0)
    dead = f"{socket.gethostname()}:999999999"  # no such process
    monkeypatch.setattr(store_mod, "worker_id", lambda: dead)
    assert store.claim("held") and store.claim("done") and store.claim("taken")
    store.finish("done", {"status": "completed"}, None)
    me = f"{socket.gethostname()}:{os.getpid()}"
    monkeypatch.setattr(store_mod, "worker_id", lambda: me)
    store.release_dead()
    assert store.claim("taken")  # a live worker (this process) holds it now
    job = runner.Job(root=str(tmp_path), keys=("held", "done", "taken"),
                     labels=("h", "d", "t"), configs=({}, {}, {}), evaluation={})
    queue: collections.deque[runner.Job] = collections.deque()
    deaths = {job.keys: runner.WORKER_DEATHS - 1}  # its earlier deaths
    results = [r for batch in runner._requeue(job, deaths, queue) for r in batch]
    assert not queue
    assert {(r.key, r.outcome) for r in results} == {("done", "trained"), ("held", "failed"),
                                                      ("taken", "busy")}
    states = {r["key"]: r["state"] for r in store.rows()}
    assert states == {"held": "failed", "done": "done", "taken": "running"}
    assert "died 3 times" in next(r.error for r in results if r.key == "held")
