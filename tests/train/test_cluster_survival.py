"""Multi-process runs that survive a cluster (docs/cluster.md, "Surviving a cluster"), on gloo
with two processes on the CPU:

- the data's checksums are hashed once per node (the process of LOCAL_RANK 0), and a damaged
  shard is refused in the same one line on every process, none left waiting;
- a process that waits longer than ``train.dist_timeout`` at a collective fails in one line
  naming the key;
- a run signalled mid-training (SIGUSR1, as SLURM's ``--signal`` sends it) saves the step it
  is on, exits 75, and ``--resume`` ends bit-exactly like the uninterrupted run: in one
  process, in a group where one process got the signal, through ``modbench train`` and
  through a torchrun group (``launch``);
- checkpoints are read memory-mapped (their tensors are the file's pages, not a copy);
- the SLURM executor asks for the signal and for the host memory its runs need, and on
  submitit's local cluster a task signalled mid-run (no periodic checkpoints) is requeued and
  resumes from the step the signal saved, ending as the local executor's run; a Ray task
  sets its thread counts.

The groups meet through a file store (the timeout test: torch's env:// on localhost, as
torchrun's). No network.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modbench.config import EXECUTION_KEYS, RunConfig, from_dict, resolve
from modbench.data import builtin_dataset
from modbench.errors import ModbenchError
from modbench.runtime.callback import Callback, TrainingRun
from modbench.runtime.checkpoint import (
    EXIT_PREEMPTED,
    Preempted,
    load_checkpoint,
    mapped_file,
    save_checkpoint,
)
from modbench.runtime.runfolder import CHECKPOINT
from modbench.study.spec import config_key
from modbench.train.distributed import launch
from modbench.train.trainer import Trainer, train
from tests.helpers import read_metrics, torch_threads

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available() and hasattr(signal, "SIGUSR1")),
    reason="needs torch.distributed with gloo and POSIX signals")

STEPS = 8
BASE = ("train.threads=1", "train.eval_every=4", "train.micro_batch_size=2")
SIGNAL_AT = 2  # the signal arrives during step 3 (0-based 2): the checkpoint is at step 3


def cfg_of(source: Path | str = "builtin", *extra: str, steps: int = STEPS) -> RunConfig:
    return resolve("tiny", seed=0, steps=steps, overrides=[*BASE, f"data.source={source}",
                                                            *extra])


def values(run: Path) -> list[tuple[str, int, float]]:
    """(kind, step, loss) of every record: training and validation losses, exactly."""
    return [(r["kind"], r["step"], r["loss"] if r["kind"] == "train" else r["val_loss"])
            for r in read_metrics(run)]


def assert_same_run(a: Path, b: Path) -> None:
    """Bit for bit: every loss, the batch hash, the final checkpoint's tensors."""
    assert values(a) == values(b)
    sa = json.loads((a / "summary.json").read_text())
    sb = json.loads((b / "summary.json").read_text())
    assert sa["batches_sha256"] == sb["batches_sha256"]
    assert sa["status"] == sb["status"] == "completed"
    ca, cb = load_checkpoint(a / CHECKPOINT), load_checkpoint(b / CHECKPOINT)
    assert ca["model"].keys() == cb["model"].keys()
    for k, w in ca["model"].items():
        assert torch.equal(w, cb["model"][k]), k
    for i, s in ca["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(cb["optimizer"]["state"][i][k]))


class _SignalAt(Callback):
    """Send this process ``sig`` at ``on_batch(step)`` (only on ``rank``, if given)."""

    def __init__(self, step: int, sig: int = signal.SIGUSR1, rank: int | None = None) -> None:
        self.step, self.sig, self.rank = step, sig, rank

    def on_batch(self, run: TrainingRun, step: int, batch: torch.Tensor) -> None:
        if step == self.step and self.rank in (None, int(os.environ.get("RANK", "0"))):
            os.kill(os.getpid(), self.sig)


class _SleepAt(Callback):
    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds

    def on_batch(self, run: TrainingRun, step: int, batch: torch.Tensor) -> None:
        if step == self.step:
            time.sleep(self.seconds)


def _count_hashes(report: Path, rank: int, label: str) -> Any:
    """Record every shard this process hashes (modbench.data.dataset._digest_and_max) until
    the function returned is called. The record of verified files (``verified.json``) is
    not trusted meanwhile: the scenarios open one corpus one after another, and which
    process of a node hashes is what they check (tests/data/test_verify_once.py checks
    the record)."""
    import modbench.data.dataset as dataset

    real, trusted = dataset._digest_and_max, dataset.VerifyRecord.trusted

    def counted(path: Path, dtype: Any) -> tuple[str, int]:
        with (report / f"hashed.{label}.{rank}").open("a") as f:
            f.write(f"{Path(path).name}\n")
        return real(path, dtype)

    dataset._digest_and_max = counted  # type: ignore[assignment]
    dataset.VerifyRecord.trusted = lambda *_: False  # type: ignore[method-assign]

    def stop() -> None:
        dataset._digest_and_max = real  # type: ignore[assignment]
        dataset.VerifyRecord.trusted = trusted  # type: ignore[method-assign]

    return stop


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except BaseException as e:
        return {"type": type(e).__name__, "message": str(e),
                "code": getattr(e, "code", None)}
    return {"type": None}


def _group_worker(rank: int, world: int, root: str, trees: dict[str, dict[str, Any]]) -> None:
    """One process of the file-store group: the data scenarios, then the preemption runs."""
    from datetime import timedelta

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    base, report = Path(root), Path(root) / "ranks"
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    out: dict[str, Any] = {}
    # the data check: one node (LOCAL_RANK 0 and 1), two nodes (LOCAL_RANK 0 on each)
    for label, local_rank in (("one_node", rank), ("two_nodes", 0)):
        os.environ["LOCAL_RANK"] = str(local_rank)
        stop = _count_hashes(report, rank, label)
        out[label] = _outcome(lambda label=label: Trainer(  # type: ignore[misc]
            from_dict(trees["good"]), base / "runs" / label, progress=False))
        stop()
    os.environ["LOCAL_RANK"] = str(rank)
    out["damaged"] = _outcome(lambda: Trainer(from_dict(trees["damaged"]),
                                              base / "runs" / "damaged", progress=False))
    # preemption: one process signalled, both stop at the same step; then resumed
    cfg = from_dict(trees["good"])
    out["whole"] = _outcome(lambda: train(cfg, base / "runs" / "whole", progress=False))
    out["preempted"] = _outcome(lambda: train(
        cfg, base / "runs" / "preempted", callbacks=[_SignalAt(SIGNAL_AT, rank=1)],
        progress=False))
    out["preempted_handler"] = signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    out["resumed"] = _outcome(lambda: train(cfg, base / "runs" / "preempted", resume=True,
                                            progress=False))
    (report / f"out.{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cluster")
    (root / "ranks").mkdir()
    good = root / "data"
    shutil.copytree(builtin_dataset(512, 64, progress=False), good)
    bad = root / "data_bad"
    shutil.copytree(good, bad)
    shard = bad / "train_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 1  # one bit: same size, a token id still inside the vocabulary
    shard.write_bytes(bytes(raw))
    trees = {"good": cfg_of(good).to_dict(), "damaged": cfg_of(bad).to_dict()}
    train(cfg_of(good), root / "single", progress=False)  # one process, the same batches
    mp.start_processes(_group_worker, args=(2, str(root), trees), nprocs=2, join=True,
                       start_method="spawn")
    return root


def outcome(root: Path, rank: int) -> dict[str, Any]:
    return json.loads((root / "ranks" / f"out.{rank}.json").read_text())  # type: ignore[no-any-return]


def hashed(root: Path, label: str, rank: int) -> list[str]:
    f = root / "ranks" / f"hashed.{label}.{rank}"
    return f.read_text().split() if f.exists() else []


# ------------------------------------------------------------------------------ the data


def test_shards_hashed_once_per_node(group: Path) -> None:
    shards = sorted(p.name for p in (group / "data").glob("*.bin"))
    assert len(shards) >= 2
    for rank in (0, 1):
        assert outcome(group, rank)["one_node"]["type"] is None
        assert outcome(group, rank)["two_nodes"]["type"] is None
    # one node: LOCAL_RANK 0 hashed every shard once, the other process none
    assert sorted(hashed(group, "one_node", 0)) == shards
    assert hashed(group, "one_node", 1) == []
    # two nodes: each node's LOCAL_RANK 0 hashed every shard once
    assert sorted(hashed(group, "two_nodes", 0)) == shards
    assert sorted(hashed(group, "two_nodes", 1)) == shards


def test_damaged_shard_refused_in_one_line_on_every_process(group: Path) -> None:
    got = [outcome(group, rank)["damaged"] for rank in (0, 1)]
    for g in got:
        assert g["type"] == "ModbenchError"
        assert "\n" not in g["message"]
        assert "train_00000.bin fails its sha256 checksum" in g["message"]
    assert got[0]["message"] == got[1]["message"]  # the process that did not hash says it too
    assert not (group / "runs" / "damaged").exists()


# ------------------------------------------------------------------------------ preemption


def test_group_stops_together_on_one_process_signal_and_resumes_bit_exactly(
        group: Path) -> None:
    for rank in (0, 1):
        out = outcome(group, rank)
        assert out["whole"]["type"] is None
        stopped = out["preempted"]
        assert (stopped["type"], stopped["code"]) == ("Preempted", EXIT_PREEMPTED)
        assert stopped["message"].startswith(f"stopped by SIGUSR1 after step {SIGNAL_AT + 1}:")
        assert out["preempted_handler"]  # the handler is gone after the run
        assert out["resumed"]["type"] is None
    run = group / "runs" / "preempted"
    # the first attempt logged steps 1..3 and saved step 3; the resume went on from there
    assert_same_run(group / "runs" / "whole", run)
    # iso-data: the processes read only their rows, rank 0 hashed the whole batches
    single = json.loads((group / "single" / "summary.json").read_text())
    assert json.loads((run / "summary.json").read_text())["batches_sha256"] == single[
        "batches_sha256"]


def test_single_process_signal_saves_the_step_and_resumes_bit_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = cfg_of()
    with pytest.raises(Preempted) as stopped:
        train(cfg, tmp_path / "cut", callbacks=[_SignalAt(SIGNAL_AT)], progress=False)
    assert stopped.value.code == EXIT_PREEMPTED and stopped.value.signum == signal.SIGUSR1
    assert load_checkpoint(tmp_path / "cut" / CHECKPOINT)["step"] == SIGNAL_AT + 1
    assert [r["step"] for r in read_metrics(tmp_path / "cut") if r["kind"] == "train"] == [
        1, 2, 3]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    # the resume reads the checkpoint memory-mapped
    loads: list[bool] = []
    real = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        loads.append(bool(kwargs.get("mmap")))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    train(cfg, tmp_path / "cut", resume=True, progress=False)
    monkeypatch.undo()
    assert loads and all(loads)
    train(cfg, tmp_path / "whole", progress=False)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")


class _SignalAtEval(Callback):
    """Send this process ``sig`` at the validation of step ``step``."""

    def __init__(self, step: int, sig: int) -> None:
        self.step, self.sig = step, sig

    def on_eval(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None:
        if step == self.step:
            os.kill(os.getpid(), self.sig)


def test_a_signal_after_the_last_step_reaches_the_previous_handler(tmp_path: Path) -> None:
    """A signal the run cannot act on (during its final validation) is not lost: the run
    completes, then the handler that was there before (submitit's requeue) gets it."""
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: got.append(signum))
    try:
        summary = train(cfg_of(steps=4), tmp_path / "run",
                        callbacks=[_SignalAtEval(4, signal.SIGUSR2)], progress=False)
        assert summary["status"] == "completed" and summary["steps"] == 4
        assert got == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def _wait_for_steps(run: Path, proc: subprocess.Popen[bytes], steps: int) -> None:
    """Until ``run``'s log has ``steps`` training records (the process still running)."""
    log = run / "metrics.jsonl"
    while proc.poll() is None:
        if log.is_file() and sum('"kind": "train"' in ln or '"kind":"train"' in ln
                                 for ln in log.read_text().splitlines()) >= steps:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run ended (code {proc.returncode}) before step {steps}")


def test_modbench_train_signalled_exits_75_and_resumes_bit_exactly(tmp_path: Path) -> None:
    """A `python -m modbench.train` process sent SIGUSR1 after its third step (as SLURM's
    --signal=USR1@120 sends it): the step it is on is saved, one line on stderr, exit 75."""
    steps = 60  # room for the signal to land mid-run; the step it lands on does not matter
    cfg = cfg_of(steps=steps)
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "modbench.train", "--preset", "tiny", "--seed", "0",
           "--steps", str(steps), "--out", str(cut), "--no-progress",
           *[a for kv in (*BASE, "data.source=builtin") for a in ("--set", kv)]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_for_steps(cut, proc, 3)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=300)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == EXIT_PREEMPTED, err.decode()
    at = load_checkpoint(cut / CHECKPOINT)["step"]
    assert 3 <= at < steps
    assert lines[-1] == (f"stopped by SIGUSR1 after step {at}: checkpoint saved in {cut}; "
                         "continue with --resume")
    assert not (cut / "summary.json").exists()
    train(cfg, cut, resume=True, progress=False)
    train(cfg, tmp_path / "whole", progress=False)
    assert_same_run(tmp_path / "whole", cut)


def test_torchrun_group_signalled_saves_and_resumes_bit_exactly(group: Path,
                                                                tmp_path: Path) -> None:
    """`modbench train --nproc 2` sent SIGUSR1: the launcher tells its processes through the
    stop file, they save one step together, it exits 75; launch(resume=True) ends like the
    uninterrupted two-process run."""
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "modbench.train", "--preset", "tiny", "--seed", "0",
           "--steps", str(STEPS), "--out", str(cut), "--no-progress", "--nproc", "2",
           *[a for kv in (*BASE, f"data.source={group / 'data'}") for a in ("--set", kv)]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_for_steps(cut, proc, 1)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=300)
    if proc.returncode == 0:
        pytest.skip("the group finished before the signal reached it")
    assert proc.returncode == EXIT_PREEMPTED, err.decode()[-2000:]
    at = load_checkpoint(cut / CHECKPOINT)["step"]
    assert 1 <= at < STEPS
    assert not (cut / "summary.json").exists()
    summary = launch(cfg_of(group / "data"), cut, 2, resume=True)
    assert (summary["status"], summary["processes"]) == ("completed", 2)
    assert_same_run(group / "runs" / "whole", cut)


# ------------------------------------------------------------------------------ timeout


def _timeout_worker(rank: int, world: int, root: str, port: int, tree: dict[str, Any]) -> None:
    """A group the trainer initialises itself (env://, train.dist_timeout=3); process 1
    sleeps 10 s before its second step."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    callbacks = [_SleepAt(1, 10.0)] if rank == 1 else []
    got = _outcome(lambda: train(from_dict(tree), Path(root) / "run", callbacks=callbacks,
                                 progress=False))
    (Path(root) / f"timeout.{rank}.json").write_text(json.dumps(got))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_process_delayed_past_dist_timeout_fails_in_one_line(tmp_path: Path) -> None:
    tree = cfg_of("builtin", "train.dist_timeout=3").to_dict()
    mp.start_processes(_timeout_worker, args=(2, str(tmp_path), _free_port(), tree), nprocs=2,
                       join=True, start_method="spawn")
    got = [json.loads((tmp_path / f"timeout.{r}.json").read_text()) for r in (0, 1)]
    waited = got[0]  # process 0 waited at the step's all-reduce for process 1
    assert waited["type"] == "ModbenchError", waited
    assert "\n" not in waited["message"]
    assert waited["message"].startswith("process 0 of 2 waited more than "
                                        "train.dist_timeout=3s at a collective")
    late = got[1]  # process 1 came back to a group that had given up on it
    assert late["type"] == "ModbenchError", late
    assert "\n" not in late["message"] and "--resume" in late["message"]


def test_dist_timeout_key() -> None:
    assert resolve("tiny").train.dist_timeout == 1800
    for bad in ("0", "-5", "1e12"):
        with pytest.raises(ModbenchError, match=r"^train.dist_timeout must be a positive "
                                                r"number of seconds"):
            resolve("tiny", overrides=[f"train.dist_timeout={bad}"])
    # an execution key: a study's run keys do not change with it, a run resumes under another
    assert "train.dist_timeout" in EXECUTION_KEYS
    cfg = resolve("tiny")
    assert config_key(resolve("tiny", overrides=["train.dist_timeout=60"])) == config_key(cfg)


# ------------------------------------------------------------------------------ mmap


def test_checkpoint_tensors_are_the_files_pages(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    save_checkpoint(path, {"model": {"w": torch.randn(64, 64)}, "step": 1})
    state = load_checkpoint(path)
    assert mapped_file(state["model"]["w"]) == str(path)
    assert mapped_file(torch.randn(64, 64)) is None


_RSS = """
import sys, torch
from pathlib import Path
from modbench.runtime.checkpoint import load_checkpoint

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no RssAnon")

path, how = Path(sys.argv[1]), sys.argv[2]
before = anon()
state = (load_checkpoint(path) if how == "modbench"
         else torch.load(path, map_location="cpu", weights_only=True))
total = float(sum(t.sum() for t in state["model"].values()))  # every page read
print(anon() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_resume_does_not_copy_the_checkpoint_into_process_memory(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    size = 64 * 2**20
    save_checkpoint(path, {"model": {f"w{i}": torch.ones(2**20) for i in range(16)},
                           "step": 1})
    assert path.stat().st_size >= size

    def growth(how: str) -> int:
        out = subprocess.run([sys.executable, "-c", _RSS, str(path), how], check=True,
                             capture_output=True, text=True, timeout=300)
        return int(out.stdout.split()[-1])

    assert growth("modbench") < size / 8  # the file's pages, read, are not the process's
    assert growth("copy") > size * 0.9  # what a load without mmap costs (the test can fail)


# ------------------------------------------------------------------------------ executors


def _job(root: Path, cfg: RunConfig, nproc: int = 1, seeds: int = 1) -> Any:
    from modbench.study.runner import Job

    return Job(root=str(root), keys=tuple(f"k{i}" for i in range(seeds)),
               labels=tuple(f"l{i}" for i in range(seeds)),
               configs=tuple(cfg for _ in range(seeds)), evaluation={},
               nproc=nproc)


def test_slurm_tasks_ask_for_the_signal_and_the_memory_they_need(tmp_path: Path) -> None:
    pytest.importorskip("submitit")
    from modbench.measure.plan import host_memory_bytes
    from modbench.study.cluster import ExecutorOptions
    from modbench.study.executors.slurm import SIGNAL_DELAY_S, SlurmExecutor, host_memory_gb

    big, tiny = resolve("climb-1.2b"), resolve("tiny")
    one = host_memory_gb([_job(tmp_path, big, nproc=8)])
    assert 0 <= one * 10**9 - host_memory_bytes(big, 8) < 10**9  # GB, rounded up
    assert host_memory_bytes(big, 8) > 12 * 1.2e9  # at least the gathered fp32 AdamW state
    # stacked seeds hold one state each; the array asks for its largest task
    assert host_memory_gb([_job(tmp_path, tiny, seeds=3)]) == -(
        -3 * host_memory_bytes(tiny, 1) // 10**9)
    assert host_memory_gb([_job(tmp_path, tiny), _job(tmp_path, big, nproc=8)]) == one

    # the parameters given to submitit (and the sbatch lines its SLURM executor writes)
    from submitit.slurm.slurm import _make_sbatch_string

    assert SIGNAL_DELAY_S >= 120

    for options, mem in ((ExecutorOptions(), one), (ExecutorOptions(slurm_mem_gb=123.0), 123)):
        ex = SlurmExecutor(options, cluster="local")
        captured: dict[str, Any] = {}

        class Auto:
            def __init__(self, **kwargs: Any) -> None:
                pass

            def update_parameters(self, captured: dict[str, Any] = captured,
                                  **kwargs: Any) -> None:
                captured.update(kwargs)

        import submitit

        real = submitit.AutoExecutor
        submitit.AutoExecutor = Auto  # type: ignore[misc]
        try:
            ex._executor(tmp_path, [_job(tmp_path, big, nproc=8)])
        finally:
            submitit.AutoExecutor = real  # type: ignore[misc]
        assert captured["mem_gb"] == mem
        assert captured["slurm_signal_delay_s"] == SIGNAL_DELAY_S
        script = _make_sbatch_string(command="x", folder=tmp_path, mem=f"{mem}GB",
                                     signal_delay_s=captured["slurm_signal_delay_s"])
        assert f"#SBATCH --signal=USR2@{SIGNAL_DELAY_S}" in script
        assert f"#SBATCH --mem={mem}GB" in script


def test_study_task_requeues_only_after_the_run_saved(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("submitit")
    import submitit

    import modbench.study.executors.slurm as se

    calls: list[str] = []

    def preempted(job: Any) -> Any:
        calls.append("saved")
        raise Preempted("stopped by SIGUSR2 after step 3: ...", signal.SIGUSR2)

    def submitit_handler(signum: int, frame: Any) -> None:
        calls.append(f"requeue {signal.Signals(signum).name}")

    monkeypatch.setattr(se, "execute_job", preempted)
    sig = submitit.JobEnvironment._usr_sig()
    previous = signal.signal(sig, submitit_handler)
    try:
        with pytest.raises(Preempted):
            se.StudyTask()(_job(tmp_path, resolve("tiny")))
        assert calls == ["saved", f"requeue {signal.Signals(sig).name}"]
        calls.clear()  # SIGTERM (scancel): the task ends, nothing requeued
        monkeypatch.setattr(se, "execute_job", lambda job: (_ for _ in ()).throw(
            Preempted("stopped by SIGTERM", signal.SIGTERM)))
        with pytest.raises(Preempted):
            se.StudyTask()(_job(tmp_path, resolve("tiny")))
        assert calls == []
    finally:
        signal.signal(sig, previous)


def test_ray_task_sets_its_thread_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import modbench.study.executors.ray as rx

    seen: dict[str, str | None] = {}
    monkeypatch.setattr(rx, "execute_job", lambda job: seen.update(
        omp=os.environ.get("OMP_NUM_THREADS"), mkl=os.environ.get("MKL_NUM_THREADS")) or [])
    monkeypatch.setenv("OMP_NUM_THREADS", "64")  # what a Ray worker may carry
    job = dataclasses.replace(_job(tmp_path, resolve("tiny")), threads=3)
    rx.run_job(job)
    assert seen == {"omp": "3", "mkl": "3"}


# ------------------------------------------------------------------------------ submitit


class _SignalOnce:
    """Wraps a StudyTask (submitit local cluster): the first attempt sends itself submitit's
    signal (SIGUSR2) at ``on_batch(step)``, as SLURM sends it before a time limit."""

    def __init__(self, fault_dir: Path, step: int) -> None:
        from modbench.study.executors.slurm import StudyTask

        self.task, self.fault_dir, self.step = StudyTask(), fault_dir, step

    def __call__(self, job: Any) -> Any:
        import modbench.train.trainer as trainer

        emit, fault_dir, at = trainer.Trainer._emit, self.fault_dir, self.step

        def emitted(self: Any, members: Any, hook: str, *args: Any) -> None:
            emit(self, members, hook, *args)
            if hook == "on_batch" and args[0] == at:
                try:
                    os.replace(fault_dir / "armed", fault_dir / "fired")
                except FileNotFoundError:
                    return  # the requeued attempt
                (fault_dir / "fired").write_text(str(os.getpid()))  # its time: now
                os.kill(os.getpid(), signal.SIGUSR2)

        trainer.Trainer._emit = emitted  # type: ignore[method-assign]
        return self.task(job)

    def checkpoint(self, job: Any) -> Any:
        return self.task.checkpoint(job)


def test_submitit_requeue_resumes_from_the_step_the_signal_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--executor slurm on submitit's local cluster, no periodic checkpoints: the signal
    during step 5 saves step 5, submitit requeues the task, the run goes on from there (it is
    not started again) and ends as the local executor's run, bit for bit."""
    pytest.importorskip("submitit")
    import yaml

    import modbench.study.runner as runner
    from modbench.study.cluster import ExecutorOptions, check_options
    from modbench.study.executors.slurm import SlurmExecutor
    from modbench.study.runner import run_study
    from modbench.study.spec import load_spec
    from modbench.study.store import Store

    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({
        "name": "preempt", "baseline": "baseline", "methods": [],
        "seeds": {"default": [0], "noise_floor": [0], "anchors": []}, "scales": ["tiny"],
        "overrides": ["train.steps=10", "train.eval_every=5", "train.checkpoint_every=0",
                      "train.threads=1"], "evaluation": {"probes": False}}))
    with torch_threads():
        local = run_study(load_spec(spec_file), tmp_path / "local", progress=False)
    assert local["trained"] == 1
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir()
    (fault_dir / "armed").touch()
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(repo), *filter(
        None, [os.environ.get("PYTHONPATH")])]))

    def local_cluster(name: str, workers: int | None, options: ExecutorOptions | None = None,
                      *, verbose: bool = False) -> Any:
        check_options(name, options or ExecutorOptions(), workers)
        return SlurmExecutor(options or ExecutorOptions(), cluster="local", poll_s=0.2,
                             task=_SignalOnce(fault_dir, 4))  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "make_executor", local_cluster)
    out = tmp_path / "slurm"
    got = run_study(load_spec(spec_file), out, executor="slurm", progress=False,
                    options=ExecutorOptions(gpus_per_run=0, cpus_per_run=1, slurm_time=60))
    assert (got["trained"], got["failed"], got["failures"]) == (1, 0, [])
    assert (fault_dir / "fired").exists()
    log = "\n".join(p.read_text() for p in (out / "slurm").glob("*_log.*"))
    assert "stopped by SIGUSR2 after step 5: checkpoint saved in" in log
    assert "Requeued job" in log
    (row,) = Store(out).rows()
    run = out / "runs" / row["key"]
    # the requeued attempt resumed (a fresh start would write config.yaml again)
    assert (run / "config.yaml").stat().st_mtime_ns < (fault_dir / "fired").stat().st_mtime_ns
    assert_same_run(tmp_path / "local" / "runs" / row["key"], run)
