"""Study executors on Ray and SLURM (through submitit).

A small study (tiny preset, baseline and qknorm x seeds 0 and 1, 10 steps, probes off) gives
the same store rows, final losses, metrics and checkpoints run by the local executor, by Ray
tasks on a local Ray instance, and by the SLURM executor's code path on submitit's local
cluster. Faults: a Ray worker SIGKILLed after its run's first checkpoint is retried by Ray and
its claim taken over (every run trained once); a submitit task preempted after its first
checkpoints is requeued and resumes from them; a task that fails has its runs recorded as
failed with a one-line reason. ``--dry-run`` prints the jobs, their resources and GPU-hours
(checked against a calculation from ``flop_report``) and writes nothing.

Faults are injected in the worker processes themselves: Ray runs a setup hook in each worker
(``worker_process_setup_hook``), the submitit test gives the executor a task subclass.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import socket
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from modbench.cli import run_cli
from modbench.errors import ModbenchError
from modbench.measure.bench import PEAK_BF16_TFLOPS
from modbench.measure.flops import flop_report
from modbench.runtime.runfolder import SUMMARY_TIMINGS
from modbench.study.cluster import ExecutorOptions, check_options
from modbench.study.runner import Job, _jobs, run_study
from modbench.study.spec import expand, load_spec
from modbench.study.store import Store
from tests.helpers import plugins_restored, torch_threads
from tests.reliability.checks import run_differences

HAVE_RAY = importlib.util.find_spec("ray") is not None
HAVE_SUBMITIT = importlib.util.find_spec("submitit") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed: pip install "
                               "'modbench[cluster]'")
needs_submitit = pytest.mark.skipif(not HAVE_SUBMITIT, reason="submitit is not installed: pip "
                                    "install 'modbench[cluster]'")

SPEC = {"name": "executors", "baseline": "baseline", "methods": ["qknorm"],
        "seeds": {"default": [0, 1], "noise_floor": [0, 1], "anchors": []},
        "scales": ["tiny"],
        "overrides": ["train.steps=10", "train.eval_every=5", "train.checkpoint_every=4",
                      "train.threads=1"],
        "evaluation": {"probes": False}}
N_RUNS = 4
REPO = Path(__file__).resolve().parents[2]
KILL_DIR = "MODBENCH_TEST_KILL_DIR"  # the Ray workers' fault folder (see _ray_worker_hook)


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    return path


def _local(spec_file: Path, folder: Path, ensembles: str) -> Path:
    with torch_threads():  # the runs set 1 thread in this process: give it back
        c = run_study(load_spec(spec_file), folder, ensembles=ensembles, progress=False)
    assert (c["trained"], c["failed"]) == (N_RUNS, 0)
    return folder


@pytest.fixture(scope="module")
def reference(spec_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The study run seed by seed by the local executor, in this process."""
    return _local(spec_file, tmp_path_factory.mktemp("local") / "study", "off")


@pytest.fixture(scope="module")
def reference_stacked(spec_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The study with each method's seeds stacked in one job, by the local executor."""
    return _local(spec_file, tmp_path_factory.mktemp("local-stacked") / "study", "on")


VOLATILE_ROW = ("worker", "claimed_at", "finished_at", "lease")


def rows(folder: Path) -> dict[str, dict[str, Any]]:
    """The store's rows by key, less who ran them, when, and the timing in their summaries."""
    out = {}
    for r in Store(folder).rows():
        r = {k: v for k, v in r.items() if k not in VOLATILE_ROW}
        for k in SUMMARY_TIMINGS:
            r["summary"].pop(k, None)
        out[r["key"]] = r
    return out


def assert_same_study(got: Path, ref: Path) -> None:
    """Same rows (states, statuses, summaries: final losses included) and, run by run, the
    same metrics.jsonl and final checkpoint, bit for bit."""
    a, b = rows(got), rows(ref)
    assert a == b
    assert len(a) == N_RUNS and {r["state"] for r in a.values()} == {"done"}
    assert {k: r["summary"]["final_val_loss"] for k, r in a.items()} == {
        k: r["summary"]["final_val_loss"] for k, r in b.items()}
    for key in a:
        assert run_differences(ref / "runs" / key, got / "runs" / key) == [], key


def assert_resumed(run: Path, fired: Path) -> None:
    """The run went on from the checkpoint it had when its process was stopped (marked by
    ``fired``): a run started afresh writes its config.yaml again, after that moment."""
    assert (run / "checkpoints" / "last.pt").is_file()
    assert (run / "config.yaml").stat().st_mtime_ns < fired.stat().st_mtime_ns


def _replace_hook(kill_dir: Path, sig: int, after: int) -> None:
    """In this worker process: from its ``after``-th checkpoint on, right after one is in
    place, send ``sig`` to itself if ``kill_dir/armed`` can be taken (only the first worker
    to get there, of all sharing ``kill_dir``, does); ``kill_dir/fired`` says which run."""
    replace = os.replace
    seen = [0]

    def hooked(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        replace(src, dst, *args, **kwargs)
        if Path(dst).name != "last.pt":
            return
        seen[0] += 1
        if seen[0] < after:
            return
        try:
            replace(kill_dir / "armed", kill_dir / "fired")
        except FileNotFoundError:
            return  # not armed, or another worker took it
        (kill_dir / "fired").write_text(json.dumps({"run": Path(dst).parents[1].name,
                                                    "pid": os.getpid()}))
        os.kill(os.getpid(), sig)

    os.replace = hooked


def _ray_worker_hook() -> None:
    """Ray's ``worker_process_setup_hook``: every Ray worker SIGKILLs itself after its first
    checkpoint while ``$MODBENCH_TEST_KILL_DIR/armed`` exists (the first one takes it)."""
    _replace_hook(Path(os.environ[KILL_DIR]), signal.SIGKILL, after=1)


# ----------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def ray_instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A local Ray instance of 2 CPUs for this module; yields its workers' fault folder."""
    ray = pytest.importorskip("ray")
    kill_dir = tmp_path_factory.mktemp("ray-faults")
    auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a private instance: no token written to $HOME
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024**2,
             runtime_env={"env_vars": {KILL_DIR: str(kill_dir),
                                       "PYTHONPATH": os.pathsep.join([str(REPO), *filter(
                                           None, [os.environ.get("PYTHONPATH")])])},
                          "worker_process_setup_hook": _ray_worker_hook})
    try:
        yield kill_dir
    finally:
        ray.shutdown()
        if auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth


@needs_ray
def test_ray_executor_equals_local(spec_file: Path, reference: Path, ray_instance: Path,
                                   tmp_path: Path) -> None:
    """Each run one Ray task (num_cpus=1, no GPU), results as they finish: the store ends as
    the local executor's does."""
    out = tmp_path / "ray"
    c = run_study(load_spec(spec_file), out, executor="ray", ensembles="off", progress=False,
                  options=ExecutorOptions(cpus_per_run=1))
    assert (c["trained"], c["failed"], c["busy"], c["failures"]) == (N_RUNS, 0, 0, [])
    assert_same_study(out, reference)
    workers = {r["worker"] for r in Store(out).rows()}
    assert f"{socket.gethostname()}:{os.getpid()}" not in workers  # trained in Ray workers
    assert all(r["lease"].startswith("ray:") for r in Store(out).rows())
    # run again: everything is done, nothing is submitted
    again = run_study(load_spec(spec_file), out, executor="ray", ensembles="off",
                      progress=False, options=ExecutorOptions(cpus_per_run=1))
    assert (again["already_done"], again["trained"]) == (N_RUNS, 0)


@needs_ray
def test_ray_tasks_load_the_spec_plugins(ray_instance: Path, tmp_path: Path,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """A spec's methods_from reaches the Ray tasks (their processes import the plugin from
    the job): a method written outside the repository trains there and its runs record the
    plugin's origin and hash."""
    from modbench.methods.plugins import combined_hash
    from tests.methods.test_plugins import rezero, sha

    plugin = rezero(tmp_path / "lab", "raygate")
    spec = dict(SPEC, name="ray-plugin", methods=["raygate"],
                methods_from=["./lab/raygate.py"],
                seeds={"default": [0], "noise_floor": [0], "anchors": []})
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "study"
    with plugins_restored(tmp_path_factory.getbasetemp()):
        c = run_study(load_spec(tmp_path / "spec.yaml"), out, executor="ray",
                      ensembles="off", progress=False, options=ExecutorOptions(cpus_per_run=1))
    assert (c["trained"], c["failed"], c["failures"]) == (2, 0, [])
    rows = Store(out).rows()
    assert f"{socket.gethostname()}:{os.getpid()}" not in {r["worker"] for r in rows}
    (run,) = [r for r in rows if r["method"] == "raygate"]
    meta = yaml.safe_load((out / "runs" / run["key"] / "config.yaml").read_text())["meta"]
    assert meta["methods"]["raygate"]["plugin"] == str(plugin)
    assert meta["methods"]["raygate"]["sha256"] == combined_hash({"raygate.py": sha(plugin)})


@needs_ray
def test_ray_retries_a_killed_worker_and_takes_over_its_claim(
        spec_file: Path, reference: Path, ray_instance: Path, tmp_path: Path) -> None:
    """A worker SIGKILLed right after its run's first checkpoint, holding the run's claim: Ray
    runs the task again in a new worker, which takes the claim over (same lease) and resumes
    the run; the study ends with every run trained once and as the local executor's."""
    (ray_instance / "fired").unlink(missing_ok=True)
    (ray_instance / "armed").touch()
    out = tmp_path / "ray-killed"
    c = run_study(load_spec(spec_file), out, executor="ray", ensembles="off", progress=False,
                  options=ExecutorOptions(cpus_per_run=1))
    fired = json.loads((ray_instance / "fired").read_text())  # a worker did die
    assert not (ray_instance / "armed").exists()
    assert (c["trained"], c["failed"], c["busy"], c["failures"]) == (N_RUNS, 0, 0, [])
    assert_same_study(out, reference)
    assert_resumed(out / "runs" / fired["run"], ray_instance / "fired")
    killed = next(r for r in Store(out).rows() if r["key"] == fired["run"])
    assert killed["worker"] != f"{socket.gethostname()}:{fired['pid']}"  # finished elsewhere


@needs_ray
def test_a_ray_job_out_of_retries_fails_its_runs(spec_file: Path, ray_instance: Path,
                                                tmp_path: Path) -> None:
    """No retries left: the runs the dead task held are recorded as failed with a one-line
    reason, the others train, and the next `study run` trains the failed ones."""
    from modbench.study.executors.ray import RayExecutor

    spec = load_spec(spec_file)
    out = tmp_path / "ray-lost"
    (ray_instance / "fired").unlink(missing_ok=True)
    (ray_instance / "armed").touch()
    ex = RayExecutor(ExecutorOptions(cpus_per_run=1), max_retries=0)
    store = Store(out)
    runs = expand(spec)
    for r in runs:
        store.register(r.key, r.scale, r.method, r.seed)
    results = [res for batch in ex.run(_jobs(out, runs, spec, stack=False)) for res in batch]
    fired = json.loads((ray_instance / "fired").read_text())
    failed = [r for r in results if r.outcome == "failed"]
    assert [r.key for r in failed] == [fired["run"]]
    assert "its Ray worker died in each of its 1 attempt(s)" in failed[0].error
    assert "\n" not in failed[0].error
    assert sorted(r.outcome for r in results) == ["failed", "trained", "trained", "trained"]
    assert {r["key"]: r["state"] for r in store.rows()}[fired["run"]] == "failed"
    again = run_study(spec, out, executor="ray", ensembles="off", progress=False,
                      options=ExecutorOptions(cpus_per_run=1))
    assert (again["already_done"], again["trained"], again["failed"]) == (3, 1, 0)


# ----------------------------------------------------------------------------- SLURM


if HAVE_SUBMITIT:
    from modbench.study.executors.slurm import SlurmExecutor, StudyTask

    class PreemptOnce(StudyTask):
        """The study's task with a fault: the first task to have every member of its job
        checkpointed sends itself SLURM's preemption signal (USR2, as submitit asks SLURM
        for), as a preempted job receives it."""

        def __init__(self, fault_dir: Path) -> None:
            self.fault_dir = fault_dir

        def __call__(self, job: Job) -> Any:
            _replace_hook(self.fault_dir, signal.SIGUSR2, after=len(job.keys))
            return super().__call__(job)

    class Crash(StudyTask):
        """A task that dies before it trains anything (as a node failure would look)."""

        def __call__(self, job: Job) -> Any:
            raise RuntimeError("the node caught fire\nsecond line of the traceback")


def _submitit_local(monkeypatch: pytest.MonkeyPatch, task: Any) -> None:
    """Run ``--executor slurm`` through submitit's local cluster: each array task a local
    process (importing this repository's tests), the same executor code otherwise."""
    import modbench.study.runner as runner

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), *filter(
        None, [os.environ.get("PYTHONPATH")])]))

    def local_cluster(name: str, workers: int | None, options: ExecutorOptions | None = None,
                      *, verbose: bool = False) -> Any:
        assert name == "slurm"
        check_options(name, options or ExecutorOptions(), workers)
        return SlurmExecutor(options or ExecutorOptions(), cluster="local", poll_s=0.2,
                             task=task)

    monkeypatch.setattr(runner, "make_executor", local_cluster)


@needs_submitit
def test_slurm_executor_on_submitit_local_equals_local_and_resumes_after_preemption(
        spec_file: Path, reference_stacked: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One job array (one task per method, its two seeds stacked); one task is preempted once
    both its seeds have a checkpoint, submitit requeues it and it resumes from them. The store,
    metrics and checkpoints end as the local executor's."""
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir()
    (fault_dir / "armed").touch()
    _submitit_local(monkeypatch, PreemptOnce(fault_dir))
    out = tmp_path / "slurm"
    c = run_study(load_spec(spec_file), out, executor="slurm", ensembles="on", progress=False,
                  options=ExecutorOptions(gpus_per_run=0, cpus_per_run=1, slurm_time=60))
    assert (c["trained"], c["failed"], c["busy"], c["failures"]) == (N_RUNS, 0, 0, [])
    fired = json.loads((fault_dir / "fired").read_text())
    assert_same_study(out, reference_stacked)
    logs = {p.name: p.read_text() for p in (out / "slurm").glob("*_log.out")}  # submitit's
    assert len([p for p in (out / "slurm").glob("*_submitted.pkl")]) == 2  # one task per job
    preempted = [n for n, text in logs.items() if "this job is preempted" in text]
    assert len(preempted) == 1 and "Requeued job" in logs[preempted[0]]
    assert_resumed(out / "runs" / fired["run"], fault_dir / "fired")
    assert all(r["lease"].startswith("slurm:") for r in Store(out).rows())


@needs_submitit
def test_slurm_tasks_load_the_spec_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """A spec's methods_from reaches SLURM array tasks (submitit's local cluster here): the
    plugin's method trains in the task's process and its run records the plugin."""
    from tests.methods.test_plugins import rezero

    plugin = rezero(tmp_path / "lab", "slurmgate")
    spec = dict(SPEC, name="slurm-plugin", methods=["slurmgate"],
                methods_from=[str(plugin)],
                seeds={"default": [0], "noise_floor": [0], "anchors": []})
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    _submitit_local(monkeypatch, StudyTask())
    out = tmp_path / "study"
    with plugins_restored(tmp_path_factory.getbasetemp()):
        c = run_study(load_spec(tmp_path / "spec.yaml"), out, executor="slurm",
                      ensembles="on", progress=False,
                      options=ExecutorOptions(gpus_per_run=0, cpus_per_run=1, slurm_time=10))
    assert (c["trained"], c["failed"], c["failures"]) == (2, 0, [])
    rows = Store(out).rows()
    assert all(r["lease"].startswith("slurm:") for r in rows)
    (run,) = [r for r in rows if r["method"] == "slurmgate"]
    meta = yaml.safe_load((out / "runs" / run["key"] / "config.yaml").read_text())["meta"]
    assert meta["methods"]["slurmgate"]["plugin"] == str(plugin)


@needs_submitit
def test_a_failed_slurm_task_fails_its_runs_in_one_line(
        spec_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _submitit_local(monkeypatch, Crash())
    out = tmp_path / "slurm-crash"
    spec = load_spec(spec_file)
    spec.methods = []  # the baseline's two seeds, stacked: one task
    c = run_study(spec, out, executor="slurm", ensembles="on", progress=False,
                  options=ExecutorOptions(gpus_per_run=0, cpus_per_run=1, slurm_time=10))
    assert (c["trained"], c["failed"]) == (0, 2)
    for f in c["failures"]:
        assert "\n" not in f and "ended" in f and "_log.err" in f
        assert "second line of the traceback" in f  # the error's last line
    assert {r["state"] for r in Store(out).rows()} == {"failed"}


def test_slurm_without_sbatch_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    out = tmp_path / "study"
    code = run_cli(["study", "run", str(spec), "--out", str(out), "--executor", "slurm",
                    "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert ("sbatch" in err) if HAVE_SUBMITIT else ("pip install 'modbench[cluster]'" in err)


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize("executor,module", [("ray", "ray"), ("slurm", "submitit")])
def test_a_missing_cluster_package_is_one_line(executor: str, module: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import ray` fails as if not installed
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    out = tmp_path / "study"
    assert run_cli(["study", "run", str(spec), "--out", str(out), "--executor", executor,
                    "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--executor {executor} needs the {module} package" in err
    assert "pip install 'modbench[cluster]'" in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize("args,msg", [
    (["--executor", "ray", "--slurm-partition", "gpu"],
     "--slurm-partition applies to --executor slurm only"),
    (["--executor", "slurm", "--ray-address", "auto"],
     "--ray-address applies to --executor ray only"),
    (["--executor", "slurm", "--workers", "4"], "--workers applies to --executor local"),
    (["--executor", "local", "--cpus-per-run", "4"], "--cpus-per-run applies to"),
    (["--executor", "local", "--gpus-per-run", "4", "--workers", "2"], "use --workers 1"),
    (["--executor", "k8s"], "unknown executor 'k8s'; use one of local, ray, slurm"),
    (["--executor", "slurm", "--slurm-time", "0"], "--slurm-time must be at least 1"),
    (["--executor", "slurm", "--slurm-extra", "mail-type"], "--slurm-extra takes KEY=VALUE"),
    (["--executor", "slurm", "--mfu", "0.3"], "add --dry-run"),
    (["--executor", "slurm", "--dry-run", "--mfu", "1.5"], "--mfu must be a fraction"),
    (["--executor", "slurm", "--dry-run", "--gpu-type", "H10"], "unknown --gpu-type 'H10'"),
])
def test_bad_executor_options_are_one_line(args: list[str], msg: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    out = tmp_path / "study"
    assert run_cli(["study", "run", str(spec), "--out", str(out), "--no-progress",
                    *args]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
    assert not out.exists()


def test_a_lease_takes_over_only_its_own_claims(tmp_path: Path) -> None:
    """A claim held by a dead process on another host blocks other workers (until stale) but
    not a later attempt of the job that holds it (the same lease); a lost job fails only the
    runs it held or never started."""
    store = Store(tmp_path)
    for k in ("a", "b", "c"):
        store.register(k, "tiny", "baseline", 0)
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("UPDATE runs SET state='running', worker='elsewhere:1', lease='ray:1', "
               "claimed_at=1e12 WHERE key IN ('a', 'b')")
    db.commit()
    db.close()
    assert store.release_dead() == 0  # another host's: not judged from here
    assert not store.claim("a") and not store.claim("a", lease="ray:2")
    assert store.claim("a", lease="ray:1")
    assert not store.fail_lost("b", "ray:2", "gone")  # someone else's claim stays
    assert store.fail_lost("b", "ray:1", "gone") and store.fail_lost("c", "ray:2", "gone")
    state = {r["key"]: (r["state"], r["error"]) for r in store.rows()}
    assert state == {"a": ("running", None), "b": ("failed", "gone"), "c": ("failed", "gone")}
    store.finish("a", {"status": "completed"}, None)
    assert not store.fail_lost("a", "ray:1", "late")  # done stays done


def test_an_index_from_before_leases_gets_the_column(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("CREATE TABLE runs (key TEXT PRIMARY KEY, scale TEXT NOT NULL, method TEXT NOT "
               "NULL, seed INTEGER NOT NULL, state TEXT NOT NULL DEFAULT 'pending', status "
               "TEXT, worker TEXT, claimed_at REAL, finished_at REAL, summary TEXT, eval TEXT, "
               "error TEXT)")
    db.execute("INSERT INTO runs (key, scale, method, seed) VALUES ('k', 'tiny', 'baseline', 0)")
    db.commit()
    db.close()
    store = Store(tmp_path)
    assert store.claim("k", lease="slurm:x")
    assert store.rows()[0]["lease"] == "slurm:x"


def test_multi_gpu_jobs_hold_one_run_each(spec_file: Path, tmp_path: Path) -> None:
    """--gpus-per-run N > 1: every run is its own torchrun job (nproc N), never stacked."""
    spec = load_spec(spec_file)
    runs = expand(spec)
    jobs = _jobs(tmp_path, runs, spec, stack=True, nproc=8)
    assert len(jobs) == N_RUNS and {(len(j.keys), j.nproc) for j in jobs} == {(1, 8)}
    assert {len(j.keys) for j in _jobs(tmp_path, runs, spec, stack=True)} == {2}


# ----------------------------------------------------------------------------- dry run


def _expected_gpu_hours(spec_name: str, peak_tflops: float, mfu: float) -> dict[str, float]:
    """GPU-hours per run, from flop_report: training tokens x train FLOPs per token, plus the
    validation passes (before training, every eval_every steps, at the end) x forward FLOPs."""
    out = {}
    for r in expand(load_spec(spec_name)):
        tc = r.config.train
        f = flop_report(r.config.model, tc.seq_len)
        n_val = 1 + len(range(tc.eval_every, tc.steps, tc.eval_every)) + 1
        flops = (f.train_flops_per_token * tc.steps * tc.batch_size * tc.seq_len
                 + f.forward_flops_per_token * tc.eval_sequences * tc.seq_len * n_val)
        out[r.label] = flops / (peak_tflops * 1e12 * mfu) / 3600
    return out


def _number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.mark.parametrize("extra,peak,mfu", [
    ([], PEAK_BF16_TFLOPS["H100"], 0.30),  # the documented defaults
    (["--gpu-tflops", "400", "--mfu", "0.5"], 400.0, 0.5),
])
def test_dry_run_prints_resources_and_gpu_hours_and_writes_nothing(
        extra: list[str], peak: float, mfu: float, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """seed002-1.2b on SLURM with 8 GPUs per run: one array task per run (torchrun groups
    never stack), each run's GPU-hours and the total as computed from its FLOPs here."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: a dry run does not need it
    # the jobs' memory plans (20 climb-1.2b methods: minutes of tracing) are
    # tests/study/test_dry_run_fits.py's; here the GPU-hours
    monkeypatch.setattr("modbench.study.plan.fit_jobs", lambda jobs, gpu: [])
    code = run_cli(["study", "run", "seed002-1.2b", "--executor", "slurm", "--dry-run",
                    "--gpus-per-run", "8", "--slurm-partition", "gpu", "--slurm-time", "720",
                    *extra])
    text = capsys.readouterr().out
    assert code == 0
    assert list(tmp_path.iterdir()) == []  # nothing written
    expected = _expected_gpu_hours("seed002-1.2b", peak, mfu)
    assert re.search(r"one job array of 26 task\(s\)", text)
    assert "8 GPU(s), 32 CPU(s), 8 processes (one torchrun group on one node)" in text
    assert "partition=gpu" in text and "720 min per job" in text
    seen = {}
    for line in text.splitlines():
        m = re.match(r"\s*\d+\s+(\S+) (s\d+)\s+\S+\s+\S+\s+(\d+)\s+([\d,.]+)\s+([\d,.]+)\s+(\d+)$",
                     line)
        if m:
            label = f"{m[1]}/{m[2]}"
            gpus, gpu_h, wall_h, timeouts = int(m[3]), _number(m[4]), _number(m[5]), int(m[6])
            assert gpus == 8
            assert gpu_h == pytest.approx(expected[label], abs=0.051)
            assert wall_h == pytest.approx(expected[label] / 8, abs=0.051)
            assert timeouts == max(0, math.ceil(expected[label] / 8 / 12) - 1)
            seen[label] = gpu_h
    assert seen.keys() == expected.keys()
    total = re.search(r"= ([\d,.]+) GPU-hours", text)
    assert total and _number(total[1]) == pytest.approx(sum(expected.values()), abs=0.051)


def test_dry_run_stacks_seeds_on_one_gpu_and_skips_done_runs(
        spec_file: Path, reference: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One GPU per job: a method's seeds share a job (its GPU-hours their sum); runs the
    folder has done are left out; the folder is read, not written."""
    index = reference / "index.sqlite"
    done = sorted(Store(reference).rows(), key=lambda r: r["key"])[0]
    db = sqlite3.connect(index)
    db.execute("UPDATE runs SET state='pending' WHERE key != ?", (done["key"],))
    db.commit()
    db.close()
    before = {p.name: p.stat().st_mtime_ns for p in reference.iterdir()}
    try:
        code = run_cli(["study", "run", str(spec_file), "--out", str(reference), "--executor",
                        "ray", "--dry-run", "--gpus-per-run", "1", "--gpu-tflops", "1e-9",
                        "--mfu", "1"])
        after = {p.name: p.stat().st_mtime_ns for p in reference.iterdir()}
    finally:
        db = sqlite3.connect(index)
        db.execute("UPDATE runs SET state='done'")
        db.commit()
        db.close()
    text = capsys.readouterr().out
    assert code == 0 and after == before
    assert f"3 of {N_RUNS} runs to train, 1 done" in text
    jobs = [line.split() for line in text.splitlines() if re.match(r"\s*\d+\s+tiny/", line)]
    labels = {j[1] + " " + j[2]: j for j in jobs}
    other = "s1" if done["seed"] == 0 else "s0"
    stacked = f"tiny/{'qknorm' if done['method'] == 'baseline' else 'baseline'} s0,s1"
    assert set(labels) == {stacked, f"tiny/{done['method']} {other}"}
    per_run = _expected_gpu_hours(str(spec_file), 1e-9, 1.0)
    assert _number(labels[stacked][6]) == pytest.approx(
        sum(v for k, v in per_run.items() if k.startswith(stacked.split()[0] + "/")), rel=1e-3)


def test_plan_refuses_what_run_refuses(spec_file: Path, tmp_path: Path) -> None:
    from modbench.study.plan import plan_study

    with pytest.raises(ModbenchError, match="--ray-address applies to --executor ray only"):
        plan_study(load_spec(spec_file), tmp_path, "local",
                   options=ExecutorOptions(ray_address="auto"))
    assert not any(tmp_path.iterdir())


def test_a_multi_gpu_job_trains_through_launch(spec_file: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A job with nproc > 1 trains its run with modbench.train.distributed.launch(cfg, out,
    nproc, resume=...) (here a stand-in that trains in process, so no GPU is needed), and
    records what it returns; a job with nproc 1 never calls it."""
    import types

    from modbench.study.runner import execute_job
    from modbench.train.trainer import train

    calls: list[tuple[str, int, bool]] = []

    def launch(cfg: Any, out_dir: Any, nproc: int, *, resume: bool = False,
               progress: bool = False) -> dict[str, Any]:
        calls.append((Path(out_dir).name, nproc, resume))
        return train(cfg, out_dir, resume=resume, progress=progress)

    fake = types.ModuleType("modbench.train.distributed")
    fake.launch = launch  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "modbench.train.distributed", fake)
    spec = load_spec(spec_file)
    spec.methods = []
    runs = expand(spec)
    store = Store(tmp_path)
    for r in runs:
        store.register(r.key, r.scale, r.method, r.seed)
    with torch_threads():
        jobs = _jobs(tmp_path, runs, spec, stack=True, nproc=4)
        results = [res for job in jobs for res in execute_job(job)]
        assert sorted(calls) == sorted((r.key, 4, False) for r in runs)
        assert [r.outcome for r in results] == ["trained", "trained"]
        assert {r["state"] for r in store.rows()} == {"done"}
        calls.clear()
        Store(tmp_path / "one").register(runs[0].key, "tiny", "baseline", 0)
        one = _jobs(tmp_path / "one", runs[:1], spec, stack=True)
        assert execute_job(one[0])[0].outcome == "trained" and calls == []
