"""The local executor (``modbench study run --executor local``, the default): this machine.

One worker runs the jobs in this process; more (``--workers``) run them in spawned worker
processes sharing the CPU threads evenly, each claiming runs in the store's index so no run
is trained twice. A run on several GPUs (``--gpus-per-run N``, N > 1) is one torchrun group
on this machine's GPUs, so one worker. Jobs get whatever device this machine has: its GPU
accounting is CUDA's here.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modbench.errors import ModbenchError
from modbench.study.executors.base import ExecutorKind, per_run, register
from modbench.study.jobs import Job, JobResult, execute_job, lost_job_results
from modbench.study.store import Store, StoreWriteError

if TYPE_CHECKING:
    from modbench.runtime.gpus import Accelerator


@dataclass(frozen=True)
class LocalOptions:
    """``--workers`` (None: :func:`auto_workers`) and ``--gpus-per-run`` (> 1: each run a
    torchrun group on this machine's GPUs)."""

    gpus_per_run: int | None = None
    workers: int | None = None


class LocalKind(ExecutorKind):
    name = "local"
    summary = "this machine"
    options_type = LocalOptions

    def check(self, opts: LocalOptions) -> None:
        if (opts.gpus_per_run or 0) > 1 and opts.workers not in (None, 1):
            raise ModbenchError(f"--gpus-per-run {opts.gpus_per_run} runs each run on "
                                f"{opts.gpus_per_run} GPUs of this machine: use --workers 1 "
                                f"(got {opts.workers})")

    def create(self, opts: LocalOptions, *, verbose: bool = False) -> LocalExecutor:
        return LocalExecutor(opts.workers, opts.gpus_per_run)

    def ensemble_gpus(self, gpus: int | None) -> int | None:
        return None  # this machine's CUDA decides

    def stack_memory(self, gpus: int | None) -> int | None:
        """This machine's GPU memory (None on the CPU, where RAM does not bound stacking)."""
        import torch

        if not torch.cuda.is_available():
            return None
        from modbench.runtime.gpus import device_memory_bytes

        return device_memory_bytes(torch.device("cuda", 0))

    def memory_gpu(self, gpus: int | None, gpu_type: str | None = None) -> Accelerator | None:
        """This machine's first GPU with its own memory (``--gpu-type`` names the estimate's
        GPU, not this one); None without CUDA: nothing is checked."""
        import torch

        if not torch.cuda.is_available():
            return None
        from modbench.runtime.gpus import Accelerator, detect, device_memory_bytes

        dev = torch.device("cuda", 0)
        return detect(dev) or Accelerator("cuda", torch.cuda.get_device_name(dev),
                                          device_memory_bytes(dev) / 1e9, None)

    def plan_gpus(self, opts: LocalOptions) -> int:
        if (opts.gpus_per_run or 0) > 1:
            return int(opts.gpus_per_run or 0)
        import torch

        return 1 if torch.cuda.is_available() else 0

    def plan_cpus(self, opts: LocalOptions, gpus: int) -> int:
        return 0  # the workers share this machine's cores

    def settings(self, opts: LocalOptions, out: Path, gpus: int, cpus: int, nproc: int,
                 n_jobs: int) -> list[tuple[str, str]]:
        w = 1 if nproc > 1 else (opts.workers if opts.workers is not None else auto_workers())
        return [("executor", f"local: {w} worker process(es) on this machine"),
                ("per job", f"{gpus} GPU(s), {per_run(nproc)}")]

    def warnings(self, opts: LocalOptions, timeouts: list[int | None],
                 gpus: int) -> list[str]:
        return [] if gpus else ["no GPU on this machine: no GPU-hours to estimate"]


register(LocalKind())


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

