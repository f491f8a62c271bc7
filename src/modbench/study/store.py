"""The results store of a study folder.

::

    DIR/spec.yaml           the spec as run (rewritten on every `study run`)
    DIR/runs/<key>/         one run folder per run (config.yaml, metrics.jsonl, summary.json,
                            eval.json, checkpoints/) — immutable once finished
    DIR/index.sqlite        one row per run: key, scale, method, seed, state, status, results

The index is SQLite in WAL mode with a busy timeout, so several worker processes (or
machines sharing the folder on a file system with working locks) can claim and finish runs
concurrently: a run is claimed with a conditional UPDATE, so two workers never train the same
run. The run folders are the source of truth and the index a cache of them: an index that is
empty (zero bytes), truncated, garbled or of another schema (:func:`index_damage`) is moved
aside (``index.sqlite.damaged-<time>``) and rebuilt from the run folders
(:func:`rebuild_rows`), with a one-line notice on stderr; rows it lacks for run folders that
are there (deleted rows) are added back from those folders, with a notice. The
check and the rebuild run under an flock on ``DIR/.index.lock``, so processes opening the
store at once neither rebuild twice nor mistake a new index for a damaged one.

A claim may carry a *lease*: a token a cluster executor gives one job, the same for every
attempt of it (a Ray task retried after its worker died, a SLURM array task requeued after a
preemption or a timeout). A later attempt takes over the claims held under its own lease, so a
claim left by a dead attempt, on this host or another, never blocks the retry.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sqlite3
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from modbench.errors import ModbenchError

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    key TEXT PRIMARY KEY,
    scale TEXT NOT NULL,
    method TEXT NOT NULL,
    seed INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',   -- pending | running | done | failed
    status TEXT,                    -- completed | diverged | stalled | dropped (summary.json)
    worker TEXT,
    claimed_at REAL,
    finished_at REAL,
    summary TEXT,                            -- summary.json
    eval TEXT,                               -- eval.json
    error TEXT,
    lease TEXT                               -- the claiming job's lease (cluster executors)
);
"""


INDEX = "index.sqlite"


class StoreWriteError(ModbenchError):
    """The study's index could not be written (a full disk, an I/O error, a read-only file
    system): the study stops with this one line. Nothing finished is lost: the run folders
    hold every finished run, and the index, which SQLite left as it was, is a cache of them."""

    def __init__(self, root: Path, problem: str) -> None:
        super().__init__(f"cannot write the study index {root / INDEX}: {problem}; the index "
                         f"is kept as it was and every finished run is kept in {root / 'runs'}; "
                         "free some space and run `modbench study run` again to go on")


#: SQLite's primary result codes of a write the storage refused, in words
_SQLITE_WRITE_FAILURES = {
    "SQLITE_FULL": "the disk is full (SQLite: database or disk is full)",
    "SQLITE_IOERR": "disk I/O error (a full disk, or failing storage)",
    "SQLITE_READONLY": "the index is read-only",
    "SQLITE_CANTOPEN": "the index cannot be opened for writing",
}


def _write_problem(error: sqlite3.OperationalError) -> str | None:
    """What an ``OperationalError`` says about the storage, in words; None for any other
    (a busy timeout, a bad statement)."""
    name = getattr(error, "sqlite_errorname", "") or ""
    for code, words in _SQLITE_WRITE_FAILURES.items():
        if name == code or name.startswith(code + "_"):
            return words
    text = str(error)
    if "disk is full" in text or "disk I/O error" in text:  # Python built without the codes
        return f"{text} (a full disk, or failing storage)"
    return None


class Store:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "runs").mkdir(exist_ok=True)
        except OSError as e:
            raise StoreWriteError(self.root, e.strerror or str(e)) from None
        with _index_lock(self.root):
            damage = index_damage(self.root / INDEX)
            if damage is not None:
                aside = _move_aside(self.root / INDEX)
            with self._db() as db:
                db.executescript(SCHEMA)
                _add_lease_column(db)
            if damage is not None:
                n = self._rebuild()
                print(f"modbench: {self.root / INDEX} was {damage}; moved to {aside.name} and "
                      f"rebuilt from {n} run folder(s)", file=sys.stderr)
            else:
                self._restore_missing_rows()

    def _restore_missing_rows(self) -> None:
        """Rows the index lacks for run folders that are there (an index whose rows were
        deleted, or one copied from elsewhere) are added back from the folders, with a one-line
        notice; the rows it has are kept. A run's row is written before its folder (the runner
        registers every run before a worker claims it), so the folders are listed first: a
        folder seen has its row by the time the keys are read."""
        runs = self.root / "runs"
        folders = {f.name for f in runs.iterdir() if f.is_dir() and not f.is_symlink()}
        if not folders:
            return
        with self._db() as db:
            keys = {r[0] for r in db.execute("SELECT key FROM runs")}
        missing = folders - keys
        if not missing:
            return
        n = self._rebuild(missing, replace=False)
        if n:
            print(f"modbench: {self.root / INDEX} had no row for {n} of the run folders in "
                  f"{runs}; added them back from those folders", file=sys.stderr)

    def _rebuild(self, keys: set[str] | None = None, replace: bool = True) -> int:
        """Write the rows of the run folders (only those named ``keys``), replacing rows
        there (else keeping them); how many rows the folders gave."""
        rows = rebuild_rows(self.root, keys)
        verb = "REPLACE" if replace else "IGNORE"
        with self._db() as db:
            for r in rows:
                db.execute(f"INSERT OR {verb} INTO runs (key, scale, method, seed, state, status, "
                           "finished_at, summary, eval) VALUES (?,?,?,?,?,?,?,?,?)",
                           (r["key"], r["scale"], r["method"], r["seed"], r["state"],
                            r["status"], r["finished_at"], r["summary"], r["eval"]))
        return len(rows)

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """A connection to the index; a write the storage refuses (SQLite's "database or disk
        is full", "disk I/O error", read-only) is a :class:`StoreWriteError` of one line (the
        statement rolled back: the index stays as it was)."""
        try:
            db = sqlite3.connect(self.root / "index.sqlite", timeout=60, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA busy_timeout=60000")
                db.row_factory = sqlite3.Row
                yield db
            finally:
                db.close()
        except sqlite3.OperationalError as e:
            problem = _write_problem(e)
            if problem is None:
                raise
            raise StoreWriteError(self.root, problem) from None

    def run_dir(self, key: str) -> Path:
        return self.root / "runs" / key

    def register(self, key: str, scale: str, method: str, seed: int) -> None:
        with self._db() as db:
            db.execute("INSERT OR IGNORE INTO runs (key, scale, method, seed) VALUES (?,?,?,?)",
                       (key, scale, method, seed))

    def claim(self, key: str, stale_after_s: float = 24 * 3600,
              lease: str | None = None) -> bool:
        """Atomically claim a pending, failed or stale run for this worker; with ``lease``, also
        a run held under the same lease (an earlier attempt of this job, which is gone)."""
        me = worker_id()
        now = time.time()
        with self._db() as db:
            cur = db.execute(
                "UPDATE runs SET state='running', worker=?, lease=?, claimed_at=?, error=NULL "
                "WHERE key=? AND (state IN ('pending','failed') OR "
                "(state='running' AND (worker=? OR claimed_at < ? OR lease=?)))",
                (me, lease, now, key, me, now - stale_after_s, lease))
            return cur.rowcount == 1

    def fail_lost(self, key: str, lease: str | None, error: str) -> bool:
        """Record as failed a run whose job was lost (its worker or cluster job died for good):
        only while it is still pending or held under that job's ``lease``, never a run that is
        done or that another worker holds. True when it was marked."""
        with self._db() as db:
            cur = db.execute(
                "UPDATE runs SET state='failed', error=?, lease=NULL WHERE key=? AND "
                "(state='pending' OR (state='running' AND lease=?))",
                (error[:2000], key, lease))
            return cur.rowcount == 1

    def release_dead(self) -> int:
        """Reset runs claimed by processes of this host that no longer exist."""
        host = socket.gethostname()
        n = 0
        with self._db() as db:
            rows = db.execute("SELECT key, worker FROM runs WHERE state='running'").fetchall()
            for row in rows:
                if worker_gone(row["worker"], host):
                    # only if that dead worker still holds it: another process may have
                    # released and claimed it since the SELECT (a live claim stays)
                    cur = db.execute("UPDATE runs SET state='pending', worker=NULL, "
                                     "lease=NULL WHERE key=? AND state='running' AND worker=?",
                                     (row["key"], row["worker"]))
                    n += cur.rowcount
        return n

    def finish(self, key: str, summary: dict[str, Any], evaluation: dict[str, Any] | None) -> None:
        with self._db() as db:
            db.execute("UPDATE runs SET state='done', status=?, finished_at=?, summary=?, eval=? "
                       "WHERE key=?", (summary.get("status"), time.time(), json.dumps(summary),
                                       json.dumps(evaluation) if evaluation else None, key))

    def release(self, key: str) -> None:
        """A run its worker paused (checkpointed, not finished): pending again, unclaimed."""
        with self._db() as db:
            db.execute("UPDATE runs SET state='pending', worker=NULL, lease=NULL, claimed_at=NULL "
                       "WHERE key=? AND state='running'", (key,))

    def reopen(self, key: str) -> None:
        """A finished run to train on again (the profile's halving rule reopens the runs it
        dropped): pending, its outcome cleared."""
        with self._db() as db:
            db.execute("UPDATE runs SET state='pending', status=NULL, finished_at=NULL, "
                       "summary=NULL, eval=NULL, worker=NULL, lease=NULL WHERE key=?", (key,))

    def fail(self, key: str, error: str) -> None:
        with self._db() as db:
            db.execute("UPDATE runs SET state='failed', error=? WHERE key=?", (error[:2000], key))

    def rows(self) -> list[dict[str, Any]]:
        with self._db() as db:
            out = []
            for r in db.execute("SELECT * FROM runs ORDER BY scale, method, seed"):
                d = dict(r)
                d["summary"] = json.loads(d["summary"]) if d["summary"] else None
                d["eval"] = json.loads(d["eval"]) if d["eval"] else None
                out.append(d)
            return out

    def state(self, key: str) -> str | None:
        with self._db() as db:
            r = db.execute("SELECT state FROM runs WHERE key=?", (key,)).fetchone()
            return r["state"] if r else None


@contextlib.contextmanager
def _index_lock(root: Path) -> Iterator[None]:
    """Serialise the index's damage check, rebuild and schema set-up (short, blocking)."""
    fd = os.open(root / ".index.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def index_damage(path: Path) -> str | None:
    """What is wrong with an existing index file (None: nothing, or no file yet)."""
    if not path.exists():
        return None
    if not path.is_file():
        return "not a file"
    wal = path.with_name(path.name + "-wal")
    if path.stat().st_size == 0:
        return None if wal.is_file() and wal.stat().st_size > 0 else "empty (zero bytes)"
    try:
        db = sqlite3.connect(path, timeout=60)
        try:
            ok = db.execute("PRAGMA quick_check").fetchone()
            wrong = _schema_problem(db)
            if wrong is None:
                db.execute("SELECT count(*) FROM runs").fetchone()
        finally:
            db.close()
    except sqlite3.DatabaseError as e:
        return f"damaged ({str(e).splitlines()[0][:80]})"
    if not ok or ok[0] != "ok":
        return f"damaged (integrity check: {str(ok[0] if ok else '?')[:80]})"
    if wrong is not None:
        return f"of the wrong schema ({wrong[:120]})"
    return None


def _expected_columns() -> list[tuple[Any, ...]]:
    """``PRAGMA table_info(runs)`` of an index made by :data:`SCHEMA`."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(SCHEMA)
        return [tuple(r) for r in db.execute("PRAGMA table_info(runs)")]
    finally:
        db.close()


def _schema_problem(db: sqlite3.Connection) -> str | None:
    """What differs between an index's schema and :data:`SCHEMA` (None: nothing; an index
    written before leases, without that column, is right): the ``runs`` table's columns,
    their types, constraints and defaults, and nothing else in the file (a view, another
    index or a trigger would change what the store's statements do)."""
    objects = sorted((str(t), str(n)) for t, n in db.execute(
        "SELECT type, name FROM sqlite_master"))
    if ("table", "runs") not in objects:
        return "'runs' is a view, not a table" if ("view", "runs") in objects else "no table 'runs'"
    extra = [f"{t} '{n}'" for t, n in objects if (t, n) != ("table", "runs")
             and n != "sqlite_autoindex_runs_1" and not n.startswith("sqlite_stat")]
    if extra:  # a trigger or an index could refuse or change the store's writes
        return f"an unknown {extra[0]}"
    # (the store names its columns in every statement: their order does not matter)
    have = {r[1]: tuple(r)[2:] for r in db.execute("PRAGMA table_info(runs)")}
    want = {c[1]: c[2:] for c in _expected_columns()}
    for name, form in want.items():
        if name not in have:
            if name != "lease":  # an index written before leases gets the column
                return f"no column '{name}' in table runs"
        elif have[name] != form:
            return (f"column '{name}' of table runs is {_column_words(have[name])}, not "
                    f"{_column_words(form)}")
    extra = [name for name in have if name not in want]
    return f"an unknown column '{extra[0]}' in table runs" if extra else None


def _column_words(form: tuple[Any, ...]) -> str:
    """A column's type, NOT NULL, default and primary key (``table_info``'s last four)."""
    kind, notnull, default, pk = form
    return " ".join([str(kind or "untyped")] + (["NOT NULL"] if notnull else [])
                    + ([f"DEFAULT {default}"] if default is not None else [])
                    + (["PRIMARY KEY"] if pk else []))


def _move_aside(path: Path) -> Path:
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.replace(path, aside)
    for extra in ("-wal", "-shm"):  # the journal of the damaged file goes with it
        side = path.with_name(path.name + extra)
        if side.exists():
            os.replace(side, aside.with_name(aside.name + extra))
    return aside


def rebuild_rows(root: Path, keys: set[str] | None = None) -> list[dict[str, Any]]:
    """The index rows of the run folders under ``ROOT/runs`` (those named ``keys``, or all):
    a finished run (its
    ``summary.json``) done with its summary and ``eval.json``, any other pending (a later
    ``study run`` resumes it). Scale, method and seed come from the study's ``spec.yaml`` where
    it names the run's key, else from the run's ``config.yaml``."""
    import yaml

    named: dict[str, tuple[str, str, int]] = {}
    with contextlib.suppress(Exception):  # no spec, or one this version cannot expand
        from modbench.study.spec import expand, load_spec

        if (root / "spec.yaml").is_file():
            named = {r.key: (r.scale, r.method, r.seed)
                     for r in expand(load_spec(root / "spec.yaml"))}
    rows = []
    for folder in sorted((root / "runs").iterdir()) if (root / "runs").is_dir() else []:
        if not folder.is_dir() or folder.is_symlink():
            continue
        key = folder.name
        if keys is not None and key not in keys:
            continue
        if key in named:
            scale, method, seed = named[key]
        else:
            try:
                cfg = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
                scale, method = str(cfg["preset"]), str(cfg["model"]["method"])
                seed = int(cfg["seed"])
            except Exception:
                continue  # not a run folder this index can describe
        summary = _json_file(folder / "summary.json")
        evaluation = _json_file(folder / "eval.json")
        done = isinstance(summary, dict)
        rows.append({
            "key": key, "scale": scale, "method": method, "seed": seed,
            "state": "done" if done else "pending",
            "status": summary.get("status") if done else None,
            "finished_at": (folder / "summary.json").stat().st_mtime if done else None,
            "summary": json.dumps(summary) if done else None,
            "eval": json.dumps(evaluation) if done and isinstance(evaluation, dict) else None})
    return rows


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _add_lease_column(db: sqlite3.Connection) -> None:
    """Indexes written before leases existed get the column (several processes may try at
    once: the losers find it there)."""
    if "lease" in {row[1] for row in db.execute("PRAGMA table_info(runs)")}:
        return
    try:
        db.execute("ALTER TABLE runs ADD COLUMN lease TEXT")
    except sqlite3.OperationalError as e:
        if "duplicate column" not in str(e):
            raise


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def worker_gone(worker: str | None, host: str | None = None) -> bool:
    """True when ``worker`` (``host:pid``) is a process of this host that no longer exists
    (a killed study); workers on other hosts are never judged from here."""
    h, _, pid = (worker or "").rpartition(":")
    return h == (host or socket.gethostname()) and pid.isdigit() and not _alive(int(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """A process that has exited but was not reaped yet (e.g. a killed study's workers,
    orphaned under a container init that reaps late): it answers signal 0 but is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].startswith("Z")
