"""Whether a study's jobs fit their GPU: each job's memory plan (:mod:`modbench.measure.plan`,
as the trainer lays the job out: ``train.parallel``, ``auto`` resolved, at the micro-batch the
run trains at) against the GPU its executor gives it (:meth:`ExecutorKind.memory_gpu
<modbench.study.executors.base.ExecutorKind.memory_gpu>`).

``modbench study run --dry-run`` lists each job's parallel mode, micro-batch and planned peak,
and both the dry run and a real run refuse, before any data is prepared or hashed, every job
that fits no layout: one line per job, the memory it needs against what the GPU has. Without
this a job that cannot fit starts, opens (and on a cluster hashes) its data, and only then
fails in the trainer's own plan. Where the executor's GPU is not known (the local executor
on a machine without CUDA, a ``--gpu-tflops`` GPU) nothing is planned or checked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modbench.errors import ModbenchError

if TYPE_CHECKING:  # torch, imported where a plan is made
    from modbench.measure.plan import MemoryPlan
    from modbench.runtime.gpus import Accelerator
    from modbench.study.jobs import Job


@dataclass
class JobFit:
    """One job as its memory plan lays it out on its GPU."""

    name: str  # scale/method and seeds, as the dry run names jobs
    nproc: int
    parallel: str  # ddp | fsdp; "-" for one process (nothing spread)
    plan: MemoryPlan | None  # None: not planned (a CPU run, a plan that cannot be made)
    problem: str = ""  # where it fits nothing: what it needs against the GPU, what to do

    @property
    def fits(self) -> bool:
        return not self.problem


class JobsDoNotFit(ModbenchError):
    """Jobs whose memory plan fits no layout on their GPU; :attr:`lines` holds one line a
    job and a last one (the message is them joined, for callers that print one line)."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


def job_name(labels: Sequence[str]) -> str:
    """``climb-3b/attnres s42`` (a job's runs: scale/method, then their seeds)."""
    scale_method = labels[0].rsplit("/", 1)[0]
    return f"{scale_method} {','.join(label.rsplit('/', 1)[1] for label in labels)}"


def _device(job: Job, gpu: Accelerator) -> Accelerator | int:
    """What the job's runs plan against: ``train.device_memory_gb`` where a run sets it (the
    trainer plans against it too), else the GPU."""
    gb_set = job.configs[0].train.device_memory_gb
    return int(gb_set * 1e9) if gb_set is not None else gpu


def fit_job(job: Job, gpu: Accelerator) -> JobFit:
    """The layout of one job's run(s) on ``gpu``: ``nproc`` processes of one run, or several
    seeds stacked in one process. A run the trainer would put on the CPU, or whose memory
    cannot be planned (its own trainer then says why, or trains without a plan), is not
    planned."""
    from modbench.measure.plan import DoesNotFit, gb, layout
    from modbench.train.recompute import apply_activation_checkpointing

    name = job_name(job.labels)
    cfg = job.configs[0]
    if cfg.train.device == "cpu":
        return JobFit(name, job.nproc, "-", None)
    ensembles = len(job.configs) if job.nproc == 1 else 1
    try:
        lay = layout(cfg, _device(job, gpu), nproc=job.nproc, ensembles=ensembles,
                     device_type="cuda", checkpointing=apply_activation_checkpointing,
                     check=True)
    except DoesNotFit as e:
        need = e.plan
        many = job.nproc > 1
        where = f"{job.nproc} x {gpu.name}" if many else f"one {gpu.name}"
        how = (f"{need.parallel}, " if many else "") + f"micro-batch {need.micro_batch}"
        problem = (f"does not fit {where}: it needs {gb(need.peak_bytes)} a GPU ({how}; "
                   f"largest term {need.largest_term()} {gb(need.terms[need.largest_term()])})"
                   f", the GPU has {gb(need.usable_bytes)} usable of "
                   f"{gb(need.device_bytes)}; {e.advice}")
        return JobFit(name, job.nproc, need.parallel if many else "-", need, problem)
    except ModbenchError:
        return JobFit(name, job.nproc, "-", None)
    return JobFit(name, job.nproc, lay.parallel if job.nproc > 1 else "-", lay.plan)


def fit_jobs(jobs: Sequence[Job], gpu: Accelerator,
             planned: dict[str, JobFit] | None = None) -> list[JobFit]:
    """:func:`fit_job` of every job; jobs alike but for their seeds are planned once (and
    once across calls that pass the same ``planned``)."""
    planned = {} if planned is None else planned
    out = []
    for job in jobs:
        configs = [c.to_dict() for c in job.configs]
        for d in configs:
            d.pop("seed", None)
        key = json.dumps([configs, job.nproc, gpu.key, gpu.memory_bytes], sort_keys=True,
                         default=str)
        if key not in planned:
            planned[key] = fit_job(job, gpu)
        first = planned[key]
        out.append(JobFit(job_name(job.labels), first.nproc, first.parallel, first.plan,
                          first.problem))
    return out


def check_fits(fits: Sequence[JobFit], gpu: Accelerator) -> None:
    """Refuse the jobs that fit nothing on ``gpu``: :class:`JobsDoNotFit`, one line a job and a
    last line that says what else to do."""
    bad = [f"job {f.name} {f.problem}" for f in fits if not f.fits]
    if bad:
        raise JobsDoNotFit([*bad, f"{len(bad)} of {len(fits)} job(s) do not fit the "
                                  f"{gpu.name}, so none was started and no data was touched; "
                                  "change what each line says (in a copy of the spec, under "
                                  "overrides), or name the GPU the jobs get with --gpu-type"])


def format_fits(fits: Sequence[JobFit], gpu: Accelerator) -> list[str]:
    """The dry run's memory rows: the GPU and its usable memory, then each job's parallel
    mode, micro-batch and planned peak a GPU."""
    from modbench.measure.plan import gb, usable_bytes

    usable = usable_bytes(gpu.memory_bytes)
    lines = ["", f"{'memory':<11}each job's plan (modbench plan) on an {gpu.name}: "
                 f"{gb(usable)} usable a GPU of {gb(gpu.memory_bytes)} (less 10 % and 2 GiB)",
             f"{'job':>4}  {'runs':<40} {'parallel':>8} {'micro':>5} {'GB a GPU':>8}"]
    for i, f in enumerate(fits, 1):
        micro = str(f.plan.micro_batch) if f.plan is not None else "-"
        peak = f"{f.plan.peak_bytes / 1e9:.2f}" if f.plan is not None else "-"
        lines.append(f"{i:>4}  {f.name:<40} {f.parallel:>8} {micro:>5} {peak:>8}")
    modes = sorted({f.parallel for f in fits if f.parallel != "-"})
    if modes:
        lines.append("parallel: " + ", ".join(
            f"{m} for {sum(f.parallel == m for f in fits)} job(s)" for m in modes)
            + " (train.parallel; auto: DDP where its plan fits, else FSDP)")
    return lines
