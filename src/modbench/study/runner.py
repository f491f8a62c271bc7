"""Run a study: train and evaluate what is missing, skip what is done, resume what was cut.

Executors take a list of :class:`Job` and yield results as jobs finish; the runner asks the
registry (:mod:`modbench.study.executors`) for the one a study names and never compares
names. ``local`` (:mod:`modbench.study.executors.local`) runs jobs in this process or in a
pool of worker processes, each claiming runs in the store's index so no run is trained
twice. The cluster executors, ``ray`` (:mod:`modbench.study.executors.ray`) and ``slurm``
(:mod:`modbench.study.executors.slurm`, through submitit), ship
:func:`~modbench.study.jobs.execute_job` and a :class:`~modbench.study.jobs.Job` (both in
:mod:`modbench.study.jobs`, below every executor, and re-exported here, as the local
executor's names are) to a worker and return its result: the store's atomic claims make them
safe to run side by side, and a job's *lease* lets a retried or requeued attempt take over
the claims its dead predecessor left.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from modbench.errors import ModbenchError
from modbench.fsutil import atomic_write_text
from modbench.study import executors
from modbench.study.executors import nproc_for
from modbench.study.executors.local import WORKER_DEATHS, LocalExecutor, _requeue, auto_workers  # noqa: F401
from modbench.study.jobs import Executor, Job, JobResult, execute_job, lost_job_results  # noqa: F401
from modbench.study.progress import StudyProgress, views_for
from modbench.study.spec import RunSpec, StudySpec
from modbench.study.stages import RunSettings, stages_for
from modbench.study.store import Store

#: The study's inductor cache (TORCHINDUCTOR_CACHE_DIR), under its folder (docs/runs.md)
COMPILE_CACHE = ".cache/inductor"
#: The warnings given once per study (``MODBENCH_WARN_ONCE_DIR``), under its folder
WARNED = ".cache/warned"


def share_compile_cache(out: str | Path) -> Any:
    """One torch.compile cache (inductor's FX graphs, AOTAutograd entries and kernels) for
    every worker and run of the study in ``out``: ``TORCHINDUCTOR_CACHE_DIR`` set to
    ``out/.cache/inductor`` before any worker starts (spawned workers, and the jobs the
    cluster executors start from this environment, inherit it), so a run whose graph another
    run already compiled loads it warm instead of compiling cold. A cache directory the user
    set is kept. Also sets ``MODBENCH_WARN_ONCE_DIR`` (``out/.cache/warned``), so that a
    warning every run of a graph would give (a model that cannot compile and trains eagerly:
    :func:`modbench.runtime.device.warn_once`) is given once per study. Returns what restores
    this process's environment."""
    from modbench.runtime.device import WARN_ONCE_ENV

    settings = {"TORCHINDUCTOR_CACHE_DIR": Path(out) / COMPILE_CACHE,
                WARN_ONCE_ENV: Path(out) / WARNED}
    before = {key: os.environ.get(key) for key in settings}
    for key, folder in settings.items():
        if before[key] is None:
            os.environ[key] = str(folder.resolve())

    def restore() -> None:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
    return restore


def make_executor(name: str, workers: int | None, options: Mapping[str, Any] | None = None,
                  *, verbose: bool = False) -> Executor:
    """The executor registered as ``name`` (:mod:`modbench.study.executors`), its ``options``
    (and ``--workers``) read and checked by its kind; a cluster executor's package (ray,
    submitit) is imported only here."""
    kind = executors.get(name)
    return kind.create(kind.options(options, workers), verbose=verbose)


ENSEMBLES = ("auto", "on", "off")


def use_ensembles(choice: str, gpus_per_job: int | None = None) -> bool:
    """``--ensembles``: ``on``, ``off``, or ``auto`` = on with a GPU only: CUDA on this machine
    (the local executor, ``gpus_per_job`` None), or one GPU per job on a cluster. On the CPU
    stacking seeds measured no faster than training them one by one (BENCHMARKS.md), while
    worker processes do fill the cores; on a GPU one small model leaves the device mostly
    idle. Runs on several GPUs each (torchrun groups) never stack."""
    if choice not in ENSEMBLES:
        raise ModbenchError(f"--ensembles must be one of {', '.join(ENSEMBLES)}, got {choice!r}")
    if gpus_per_job is not None and gpus_per_job > 1:
        return False
    if choice == "auto":
        if gpus_per_job is not None:
            return gpus_per_job == 1
        import torch

        return torch.cuda.is_available()
    return choice == "on"


def check_until_decided(until_decided: int | None) -> None:
    """``--until-decided N``: a look compares groups of at least two seeds (None: off)."""
    if until_decided is not None and until_decided < 2:
        raise ModbenchError(f"--until-decided must be at least 2 seeds per group (a look "
                            f"compares two or more), got {until_decided}; give 2 or more, or "
                            "leave it out to run the spec's seeds only")


def check_spending(spending: str) -> None:
    """``--spending``: one of the α-spending functions
    (:data:`modbench.analysis.stats.SPENDING`)."""
    from modbench.analysis.stats import SPENDING

    if spending not in SPENDING:
        raise ModbenchError(f"--spending must be one of {', '.join(SPENDING)}, got "
                            f"{spending!r}")


def check_futility(futility: float | None) -> None:
    """``--futility``: a conditional power between 0 and 1 (None: off)."""
    from modbench.analysis.stats import check_futility as check

    try:
        check(futility)
    except ValueError:
        raise ModbenchError(f"--futility must be a conditional power between 0 and 1, "
                            f"exclusive (e.g. 0.1), got {futility!r}; leave it out to never "
                            "stop a method for futility") from None


def check_study_run(spec: StudySpec, runs: list[RunSpec], until_decided: int | None) -> None:
    """What ``modbench study run`` refuses of a spec with its options before anything is
    written, which ``--dry-run`` refuses too: ``--until-decided`` on a tuned study, and a
    tracker in the runs' ``train.trackers`` that cannot start."""
    if until_decided is not None and spec.tuning is not None:
        raise ModbenchError("--until-decided adds seeds a tuned study's stages do not follow; "
                            "run the tuned study with fixed seeds, or drop its tuning block")
    from modbench.train.trackers import check_trackers

    check_trackers(dict.fromkeys(t for r in runs for t in r.config.train.trackers))


def run_study(spec: StudySpec, out: str | Path, *, executor: str = "local",
              workers: int | None = 1, until_decided: int | None = None,
              ensembles: str = "auto", progress: bool = True,
              options: Mapping[str, Any] | None = None,
              spending: str = "obrien_fleming",
              runs: list[RunSpec] | None = None,
              replicate: Sequence[str] = (),
              futility: float | None = None,
              gpu_type: str | None = None) -> dict[str, Any]:
    """Run every missing run of ``spec`` into the study folder ``out``, stage by stage
    (:mod:`modbench.study.stages`): the study's own runs; with ``until_decided=N`` the seeds a
    group-sequential design adds, up to N per group (Lan–DeMets ``spending``:
    ``obrien_fleming`` or ``pocock``; ``futility``: stop a method whose conditional power
    under the current trend is below it, None never; :mod:`modbench.study.stages.sequential`);
    with a ``tuning`` block its tuning and tuned stages in ``out/tuning`` and ``out/tuned``
    (:mod:`modbench.study.stages.tuning`). Every stage's runs are added to the counts.

    ``executor``: a registered executor's name (:func:`modbench.study.executors.names`:
    ``local``, ``ray``, ``slurm``), with the options given to it in ``options``
    (:class:`modbench.study.executors.ExecutorOptions`, or its kind's options dataclass); one
    executor runs every stage. ``workers``: parallel worker processes of the local executor
    (None: :func:`auto_workers`). ``ensembles``: whether a method's seeds at a scale train
    stacked in one process (:func:`use_ensembles`; methods that cannot stack train seed by
    seed). ``runs``: these runs instead of the spec's own. ``replicate``: run only the
    replication of the (finished) study under these changes (``study replicate --change``,
    :mod:`modbench.study.stages.replication`). Each stage's jobs are checked against the GPU
    the executor gives them (:meth:`ExecutorKind.memory_gpu
    <modbench.study.executors.base.ExecutorKind.memory_gpu>`: ``gpu_type``, else a cluster's
    assumed H100 80 GB, or the local executor's CUDA device) before their data is prepared:
    jobs whose memory plan fits nothing are refused (:class:`modbench.study.fits.JobsDoNotFit`).
    """
    check_until_decided(until_decided)
    check_spending(spending)
    check_futility(futility)
    kind = executors.get(executor)  # an unknown name: one line, before anything is written
    if spec.methods_from:  # a spec built in Python: its plugins, recorded absolute
        from modbench.methods.plugins import load_plugins

        spec.methods_from = [p.ref for p in load_plugins(spec.methods_from)]
    stages = stages_for(spec, out, RunSettings(
        until_decided, spending, runs, futility=futility, replicate=tuple(replicate),
        only=("replication",) if replicate else None))
    check_study_run(spec, stages[0].runs() or [], until_decided)
    for stage in stages:
        stage.check()
    if ensembles not in ENSEMBLES:
        use_ensembles(ensembles)  # the one-line error, before anything is written
    restore_env = share_compile_cache(out)  # before any worker starts
    try:
        ex = make_executor(executor, workers, options, verbose=progress)  # checks the options
    except BaseException:
        restore_env()
        raise
    session = StudySession(ex, use_ensembles(ensembles, kind.ensemble_gpus(ex.gpus_per_job)),
                           kind.stack_memory, progress)
    try:
        session.gpu = kind.memory_gpu(ex.gpus_per_job, gpu_type)
        for stage in stages:
            stage.run(session)
    except ModbenchError:
        session.remove_fresh()  # a study refused before any run started leaves nothing
        raise
    finally:
        ex.close()
        restore_env()
    return session.counts


def replicate_study(folder: str | Path, changes: Sequence[str], **options: Any
                    ) -> dict[str, Any]:
    """Replicate the finished study in ``folder`` under each of ``changes`` (``threads=2``,
    ``onednn``, ...; :data:`modbench.study.stages.replication.FACTORS`), with its recorded
    spec; ``options``: :func:`run_study`'s (executor, workers, progress, ...)."""
    from modbench.study.results import check_study_folder, load_spec_of
    from modbench.study.stages.replication import parse_change

    if not changes:
        raise ModbenchError("give at least one --change FACTOR (e.g. --change threads=2)")
    for c in changes:
        parse_change(c)
    check_study_folder(Path(folder))
    spec = load_spec_of(folder)
    if spec is None:
        raise ModbenchError(f"{folder} has no spec.yaml to replicate; run `modbench study "
                            "run` on it first")
    return run_study(spec, folder, replicate=list(changes), **options)


class StudySession:
    """The runner's :class:`~modbench.study.stages.Session`: one executor for every stage of
    a study, the counts they add up to, and each study folder (the study's, ``tuning/``,
    ``tuned/``) made on its first use: its results store, its ``spec.yaml``, the claims of
    workers gone released."""

    def __init__(self, ex: Executor, stack: bool, stack_memory: Any, progress: bool) -> None:
        self.ex, self.progress = ex, progress
        self.nproc = nproc_for(ex.gpus_per_job)
        self.stack = stack
        self.memory = stack_memory(ex.gpus_per_job) if stack else None
        self.counts: dict[str, Any] = {
            "total": 0, "already_done": 0, "trained": 0, "skipped": 0, "failed": 0, "busy": 0,
            "paused": 0, "dropped": 0, "diverged": 0, "stalled": 0, "added_seeds": 0,
            "failures": []}
        self.stores: dict[Path, Store] = {}
        self.fresh: list[Path] = []
        self.gpu: Any = None  # the GPU each job's memory plan is checked on (None: none)
        self.planned: dict[str, Any] = {}  # the plans made, for the next stages' jobs

    def store(self, spec: StudySpec, folder: Path) -> Store:
        if folder not in self.stores:
            if not folder.exists():
                self.fresh.append(folder)
            store = Store(folder)
            atomic_write_text(folder / "spec.yaml",
                              yaml.safe_dump(spec.to_dict(), sort_keys=False))
            store.release_dead()
            self.stores[folder] = store
        return self.stores[folder]

    def execute(self, spec: StudySpec, folder: Path, runs: list[RunSpec],
                until: int | None = None) -> None:
        store = self.store(spec, Path(folder))
        _execute(store, runs, spec, folder, self.ex, self.counts, self.counts["failures"],
                 self.progress, self.stack, self.nproc, self.memory, until,
                 self.check_fits if self.gpu is not None else None)

    def check_fits(self, jobs: list[Job]) -> None:
        """Refuse the jobs whose memory plan fits nothing on :attr:`gpu`
        (:mod:`modbench.study.fits`), each plan made once a session."""
        from modbench.study.fits import check_fits, fit_jobs

        check_fits(fit_jobs(jobs, self.gpu, self.planned), self.gpu)

    def remove_fresh(self) -> None:
        """Remove each study folder this session made in which no run started: no run
        folder, and every run of its index still pending (the deepest folder first)."""
        for folder in reversed(self.fresh):
            store = self.stores.get(folder)  # None: its store could not be made
            started = any((folder / "runs").glob("*")) or (store is not None and any(
                r["state"] != "pending" for r in store.rows()))
            if not started:
                shutil.rmtree(folder, ignore_errors=True)


def _execute(store: Store, runs: list[RunSpec], spec: StudySpec, out: str | Path, ex: Executor,
             counts: dict[str, Any], failures: list[str], progress: bool,
             stack: bool = False, nproc: int = 1, memory: int | None = None,
             until: int | None = None,
             check: Callable[[list[Job]], None] | None = None) -> None:
    """Train ``runs`` (those not done) through ``ex``; with ``until``, only to that step
    (paused runs go back to pending; not counted, the call that trains them to the end
    counts them). ``check`` refuses jobs first, before any data work (the session's memory
    check: :meth:`StudySession.check_fits`)."""
    for r in runs:
        store.register(r.key, r.scale, r.method, r.seed)
    todo = [r for r in runs if store.state(r.key) != "done"]
    made = _jobs(out, todo, spec, stack, nproc, memory)
    if check is not None and made:
        check(made)
    _prepare_data(todo, progress)
    if until is None:
        counts["total"] += len(runs)
        counts["already_done"] += len(runs) - len(todo)
    # live progress: each running run's step, loss and tokens/s, an ETA from step times
    bar = StudyProgress(spec.name, views_for(todo, store), store, enabled=progress,
                        done_before=len(runs) - len(todo), workers=getattr(ex, "workers", None))
    try:
        jobs = [dataclasses.replace(j, until=until) for j in made]
        for results in ex.run(jobs):
            for res in results:
                counts[res.outcome] += 1
                counts["diverged"] += res.status == "diverged"
                counts["stalled"] += res.status == "stalled"
                if res.error:
                    failures.append(f"{res.label}: {res.error}")
                bar.finished(res)
    finally:
        bar.close()


def _prepare_data(runs: list[RunSpec], progress: bool) -> None:
    """Open (and for the built-in corpus, prepare) each distinct data set once here, before
    workers start, so they never prepare the same data side by side or wait on it."""
    from modbench.runtime.data import open_data

    seen: set[tuple[str, int, int]] = set()
    for r in runs:
        c = r.config
        key = (c.data.source, c.model.vocab_size, c.train.seq_len)
        if key not in seen:
            seen.add(key)
            open_data(c, progress=progress)


def _jobs(out: str | Path, runs: list[RunSpec], spec: StudySpec, stack: bool,
          nproc: int = 1, memory: int | None = None) -> list[Job]:
    """One job per run; with ``stack``, one job per group of runs that differ only in their
    init seed (same scale, method and data order) when the method can stack, and, with
    ``memory`` (device bytes, the executor kind's ``stack_memory``), only as many seeds a job
    as the memory plan fits on that device (:func:`modbench.measure.plan.max_ensembles`).
    With ``nproc`` > 1 every run is one torchrun group: one run per job."""
    from modbench.methods.build import plan

    groups: dict[str, list[RunSpec]] = {}
    for r in runs:
        d = r.config.to_dict()
        d.pop("seed")
        same = json.dumps(d, sort_keys=True) if stack and nproc == 1 else r.key
        groups.setdefault(same, []).append(r)
    batches: list[list[RunSpec]] = []
    for group in groups.values():
        if len(group) > 1 and not plan(group[0].config.model).stackable:
            batches += [[r] for r in group]
        elif len(group) > 1 and memory is not None:
            from modbench.measure.plan import max_ensembles

            k = max_ensembles(group[0].config, memory, len(group), device_type="cuda")
            batches += [group[i:i + k] for i in range(0, len(group), k)]
        else:
            batches.append(group)
    ev = dataclasses.asdict(spec.evaluation)
    return [Job(str(out), tuple(r.key for r in b), tuple(r.label for r in b),
                tuple(r.config for r in b), ev, nproc=nproc,
                plugins=tuple(spec.methods_from)) for b in batches]


def study_status(out: str | Path) -> list[dict[str, Any]]:
    from modbench.study.results import check_study_folder

    check_study_folder(Path(out))
    return Store(out).rows()


def group_rows(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows:
        k = r["status"] if r["state"] == "done" else r["state"]
        counts[k] = counts.get(k, 0) + 1
    return counts


def interrupted_line(spec: str | None, out: str | Path | None) -> str:
    """The one line an interrupted ``modbench study run SPEC --out OUT`` prints (Ctrl-C, from
    the command line): how many runs are finished and kept, how many will resume from their
    last checkpoint, and the command that goes on."""
    from modbench.runtime.runfolder import CHECKPOINT
    from modbench.study.store import INDEX

    again = " ".join(["modbench study run", *([shlex.quote(spec)] if spec else []),
                      *(["--out", shlex.quote(str(out))] if out is not None else [])])
    try:
        from modbench.study.spec import load_spec

        folder = Path(out) if out is not None else Path("studies") / load_spec(spec).name
        if not (folder / INDEX).is_file():
            return f"interrupted before any run started: nothing was saved; `{again}` starts it"
        store = Store(folder)
        rows = store.rows()
    except Exception:
        return f"interrupted; `{again}` goes on where it stopped"
    done = sum(r["state"] == "done" for r in rows)
    cut = sum(r["state"] != "done" and (store.run_dir(r["key"]) / CHECKPOINT).is_file()
              for r in rows)
    return (f"interrupted: {done} of {len(rows)} runs finished and kept in {folder}"
            + (f", {cut} more resume{'s' if cut == 1 else ''} from the last checkpoint"
               f"{'' if cut == 1 else 's'}" if cut else "")
            + f"; `{again}` goes on where it stopped")
