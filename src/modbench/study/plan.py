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

import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modbench.config import RunConfig
from modbench.errors import ModbenchError, suggest
from modbench.measure.flops import flop_report
from modbench.study import executors
from modbench.study.executors import nproc_for
from modbench.study.spec import StudySpec, expand

#: Model FLOPs utilisation assumed when ``--mfu`` is left out: what a dense decoder of about
#: 1B parameters sustains in bf16 on an H100-class GPU with a well-tuned trainer is about
#: 0.3-0.45; the estimate takes the low end. modbench's own eager step at 60M parameters
#: measured 0.056 (BENCHMARKS.md): small models sit far below, so measure yours.
DEFAULT_MFU = 0.30
DEFAULT_GPU = "H100"


@dataclass(frozen=True)
class Throughput:
    """Sustained training FLOP/s of one GPU: its dense bf16 peak times the MFU."""

    gpu: str
    peak_tflops: float
    mfu: float
    mfu_assumed: bool = True

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.mfu


def throughput(gpu_type: str | None = None, gpu_tflops: float | None = None,
               mfu: float | None = None) -> Throughput:
    """``--gpu-type`` (a name of :data:`PEAK_BF16_TFLOPS`), or ``--gpu-tflops`` (the dense
    bf16 peak in TFLOP/s), and ``--mfu``."""
    from modbench.measure.bench import PEAK_BF16_TFLOPS

    if mfu is not None and not 0 < mfu <= 1:
        raise ModbenchError(f"--mfu must be a fraction in (0, 1], got {mfu}")
    if gpu_tflops is not None:
        if gpu_tflops <= 0:
            raise ModbenchError(f"--gpu-tflops must be positive, got {gpu_tflops}")
        name = gpu_type or "GPU"
        peak = gpu_tflops
    else:
        name = gpu_type or DEFAULT_GPU
        known = {k.lower(): k for k in PEAK_BF16_TFLOPS}
        if name.lower() not in known:
            raise ModbenchError(f"unknown --gpu-type '{name}'{suggest(name, PEAK_BF16_TFLOPS)}; "
                                f"use one of {', '.join(PEAK_BF16_TFLOPS)} or give its dense "
                                "bf16 peak with --gpu-tflops")
        name = known[name.lower()]
        peak = PEAK_BF16_TFLOPS[name]
    return Throughput(name, float(peak), DEFAULT_MFU if mfu is None else mfu, mfu is None)


def validations(cfg: RunConfig) -> int:
    """Validation passes of a full run: before training, every ``eval_every`` steps before
    the last, and at the end."""
    tc = cfg.train
    return 2 + ((tc.steps - 1) // tc.eval_every if tc.eval_every else 0)


def run_flops(cfg: RunConfig) -> float:
    """FLOPs of one run trained to its last step: training plus its validation passes."""
    r = flop_report(cfg.model, cfg.train.seq_len)
    tc = cfg.train
    train = r.train_flops_per_token * tc.steps * tc.batch_size * tc.seq_len
    val = r.forward_flops_per_token * tc.eval_sequences * tc.seq_len * validations(cfg)
    return float(train + val)


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
class StagePlan:
    """A tuned study's later stage (``tuning:``; :mod:`modbench.study.tuning`): its folder, its
    runs, those done, the FLOPs of the rest and what the stage is. ``known``: whether its runs
    are fixed already (the tuning stage's always; the tuned stage's once the tuning stage has
    chosen every value, else its FLOPs are those at the grid's costliest value)."""

    name: str
    folder: Path
    runs: int
    done: int
    flops: float
    what: str
    known: bool = True
    gpu_hours: float | None = None
    upper_bound: bool = False  # flops (and GPU-hours) are an upper bound, not the estimate


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
    stages: list[StagePlan] = field(default_factory=list)  # a tuned study's stages 1 and 2

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
               rate: Throughput | None = None) -> StudyPlan:
    """The jobs ``modbench study run`` would start for ``spec`` into ``out`` (runs the study
    folder already has done are left out), with their resources and estimated GPU-hours; the
    executor's kind (:mod:`modbench.study.executors`) reads and checks its options and gives
    its GPUs, CPUs, time-outs, settings rows and warnings. Reads the folder's index if there is
    one; writes nothing."""
    from modbench.study.runner import _jobs, use_ensembles

    kind = executors.get(executor)
    opts = kind.options(options, workers)
    rate = rate or throughput()
    runs = expand(spec)
    done = _done_keys(Path(out))
    todo = [r for r in runs if r.key not in done]
    gpus = kind.plan_gpus(opts)
    cpus = kind.plan_cpus(opts, gpus)
    nproc = nproc_for(gpus)
    stack = use_ensembles(ensembles, kind.ensemble_gpus(gpus)) and nproc == 1
    memory = kind.stack_memory(gpus) if stack else None
    configs = {r.key: r.config for r in todo}
    jobs = []
    for job in _jobs(out, todo, spec, stack, nproc, memory):
        cfgs = [configs[k] for k in job.keys]
        flops = sum(run_flops(c) for c in cfgs)
        tc = cfgs[0].train
        gpu_h = flops / rate.flops_per_s / 3600 if gpus else None
        wall_h = gpu_h / gpus if gpu_h is not None else None
        jobs.append(JobPlan(job.labels, tc.steps * tc.batch_size * tc.seq_len, flops, gpus,
                            cpus, nproc, gpu_h, wall_h, kind.timeouts(opts, wall_h)))
    plan = StudyPlan(spec.name, Path(out), executor, len(runs), len(runs) - len(todo), jobs,
                     rate, any(len(j.labels) > 1 for j in jobs),
                     time_limited=kind.time_limited)
    plan.settings = kind.settings(opts, Path(out), gpus, cpus, nproc, len(jobs))
    plan.warnings = kind.warnings(opts, [j.timeouts for j in jobs], gpus)
    plan.stages = plan_stages(spec, Path(out), rate if gpus else None)
    return plan


def plan_stages(spec: StudySpec, out: Path, rate: Throughput | None) -> list[StagePlan]:
    """A tuned study's stages after the frozen one (none without a ``tuning`` block): the
    tuning stage's runs, and the tuned stage's, which are known only once the tuning stage's
    ``best.json`` is written (before that, one run per verdict run, costed at the grid value
    whose run costs most: an upper bound where the key changes the FLOPs, such as
    ``train.steps``; exact for ``recipe.lr``). ``rate``: GPU throughput, None on the CPU."""
    import json

    from modbench.report.tuning import BEST_FILE, TUNED_DIR, TUNING_DIR
    from modbench.study.spec import RunSpec, run_spec, tuning_grid
    from modbench.study.tuning import tuned_runs, tuning_runs, with_value

    t = spec.tuning
    if t is None:
        return []

    def hours(flops: float) -> float | None:
        return flops / rate.flops_per_s / 3600 if rate is not None else None

    def left(runs: list[RunSpec], folder: Path) -> tuple[list[RunSpec], float]:
        """The runs ``folder``'s index has not done, and their FLOPs."""
        done = _done_keys(folder)
        todo = [r for r in runs if r.key not in done]
        return todo, sum(run_flops(r.config) for r in todo)

    first = [r for _, r in tuning_runs(spec)]
    todo, flops = left(first, out / TUNING_DIR)
    grid = tuning_grid(t.key, t.grid)
    seeds = ", ".join(str(x) for x in t.seeds)
    stages = [StagePlan("tuning", out / TUNING_DIR, len(first), len(first) - len(todo), flops,
                        f"every method and the baseline at each of the {len(grid)} values of "
                        f"{t.key}, on tuning seed(s) {seeds}", gpu_hours=hours(flops))]
    best_file = out / TUNING_DIR / BEST_FILE
    best = None
    if not todo and best_file.is_file():
        try:
            best = json.loads(best_file.read_text())
            second = tuned_runs(spec, best)
        except (ValueError, KeyError, TypeError):  # a damaged best.json: as if not chosen
            best = None
    if best is not None:
        todo, flops = left(second, out / TUNED_DIR)
        stages.append(StagePlan("tuned", out / TUNED_DIR, len(second), len(second) - len(todo),
                                flops, f"every method at its best {t.key} (best.json), on "
                                "the verdict seeds", gpu_hours=hours(flops)))
        return stages
    second = expand(spec)
    variants = [with_value(spec, v) for v in grid]
    costs = [[run_flops(run_spec(v, r.scale, r.method, r.seed).config) for v in variants]
             for r in second]
    flops = sum(max(c) for c in costs)
    stages.append(StagePlan("tuned", out / TUNED_DIR, len(second), 0, flops,
                            f"every method at its best {t.key}, chosen by the tuning stage, on "
                            "the verdict seeds", known=False, gpu_hours=hours(flops),
                            upper_bound=any(min(c) != max(c) for c in costs)))
    return stages


def _done_keys(folder: Path) -> set[str]:
    """Keys of the runs the folder's index has done, read without writing anything (no index,
    or one that cannot be read: none)."""
    index = folder / "index.sqlite"
    if not index.is_file():
        return set()
    # a closed index (no write-ahead log beside it) is read as immutable: SQLite then creates
    # no -wal/-shm files; an index in use is read through the log its writers keep
    live = index.with_name(index.name + "-wal").exists()
    try:
        db = sqlite3.connect(f"{index.resolve().as_uri()}?{'mode=ro' if live else 'immutable=1'}",
                             uri=True)
        try:
            return {r[0] for r in db.execute("SELECT key FROM runs WHERE state='done'")}
        finally:
            db.close()
    except sqlite3.Error:
        return set()


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
        lines.append(f"then stage {st.name} -> {st.folder}: {left} of {st.runs} runs to train"
                     + (f" ({st.done} done)" if st.done else "")
                     + f", {bound}{st.flops:.3e} FLOPs{gpu}: {st.what}")
    if plan.stages:
        flops = plan.flops + sum(st.flops for st in plan.stages)
        runs = todo + sum(st.runs - st.done for st in plan.stages)
        bound = any(st.upper_bound for st in plan.stages)
        lines.append(f"all stages: {runs} runs, {'at most ' if bound else ''}{flops:.3e} "
                     "FLOPs")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
