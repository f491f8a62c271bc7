"""The SLURM executor (``modbench study run --executor slurm``), job arrays through submitit:
its kind (the ``--slurm-*`` options, ``--gpus-per-run``, ``--cpus-per-run``, their checks, its
``--dry-run`` rows: the job array, time limit and requeues, sbatch settings; GPU accounting,
one GPU per job unless told) and the executor. submitit is imported only when the executor
submits, so ``--help`` and ``--dry-run`` need none.

Every wave of a study (its runs, then each ``--until-decided`` round) is one job array
(``AutoExecutor.map_array``): one array task per job, with ``--gpus-per-run`` GPUs and
``--cpus-per-run`` CPUs on one node, the partition, time limit, account and the rest of the
``--slurm-*`` options. Logs and submitit's pickles go to ``<study>/slurm`` (``--slurm-folder``).

Each task runs :class:`StudyTask`, a submitit ``Checkpointable``. Before SLURM preempts a
task or its time limit comes, it sends the task submitit's signal (SIGUSR2, as far ahead as
:func:`signal_lead_s` plans the array's longest step and checkpoint write to take, at least
:data:`SIGNAL_DELAY_S` seconds: ``--signal=USR2@300``). The run training then finishes
its step, saves a checkpoint of it (every process of a torchrun group gathering its part) and
stops (:class:`modbench.runtime.checkpoint.Preempted`); only then does the task hand the
signal to submitit, which calls :meth:`StudyTask.checkpoint` and requeues the same task, so no
step is lost. (Outside a run's training loop the signal goes to submitit at once.) The
requeued attempt claims its runs under the job's lease, taking over what its predecessor
held, and resumes every run from that checkpoint (:func:`modbench.study.jobs.execute_job`
resumes a run folder that has one), so a run longer than the time limit trains across several
allocations.

Each task asks for the host memory its runs need (``--mem``, :func:`host_memory_gb`: the full
fp32 state a checkpoint gathers on rank 0, and per process the model built on the CPU and a
runtime allowance), unless ``--slurm-mem-gb`` says otherwise. Results are collected
as array tasks finish (``submitit.helpers.as_completed``); a task that fails (a crash, out of
memory, cancelled, too many time-outs) has its unfinished runs recorded as failed with a
one-line reason, and the next ``modbench study run`` retries them.

The results store (``<study>/index.sqlite``) stays the only record: the study folder must be
on a file system the compute nodes share. Interrupting ``modbench study run`` leaves the array
running (``scancel`` stops it); its runs show as running in ``modbench study status``.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modbench.errors import ModbenchError
from modbench.runtime.checkpoint import Preempted
from modbench.study.executors.base import ExecutorKind, flag, one_line, per_run, register
from modbench.study.jobs import Job, JobResult, execute_job, lost_job_results

if TYPE_CHECKING:
    import submitit

#: a day per job (a longer run times out and is requeued from its last checkpoint, at most
#: ``max_timeouts`` times), submitit's array parallelism
SLURM_TIME_MIN = 24 * 60
SLURM_ARRAY_PARALLELISM = 256
SLURM_MAX_TIMEOUTS = 30


@dataclass(frozen=True)
class SlurmOptions:
    """``--gpus-per-run`` (None: 1), ``--cpus-per-run`` (None: 4 per GPU) and the
    ``--slurm-*`` options without their prefix (None: the default above, or the cluster's)."""

    gpus_per_run: int | None = None
    cpus_per_run: int | None = None
    partition: str | None = None
    time: int | None = None  # minutes
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    mem_gb: float | None = None
    array_parallelism: int | None = None
    setup: tuple[str, ...] = ()
    folder: str | None = None
    max_timeouts: int | None = None
    extra: tuple[str, ...] = ()  # KEY=VALUE sbatch parameters

    @property
    def time_min(self) -> int:
        return self.time or SLURM_TIME_MIN

    @property
    def timeouts_allowed(self) -> int:
        return SLURM_MAX_TIMEOUTS if self.max_timeouts is None else self.max_timeouts


def extra_parameters(opts: SlurmOptions) -> dict[str, str]:
    """``--slurm-extra KEY=VALUE`` items as sbatch parameters (``mail-user``: ``--mail-user``)."""
    out: dict[str, str] = {}
    for item in opts.extra:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ModbenchError(f"--slurm-extra takes KEY=VALUE (an sbatch option without its "
                                f"dashes, e.g. mail-type=END), got {item!r}")
        out[key.strip().lstrip("-")] = value.strip()
    return out


class SlurmKind(ExecutorKind):
    name = "slurm"
    summary = "job arrays through submitit"
    options_type = SlurmOptions
    prefix = "slurm_"
    implementation = "modbench.study.executors.slurm:SlurmExecutor"
    requires = "submitit"
    time_limited = True

    def check(self, opts: SlurmOptions) -> None:
        for name in ("time", "array_parallelism"):
            value = getattr(opts, name)
            if value is not None and value < 1:
                raise ModbenchError(f"{flag(self.prefix + name)} must be at least 1, got {value}")
        if opts.max_timeouts is not None and opts.max_timeouts < 0:
            raise ModbenchError(f"--slurm-max-timeouts must be 0 or more, got "
                                f"{opts.max_timeouts}")
        if opts.mem_gb is not None and opts.mem_gb <= 0:
            raise ModbenchError(f"--slurm-mem-gb must be positive, got {opts.mem_gb}")
        extra_parameters(opts)  # KEY=VALUE items

    def gpus(self, opts: SlurmOptions, cluster_has_gpus: bool = True) -> int:
        """``--gpus-per-run``, else 1: a SLURM job asks for its GPU."""
        return super().gpus(opts, cluster_has_gpus=True)

    def timeouts(self, opts: SlurmOptions, wall_hours: float | None) -> int | None:
        if wall_hours is None:
            return None
        return max(0, math.ceil(wall_hours / (opts.time_min / 60)) - 1)

    def warnings(self, opts: SlurmOptions, timeouts: list[int | None],
                 gpus: int) -> list[str]:
        over = [t or 0 for t in timeouts if (t or 0) > opts.timeouts_allowed]
        out = [f"{len(over)} job(s) need more than --slurm-max-timeouts "
               f"{opts.timeouts_allowed} requeues at --slurm-time {opts.time_min} (the longest "
               f"{max(over)}): raise one of them, or --gpus-per-run"] if over else []
        return out + super().warnings(opts, timeouts, gpus)

    def settings(self, opts: SlurmOptions, out: Path, gpus: int, cpus: int, nproc: int,
                 n_jobs: int) -> list[tuple[str, str]]:
        parallel = opts.array_parallelism or SLURM_ARRAY_PARALLELISM
        sbatch = [("partition", opts.partition or "(cluster default)"),
                  ("account", opts.account or "(default)"),
                  *([("qos", opts.qos)] if opts.qos else []),
                  *([("constraint", opts.constraint)] if opts.constraint else []),
                  *extra_parameters(opts).items()]
        rows = [("executor", f"slurm (submitit): one job array of {n_jobs} task(s), at most "
                             f"{parallel} at once"),
                ("per job", f"1 node, 1 task, {gpus} GPU(s), {cpus} CPU(s), {per_run(nproc)}"
                            + (f", {opts.mem_gb:g} GB memory" if opts.mem_gb else "")),
                ("time limit", f"{opts.time_min} min per job; timed out or preempted, it is "
                               f"requeued and resumes from its last checkpoint (up to "
                               f"{opts.timeouts_allowed} time-outs)"),
                ("sbatch", ", ".join(f"{k}={v}" for k, v in sbatch)),
                ("logs", str(self.folder(opts, out)))]
        return rows + [("setup", line) for line in opts.setup]

    def folder(self, opts: SlurmOptions, root: Path) -> Path:
        """Where submitit's logs and pickles go: ``--slurm-folder``, else ``<study>/slurm``."""
        return Path(opts.folder) if opts.folder else root / "slurm"


KIND = register(SlurmKind())


#: the least time (s) before the end of an allocation at which SLURM signals a task; a job
#: whose step and checkpoint take longer asks for more (:func:`signal_lead_s`)
SIGNAL_DELAY_S = 300
#: checkpoint write speed assumed on a cluster's shared file system (bytes/s): a conservative
#: few hundred MB/s (the lead time's save term)
SAVE_BYTES_PER_S = 200e6
#: seconds added to the lead for the process to exit and hand the signal to submitit
EXIT_SLACK_S = 60
#: the GPU peak (dense bf16 TFLOP/s) a step is planned at when the executor is not told its
#: GPU: an A100's, the slowest of the catalogue's training GPUs, so the lead errs long
LEAD_PEAK_TFLOPS = 312.0


def lead_for(step_s: float, save_s: float) -> int:
    """Seconds of warning a run needs: the step under way when the signal comes (the stop is
    read after every step) and the checkpoint write, each with half again for noise, and
    :data:`EXIT_SLACK_S`; at least :data:`SIGNAL_DELAY_S`."""
    return max(SIGNAL_DELAY_S, math.ceil(1.5 * (step_s + save_s) + EXIT_SLACK_S))


def signal_lead_s(jobs: list[Job], time_min: int | None = None,
                  peak_tflops: float = LEAD_PEAK_TFLOPS, mfu: float | None = None) -> int:
    """The ``--signal`` lead the array's tasks ask for (the largest of its jobs'):
    :func:`lead_for` of a job's planned step (its training and validation FLOPs a step, its
    stacked seeds together, over its GPUs at ``peak_tflops`` times ``mfu``, default
    :data:`~modbench.study.costs.DEFAULT_MFU`) and its checkpoint write
    (:func:`modbench.measure.plan.checkpoint_bytes` of each seed at
    :data:`SAVE_BYTES_PER_S`); at most half the time limit ``time_min`` (a longer lead would
    stop a task soon after it starts), never below :data:`SIGNAL_DELAY_S`."""
    from modbench.measure.plan import checkpoint_bytes
    from modbench.study.costs import DEFAULT_MFU, run_flops

    rate = peak_tflops * 1e12 * (mfu or DEFAULT_MFU)
    lead = SIGNAL_DELAY_S
    for job in jobs:
        cfg = job.configs[0]
        step_s = (run_flops(cfg) / max(1, cfg.train.steps) * len(job.configs)
                  / (max(1, job.nproc) * rate))
        save_s = checkpoint_bytes(cfg) * len(job.configs) / SAVE_BYTES_PER_S
        lead = max(lead, lead_for(step_s, save_s))
    if time_min is not None:
        lead = min(lead, max(SIGNAL_DELAY_S, time_min * 60 // 2))
    return int(lead)


def host_memory_gb(jobs: list[Job]) -> int:
    """Host memory (GB, rounded up) a task of these jobs needs, the largest of them:
    :func:`modbench.measure.plan.host_memory_bytes` of each run (rank 0's gathered fp32
    weights and optimizer state for a checkpoint, the model each process builds on the CPU,
    a runtime allowance per process), summed over the seeds a job stacks. A resume maps its
    checkpoint (``runtime.checkpoint``), sharing the node's page cache, so it adds nothing."""
    from modbench.measure.plan import host_memory_bytes

    need = max(sum(host_memory_bytes(c, job.nproc) for c in job.configs)
               for job in jobs)
    return -(-need // 10**9)


class StudyTask:
    """What each array task runs: :func:`execute_job` on its :class:`Job`. A run stopped by
    the scheduler's signal (it saved its step) hands that signal to submitit's handler, which
    requeues the task. Checkpointable as submitit defines it: it has a :meth:`checkpoint`
    (what ``submitit.helpers.Checkpointable`` adds; subclassing it would import submitit with
    this module)."""

    def __call__(self, job: Job) -> list[JobResult]:
        try:
            return execute_job(job)
        except Preempted as stopped:
            _requeue(stopped)
            raise

    def checkpoint(self, job: Job) -> submitit.helpers.DelayedSubmission:
        """On preemption or time-out: requeue the same job. The runs' own checkpoints hold
        their state; the requeued attempt resumes them (same lease, so its claims carry over)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, job)


class SlurmExecutor:
    """Job arrays through submitit; see the module's docstring.

    ``cluster``: submitit's cluster, ``slurm`` (default) or ``local`` (the same code path with
    each task a local process: for tests). ``task``: the callable each array task runs (a
    :class:`StudyTask`; a subclass may add set-up)."""

    def __init__(self, options: SlurmOptions | Mapping[str, Any], *, verbose: bool = False,
                 cluster: str = "slurm", poll_s: float | None = None,
                 task: StudyTask | None = None) -> None:
        if cluster == "slurm" and shutil.which("sbatch") is None:
            raise ModbenchError("--executor slurm needs SLURM's sbatch, which is not on this "
                                "machine's PATH; run it on a cluster login node, or see what it "
                                "would submit with --dry-run")
        self.options: SlurmOptions = KIND.options(options)
        self.verbose = verbose
        self.cluster = cluster
        self.poll_s = poll_s if poll_s is not None else (15.0 if cluster == "slurm" else 0.5)
        self.task = task or StudyTask()
        self.gpus_per_job = KIND.gpus(self.options)
        self.cpus = KIND.cpus(self.options, self.gpus_per_job)
        self.submitted: list[Any] = []  # the submitit jobs of the last wave

    def folder(self, root: Path) -> Path:
        return KIND.folder(self.options, root)

    def _executor(self, root: Path, jobs: list[Job]) -> submitit.AutoExecutor:
        import submitit

        o = self.options
        timeouts = o.timeouts_allowed
        ex = submitit.AutoExecutor(folder=self.folder(root), cluster=self.cluster,
                                   slurm_max_num_timeout=timeouts,
                                   local_max_num_timeout=timeouts)
        params: dict[str, Any] = {
            "name": f"modbench-{root.name}",
            "slurm_signal_delay_s": signal_lead_s(jobs, o.time_min),
            "timeout_min": o.time_min,
            "nodes": 1,
            "tasks_per_node": 1,  # one process per job; a multi-GPU run starts torchrun itself
            "gpus_per_node": self.gpus_per_job,
            "cpus_per_task": self.cpus,
            "mem_gb": o.mem_gb if o.mem_gb is not None else host_memory_gb(jobs),
            "slurm_partition": o.partition,
            "slurm_account": o.account,
            "slurm_qos": o.qos,
            "slurm_constraint": o.constraint,
            "slurm_array_parallelism": o.array_parallelism,
            "slurm_setup": list(o.setup) or None,
            "slurm_additional_parameters": extra_parameters(o) or None,
        }
        ex.update_parameters(**{k: v for k, v in params.items() if v is not None})
        return ex

    def run(self, jobs: list[Job]) -> Iterator[list[JobResult]]:
        import submitit

        if not jobs:
            return
        root = Path(jobs[0].root).resolve()
        jobs = [dataclasses.replace(j, root=str(root), threads=self.cpus,
                                    lease=f"slurm:{uuid.uuid4().hex}") for j in jobs]
        ex = self._executor(root, jobs)
        try:
            submitted = ex.map_array(self.task, jobs)
        except Exception as e:  # sbatch refused: a bad partition, account, time limit ...
            raise ModbenchError(f"sbatch refused the job array ({one_line(e)}); check the "
                                "--slurm-* options") from e
        self.submitted = submitted
        by_job = {id(s): j for s, j in zip(submitted, jobs, strict=True)}
        array = submitted[0].job_id.split("_")[0]
        if self.verbose:
            _say(f"slurm: submitted {len(jobs)} task(s) as job {array}; logs in "
                 f"{self.folder(root)}")
        left = set(by_job)
        try:
            for sjob in submitit.helpers.as_completed(submitted, poll_frequency=self.poll_s):
                left.discard(id(sjob))
                job = by_job[id(sjob)]
                try:
                    results: list[JobResult] = sjob.result()
                except Exception as e:
                    results = lost_job_results(job, _reason(sjob, e))
                yield results
        except BaseException:
            if left and self.verbose:
                _say(f"slurm: job {array} keeps running ({len(left)} task(s) not finished); "
                     f"`scancel {array}` stops it, `modbench study status {root}` follows it")
            raise

    def close(self) -> None:
        pass


def _requeue(stopped: Preempted) -> None:
    """Give submitit the signal a run stopped on (after it saved): its handler calls
    :meth:`StudyTask.checkpoint`, requeues the task and exits. SIGTERM (``scancel``, or
    SLURM ending the job) is not passed on: the task ends, and the next ``modbench study
    run`` resumes the run from the checkpoint. Outside a submitit job (no handler of its
    own) nothing happens."""
    import signal

    import submitit

    try:
        sig = submitit.JobEnvironment._usr_sig()
    except (AttributeError, RuntimeError):
        return
    handler = signal.getsignal(sig)
    if stopped.signum != signal.SIGTERM and callable(handler):
        handler(sig, None)  # submitit's SignalHandler.checkpoint_and_try_requeue


def _reason(sjob: Any, error: Exception) -> str:
    """One line: which task, how it ended, the last line of its error, where its log is."""
    try:
        state = sjob.state
    except Exception:
        state = "UNKNOWN"
    return (f"SLURM task {sjob.job_id} ended {state}: {_error_line(error)} (log: "
            f"{sjob.paths.stderr}); run `modbench study run` again to retry it")


def _error_line(error: Exception) -> str:
    """The last line of the task's traceback (submitit's FailedJobError quotes it between two
    dashed lines, then the log paths), else the last line of what submitit says."""
    import submitit

    text, rule = str(error), "-" * 22 + "\n"
    if isinstance(error, submitit.core.utils.FailedJobError) and text.count(rule) >= 2:
        text = text.split(rule)[1]
    return one_line(text, 200)


def _say(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)
