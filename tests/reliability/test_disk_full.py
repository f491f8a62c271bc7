"""A full disk (ENOSPC) or another refused write, at every writer: the checkpoint, the
metrics log, the study's index and the report. Each gives one line that says what failed,
where and what was kept, exit 2; nothing is left half written; in a study a run whose
checkpoint cannot be written is recorded as failed with that line, and an index that cannot
be written stops the study with one line, the index as it was.

No disk is filled: the writes are made to fail in process (torch.save's errno-less
``RuntimeError`` as a full disk gives it, ``OSError(ENOSPC)``, SQLite's SQLITE_FULL), and one
real-file check runs ``modbench train`` under ``RLIMIT_FSIZE`` (writes past N bytes fail with
EFBIG), as a full disk would fail them."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from modbench.cli import run_cli
from modbench.errors import ModbenchError
from modbench.runtime import checkpoint as ckpt_mod
from modbench.runtime import runfolder
from modbench.runtime.checkpoint import checkpoint_step, load_checkpoint, save_checkpoint
from modbench.runtime.runfolder import CHECKPOINT, MetricsLog
from modbench.study import store as store_mod
from modbench.study.store import INDEX, Store, StoreWriteError, index_damage

TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"


def _state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((64, 64), float(step))}, "step": step}


def _torch_save_fails_midway(monkeypatch: pytest.MonkeyPatch, *, free: int = 0,
                             error: BaseException | None = None) -> None:
    """torch.save writes part of the file, then fails as on a full disk (``free`` bytes left
    on the file system)."""

    def failing(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        Path(f).write_bytes(b"PK\x03\x04" + b"\0" * 1000)  # a torn zip: what was written
        raise error if error is not None else RuntimeError(TORCH_FULL)

    monkeypatch.setattr(ckpt_mod.torch, "save", failing)
    monkeypatch.setattr(runfolder, "free_bytes", lambda path: free)


def _only_file(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("how", ["torch_runtime_error", "oserror_enospc"])
def test_checkpoint_on_a_full_disk_keeps_the_previous_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    path = tmp_path / "checkpoints" / "last.pt"
    save_checkpoint(path, _state(40))
    before = path.read_bytes()
    error = None if how == "torch_runtime_error" else OSError(errno.ENOSPC, os.strerror(
        errno.ENOSPC))
    _torch_save_fails_midway(monkeypatch, error=error)
    with pytest.raises(ModbenchError) as e:
        save_checkpoint(path, _state(41))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot write checkpoint {path}: the disk is full")
    assert "the previous checkpoint (step 40) is kept intact" in msg
    assert path.read_bytes() == before  # untouched, and no temporary file left
    assert _only_file(path.parent) == ["last.pt"]
    monkeypatch.undo()
    assert checkpoint_step(path) == 40 and load_checkpoint(path)["step"] == 40


def test_first_checkpoint_on_a_full_disk_says_nothing_was_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.pt"
    _torch_save_fails_midway(monkeypatch)
    with pytest.raises(ModbenchError, match="no earlier checkpoint to keep"):
        save_checkpoint(path, _state(1))
    assert list(tmp_path.iterdir()) == []


def test_torch_write_failure_with_room_left_is_not_called_a_full_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _torch_save_fails_midway(monkeypatch, free=10 << 30)
    with pytest.raises(ModbenchError) as e:
        save_checkpoint(tmp_path / "last.pt", _state(1))
    assert "disk is full" not in str(e.value)
    assert "the write failed (torch: [enforce fail at inline_container.cc" in str(e.value)


def test_other_torch_errors_are_not_taken_for_write_failures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("something else")

    monkeypatch.setattr(ckpt_mod.torch, "save", failing)
    with pytest.raises(RuntimeError, match="something else"):
        save_checkpoint(tmp_path / "last.pt", _state(1))
    assert list(tmp_path.iterdir()) == []


class _FullAfter:
    """A text file whose writes fail with ENOSPC once ``room`` more characters were taken:
    part of the line lands, as on a disk that fills mid-write."""

    def __init__(self, real: Any, room: int) -> None:
        self.real, self.room = real, room

    def write(self, text: str) -> int:
        if len(text) > self.room:
            self.real.write(text[:self.room])
            self.real.flush()
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(text)
        return int(self.real.write(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_metrics_log_on_a_full_disk_is_cut_back_to_its_last_whole_record(
        tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.write({"kind": "train", "step": 1, "loss": 5.0})
    log.write({"kind": "train", "step": 2, "loss": 4.0})
    whole = path.read_bytes()
    log._file = _FullAfter(log._file, room=10)  # type: ignore[assignment]
    with pytest.raises(ModbenchError) as e:
        log.write({"kind": "train", "step": 3, "loss": 3.0})
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot write {path}: the disk is full (No space left on device")
    assert "the log is kept whole up to step 2" in msg
    assert path.read_bytes() == whole  # the torn third line is gone
    log.close()  # no second error from the buffer it could not write
    assert path.read_bytes() == whole


# ------------------------------------------------------------------------ the study


SPEC = {"name": "diskfull", "baseline": "baseline", "methods": ["qknorm"],
        "seeds": {"default": [0], "noise_floor": [0], "anchors": []}, "scales": ["tiny"],
        "overrides": ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=0",
                      "train.threads=1"]}


def _study(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    spec, folder = tmp_path / "spec.yaml", tmp_path / "S"
    spec.write_text(yaml.safe_dump(SPEC))
    code = run_cli(["study", "run", str(spec), "--out", str(folder), "--workers", "1",
                    "--no-progress", "--ensembles", "off", *extra])
    return code, folder


def test_study_records_a_run_whose_checkpoint_hit_a_full_disk_as_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    real_save = torch.save
    calls = {"n": 0}

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:  # the first run's first checkpoint
            raise RuntimeError(TORCH_FULL)
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt_mod.torch, "save", save)
    monkeypatch.setattr(runfolder, "free_bytes", lambda path: 0 if calls["n"] == 1 else 1 << 40)
    code, folder = _study(tmp_path)
    err = capsys.readouterr().err
    assert code == 1, err  # the study finished, with one failed run
    assert "Traceback" not in err
    rows = Store(folder).rows()
    failed = [r for r in rows if r["state"] == "failed"]
    assert len(failed) == 1 and sum(r["state"] == "done" for r in rows) == 1
    line = failed[0]["error"]
    assert "\n" not in line and "the disk is full" in line and "cannot write checkpoint" in line
    r = failed[0]
    assert f"failed: {r['scale']}/{r['method']}/s{r['seed']}: {line}" in err
    # once there is room, the same command finishes it
    monkeypatch.undo()
    code, _ = _study(tmp_path)
    assert code == 0
    assert all(r["state"] == "done" for r in Store(folder).rows())


class _FullDb:
    """A SQLite connection whose run-finishing UPDATE fails as on a full disk."""

    def __init__(self, real: sqlite3.Connection) -> None:
        object.__setattr__(self, "real", real)

    def __setattr__(self, name: str, value: Any) -> None:  # row_factory: the real one's
        setattr(self.real, name, value)

    def execute(self, sql: str, *args: Any) -> Any:
        if sql.startswith("UPDATE runs SET state='done'"):
            e = sqlite3.OperationalError("database or disk is full")
            e.sqlite_errorname = "SQLITE_FULL"  # type: ignore[attr-defined]
            raise e
        return self.real.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_study_whose_index_cannot_be_written_stops_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    connect = sqlite3.connect
    monkeypatch.setattr(store_mod.sqlite3, "connect",
                        lambda *a, **k: _FullDb(connect(*a, **k)))
    code, folder = _study(tmp_path)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: cannot write the study index {folder / INDEX}: the disk "
                               "is full")
    assert "every finished run is kept in" in lines[0]
    monkeypatch.undo()
    assert index_damage(folder / INDEX) is None  # the index is whole
    rows = Store(folder).rows()
    assert len(rows) == 2 and not any(r["state"] == "done" for r in rows)
    assert len(list(folder.glob("runs/*/summary.json"))) == 1  # the run itself is kept
    code, _ = _study(tmp_path, "--no-report")  # and the same command goes on
    assert code == 0 and all(r["state"] == "done" for r in Store(folder).rows())


def test_store_write_error_is_one_line_and_leaves_the_index(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    store = Store(tmp_path)
    store.register("k", "tiny", "baseline", 0)
    connect = sqlite3.connect
    monkeypatch.setattr(store_mod.sqlite3, "connect",
                        lambda *a, **k: _FullDb(connect(*a, **k)))
    with pytest.raises(StoreWriteError) as e:
        store.finish("k", {"status": "completed"}, None)
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    assert Store(tmp_path).state("k") == "pending"


def test_report_on_a_full_disk_keeps_the_report_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, folder = _study(tmp_path)
    assert code == 0
    report = folder / "report"
    before = {p.name: p.read_bytes() for p in report.iterdir() if p.is_file()}
    import modbench.report.build as build

    def full(path: Path, text: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(build, "atomic_write_text", full)
    capsys.readouterr()
    assert run_cli(["study", "report", str(folder)]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: cannot write {report}") and "the disk is full" in lines[0]
    assert "the report files already there are kept as they were" in lines[0]
    assert {p.name: p.read_bytes() for p in report.iterdir() if p.is_file()} == before


# ------------------------------------------------------------ a real file size limit


def _limit_file_size(limit: int) -> Any:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return apply


def test_train_cli_past_a_file_size_limit_one_line_nothing_half_written(tmp_path: Path) -> None:
    """The checkpoint (about 1 MB) cannot be written under a 256 kB per-file limit; the
    config, the log and the prepared data (read, not written) fit."""
    from modbench.data import builtin_dataset

    builtin_dataset(512, 64, progress=False)  # prepared here, before the limit applies
    run = tmp_path / "R"
    done = subprocess.run(
        [sys.executable, "-m", "modbench", "train", "--preset", "tiny", "--steps", "4",
         "--checkpoint-every", "2", "--set", "train.threads=1", "--set", "train.eval_every=0",
         "--no-progress", "--out", str(run)],
        capture_output=True, text=True, timeout=600, preexec_fn=_limit_file_size(256_000),
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: cannot write checkpoint {run / CHECKPOINT}: the file "
                               "size limit was reached"), lines[0]
    assert "no earlier checkpoint to keep" in lines[0]
    assert not (run / CHECKPOINT).exists()
    assert list((run / "checkpoints").iterdir()) == []  # no temporary file left
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "train"] == [1, 2]
    assert not (run / "summary.json").exists()


def test_a_refused_write_no_writer_words_is_one_line_at_the_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``config.yaml`` of a fresh run on a full disk (the trainer's own atomic write): the
    command line's net turns the ``OSError`` into one line, and the fresh folder is gone."""
    import modbench.train.trainer as trainer

    def full(path: Path, text: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(trainer, "atomic_write_text", full)
    run = tmp_path / "R"
    code = run_cli(["train", "--preset", "tiny", "--steps", "2", "--no-progress",
                    "--out", str(run)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: cannot write {run / 'config.yaml'}: the disk is full")
    assert not run.exists()
