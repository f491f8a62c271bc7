"""Failures that recover by themselves (docs/cluster.md, "Restarts"): a torchrun group started
with ``train.max_restarts`` (``modbench train --nproc N --max-restarts M``) whose process is
killed is started again by torchrun and resumes from the last checkpoint, ending bit for bit
as the run nobody killed; a restarted group whose launcher was told to stop does not train
again; the environment the launcher gives its processes turns NCCL's Flight Recorder on for
an nccl group, its dumps into the run folder, unless the user set it.

The kill: a ``sitecustomize`` on the processes' ``PYTHONPATH`` wraps the trainer's step in the
first start's rank 0 (the process that writes the run folder and holds its lock) and sends it
SIGKILL at a step after a checkpoint; every process records its restart count. On the CPU,
gloo, two processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from modbench.cli import run_cli
from modbench.config import EXECUTION_KEYS, RunConfig, resolve
from modbench.errors import ModbenchError
from modbench.runtime.checkpoint import EXIT_PREEMPTED, STOP_FILE_ENV, Preempted, load_checkpoint
from modbench.runtime.runfolder import CHECKPOINT
from modbench.study.spec import config_key
from modbench.train.distributed import (
    FLIGHT_RECORDER,
    RESTART_ENV,
    flight_recorder_environment,
    group_environment,
    launch,
)
from modbench.train.runs import TrainOptions, restarted
from tests.helpers import read_metrics
from tests.train.test_cluster_survival import _wait_for_steps, assert_same_run

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available() and hasattr(signal, "SIGKILL")),
    reason="needs torch.distributed with gloo and POSIX signals")

STEPS, KILL_AT = 8, 5  # checkpoints at steps 2 and 4; the kill during step 6 (0-based 5)
BASE = ("train.threads=1", "train.eval_every=4", "train.checkpoint_every=2",
        "train.micro_batch_size=2")

SITECUSTOMIZE = '''
import json, os, signal
from pathlib import Path

_report = os.environ.get("MODBENCH_TEST_REPORT")
if _report and os.environ.get("RANK") is not None:
    import modbench.train.trainer as _trainer

    _rank, _restart = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    Path(_report, f"env.{_rank}.{_restart}.json").write_text(json.dumps(dict(os.environ)))
    _kill = os.environ.get("MODBENCH_TEST_KILL")  # "rank:step", in the first start only
    _at = int(_kill.split(":")[1]) if _kill and _restart == "0" and (
        _kill.split(":")[0] == _rank) else None
    _real = _trainer.Trainer._train_step

    def _step(self, step, *args, **kwargs):
        with open(Path(_report, f"steps.{_rank}.{_restart}"), "a") as f:
            f.write(f"{step}\\n")
        if step == _at:
            os.kill(os.getpid(), signal.SIGKILL)
        return _real(self, step, *args, **kwargs)

    _trainer.Trainer._train_step = _step
'''


def trained(report: Path, rank: int, restart: int) -> list[int]:
    """The steps process ``rank`` began in the start ``restart`` of its group."""
    f = report / f"steps.{rank}.{restart}"
    return [int(x) for x in f.read_text().split()] if f.exists() else []


def cfg_of(*extra: str) -> RunConfig:
    return resolve("tiny", seed=0, steps=STEPS, overrides=[*BASE, "data.source=builtin",
                                                            *extra])


@pytest.fixture
def hooked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder the processes report to; their sitecustomize on PYTHONPATH."""
    hooks, report = tmp_path / "hooks", tmp_path / "report"
    hooks.mkdir()
    report.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("MODBENCH_TEST_REPORT", str(report))
    return report


def test_a_killed_process_restarts_the_group_which_resumes_bit_exactly(
        tmp_path: Path, hooked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = cfg_of()
    began = time.perf_counter()
    whole = launch(cfg, tmp_path / "whole", 2)  # nobody killed
    print(f"unkilled run: {time.perf_counter() - began:.1f} s")
    assert whole["status"] == "completed"
    assert sorted(p.name for p in hooked.glob("env.*")) == ["env.0.0.json", "env.1.0.json"]
    for p in hooked.iterdir():
        p.unlink()
    monkeypatch.setenv("MODBENCH_TEST_KILL", f"0:{KILL_AT}")
    began = time.perf_counter()
    summary = launch(cfg, tmp_path / "killed", 2, max_restarts=1)
    took = time.perf_counter() - began
    assert (summary["status"], summary["processes"]) == ("completed", 2)
    # both processes started twice: torchrun restarted the group once
    assert sorted(p.name for p in hooked.glob("env.*")) == [
        "env.0.0.json", "env.0.1.json", "env.1.0.json", "env.1.1.json"]
    # rank 0 killed as it began step 6 (0-based 5), both resumed at the checkpoint of step 4
    assert trained(hooked, 0, 0)[-1] == KILL_AT
    assert trained(hooked, 1, 0)[-1] in (KILL_AT - 1, KILL_AT)  # stopped by torchrun
    assert trained(hooked, 0, 1) == trained(hooked, 1, 1) == list(range(4, STEPS))
    assert_same_run(tmp_path / "whole", tmp_path / "killed")
    print(f"killed and restarted run: {took:.1f} s")
    # a CPU group: no Flight Recorder (it records NCCL's collectives)
    env = json.loads((hooked / "env.1.1.json").read_text())
    assert "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    assert env[STOP_FILE_ENV] and env["OMP_NUM_THREADS"] == "1"


def test_without_restarts_a_killed_process_ends_the_run(tmp_path: Path, hooked: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODBENCH_TEST_KILL", "1:3")
    with pytest.raises(ModbenchError, match=r"continued with resume=True|--resume"):
        launch(cfg_of(), tmp_path / "run", 2)
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_signalled_group_is_not_trained_again_by_its_restarts(
        tmp_path: Path, hooked: Path) -> None:
    """`modbench train --nproc 2 --max-restarts 2` sent SIGUSR1: the processes save their
    step and exit 75, which torchrun counts as a failure and restarts; the restarted
    processes see the launcher's stop file and exit 75 at once, so the command exits 75 with
    the signalled step saved and nothing trained after it."""
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "modbench.train", "--preset", "tiny", "--seed", "0",
           "--steps", "60", "--out", str(cut), "--no-progress", "--nproc", "2",
           "--max-restarts", "2",
           *[a for kv in (*BASE, "data.source=builtin") for a in ("--set", kv)]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_for_steps(cut, proc, 1)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, err.decode()[-2000:]
    at = load_checkpoint(cut / CHECKPOINT)["step"]
    assert 1 <= at < 60 and not (cut / "summary.json").exists()
    assert max(r["step"] for r in read_metrics(cut) if r["kind"] == "train") == at
    assert sorted(p.name for p in hooked.glob("env.*")) == [  # restarted twice ...
        f"env.{rank}.{n}.json" for rank in (0, 1) for n in (0, 1, 2)]
    for rank in (0, 1):  # ... and trained no step again
        assert trained(hooked, rank, 0)[-1] == at - 1
        assert trained(hooked, rank, 1) == trained(hooked, rank, 2) == []


# ------------------------------------------------------------------------------ restarted


def test_a_restarted_process_resumes_its_run(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    opts = TrainOptions(out=out, nproc=None)
    monkeypatch.delenv(STOP_FILE_ENV, raising=False)
    monkeypatch.delenv(RESTART_ENV, raising=False)
    assert restarted(opts) is opts  # no torchrun
    monkeypatch.setenv(RESTART_ENV, "0")
    out.mkdir()
    (out / "config.yaml").write_text("{}")
    assert restarted(opts) is opts  # the first start: as asked
    monkeypatch.setenv(RESTART_ENV, "1")
    assert restarted(opts).resume  # a restart continues the run
    (out / "config.yaml").unlink()
    assert not restarted(opts).resume  # killed before config.yaml: starts afresh again
    # a restart after the launcher's stop file: exit 75 at once, not another run
    stop = tmp_path / "stop"
    stop.touch()
    monkeypatch.setenv(STOP_FILE_ENV, str(stop))
    with pytest.raises(Preempted) as stopped:
        restarted(opts)
    assert stopped.value.code == 75 and "before a restart" in str(stopped.value)


# ------------------------------------------------------------------------------ the keys


def test_max_restarts_key_and_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert resolve("tiny").train.max_restarts == 0
    for bad in ("-1", "101"):
        with pytest.raises(ModbenchError, match=r"^train.max_restarts must be a whole number"):
            resolve("tiny", overrides=[f"train.max_restarts={bad}"])
    assert "train.max_restarts" in EXECUTION_KEYS  # never in a study's run key
    assert config_key(resolve("tiny", overrides=["train.max_restarts=3"])) == config_key(
        resolve("tiny"))
    code = run_cli(["train", "--preset", "tiny", "--steps", "2", "--max-restarts", "2",
                    "--out", str(tmp_path / "a"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("error: --max-restarts starts a torchrun group again after "
                                 "a failure; add --nproc N with N >= 2, or drop "
                                 "--max-restarts")
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------------------ environment


def test_the_launcher_turns_the_flight_recorder_on_for_nccl_groups(tmp_path: Path) -> None:
    out, stop = tmp_path / "run", tmp_path / "stop"
    plain = {"PATH": "/bin", "OMP_NUM_THREADS": "16"}
    cpu = group_environment(cfg_of("train.device=cpu"), out, 2, stop, plain)
    assert cpu == {"PATH": "/bin", "OMP_NUM_THREADS": "1", STOP_FILE_ENV: str(stop)}
    gpu = group_environment(cfg_of("train.device=cuda", "train.threads=0"), out, 2, stop, plain)
    fr = {"TORCH_FR_BUFFER_SIZE": "20000",
          "TORCH_FR_DUMP_TEMP_FILE": str(out / FLIGHT_RECORDER),
          "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert {k: gpu[k] for k in fr} == fr
    assert gpu["PATH"] == "/bin" and gpu[STOP_FILE_ENV] == str(stop)
    # the user's settings win, under either of torch's names
    mine = {**plain, "TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_"}
    kept = group_environment(cfg_of("train.device=cuda"), out, 2, stop, mine)
    assert {k: v for k, v in kept.items() if k.startswith("TORCH_")} == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_"}
    # a torch before 2.7 reads the TORCH_NCCL_ names
    assert flight_recorder_environment(out, {}, "2.6.0+cu124") == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(out / FLIGHT_RECORDER),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
