"""One writer per run folder (modbench.runtime.lock): two ``modbench train --out R --resume``
at once leave one run with exactly its steps, the second refused in one line naming the
holder; a killed holder's lock is taken over; eval and diagnose refuse a folder in use."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers import cli, torch_threads

from modbench.cli import run_cli
from modbench.errors import ModbenchError
from modbench.runtime.lock import LOCK_NAME, FolderLock, holder_of, lock_path

TRAIN = ["-m", "modbench", "train", "--preset", "tiny", "--steps", "30", "--checkpoint-every",
         "3", "--set", "train.threads=1", "--set", "train.eval_every=0", "--no-progress"]


def _modbench(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait(cond: object, what: str, proc: subprocess.Popen[str] | None = None,
          limit: float = 300.0) -> None:
    """Poll ``cond()`` (a safety limit only: the test never asserts on time)."""
    end = time.monotonic() + limit
    while not cond():  # type: ignore[operator]
        if proc is not None and proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"{what}: the process ended first ({proc.returncode}): {err}")
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def _holder_pid(run: Path) -> object:
    return (holder_of(run / LOCK_NAME) or {}).get("pid")


def test_two_resumes_one_run_exactly_its_steps(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "R"
    # a first writer, killed after its first checkpoint: its lock file stays, naming it
    first = _modbench(*TRAIN, "--out", str(run))
    _wait(lambda: (run / "checkpoints" / "last.pt").is_file(), "a checkpoint", first)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert _holder_pid(run) == first.pid  # a stale lock of a dead process

    second = _modbench(*TRAIN, "--out", str(run), "--resume")
    try:
        _wait(lambda: _holder_pid(run) == second.pid, "the resume's lock", second)
        os.kill(second.pid, signal.SIGSTOP)  # it holds the folder while the third tries
        # the third in process (tests.helpers.cli, what `python -m modbench` runs): refused
        # before it trains, by the lock another process holds
        code, _, err = cli(capsys, *TRAIN[2:], "--out", str(run), "--resume")
    finally:
        os.kill(second.pid, signal.SIGCONT)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"PID {second.pid}" in lines[0] and socket.gethostname() in lines[0]
    assert "Traceback" not in err
    _, err = second.communicate(timeout=600)
    assert second.returncode == 0, err

    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r.get("kind", "train") == "train" and "loss" in r]
    assert steps == list(range(1, 31))
    assert json.loads((run / "summary.json").read_text())["steps"] == 30
    assert not (run / LOCK_NAME).exists()  # released at the end


def _hold(folder: str, ready: multiprocessing.synchronize.Event) -> None:
    FolderLock(folder, "holder").acquire()
    ready.set()
    time.sleep(600)


def test_killed_holder_is_taken_over_and_a_live_one_refused(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold, args=(str(folder), ready))
    p.start()
    try:
        assert ready.wait(120)
        with pytest.raises(ModbenchError, match=rf"in use by holder \(PID {p.pid} on host "):
            FolderLock(folder, "second").acquire()
    finally:
        p.kill()
        p.join()
    assert holder_of(folder / LOCK_NAME)["pid"] == p.pid  # type: ignore[index]
    with FolderLock(folder, "after") as lock:  # the dead holder's lock, taken over
        assert lock.held and holder_of(folder / LOCK_NAME)["pid"] == os.getpid()  # type: ignore[index]
        with pytest.raises(ModbenchError, match="in use by after"):
            FolderLock(folder).acquire()  # a second writer in the same process too
    assert not (folder / LOCK_NAME).exists() and folder.is_dir()  # not created by `after`


def test_a_lock_that_created_its_folder_removes_it_when_empty(tmp_path: Path) -> None:
    folder = tmp_path / "a" / "b"
    with FolderLock(folder):
        assert folder.is_dir()
    assert not folder.exists()
    with FolderLock(folder, beside=True) as lock:  # next to a folder renamed into place
        assert lock.path == lock_path(folder, True) and lock.path.is_file()
        assert not folder.exists()
    assert not lock.path.exists()


def test_lock_file_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    target = tmp_path / "victim"
    target.write_text("keep")
    (folder / LOCK_NAME).symlink_to(target)
    with pytest.raises(ModbenchError, match="cannot be opened"):
        FolderLock(folder).acquire()
    assert target.read_text() == "keep"


def test_eval_refuses_a_run_folder_in_use(tmp_path: Path) -> None:
    run = tmp_path / "R"
    with torch_threads():  # trained in process; the refused eval is another process
        assert run_cli([*TRAIN[2:6], "4", *TRAIN[7:], "--out", str(run)]) == 0
    with FolderLock(run, "modbench train"):
        ev = _modbench("-m", "modbench", "eval", str(run), "--no-progress")
        _, err = ev.communicate(timeout=300)
    assert ev.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert f"PID {os.getpid()}" in err and not (run / "eval.json").exists()
