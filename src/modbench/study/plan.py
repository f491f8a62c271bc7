"""``modbench study run --dry-run``: the jobs a study would submit, their resources and the
GPU-hours they should take; nothing is submitted, started or written.

The estimate divides each job's FLOPs by a sustained throughput per GPU::

    FLOPs of a run   = train FLOPs/token x steps x batch_size x seq_len          (training)
                     + forward FLOPs/token x eval_sequences x seq_len x validations
    validations      = 2 + (steps - 1) // eval_every     (before training, every eval_every
                                                          steps, at the end)
    GPU-hours of a job = sum of its runs' FLOPs / (peak x MFU) / 3600
    wall hours         = GPU-hours / GPUs per job

FLOPs per token are :func:`modbench.measure.flops.flop_report`'s (``modbench flops``: matrix
multiplications, training = 3 x forward). The throughput is the GPU's dense bf16 peak
(:data:`modbench.measure.bench.PEAK_BF16_TFLOPS`, ``--gpu-type``, or ``--gpu-tflops``) times
an assumed model FLOPs utilisation, :data:`DEFAULT_MFU` unless ``--mfu`` gives one measured
on the cluster (``tokens_per_s`` in a run's metrics.jsonl x train FLOPs/token / (GPUs x
peak)). Not counted: the end-of-run evaluation (probes, harness tasks), start-up, checkpoint
writes, and the steps a requeued job repeats since its last checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modbench.study import executors
from modbench.study.costs import (  # noqa: F401  (re-exported: the dry run's names)
    DEFAULT_GPU,
    DEFAULT_MFU,
    StagePlan,
    Throughput,
    done_keys,
    run_flops,
    throughput,
    validations,
)
from modbench.study.executors import nproc_for
from modbench.study.fits import JobFit, check_fits, fit_jobs, format_fits
from modbench.study.spec import StudySpec
from modbench.study.stages import RunSettings, stages_for

if TYPE_CHECKING:
    from modbench.runtime.gpus import Accelerator


@dataclass
class JobPlan:
    labels: tuple[str, ...]
    tokens_per_run: int
    flops: float  # all of its runs
    gpus: int
    cpus: int
    nproc: int
    gpu_hours: float | None  # None: a CPU job
    wall_hours: float | None
    timeouts: int | None = None  # a time-limited executor (SLURM): the requeues it needs

    @property
    def name(self) -> str:
        scale_method = self.labels[0].rsplit("/", 1)[0]
        seeds = ",".join(label.rsplit("/", 1)[1] for label in self.labels)
        return f"{scale_method} {seeds}"


@dataclass
class StudyPlan:
    spec: str
    folder: Path
    executor: str
    runs: int
    done: int
    jobs: list[JobPlan]
    throughput: Throughput
    stacked: bool
    settings: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    time_limited: bool = False  # its jobs requeue at a time limit: a time-outs column
    stages: list[StagePlan] = field(default_factory=list)  # the later stages' rows
    # each job's memory plan on the GPU its executor gives it (none: the GPU is not known)
    gpu: Accelerator | None = None
    fits: list[JobFit] = field(default_factory=list)

    @property
    def flops(self) -> float:
        return sum(j.flops for j in self.jobs)

    @property
    def gpu_hours(self) -> float | None:
        hours = [j.gpu_hours for j in self.jobs if j.gpu_hours is not None]
        return sum(hours) if hours else None


def plan_study(spec: StudySpec, out: str | Path, executor: str = "local", *,
               workers: int | None = None, ensembles: str = "auto",
               options: Mapping[str, Any] | None = None,
               rate: Throughput | None = None, until_decided: int | None = None,
               spending: str = "obrien_fleming",
               futility: float | None = None) -> StudyPlan:
    """The jobs ``modbench study run`` would start for ``spec`` into ``out`` (runs the study
    folder already has done are left out), with their resources and estimated GPU-hours; the
    executor's kind (:mod:`modbench.study.executors`) reads and checks its options and gives
    its GPUs, CPUs, time-outs, settings rows and warnings. The study's own stage's jobs are
    listed in full; each later stage (:mod:`modbench.study.stages`: the sequential looks of
    ``until_decided``, a tuned study's stages) gives its row (:meth:`Stage.plan
    <modbench.study.stages.Stage.plan>`). Reads the folder's index if there is one; writes
    nothing."""
    from modbench.study.runner import _jobs, use_ensembles

    kind = executors.get(executor)
    opts = kind.options(options, workers)
    rate = rate or throughput()
    own, *later = stages_for(spec, out, RunSettings(until_decided, spending,
                                                    futility=futility))
    runs = own.runs() or []
    done = done_keys(Path(out))
    todo = [r for r in runs if r.key not in done]
    gpus = kind.plan_gpus(opts)
    cpus = kind.plan_cpus(opts, gpus)
    nproc = nproc_for(gpus)
    stack = use_ensembles(ensembles, kind.ensemble_gpus(gpus)) and nproc == 1
    memory = kind.stack_memory(gpus) if stack else None
    configs = {r.key: r.config for r in todo}
    made = _jobs(out, todo, spec, stack, nproc, memory)
    gpu = kind.memory_gpu(gpus, rate.gpu)  # every job's plan checked on it, before the rows
    fits = fit_jobs(made, gpu) if gpu is not None else []
    if gpu is not None:
        check_fits(fits, gpu)
    jobs = []
    for job in made:
        cfgs = [configs[k] for k in job.keys]
        flops = sum(run_flops(c) for c in cfgs)
        tc = cfgs[0].train
        gpu_h = flops / rate.flops_per_s / 3600 if gpus else None
        wall_h = gpu_h / gpus if gpu_h is not None else None
        jobs.append(JobPlan(job.labels, tc.steps * tc.batch_size * tc.seq_len, flops, gpus,
                            cpus, nproc, gpu_h, wall_h, kind.timeouts(opts, wall_h)))
    plan = StudyPlan(spec.name, Path(out), executor, len(runs), len(runs) - len(todo), jobs,
                     rate, any(len(j.labels) > 1 for j in jobs),
                     time_limited=kind.time_limited, gpu=gpu, fits=fits)
    plan.settings = kind.settings(opts, Path(out), gpus, cpus, nproc, len(jobs))
    plan.warnings = kind.warnings(opts, [j.timeouts for j in jobs], gpus)
    plan.stages = [p for st in later if (p := st.plan(rate if gpus else None)) is not None]
    return plan


def _count(x: float) -> str:
    """Tokens as 23.07B, 1.20M, 65.5K."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def format_plan(plan: StudyPlan) -> str:
    """The dry run as a cluster user reads it: settings, one line per job, the total."""
    rate = plan.throughput
    todo = plan.runs - plan.done
    lines = ["dry run: nothing submitted, nothing written",
             f"{'study':<11}{plan.spec} -> {plan.folder} ({todo} of {plan.runs} runs to train"
             + (f", {plan.done} done" if plan.done else "") + ")"]
    lines += [f"{k:<11}{v}" for k, v in plan.settings]
    mfu = f"MFU {rate.mfu:.2f}" + (" (assumed; --mfu)" if rate.mfu_assumed else "")
    if any(j.gpus for j in plan.jobs):
        lines.append(f"{'throughput':<11}{rate.gpu} dense bf16 peak {rate.peak_tflops:g} "
                     f"TFLOP/s x {mfu} = {rate.flops_per_s / 1e12:.1f} TFLOP/s per GPU")
    if plan.stacked:
        lines.append(f"{'stacked':<11}a method's seeds train stacked in one job (--ensembles; "
                     "off: one run per job)")
    limited = plan.time_limited
    head = (f"{'job':>4}  {'runs':<40} {'tokens/run':>10} {'FLOPs':>9} {'GPUs':>4} "
            f"{'GPU-hours':>10} {'wall h':>8}" + (f" {'time-outs':>9}" if limited else ""))
    lines += ["", head]
    for i, j in enumerate(plan.jobs, 1):
        gpu_h = f"{j.gpu_hours:,.1f}" if j.gpu_hours is not None else "-"
        wall = f"{j.wall_hours:,.1f}" if j.wall_hours is not None else "-"
        row = (f"{i:>4}  {j.name:<40} {_count(j.tokens_per_run):>10} {j.flops:>9.3g} "
               f"{j.gpus:>4} {gpu_h:>10} {wall:>8}")
        if limited:
            row += f" {j.timeouts if j.timeouts is not None else '-':>9}"
        lines.append(row)
    if plan.gpu is not None and plan.fits:
        lines += format_fits(plan.fits, plan.gpu)
    total = plan.gpu_hours
    longest = max((j.wall_hours for j in plan.jobs if j.wall_hours is not None), default=None)
    lines.append("")
    if not plan.jobs:
        lines.append("total: nothing to train (every run is done)")
    else:
        text = (f"total: {todo} runs in {len(plan.jobs)} jobs, {plan.flops:.3e} FLOPs"
                + (f" = {total:,.1f} GPU-hours ({total / 24:,.1f} GPU-days) at "
                   f"{rate.flops_per_s / 1e12:.1f} TFLOP/s per GPU" if total is not None else ""))
        if longest is not None:
            text += f"; the longest job {longest:,.1f} h wall"
        lines.append(text)
    lines.append("counted: training (3 x forward matmul FLOPs per token, `modbench flops`) and "
                 "validation passes;")
    lines.append("not counted: end-of-run evaluation (probes, harness tasks), start-up, "
                 "checkpoint writes, steps redone after a requeue")
    for st in plan.stages:
        left = st.runs - st.done
        bound = "at most " if st.upper_bound else ""
        gpu = (f" = {bound}{st.gpu_hours:,.1f} GPU-hours" if st.gpu_hours is not None else "")
        lines.append(f"then stage {st.name} -> {st.folder}: "
                     + (f"at most {left} runs to train" if st.runs_bound
                        else f"{left} of {st.runs} runs to train")
                     + (f" ({st.done} done)" if st.done else "")
                     + f", {bound}{st.flops:.3e} FLOPs{gpu}: {st.what}")
    if plan.stages:
        flops = plan.flops + sum(st.flops for st in plan.stages)
        runs = todo + sum(st.runs - st.done for st in plan.stages)
        bound = any(st.upper_bound for st in plan.stages)
        lines.append(f"all stages: {'at most ' if any(st.runs_bound for st in plan.stages) else ''}"
                     f"{runs} runs, {'at most ' if bound else ''}{flops:.3e} "
                     "FLOPs")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
