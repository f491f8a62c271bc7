"""``modbench study``: run, inspect and validate studies."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from modbench.methods.options import MethodsFrom, use_plugins

if TYPE_CHECKING:
    from modbench.study.spec import StudySpec

study_app = typer.Typer(help="Run a study: methods x seeds x scales under one recipe.\n\n"
                        "Example: modbench study run builtin-cpu --out studies/builtin-cpu",
                        no_args_is_help=True)


_CLUSTER = "Executors and resources"


# options checked as they are parsed (one line each, exit 2), so that --dry-run refuses what
# the run refuses; modbench.study.runner.run_study checks them again for callers in Python
def _until_decided(value: int | None) -> int | None:
    from modbench.study.runner import check_until_decided

    check_until_decided(value)
    return value


def _spending(value: str) -> str:
    from modbench.study.runner import check_spending

    check_spending(value)
    return value


def _futility(value: float | None) -> float | None:
    from modbench.study.runner import check_futility

    check_futility(value)
    return value

_SLURM = "SLURM (--executor slurm)"
_DRY = "Dry run (--dry-run)"


# `study run`'s options, declared once (the executor's flags go to its kind by name)
SpecOption = Annotated[str | None, typer.Argument(
    help="Spec YAML file or built-in name (default: builtin-cpu).")]
OutOption = Annotated[Path | None, typer.Option(
    help="Study folder (default: studies/<spec name>).")]
ExecutorOption = Annotated[str, typer.Option(
    help="Where runs execute, a registered executor: local (this machine), ray (a local "
         "Ray instance or --ray-address), slurm (job arrays through submitit); each takes "
         "its own options below. Example: --executor slurm.",
    rich_help_panel=_CLUSTER)]
WorkersOption = Annotated[int | None, typer.Option(
    help="Parallel worker processes of the local executor (default: one per CPU core (at "
         "most 8) without a GPU, each on one thread; 1 with a GPU).")]
UntilDecidedOption = Annotated[int | None, typer.Option(
    help="Then add seeds as a group-sequential design, up to N seeds per group (N at "
         "least 2): at each look the verdict's own test at the α that look spends, the "
         "baseline's seeds first, one more seed for each method not yet decided.",
    callback=_until_decided)]
SpendingOption = Annotated[str, typer.Option(
    help="--until-decided's α-spending function (Lan–DeMets): obrien_fleming (little α "
         "early, most at the last look) or pocock (evenly).",
    callback=_spending)]
FutilityOption = Annotated[float | None, typer.Option(
    help="--until-decided's futility rule (non-binding): at a look, stop giving seeds to a "
         "method whose conditional power under the current trend, the chance its test "
         "still reaches the decision by the cap if its effect is what its seeds show now, is "
         "below this (0 to 1; 0.1 is the measured design: docs/statistics.md). Its verdict "
         "stays within noise. Default: never stop for futility. Example: --futility 0.1.",
    callback=_futility)]
EnsemblesOption = Annotated[str, typer.Option(
    help="Train a method's seeds stacked in one process: auto (with a GPU: CUDA here, or "
         "one GPU per job on a cluster), on, off.")]
ReportOption = Annotated[bool, typer.Option(help="Write the report when done.")]
ProgressOption = Annotated[bool, typer.Option(help="Show a progress bar.")]
DryRunOption = Annotated[bool, typer.Option(
    "--dry-run", help="Print the jobs it would start, their resources and estimated "
                      "GPU-hours; submit, start and write nothing. Example: modbench study "
                      "run seed002-1.2b --executor slurm --dry-run.",
    rich_help_panel=_DRY)]
GpusPerRunOption = Annotated[int | None, typer.Option(
    help="GPUs per job (a run, or a method's stacked seeds); more than 1 trains each run "
         "as one torchrun group on one node (default: slurm 1; ray 1 if the cluster has "
         "GPUs, else 0). Example: --gpus-per-run 8.", rich_help_panel=_CLUSTER)]
CpusPerRunOption = Annotated[int | None, typer.Option(
    help="CPUs per job, ray and slurm (default: 4 per GPU, 1 without). Example: "
         "--cpus-per-run 16.", rich_help_panel=_CLUSTER)]
RayAddressOption = Annotated[str | None, typer.Option(
    help="Join this Ray cluster (ray.init(address=...)) (default: start a local Ray "
         "instance). Example: --ray-address auto.", rich_help_panel=_CLUSTER)]
SlurmPartitionOption = Annotated[str | None, typer.Option(
    help="Partition (default: the cluster's). Example: --slurm-partition gpu.",
    rich_help_panel=_SLURM)]
SlurmTimeOption = Annotated[int | None, typer.Option(
    help="Time limit per job in minutes; a longer job is requeued and resumes from its "
         "last checkpoint (default: 1440). Example: --slurm-time 720.",
    rich_help_panel=_SLURM)]
SlurmAccountOption = Annotated[str | None, typer.Option(
    help="Account to charge. Example: --slurm-account myproject.",
    rich_help_panel=_SLURM)]
SlurmQosOption = Annotated[str | None, typer.Option(
    help="Quality of service. Example: --slurm-qos high.", rich_help_panel=_SLURM)]
SlurmConstraintOption = Annotated[str | None, typer.Option(
    help="Node features. Example: --slurm-constraint h100.", rich_help_panel=_SLURM)]
SlurmMemGbOption = Annotated[float | None, typer.Option(
    help="Memory per job in GB (default: the partition's). Example: --slurm-mem-gb 200.",
    rich_help_panel=_SLURM)]
SlurmArrayParallelismOption = Annotated[int | None, typer.Option(
    help="Array tasks running at once (default: 256). Example: "
         "--slurm-array-parallelism 8.", rich_help_panel=_SLURM)]
SlurmSetupOption = Annotated[list[str] | None, typer.Option(
    help="Shell line run before each job, repeatable. Example: --slurm-setup 'module load "
         "cuda/12.4' --slurm-setup 'source ~/venv/bin/activate'.",
    rich_help_panel=_SLURM)]
SlurmFolderOption = Annotated[Path | None, typer.Option(
    help="Folder for submitit's logs and pickles (default: <study>/slurm). Example: "
         "--slurm-folder /scratch/me/logs.", rich_help_panel=_SLURM)]
SlurmMaxTimeoutsOption = Annotated[int | None, typer.Option(
    help="Time-outs after which a job is not requeued again (default: 30). Example: "
         "--slurm-max-timeouts 10.", rich_help_panel=_SLURM)]
SlurmExtraOption = Annotated[list[str] | None, typer.Option(
    help="Any other sbatch option as KEY=VALUE, repeatable. Example: --slurm-extra "
         "mail-type=END --slurm-extra exclude=node07.", rich_help_panel=_SLURM)]
ExecutorOptionOption = Annotated[list[str] | None, typer.Option(
    help="Any option of the chosen executor as KEY=VALUE, KEY its flag without the dashes "
         "(for an executor without flags of its own), repeatable. Example: "
         "--executor-option slurm-qos=high.", rich_help_panel=_CLUSTER)]
GpuTypeOption = Annotated[str | None, typer.Option(
    help="GPU whose dense bf16 peak the estimate uses and whose memory each job's memory "
         "plan is checked against, dry run or not (ray, slurm): H100, H200, A100, B200 "
         "(default: H100). Example: --gpu-type A100.", rich_help_panel=_DRY)]
GpuTflopsOption = Annotated[float | None, typer.Option(
    help="Dense bf16 peak in TFLOP/s of another GPU. Example: --gpu-tflops 459.",
    rich_help_panel=_DRY)]
MfuOption = Annotated[float | None, typer.Option(
    help="Model FLOPs utilisation the estimate assumes (default: 0.30). Example: --mfu "
         "0.4.", rich_help_panel=_DRY)]


@study_app.command("run")
def run(
    spec: SpecOption = None,
    out: OutOption = None,
    executor: ExecutorOption = "local",
    workers: WorkersOption = None,
    until_decided: UntilDecidedOption = None,
    spending: SpendingOption = "obrien_fleming",
    futility: FutilityOption = None,
    ensembles: EnsemblesOption = "auto",
    report: ReportOption = True,
    progress: ProgressOption = True,
    dry_run: DryRunOption = False,
    gpus_per_run: GpusPerRunOption = None,
    cpus_per_run: CpusPerRunOption = None,
    ray_address: RayAddressOption = None,
    slurm_partition: SlurmPartitionOption = None,
    slurm_time: SlurmTimeOption = None,
    slurm_account: SlurmAccountOption = None,
    slurm_qos: SlurmQosOption = None,
    slurm_constraint: SlurmConstraintOption = None,
    slurm_mem_gb: SlurmMemGbOption = None,
    slurm_array_parallelism: SlurmArrayParallelismOption = None,
    slurm_setup: SlurmSetupOption = None,
    slurm_folder: SlurmFolderOption = None,
    slurm_max_timeouts: SlurmMaxTimeoutsOption = None,
    slurm_extra: SlurmExtraOption = None,
    executor_option: ExecutorOptionOption = None,
    gpu_type: GpuTypeOption = None,
    gpu_tflops: GpuTflopsOption = None,
    mfu: MfuOption = None,
    methods_from: MethodsFrom = None,
) -> None:
    """Train and evaluate every run of a study that is not done yet (a killed study resumes
    by running the same command), on this machine, on Ray or on SLURM.

    Example: modbench study run my_study.yaml --out studies/mine --workers 2

    Example: modbench study run seed002-1.2b --executor slurm --gpus-per-run 8
    --slurm-partition gpu --slurm-time 1440 --dry-run
    """
    from modbench.study.runner import run_study

    s = load_spec_with_plugins(spec, methods_from)
    folder = out or Path("studies") / s.name
    options = _executor_options(
        executor_option, gpus_per_run=gpus_per_run, cpus_per_run=cpus_per_run,
        ray_address=ray_address, slurm_partition=slurm_partition, slurm_time=slurm_time,
        slurm_account=slurm_account, slurm_qos=slurm_qos, slurm_constraint=slurm_constraint,
        slurm_mem_gb=slurm_mem_gb, slurm_array_parallelism=slurm_array_parallelism,
        slurm_setup=tuple(slurm_setup or ()),
        slurm_folder=str(slurm_folder) if slurm_folder else None,
        slurm_max_timeouts=slurm_max_timeouts, slurm_extra=tuple(slurm_extra or ()))
    if dry_run:
        with _refusing_jobs():
            text = _dry_run(s, folder, executor, workers, ensembles, options, until_decided,
                            spending, futility, gpu_type, gpu_tflops, mfu)
        typer.echo(text)
        return
    if gpu_tflops is not None or mfu is not None:
        from modbench.errors import ModbenchError

        raise ModbenchError("--gpu-tflops and --mfu set the --dry-run estimate; add --dry-run, "
                            "or leave them out")
    if gpu_type is not None:
        from modbench.study.plan import throughput

        gpu_type = throughput(gpu_type).gpu  # an unknown name: one line, as in a dry run
    with _refusing_jobs():
        c = run_study(s, folder, executor=executor, workers=workers,
                      until_decided=until_decided, ensembles=ensembles, progress=progress,
                      options=options, spending=spending, futility=futility,
                      gpu_type=gpu_type)
    _say_counts(s.name, folder, c, until_decided is not None)
    if report:
        from modbench.study.reporting import write_study_report

        written = write_study_report(folder)
        typer.echo(f"report: {written / 'report.md'} and {written / 'report.html'}")
    if c["failed"]:
        raise typer.Exit(1)


@contextlib.contextmanager
def _refusing_jobs() -> Iterator[None]:
    """Jobs that fit no memory plan on their GPU (:class:`modbench.study.fits.JobsDoNotFit`):
    one line each on stderr, then exit 2."""
    from modbench.study.fits import JobsDoNotFit

    try:
        yield
    except JobsDoNotFit as e:
        for line in e.lines:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(2) from None


def load_spec_with_plugins(spec: str | None, methods_from: list[str] | None) -> StudySpec:
    """The spec ``study run`` is given, with the plugins ``--methods-from`` adds."""
    from modbench.study.spec import load_spec

    s = load_spec(spec)
    s.methods_from = _with_plugins(s.methods_from, methods_from)
    return s


def _executor_options(items: list[str] | None, **flags: Any) -> Any:
    """The executor's options by flag name (its kind reads the ones it takes), then any
    ``--executor-option KEY=VALUE`` items over them."""
    from modbench.study.executors import ExecutorOptions, parse_items

    return ExecutorOptions(parse_items(items or (), ExecutorOptions(**flags)))


def _dry_run(s: StudySpec, folder: Path, executor: str, workers: int | None, ensembles: str,
             options: Any, until_decided: int | None, spending: str, futility: float | None,
             gpu_type: str | None, gpu_tflops: float | None, mfu: float | None) -> str:
    """``study run --dry-run``: what the run refuses of the spec with these options, refused
    here too; else the plan of every stage, as text."""
    from modbench.study.plan import format_plan, plan_study, throughput
    from modbench.study.runner import check_study_run
    from modbench.study.spec import expand

    check_study_run(s, expand(s), until_decided)
    plan = plan_study(s, folder, executor, workers=workers, ensembles=ensembles,
                      options=options, rate=throughput(gpu_type, gpu_tflops, mfu),
                      until_decided=until_decided, spending=spending, futility=futility)
    return format_plan(plan)


def _say_counts(name: str, folder: Path, c: dict[str, Any], sequential: bool) -> None:
    """The line ``study run`` ends with, and each failed run's reason."""
    typer.echo(f"study {name} in {folder}: {c['total']} runs, {c['already_done']} already "
               f"done, {c['trained']} trained, {c['diverged']} diverged, {c['stalled']} stalled, "
               f"{c['failed']} failed"
               + (f", {c['busy']} held by other workers" if c["busy"] else "")
               + (f", {c['dropped']} dropped by the profile's halving rule"
                  if c.get("dropped") else "")
               + (f", {c['added_seeds']} seeds added" if sequential else ""))
    for f in c["failures"]:
        typer.echo(f"  failed: {f}", err=True)


def _with_plugins(recorded: list[str], given: list[str] | None) -> list[str]:
    """A spec's plugins and those ``--methods-from`` adds (loaded now, recorded absolute in
    the study folder's spec.yaml, so `status` and `report` load them without the flag)."""
    if not given:
        return recorded
    from modbench.methods.plugins import load_plugins

    return list(dict.fromkeys([*recorded, *(p.ref for p in load_plugins(given))]))


@study_app.command("status")
def status(folder: Annotated[Path, typer.Argument(help="A study folder.")],
           methods_from: MethodsFrom = None) -> None:
    """Show the progress of a study: every run and its state (a tuned study's tuning and
    tuned stages after the frozen study, each from its own folder). A run whose outside
    method's code changed since it trained is named (the report leaves it out).

    Example: modbench study status studies/builtin-cpu
    """
    from modbench.study.stages import stages_for

    use_plugins(methods_from)
    spec = _recorded_spec(folder)
    listed = 0
    for stage in stages_for(spec, folder):
        for part in stage.status():
            if part.folder is not None:
                if listed:
                    typer.echo("")
                _status_rows(part.folder, part.key)
                listed += 1
            for line in part.lines:
                typer.echo(line)


def _recorded_spec(folder: Path) -> StudySpec:
    """The spec the study in ``folder`` was run with, which says its stages (a folder that is
    no study: the one-line error; a spec that no longer reads: the study's own stage only)."""
    from modbench.errors import ModbenchError
    from modbench.study.results import check_study_folder, load_spec_of
    from modbench.study.spec import StudySpec

    check_study_folder(folder)
    try:
        return load_spec_of(folder) or StudySpec()
    except ModbenchError:
        return StudySpec()


def _run_value(run: Path, key: str) -> Any:
    """``key`` (dotted, such as recipe.lr) in the run folder's config.yaml, or None."""
    import yaml

    try:
        node: Any = yaml.safe_load((run / "config.yaml").read_text())
        for part in key.split("."):
            node = node[part]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    return node


def _status_rows(folder: Path, key: str | None = None) -> None:
    """One study folder's line of counts and a line per run (``key``: also each run's value
    of that config key, for a tuned study's stages)."""
    from modbench.study.runner import group_rows, study_status
    from modbench.study.store import worker_gone

    rows = study_status(folder)
    for r in rows:  # a killed study leaves its claimed run "running" until the next `run`
        if r["state"] == "running" and worker_gone(r.get("worker")):
            r["state"] = "interrupted"
    changed = _code_changes(folder, rows)
    current = {(r["scale"], r["method"], r["seed"]) for r in rows
               if r["key"] not in changed and r["state"] == "done"}
    counts = group_rows(rows)
    typer.echo(f"{folder}: {len(rows)} runs — " + ", ".join(
        f"{v} {k}" for k, v in sorted(counts.items())))
    scale_w = max((len(r["scale"]) for r in rows), default=0)
    method_w = max((len(r["method"]) for r in rows), default=0)
    for r in rows:
        s = r["summary"] or {}
        loss = s.get("final_val_loss")
        extra = f"val {loss:.4f}" if isinstance(loss, float) else ""
        if r["status"] in ("diverged", "stalled"):
            extra = f"{r['status']} at step {s.get(r['status'] + '_at_step')}"
        if r["state"] == "failed":
            extra = (r["error"] or "").strip().splitlines()[-1][:80] if r["error"] else ""
        if r["state"] == "interrupted":
            extra = "its worker is gone; run `modbench study run` again to resume it"
        if r["key"] in changed:
            again = ("replaced by a run with the loaded code"
                     if (r["scale"], r["method"], r["seed"]) in current
                     else "`study run` trains it again")
            extra = (f"{extra}  " if extra else "") + (
                f"code changed since it trained ({changed[r['key']]}): left out of the "
                f"report, {again}")
        value = f"{key}={_run_value(folder / 'runs' / r['key'], key)}  " if key else ""
        typer.echo(f"  {r['scale']:<{scale_w}}  {r['method']:<{method_w}}  s{r['seed']:<4} "
                   f"{value}{(r['status'] or r['state']):<10} {extra}".rstrip())


def _code_changes(folder: Path, rows: list[dict[str, Any]]) -> dict[str, str]:
    """Runs of a study whose outside methods' code differs from the code its plugins load now
    (``modbench.study.results.code_changes``, which reads no run folder of a built-in
    method)."""
    from modbench.study.results import code_changes, load_study_plugins

    load_study_plugins(folder)
    return code_changes(folder, ((r["key"], r["method"]) for r in rows))


@study_app.command("report")
def report(
    folder: Annotated[Path, typer.Argument(help="A study folder.")],
    metric: Annotated[str | None, typer.Option(
        help="Primary metric: val_loss, probe_avg, climb_avg or a task name "
             "(default: the spec's).")] = None,
    predict: Annotated[str | None, typer.Option(
        help="Also print each method's gap at this preset, extrapolated from the study's "
             "scaling fits (3 or more scales), beside the GPU-hours its real runs would "
             "cost. Example: --predict climb-1.2b.")] = None,
    gpu_type: Annotated[str | None, typer.Option(
        help="With --predict: the GPU of the GPU-hours (default: H100).")] = None,
    mfu: Annotated[float | None, typer.Option(
        help="With --predict: the MFU the GPU-hours assume (default: 0.30).")] = None,
    methods_from: MethodsFrom = None,
) -> None:
    """Write FOLDER/report/: report.md, a self-contained report.html, results.csv and plots.

    Example: modbench study report studies/builtin-cpu

    Example: modbench study report studies/ladder-cpu --predict climb-1.2b
    """
    from modbench.study.reporting import write_study_report

    use_plugins(methods_from)
    if predict is None and (gpu_type is not None or mfu is not None):
        from modbench.errors import ModbenchError

        raise ModbenchError("--gpu-type and --mfu set --predict's GPU-hours; add --predict "
                            "PRESET, or leave them out")
    text = _prediction(folder, predict, gpu_type, mfu) if predict is not None else None
    out = write_study_report(folder, metric)
    typer.echo(f"wrote {out / 'report.md'}, {out / 'report.html'}, {out / 'results.csv'}")
    if text is not None:
        typer.echo(text)


def _prediction(folder: Path, shape: str, gpu_type: str | None, mfu: float | None) -> str:
    """``study report --predict SHAPE``: each method's gain over the baseline at SHAPE from
    the full-ladder fits (:meth:`~modbench.analysis.scaling.ScalingAnalysis.extrapolated_gain`),
    marked as an extrapolation, beside the GPU-hours of the study's runs at SHAPE
    (``study plan``'s accounting: :func:`~modbench.study.plan.run_flops`)."""
    import dataclasses
    import math

    from modbench.analysis.scaling import (
        analyse,
        method_non_embedding_params,
        points_from_results,
    )
    from modbench.errors import ModbenchError
    from modbench.study.plan import run_flops, throughput
    from modbench.study.results import load_results, load_spec_of
    from modbench.study.spec import StudySpec, expand, run_spec

    rate = throughput(gpu_type, None, mfu)
    spec = load_spec_of(folder) or StudySpec()
    target = expand(dataclasses.replace(spec, scales=[shape]))  # an unknown preset: one line
    results = load_results(folder)
    an = analyse(points_from_results(results), results.baseline)
    if an is None:
        raise ModbenchError(f"{folder} has fewer than 3 scales with a finished "
                            f"'{results.baseline}' run: no scaling fit to extrapolate; "
                            "--predict needs a ladder (docs/studies.md, Ladders)")
    seed = spec.seeds.default[0]
    n_of = {m: method_non_embedding_params(run_spec(spec, shape, m, seed).config.model)
            for m in an.methods}
    top = an.methods[an.baseline].rungs[-1]
    hours = {m: sum(run_flops(r.config) for r in target if r.method == m)
             / rate.flops_per_s / 3600 for m in an.methods}
    lines = [f"EXTRAPOLATION, not a measurement: {shape} from the fits over {len(an.scales)} "
             f"rungs of {folder} (largest {top.scale}, N {top.params:.3g}); {shape} has N "
             f"{n_of[an.baseline]:.3g} non-embedding parameters, "
             f"{n_of[an.baseline] / top.params:.3g}x the largest rung",
             f"{'method':<24} {'predicted loss':>14} {'gain over baseline [95% CI]':>32} "
             f"{'GPU-hours':>10}"]  # a method's runs at SHAPE
    for m, ms in an.methods.items():
        if ms.fit_n is None:  # every seed failed at all but one or two rungs: nothing to fit
            loss, gain = "–", f"no fit ({len(ms.rungs)} of {len(an.scales)} rungs trained)"
        else:
            loss = f"{ms.extrapolate(n_of[m]):.4f}"
            if m == an.baseline:
                gain = "(baseline)"
            else:
                g, (lo, hi) = an.extrapolated_gain(m, n_of[m], n_of[an.baseline])
                gain = f"{g:+.4f} [{lo:+.4f}, {hi:+.4f}]"
        lines.append(f"{m:<24} {loss:>14} {gain:>32} {hours[m]:>10,.1f}")
    total = sum(hours.values())
    cfg = run_spec(spec, shape, an.baseline, seed).config
    t_target = cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len / n_of[an.baseline]
    t_top = next((r.tokens / top.params for r in results.rows if r.scale == top.scale
                  and r.method == an.baseline and r.tokens), math.nan)
    if not math.isclose(t_target, t_top, rel_tol=0.1):
        lines.append(f"note: the largest rung trained {t_top:.3g} tokens per non-embedding "
                     f"parameter, {shape} trains {t_target:.3g}; the fits assume a ladder's "
                     "fixed ratio, so the extrapolation is further off than its interval says")
    lines.append(f"the real runs at {shape} ({len(target)} runs, the spec's seeds): "
                 f"{total:,.1f} GPU-hours on {rate.gpu} at MFU {rate.mfu:.2f}"
                 f"{' (assumed)' if rate.mfu_assumed else ''}, `study run --dry-run`'s "
                 "accounting; the interval is the fits' bootstrap spread, not one run's "
                 "noise, and holds only if the ladder's trend continues")
    return "\n".join(lines)


@study_app.command("replicate")
def replicate(
    folder: Annotated[Path, typer.Argument(help="A finished study folder.")],
    change: Annotated[list[str], typer.Option(
        help="The factor to change, FACTOR[=VALUE], repeatable: seeds[=OFFSET], "
             "data-order[=SEED], dtype[=bf16|fp32], compile[=true|false], threads[=N], "
             "onednn[=off|on]. Example: --change threads=2 --change onednn.")],
    workers: WorkersOption = None,
    executor: ExecutorOption = "local",
    report: ReportOption = True,
    progress: ProgressOption = True,
    methods_from: MethodsFrom = None,
) -> None:
    """Re-run every method with a decided verdict, and the baseline, with one factor changed,
    and say which verdicts replicate (into FOLDER/replicate/<change>/; the report's
    "Replication" section). Thread count and oneDNN change only the order of sums: a verdict
    that does not replicate under them depends on the machine.

    Example: modbench study replicate studies/builtin-cpu --change threads=2 --change onednn
    """
    from modbench.study.runner import replicate_study

    use_plugins(methods_from)
    c = replicate_study(folder, change, executor=executor, workers=workers, progress=progress)
    _say_counts(folder.name + " (replication)", folder, c, False)
    from modbench.report.replication import read_replications

    wanted = {ch.replace("=", "-") for ch in change}
    for data in read_replications(folder):
        if data["change"].replace("=", "-") in wanted:
            typer.echo(f"replication under {data['change']}: {data['replicated']} of "
                       f"{data['verdicts']} decided verdicts replicate")
    if report:
        from modbench.study.reporting import write_study_report

        written = write_study_report(folder)
        typer.echo(f"report: {written / 'report.md'} and {written / 'report.html'}")
    if c["failed"]:
        raise typer.Exit(1)


@study_app.command("validate")
def validate(spec: Annotated[str, typer.Argument(help="Spec YAML file or built-in name.")],
             methods_from: MethodsFrom = None) -> None:
    """Check a spec without running it: keys, methods, presets, recipes, overrides, and the
    plugins it loads its own methods from.

    Example: modbench study validate seed002-1.2b
    """
    from modbench.study.spec import expand, load_spec

    use_plugins(methods_from)
    s = load_spec(spec)
    runs = expand(s)
    scales = sorted({r.scale for r in runs})
    tuning = ""
    if s.tuning is not None:  # stage 1 resolves every value now; stage 2 trains len(runs) more
        from modbench.study.stages.tuning import tuning_runs

        tuning = (f"; tuning {s.tuning.key}: {len(tuning_runs(s))} tuning runs, then "
                  f"{len(runs)} tuned runs")
    typer.echo(f"{s.name}: valid — {len(runs)} runs, {len({r.method for r in runs})} methods, "
               f"scales {', '.join(scales)}{tuning}")


@study_app.command("plan")
def plan(
    spec: Annotated[str, typer.Argument(help="Spec YAML file or built-in name.")],
    effect: Annotated[str, typer.Option(
        help="The true effect to find: in loss (metric) units, or in sigmas of the noise floor. "
             "Example: --effect 0.02, --effect 2σ, --effect 2sigma.")],
    sigma: Annotated[float | None, typer.Option(
        help="The noise floor (the baseline's seed std) in metric units. Example: --sigma "
             "0.03.")] = None,
    from_study: Annotated[Path | None, typer.Option(
        "--from", help="Take the noise floor from a finished study folder: its baseline's "
                       "seed std at its first scale. Example: --from studies/builtin-cpu.")
    ] = None,
    power: Annotated[float, typer.Option(
        help="The probability of calling the effect an improver to aim at.")] = 0.8,
    baseline_seeds: Annotated[str, typer.Option(
        help="The baseline's seeds at each candidate n: same (n), sqrt (n x sqrt(methods), "
             "Dunnett's allocation for many comparisons with one baseline) or a number "
             "(at least n). Example: --baseline-seeds sqrt.")] = "same",
    workers: Annotated[int | None, typer.Option(
        help="CPU worker processes the CPU wall time assumes (default: one per usable core, "
             "at most 8, as `study run`).")] = None,
    gpu_type: Annotated[str | None, typer.Option(
        help="GPU of the GPU-hours estimate: H100, H200, A100, B200 (default: H100).")] = None,
    gpu_tflops: Annotated[float | None, typer.Option(
        help="Dense bf16 peak in TFLOP/s of another GPU.")] = None,
    mfu: Annotated[float | None, typer.Option(
        help="Model FLOPs utilisation of the GPU estimate (default: 0.30).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    methods_from: MethodsFrom = None,
) -> None:
    """Seeds per method and baseline that give the verdict POWER (default 80 %) to call a
    true effect an improver, at the spec's design (its methods form the Holm family at alpha
    0.05, pooled t, |Δ| > 1σ), n = 2..20, and what they cost: FLOPs, CPU time, GPU-hours.
    Writes nothing. docs/statistics.md, "Planning seeds".

    Example: modbench study plan builtin-cpu --effect 2σ

    Example: modbench study plan builtin-cpu --effect 0.02 --from studies/builtin-cpu --json
    """
    import json

    from modbench.study.plan import throughput
    from modbench.study.seeds import plan_study_seeds
    from modbench.study.spec import load_spec

    use_plugins(methods_from)
    rate = throughput(gpu_type, gpu_tflops, mfu)
    plan = plan_study_seeds(load_spec(spec), effect, sigma=sigma, from_study=from_study,
                            power=power, baseline_seeds=baseline_seeds, workers=workers,
                            rate=rate)
    typer.echo(json.dumps(plan.to_json(), indent=2) if as_json else plan.format())


@study_app.command("list")
def list_specs() -> None:
    """List the built-in study specs.

    Example: modbench study list
    """
    from modbench.study.spec import builtin_specs, load_spec

    names = sorted(builtin_specs())
    width = max((len(n) for n in names), default=0)
    for name in names:
        typer.echo(f"{name:<{width}}  {load_spec(name).description}")
