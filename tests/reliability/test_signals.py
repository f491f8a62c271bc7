"""Ctrl-C (SIGINT) during ``modbench train`` and ``modbench study run``: exit 130 and ONE
line on stderr saying what was saved (the last checkpoint's step, or that nothing was) and
the exact command that continues; that command then finishes the run. No traceback, no
"leaked semaphore" warning from the study's worker processes.

The train children pause at a chosen point (right after their first checkpoint is in place,
or at their first metrics record, before any checkpoint) until the test's SIGINT arrives, so
where the signal lands never depends on timing; the study is interrupted the way a terminal
does it, SIGINT to its whole process group, once a run has a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tests.helpers import torch_threads

from modbench.cli import run_cli
from modbench.runtime.checkpoint import checkpoint_step
from modbench.runtime.runfolder import CHECKPOINT, METRICS, SUMMARY

STEPS = 12
TRAIN = ["train", "--preset", "tiny", "--steps", str(STEPS), "--checkpoint-every", "1",
         "--set", "train.threads=1", "--set", "train.eval_every=0", "--no-progress"]

# The child: `modbench ARGS` in a process that, at PAUSE_AT, writes PAUSED and sleeps until a
# signal ends the sleep (Ctrl-C raises KeyboardInterrupt right there, inside the trainer).
CHILD = """
import os, sys, time
from pathlib import Path
pause_at, marker = os.environ["PAUSE_AT"], Path(os.environ["PAUSED"])

def pause():
    marker.write_text("paused")
    # short sleeps: a SIGINT the kernel hands to another thread (torch's) only sets Python's
    # flag, which the main thread reads when its sleep ends; one long sleep then outlives the
    # test (seen once under load), a real training step never sleeps that long
    for _ in range(36000):
        time.sleep(0.1)

if pause_at == "first_checkpoint":
    real = os.replace
    def replace(src, dst, *a, **k):
        real(src, dst, *a, **k)
        if Path(dst).name == "last.pt" and not marker.exists():
            pause()
    os.replace = replace
else:  # first_record: the first metrics line, before any checkpoint
    from modbench.runtime.runfolder import MetricsLog
    write = MetricsLog.write
    def hooked(self, record):
        write(self, record)
        if not marker.exists():
            pause()
    MetricsLog.write = hooked
if sys.argv[1] == "train" and os.environ.get("ENTRY") == "python -m modbench.train":
    from modbench.train.cli import main as train_main  # what each torchrun process runs
    sys.exit(train_main(sys.argv[2:]))
from modbench.cli import main
sys.argv = ["modbench", *sys.argv[1:]]
main()
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _default_sigint() -> None:
    """A child run from a background job inherits SIGINT ignored; a terminal's is default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait(cond: object, what: str, proc: subprocess.Popen[str], limit: float = 300.0) -> None:
    """Poll ``cond()`` (a safety limit only: nothing is asserted on time)."""
    end = time.monotonic() + limit
    while not cond():  # type: ignore[operator]
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"{what}: the process ended first ({proc.returncode}): {err}")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def _interrupted_train(tmp_path: Path, pause_at: str,
                       entry: str = "modbench") -> tuple[Path, str]:
    run, marker = tmp_path / "R", tmp_path / "paused"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *TRAIN, "--out", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(PAUSE_AT=pause_at, PAUSED=str(marker), ENTRY=entry),
                            preexec_fn=_default_sigint)
    _wait(marker.exists, f"the pause at {pause_at}", proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    return run, lines[0]


def _resume(line: str, run: Path) -> None:
    """Run the command the line names to the end, in process (run_cli: what `python -m
    modbench` runs; the run's train.threads=1 sets one torch thread, restored after)."""
    command = line.split("with: ", 1)[1].split()
    assert command[:2] == ["modbench", "train"]
    with torch_threads():
        assert run_cli([*command[1:], "--no-progress"]) == 0
    assert json.loads((run / SUMMARY).read_text())["steps"] == STEPS
    records = [json.loads(x) for x in (run / METRICS).read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "train"] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("entry", ["modbench", "python -m modbench.train"])
def test_sigint_after_a_checkpoint_names_its_step_and_the_resume(tmp_path: Path,
                                                                  entry: str) -> None:
    """The same line from ``modbench train`` and from ``python -m modbench.train`` (what
    torchrun runs in each process of a group)."""
    run, line = _interrupted_train(tmp_path, "first_checkpoint", entry)
    step = checkpoint_step(run / CHECKPOINT)
    assert step == 1
    assert line == (f"interrupted: the last checkpoint (step {step}) is saved in {run}; "
                    f"resume with: modbench train --out {run} --resume")
    assert not list((run / "checkpoints").glob(".*.tmp"))
    _resume(line, run)


def test_sigint_before_any_checkpoint_says_nothing_was_saved(tmp_path: Path) -> None:
    run, line = _interrupted_train(tmp_path, "first_record")
    assert not (run / CHECKPOINT).exists()
    assert line.startswith(f"interrupted before the first checkpoint: nothing was saved in "
                           f"{run};"), line
    assert line.endswith(f"modbench train --out {run} --resume")
    _resume(line, run)  # from step 0


SPEC = {"name": "sigint", "baseline": "baseline", "methods": [],
        "seeds": {"default": [0], "noise_floor": [0, 1], "anchors": []}, "scales": ["tiny"],
        "overrides": ["train.steps=40", "train.checkpoint_every=1", "train.eval_every=0",
                      "train.threads=1"]}


def test_sigint_to_a_study_one_line_no_leaked_semaphore_and_it_goes_on(tmp_path: Path) -> None:
    spec, folder = tmp_path / "spec.yaml", tmp_path / "S"
    spec.write_text(yaml.safe_dump(SPEC))
    args = ["study", "run", str(spec), "--out", str(folder), "--workers", "2", "--no-progress"]
    proc = subprocess.Popen([sys.executable, "-m", "modbench", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=_default_sigint, start_new_session=True)
    _wait(lambda: any(folder.glob("runs/*/checkpoints/last.pt")), "a run's checkpoint", proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C on a terminal does: the whole group
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "leaked semaphore" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    again = f"`modbench study run {spec} --out {folder}` goes on where it stopped"
    assert lines[0].startswith("interrupted: 0 of 2 runs finished and kept in") and \
        lines[0].endswith(again), lines[0]
    assert "from the last checkpoint" in lines[0]

    done = subprocess.run([sys.executable, "-m", "modbench", *args, "--no-report"],
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    assert "leaked semaphore" not in done.stderr
    for summary in folder.glob("runs/*/summary.json"):
        assert json.loads(summary.read_text())["steps"] == 40
    assert len(list(folder.glob("runs/*/summary.json"))) == 2
