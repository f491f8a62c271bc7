"""The Ray executor (``modbench study run --executor ray``), every job one Ray task: its kind
(the options ``--ray-address``, ``--gpus-per-run``, ``--cpus-per-run``, their checks, its
``--dry-run`` rows and GPU accounting) and the executor. ray itself is imported only when the
executor connects, so ``--help`` and ``--dry-run`` need none.

Each task declares its resources (``num_gpus``, ``num_cpus``: ``--gpus-per-run``,
``--cpus-per-run``), so Ray places it on a node with room for it; a run on several GPUs is
one task holding them all on one node, which trains it as a torchrun group. Results come back
as tasks finish (``ray.wait``). A task whose worker process dies (killed, out of memory, its
node lost) is run again by Ray (``max_retries``); the job carries a lease, so the new attempt
takes over the claims the dead one left in the results store, on this node or another, and
resumes its runs from their last checkpoints. A job out of retries has its unfinished runs
recorded as failed. The study folder must be on a file system every node shares.

Without ``--ray-address`` a local Ray instance starts on this machine (and stops at the end);
``--ray-address auto`` (or ``ray://head:10001``) joins a running cluster, whose nodes need
the same modbench installed. Tasks run in the driver's working directory where the node has
it, so relative paths (the study folder, ``data.source``) resolve as they do here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modbench.errors import ModbenchError
from modbench.study.executors.base import ExecutorKind, one_line, per_run, register, require
from modbench.study.jobs import Job, JobResult, execute_job, lost_job_results

#: how often a task whose worker process died (killed, out of memory, its node lost) is run
#: again before its unfinished runs are recorded as failed
RAY_MAX_RETRIES = 3


@dataclass(frozen=True)
class RayOptions:
    """``--gpus-per-run`` (None: 1 if the cluster has GPUs, else 0), ``--cpus-per-run`` (None:
    4 per GPU, 1 without), ``--ray-address`` (None: start a local Ray instance)."""

    gpus_per_run: int | None = None
    cpus_per_run: int | None = None
    address: str | None = None


class RayKind(ExecutorKind):
    name = "ray"
    summary = "a local Ray instance, or the cluster at --ray-address"
    options_type = RayOptions
    prefix = "ray_"
    implementation = "modbench.study.executors.ray:RayExecutor"
    requires = "ray"

    def settings(self, opts: RayOptions, out: Path, gpus: int, cpus: int, nproc: int,
                 n_jobs: int) -> list[tuple[str, str]]:
        where = (f"the Ray cluster at {opts.address}" if opts.address
                 else "a local Ray instance started on this machine")
        rows = [("executor", f"ray: {n_jobs} task(s) on {where}; a task whose worker dies is "
                             f"retried up to {RAY_MAX_RETRIES} times"),
                ("per job", f"num_gpus={gpus}, num_cpus={cpus}: {gpus} GPU(s), {cpus} CPU(s), "
                            f"{per_run(nproc)}")]
        if opts.gpus_per_run is None:
            rows.append(("", "(GPUs per job: 1 on a cluster with GPUs, else 0; set "
                             "--gpus-per-run to be sure)"))
        return rows


KIND = register(RayKind())


#: the thread-count variables a Ray task sets (not defaults: Ray sets OMP_NUM_THREADS itself)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def run_job(job: Job, cwd: str | None = None) -> list[JobResult]:
    """The Ray task: train and evaluate one job's runs in this worker process, its thread
    counts set to the task's CPUs (Ray's worker may have left other values; a torchrun group
    started from here divides them among its processes)."""
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    if job.threads:
        for name in THREAD_VARIABLES:
            os.environ[name] = str(job.threads)
    return execute_job(job)


class RayExecutor:
    """Jobs as Ray tasks; see the module's docstring."""

    def __init__(self, options: RayOptions | Mapping[str, Any], *, verbose: bool = False,
                 max_retries: int = RAY_MAX_RETRIES) -> None:
        self.options: RayOptions = KIND.options(options)
        self.verbose = verbose
        self.max_retries = max_retries
        self._ray: Any = None
        self._started = False
        self._gpus: int | None = None

    def _connect(self) -> Any:
        """Ray, initialised: the running instance of this process, the cluster at
        ``--ray-address``, or a local instance started here."""
        if self._ray is not None:
            return self._ray
        ray = require("ray", "ray")
        if not ray.is_initialized():
            address = self.options.address
            try:
                ray.init(address=address, include_dashboard=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = f"the Ray cluster at {address}" if address else "a local Ray instance"
                raise ModbenchError(f"cannot start or join {where} ({one_line(e)}); check "
                                    "--ray-address (auto on a cluster node, or "
                                    "ray://HEAD:10001)") from e
            self._started = True
        self._ray = ray
        return ray

    @property
    def gpus_per_job(self) -> int:
        """``--gpus-per-run``, else 1 when the Ray cluster has GPUs, else 0."""
        if self._gpus is None:
            ray = self._connect()
            has_gpus = float(ray.cluster_resources().get("GPU", 0)) > 0
            self._gpus = KIND.gpus(self.options, has_gpus)
        return self._gpus

    def run(self, jobs: list[Job]) -> Iterator[list[JobResult]]:
        if not jobs:
            return
        ray = self._connect()
        gpus = self.gpus_per_job
        cpus = KIND.cpus(self.options, gpus)
        task = ray.remote(run_job)
        resources = {"num_cpus": cpus, "num_gpus": gpus, "max_retries": self.max_retries,
                     "retry_exceptions": False}
        cwd = os.getcwd()
        pending: dict[Any, Job] = {}
        for job in jobs:
            # absolute root, one thread per CPU, and a lease every attempt of it claims under
            job = dataclasses.replace(job, root=str(Path(job.root).resolve()), threads=cpus,
                                      lease=f"ray:{uuid.uuid4().hex}")
            ref = task.options(name=f"modbench {job.labels[0]}", **resources).remote(job, cwd)
            pending[ref] = job
        if self.verbose:
            _say(f"ray: {len(jobs)} task(s), each num_gpus={gpus} num_cpus={cpus}, on "
                 f"{ray.cluster_resources().get('CPU', 0):g} CPUs and "
                 f"{ray.cluster_resources().get('GPU', 0):g} GPUs")
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    job = pending.pop(ref)
                    try:
                        results: list[JobResult] = ray.get(ref)
                    except ray.exceptions.RayError as e:
                        results = lost_job_results(job, self._reason(ray, e))
                    yield results
        finally:
            for ref in pending:  # interrupted: stop what is still queued or running
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)

    def _reason(self, ray: Any, error: Exception) -> str:
        if isinstance(error, ray.exceptions.RayTaskError):
            why = f"its Ray task raised {one_line(error, 200)}"
        else:
            why = (f"its Ray worker died in each of its {self.max_retries + 1} attempt(s) "
                   f"({type(error).__name__}: killed, out of memory, or its node lost)")
        return f"{why}; run `modbench study run` again to retry it"

    def close(self) -> None:
        if self._started and self._ray is not None:
            self._ray.shutdown()
        self._ray, self._started = None, False


def _say(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)
