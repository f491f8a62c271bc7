"""Run a study: train and evaluate what is missing, skip what is done, resume what was cut.

Executors take a list of :class:`Job` and yield results as jobs finish. ``local`` runs them
in this process (``workers=1``) or in a pool of worker processes, each claiming runs in the
store's index so no run is trained twice. The cluster executors, ``ray``
(:mod:`modbench.study.ray_executor`) and ``slurm`` (:mod:`modbench.study.slurm_executor`,
through submitit), ship :func:`~modbench.study.jobs.execute_job` and a
:class:`~modbench.study.jobs.Job` (both in :mod:`modbench.study.jobs`, below every executor,
and re-exported here) to a worker and return its result: the store's atomic claims make
them safe to run side by side, and a job's *lease* lets a retried or requeued attempt take
over the claims its dead predecessor left.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import multiprocessing
import os
import shlex
import shutil
import signal
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing import connection
from pathlib import Path
from typing import Any

import yaml

from modbench.errors import ModbenchError
from modbench.fsutil import atomic_write_text
from modbench.study.cluster import (
    EXECUTOR_NAMES,
    ExecutorOptions,
    check_options,
    nproc_for,
    require,
)
from modbench.study.jobs import (  # re-exported: the job code lives in study/jobs.py
    Executor,
    Job,
    JobResult,
    execute_job,
    lost_job_results,
)
from modbench.study.progress import StudyProgress, views_for
from modbench.study.spec import RunSpec, StudySpec, expand, run_spec
from modbench.study.store import Store, StoreWriteError

#: The study's inductor cache (TORCHINDUCTOR_CACHE_DIR), under its folder (docs/runs.md)
COMPILE_CACHE = ".cache/inductor"


def share_compile_cache(out: str | Path) -> Any:
    """One torch.compile cache (inductor's FX graphs, AOTAutograd entries and kernels) for
    every worker and run of the study in ``out``: ``TORCHINDUCTOR_CACHE_DIR`` set to
    ``out/.cache/inductor`` before any worker starts (spawned workers, and the jobs the
    cluster executors start from this environment, inherit it), so a run whose graph another
    run already compiled loads it warm instead of compiling cold. A cache directory the user
    set is kept. Returns what restores this process's environment."""
    key = "TORCHINDUCTOR_CACHE_DIR"
    before = os.environ.get(key)
    if before is None:
        os.environ[key] = str((Path(out) / COMPILE_CACHE).resolve())

    def restore() -> None:
        if before is None:
            os.environ.pop(key, None)
    return restore


def auto_workers() -> int:
    """``--workers`` left out: one worker per usable CPU core (at most 8; the process's affinity
    mask, so a SLURM allocation, not the whole node) on a machine without a GPU,
    each with one thread: small models run at least as fast on one thread, so processes, not
    threads, fill the cores. With CUDA, one worker (the local executor has one device)."""
    import torch

    from modbench.runtime.device import usable_cpus

    if torch.cuda.is_available():
        return 1
    return min(usable_cpus(), 8)


#: A job whose worker process dies (killed, out of memory, a crash below Python) goes to a
#: fresh worker; after this many deaths its unfinished runs are recorded as failed.
WORKER_DEATHS = 3


class LocalExecutor:
    """This machine: in process for one worker, else ``workers`` spawned worker processes
    sharing the CPU threads evenly.

    Each worker gets one job at a time over its own pipe, so the parent always knows which
    job a worker holds. A worker that dies mid-job (SIGKILL, the OOM killer) is noticed at
    once: its claims are released (:meth:`Store.release_dead`), the runs it finished are
    reported, and the rest of its job goes to a fresh worker (at most
    :data:`WORKER_DEATHS` times), while the other workers carry on."""

    def __init__(self, workers: int | None = None, gpus_per_run: int | None = None) -> None:
        workers = (1 if (gpus_per_run or 0) > 1 else auto_workers()) if workers is None \
            else workers
        if workers < 1:
            raise ModbenchError(f"--workers must be at least 1, got {workers}")
        self.workers = workers
        # only a torchrun group (> 1 GPU per run) changes what a local job does
        self.gpus_per_job = gpus_per_run if (gpus_per_run or 0) > 1 else None

    def close(self) -> None:
        pass

    def run(self, jobs: list[Job]) -> Iterator[list[JobResult]]:
        workers = min(self.workers, len(jobs))
        if workers <= 1:
            for job in jobs:
                yield execute_job(job)
            return
        from modbench.runtime.device import usable_cpus

        threads = max(1, usable_cpus() // workers)
        queue = collections.deque(dataclasses.replace(j, threads=threads) for j in jobs)
        ctx = multiprocessing.get_context("spawn")
        pool: list[_Worker] = []
        deaths: dict[tuple[str, ...], int] = {}
        try:
            while queue or any(w.job for w in pool):
                for w in pool:
                    if w.job is None and queue:
                        w.give(queue.popleft())
                while queue and len(pool) < workers:
                    pool.append(_Worker(ctx, queue.popleft()))
                ready = set(connection.wait([w.conn for w in pool]
                                            + [w.process.sentinel for w in pool]))
                for w in list(pool):
                    if w.conn in ready and w.job is not None:
                        try:
                            results = w.conn.recv()
                        except (EOFError, OSError):
                            pass  # it died while sending: handled below
                        else:
                            w.job = None
                            if isinstance(results, _IndexFailed):  # the study stops
                                raise ModbenchError(results.message)
                            yield results
                            continue
                    if w.process.sentinel in ready or w.conn in ready:
                        pool.remove(w)
                        lost = w.close()
                        if lost is not None:
                            yield from _requeue(lost, deaths, queue)
        except (KeyboardInterrupt, ModbenchError):  # Ctrl-C, or the index cannot be
            _interrupt(pool)  # written: every worker stops where it is, then ends
            raise
        except BaseException:
            for w in pool:
                w.process.terminate()
            raise
        finally:
            for w in pool:
                w.close()


#: seconds an interrupted worker gets to stop (close its files, release its run folder) and
#: exit on its own before it is terminated
STOP_WAIT_S = 60.0


def _interrupt(pool: list[_Worker]) -> None:
    """Ctrl-C reached the study (or the study stops on an index it cannot write): pass it on
    to every worker (a terminal's Ctrl-C reached them already; a second is ignored,
    :func:`_interrupt_once`), so each stops its run where it is (the run keeps its last
    checkpoint) and exits on its own, its finalizers run;
    terminated instead (SIGTERM, the pre-emption path that saves a step) they would leave the
    resource tracker warning of leaked semaphores, and each would print its own line."""
    for w in pool:
        if w.process.is_alive() and w.process.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(w.process.pid, signal.SIGINT)
    for w in pool:
        w.process.join(STOP_WAIT_S)


def _interrupt_once(signum: int, frame: Any) -> None:
    """A worker's SIGINT handler: the first stops the job (``KeyboardInterrupt``), later ones
    (the terminal's and the parent's both arrive) are ignored while it winds down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _requeue(job: Job, deaths: dict[tuple[str, ...], int],
             queue: collections.deque[Job]) -> Iterator[list[JobResult]]:
    """A job whose worker died: release its claims, report the runs it finished, and queue
    the rest again (after :data:`WORKER_DEATHS` deaths, the job is lost: :func:`lost_job_results`
    records its released runs as failed and leaves any another worker has claimed since)."""
    store = Store(job.root)
    store.release_dead()
    rows = {r["key"]: r for r in store.rows()}
    keep = [i for i, k in enumerate(job.keys) if rows.get(k, {}).get("state") != "done"]
    finished = [JobResult(k, label, "trained", rows[k]["status"])
                for k, label in zip(job.keys, job.labels, strict=True) if k in rows
                and rows[k]["state"] == "done"]
    if finished:
        yield finished
    if not keep:
        return
    rest = dataclasses.replace(job, keys=tuple(job.keys[i] for i in keep),
                               labels=tuple(job.labels[i] for i in keep),
                               configs=tuple(job.configs[i] for i in keep))
    n = deaths[rest.keys] = deaths.get(job.keys, 0) + 1
    if n < WORKER_DEATHS:
        queue.appendleft(rest)
        return
    yield lost_job_results(rest, f"its worker process died {n} times (killed, or out of "
                                 "memory); run `modbench study run` again to retry it")


@dataclass(frozen=True)
class _IndexFailed:
    """A worker's answer when the study's index cannot be written (:class:`StoreWriteError`):
    its one line, for the parent to stop the study with."""

    message: str


def _worker_main(conn: Any) -> None:
    """A worker process: run the jobs that arrive on ``conn`` until it sends None."""
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        while (job := conn.recv()) is not None:
            try:
                conn.send(execute_job(job))
            except StoreWriteError as e:  # one line to the parent, no traceback here
                conn.send(_IndexFailed(str(e)))
                return
    except (EOFError, KeyboardInterrupt):  # the parent is gone, or Ctrl-C reached us too
        pass


class _Worker:
    """One worker process of :class:`LocalExecutor`, its pipe and the job it holds."""

    def __init__(self, ctx: Any, job: Job) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.job: Job | None = None
        self.give(job)

    def give(self, job: Job) -> None:
        self.job = job
        self.conn.send(job)

    def close(self) -> Job | None:
        """Stop the worker (if it still runs); return the job it died holding, if any."""
        if self.process.is_alive() and self.job is None:
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()
        self.conn.close()
        lost, self.job = self.job, None
        return lost


EXECUTORS = EXECUTOR_NAMES


def make_executor(name: str, workers: int | None, options: ExecutorOptions | None = None,
                  *, verbose: bool = False) -> Executor:
    """The executor ``name`` (``local``, ``ray`` or ``slurm``) with ``options`` checked; the
    cluster executors import ray or submitit only here."""
    opts = options or ExecutorOptions()
    check_options(name, opts, workers)
    if name == "ray":
        require("ray", "ray")
        from modbench.study.ray_executor import RayExecutor

        return RayExecutor(opts, verbose=verbose)
    if name == "slurm":
        require("submitit", "slurm")
        from modbench.study.slurm_executor import SlurmExecutor

        return SlurmExecutor(opts, verbose=verbose)
    return LocalExecutor(workers, opts.gpus_per_run)


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


def stack_memory(executor: str, gpus: int | None) -> int | None:
    """The device memory (bytes) stacked seeds are planned against (:func:`_jobs`): the
    local GPU's, or on a cluster of one GPU per job the catalogue's H100 80 GB (a run's
    ``train.device_memory_gb`` overrides either); None on the CPU, where RAM does not bound
    stacking."""
    if executor != "local":
        if gpus != 1:
            return None
        from modbench.runtime.gpus import lookup

        return lookup("h100-80gb").memory_bytes
    import torch

    if not torch.cuda.is_available():
        return None
    from modbench.runtime.gpus import device_memory_bytes

    return device_memory_bytes(torch.device("cuda", 0))


def run_study(spec: StudySpec, out: str | Path, *, executor: str = "local",
              workers: int | None = 1, until_decided: int | None = None,
              ensembles: str = "auto", progress: bool = True,
              options: ExecutorOptions | None = None,
              spending: str = "obrien_fleming") -> dict[str, Any]:
    """Run every missing run of ``spec`` into the study folder ``out``.

    ``executor``: ``local``, ``ray`` or ``slurm``, with its resources and cluster settings in
    ``options`` (:class:`modbench.study.cluster.ExecutorOptions`).
    ``workers``: parallel worker processes of the local executor (None: :func:`auto_workers`).
    ``ensembles``: whether a method's seeds at a scale train stacked in one process
    (:func:`use_ensembles`; methods that cannot stack train seed by seed).

    ``until_decided=N``: afterwards, add seeds as a group-sequential design, up to N seeds per
    group: at each look the verdict's own test at the alpha that look spends (Lan–DeMets
    ``spending``: ``obrien_fleming`` or ``pocock``), the baseline's seeds first, one more
    seed for each method not yet decided (:func:`modbench.analysis.stats.sequential_look`);
    the looks are kept in the study folder (``analysis.results.LOOKS_FILE``) and the report
    judges the study by them.
    """
    if until_decided is not None:
        from modbench.analysis.stats import SPENDING

        if until_decided < 2 or spending not in SPENDING:
            raise ModbenchError(f"--until-decided needs at least 2 seeds per group (got "
                                f"{until_decided}) and --spending one of "
                                f"{', '.join(SPENDING)} (got {spending!r})")
    runs = expand(spec)
    if ensembles not in ENSEMBLES:
        use_ensembles(ensembles)  # the one-line error, before anything is written
    from modbench.train.trackers import check_trackers

    check_trackers(dict.fromkeys(t for r in runs for t in r.config.train.trackers))
    fresh = not Path(out).exists()  # a study refused before any run started leaves nothing
    restore_env = share_compile_cache(out)  # before any worker starts
    try:
        ex = make_executor(executor, workers, options, verbose=progress)  # checks the options
    except BaseException:
        restore_env()
        raise
    try:
        store = Store(out)
        atomic_write_text(Path(out) / "spec.yaml",
                          yaml.safe_dump(spec.to_dict(), sort_keys=False))
        store.release_dead()
        counts: dict[str, Any] = {"total": 0, "already_done": 0, "trained": 0, "skipped": 0,
                                  "failed": 0, "busy": 0, "diverged": 0, "stalled": 0,
                                  "added_seeds": 0}
        failures: list[str] = []
        gpus = ex.gpus_per_job
        nproc = nproc_for(gpus)
        stack = use_ensembles(ensembles, None if executor == "local" else gpus)
        memory = stack_memory(executor, gpus) if stack else None
        asked: set[str] = set()
        while runs:
            _execute(store, runs, spec, out, ex, counts, failures, progress, stack, nproc,
                     memory)
            if until_decided is None:
                break
            runs = _undecided_runs(spec, out, until_decided, spending)
            if {r.key for r in runs} <= asked:  # the same runs again: they failed, stop
                break
            asked = {r.key for r in runs}
            counts["added_seeds"] += len(runs)
    except ModbenchError:
        if fresh and not any((Path(out) / "runs").glob("*")):
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        ex.close()
        restore_env()
    counts["failures"] = failures
    return counts


def _execute(store: Store, runs: list[RunSpec], spec: StudySpec, out: str | Path, ex: Executor,
             counts: dict[str, Any], failures: list[str], progress: bool,
             stack: bool = False, nproc: int = 1, memory: int | None = None) -> None:
    for r in runs:
        store.register(r.key, r.scale, r.method, r.seed)
    todo = [r for r in runs if store.state(r.key) != "done"]
    _prepare_data(todo, progress)
    counts["total"] += len(runs)
    counts["already_done"] += len(runs) - len(todo)
    # live progress: each running run's step, loss and tokens/s, an ETA from step times
    bar = StudyProgress(spec.name, views_for(todo, store), store, enabled=progress,
                        done_before=len(runs) - len(todo), workers=getattr(ex, "workers", None))
    try:
        for results in ex.run(_jobs(out, todo, spec, stack, nproc, memory)):
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


def _undecided_runs(spec: StudySpec, out: str | Path, cap: int,
                    spending: str = "obrien_fleming") -> list[RunSpec]:
    """One look of the group-sequential design at each scale
    (:func:`modbench.analysis.stats.sequential_look`, with the report's verdict rule): the new
    seeds it asks for (a method's next seed numbers above its first, a gap first: a run of an
    earlier wave left unfinished), the look recorded in the study folder (``LOOKS_FILE``). A
    scale whose last look asked for nothing and whose seeds have not changed since gets no new
    look."""
    from modbench.analysis.results import (
        ALPHA,
        LOOKS_FILE,
        default_metric,
        looks_json,
        metric_table,
        read_looks,
        verdict_options,
    )
    from modbench.analysis.stats import sequential_look
    from modbench.study.results import load_rows

    metric = default_metric(spec.evaluation.primary, spec.evaluation.tasks)
    rows = load_rows(out)
    looks = read_looks(out)
    new: list[RunSpec] = []
    for scale in spec.scales:
        table = metric_table(rows, scale, metric, spec.baseline)
        if spec.baseline not in table:
            continue
        history = looks.setdefault(scale, [])
        if history and (history[-1].cap, history[-1].spending) != (cap, spending):
            raise ModbenchError(
                f"the looks of {scale} were planned for --until-decided {history[-1].cap} "
                f"--spending {history[-1].spending}; go on with those, or remove "
                f"{Path(out) / LOOKS_FILE} to start a new design")
        seeds = {m: len(s) for m, s in table.items()}
        if history and history[-1].last and dict(history[-1].seeds) == seeds:
            continue
        look = sequential_look(table, history, cap, baseline=spec.baseline, alpha=ALPHA,
                               spending=spending, n_resamples=1,
                               **verdict_options(rows, scale, metric,
                                                 list(spec.seeds.anchors), table))
        history.append(look)
        for method, k in look.add.items():
            have = set(table.get(method) or ())
            # the next seeds above the first (a gap: a run of an earlier wave left unfinished)
            seed, seeds = (min(have) + 1 if have else 0), []
            while len(seeds) < k:
                if seed not in have:
                    seeds.append(seed)
                seed += 1
            new += [run_spec(spec, scale, method, s) for s in seeds]
    if any(looks.values()):
        atomic_write_text(Path(out) / LOOKS_FILE, looks_json(looks))
    return new


def _jobs(out: str | Path, runs: list[RunSpec], spec: StudySpec, stack: bool,
          nproc: int = 1, memory: int | None = None) -> list[Job]:
    """One job per run; with ``stack``, one job per group of runs that differ only in their
    init seed (same scale, method and data order) when the method can stack, and, with
    ``memory`` (device bytes, :func:`stack_memory`), only as many seeds a job as the memory
    plan fits on that device (:func:`modbench.analysis.plan.max_ensembles`). With ``nproc``
    > 1 every run is one torchrun group: one run per job."""
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
            from modbench.analysis.plan import max_ensembles

            k = max_ensembles(group[0].config, memory, len(group), device_type="cuda")
            batches += [group[i:i + k] for i in range(0, len(group), k)]
        else:
            batches.append(group)
    ev = dataclasses.asdict(spec.evaluation)
    return [Job(str(out), tuple(r.key for r in b), tuple(r.label for r in b),
                tuple(r.config.to_dict() for r in b), ev, nproc=nproc) for b in batches]


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
