"""``modbench study``: run, inspect and validate studies."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

study_app = typer.Typer(help="Run a study: methods x seeds x scales under one recipe.\n\n"
                        "Example: modbench study run builtin-cpu --out studies/builtin-cpu",
                        no_args_is_help=True)


_CLUSTER = "Executors and resources"
_SLURM = "SLURM (--executor slurm)"
_DRY = "Dry run (--dry-run)"


@study_app.command("run")
def run(
    spec: Annotated[str | None, typer.Argument(
        help="Spec YAML file or built-in name (default: builtin-cpu).")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Study folder (default: studies/<spec name>).")] = None,
    executor: Annotated[str, typer.Option(
        help="Where runs execute: local (this machine), ray (a local Ray instance or "
             "--ray-address), slurm (job arrays through submitit). Example: --executor slurm.",
        rich_help_panel=_CLUSTER)] = "local",
    workers: Annotated[int | None, typer.Option(
        help="Parallel worker processes of the local executor (default: one per CPU core (at "
             "most 8) without a GPU, each on one thread; 1 with a GPU).")] = None,
    until_decided: Annotated[int | None, typer.Option(
        help="Then add seeds to methods whose interval straddles the decision threshold, up "
             "to N seeds per method.")] = None,
    ensembles: Annotated[str, typer.Option(
        help="Train a method's seeds stacked in one process: auto (with a GPU: CUDA here, or "
             "one GPU per job on a cluster), on, off.")] = "auto",
    report: Annotated[bool, typer.Option(help="Write the report when done.")] = True,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the jobs it would start, their resources and estimated "
                          "GPU-hours; submit, start and write nothing. Example: modbench study "
                          "run seed002-1.2b --executor slurm --dry-run.",
        rich_help_panel=_DRY)] = False,
    gpus_per_run: Annotated[int | None, typer.Option(
        help="GPUs per job (a run, or a method's stacked seeds); more than 1 trains each run "
             "as one torchrun group on one node (default: slurm 1; ray 1 if the cluster has "
             "GPUs, else 0). Example: --gpus-per-run 8.", rich_help_panel=_CLUSTER)] = None,
    cpus_per_run: Annotated[int | None, typer.Option(
        help="CPUs per job, ray and slurm (default: 4 per GPU, 1 without). Example: "
             "--cpus-per-run 16.", rich_help_panel=_CLUSTER)] = None,
    ray_address: Annotated[str | None, typer.Option(
        help="Join this Ray cluster (ray.init(address=...)) (default: start a local Ray "
             "instance). Example: --ray-address auto.", rich_help_panel=_CLUSTER)] = None,
    slurm_partition: Annotated[str | None, typer.Option(
        help="Partition (default: the cluster's). Example: --slurm-partition gpu.",
        rich_help_panel=_SLURM)] = None,
    slurm_time: Annotated[int | None, typer.Option(
        help="Time limit per job in minutes; a longer job is requeued and resumes from its "
             "last checkpoint (default: 1440). Example: --slurm-time 720.",
        rich_help_panel=_SLURM)] = None,
    slurm_account: Annotated[str | None, typer.Option(
        help="Account to charge. Example: --slurm-account myproject.",
        rich_help_panel=_SLURM)] = None,
    slurm_qos: Annotated[str | None, typer.Option(
        help="Quality of service. Example: --slurm-qos high.", rich_help_panel=_SLURM)] = None,
    slurm_constraint: Annotated[str | None, typer.Option(
        help="Node features. Example: --slurm-constraint h100.", rich_help_panel=_SLURM)] = None,
    slurm_mem_gb: Annotated[float | None, typer.Option(
        help="Memory per job in GB (default: the partition's). Example: --slurm-mem-gb 200.",
        rich_help_panel=_SLURM)] = None,
    slurm_array_parallelism: Annotated[int | None, typer.Option(
        help="Array tasks running at once (default: 256). Example: "
             "--slurm-array-parallelism 8.", rich_help_panel=_SLURM)] = None,
    slurm_setup: Annotated[list[str] | None, typer.Option(
        help="Shell line run before each job, repeatable. Example: --slurm-setup 'module load "
             "cuda/12.4' --slurm-setup 'source ~/venv/bin/activate'.",
        rich_help_panel=_SLURM)] = None,
    slurm_folder: Annotated[Path | None, typer.Option(
        help="Folder for submitit's logs and pickles (default: <study>/slurm). Example: "
             "--slurm-folder /scratch/me/logs.", rich_help_panel=_SLURM)] = None,
    slurm_max_timeouts: Annotated[int | None, typer.Option(
        help="Time-outs after which a job is not requeued again (default: 30). Example: "
             "--slurm-max-timeouts 10.", rich_help_panel=_SLURM)] = None,
    slurm_extra: Annotated[list[str] | None, typer.Option(
        help="Any other sbatch option as KEY=VALUE, repeatable. Example: --slurm-extra "
             "mail-type=END --slurm-extra exclude=node07.", rich_help_panel=_SLURM)] = None,
    gpu_type: Annotated[str | None, typer.Option(
        help="GPU whose dense bf16 peak the estimate uses: H100, H200, A100, B200 (default: "
             "H100). Example: --gpu-type A100.", rich_help_panel=_DRY)] = None,
    gpu_tflops: Annotated[float | None, typer.Option(
        help="Dense bf16 peak in TFLOP/s of another GPU. Example: --gpu-tflops 459.",
        rich_help_panel=_DRY)] = None,
    mfu: Annotated[float | None, typer.Option(
        help="Model FLOPs utilisation the estimate assumes (default: 0.30). Example: --mfu "
             "0.4.", rich_help_panel=_DRY)] = None,
) -> None:
    """Train and evaluate every run of a study that is not done yet (a killed study resumes
    by running the same command), on this machine, on Ray or on SLURM.

    Example: modbench study run my_study.yaml --out studies/mine --workers 2

    Example: modbench study run seed002-1.2b --executor slurm --gpus-per-run 8
    --slurm-partition gpu --slurm-time 1440 --dry-run
    """
    from modbench.study.cluster import ExecutorOptions
    from modbench.study.runner import run_study
    from modbench.study.spec import load_spec

    s = load_spec(spec)
    folder = out or Path("studies") / s.name
    options = ExecutorOptions(
        gpus_per_run=gpus_per_run, cpus_per_run=cpus_per_run, ray_address=ray_address,
        slurm_partition=slurm_partition, slurm_time=slurm_time, slurm_account=slurm_account,
        slurm_qos=slurm_qos, slurm_constraint=slurm_constraint, slurm_mem_gb=slurm_mem_gb,
        slurm_array_parallelism=slurm_array_parallelism, slurm_setup=tuple(slurm_setup or ()),
        slurm_folder=str(slurm_folder) if slurm_folder else None,
        slurm_max_timeouts=slurm_max_timeouts, slurm_extra=tuple(slurm_extra or ()))
    if dry_run:
        from modbench.study.plan import format_plan, plan_study, throughput

        plan = plan_study(s, folder, executor, workers=workers, ensembles=ensembles,
                          options=options, rate=throughput(gpu_type, gpu_tflops, mfu))
        typer.echo(format_plan(plan))
        return
    if gpu_type is not None or gpu_tflops is not None or mfu is not None:
        from modbench.errors import ModbenchError

        raise ModbenchError("--gpu-type, --gpu-tflops and --mfu set the --dry-run estimate; "
                            "add --dry-run, or leave them out")
    c = run_study(s, folder, executor=executor, workers=workers, until_decided=until_decided,
                  ensembles=ensembles, progress=progress, options=options)
    typer.echo(f"study {s.name} in {folder}: {c['total']} runs, {c['already_done']} already "
               f"done, {c['trained']} trained, {c['diverged']} diverged, {c['stalled']} stalled, "
               f"{c['failed']} failed"
               + (f", {c['busy']} held by other workers" if c["busy"] else "")
               + (f", {c['added_seeds']} seeds added" if until_decided else ""))
    for f in c["failures"]:
        typer.echo(f"  failed: {f}", err=True)
    if report:
        from modbench.study.results import write_study_report

        out = write_study_report(folder)
        typer.echo(f"report: {out / 'report.md'} and {out / 'report.html'}")
    if c["failed"]:
        raise typer.Exit(1)


@study_app.command("status")
def status(folder: Annotated[Path, typer.Argument(help="A study folder.")]) -> None:
    """Show the progress of a study: every run and its state.

    Example: modbench study status studies/builtin-cpu
    """
    from modbench.study.runner import group_rows, study_status
    from modbench.study.store import worker_gone

    rows = study_status(folder)
    for r in rows:  # a killed study leaves its claimed run "running" until the next `run`
        if r["state"] == "running" and worker_gone(r.get("worker")):
            r["state"] = "interrupted"
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
        typer.echo(f"  {r['scale']:<{scale_w}}  {r['method']:<{method_w}}  s{r['seed']:<4} "
                   f"{(r['status'] or r['state']):<10} {extra}".rstrip())


@study_app.command("report")
def report(
    folder: Annotated[Path, typer.Argument(help="A study folder.")],
    metric: Annotated[str | None, typer.Option(
        help="Primary metric: val_loss, probe_avg, climb_avg or a task name "
             "(default: the spec's).")] = None,
) -> None:
    """Write FOLDER/report/: report.md, a self-contained report.html, results.csv and plots.

    Example: modbench study report studies/builtin-cpu
    """
    from modbench.study.results import write_study_report

    out = write_study_report(folder, metric)
    typer.echo(f"wrote {out / 'report.md'}, {out / 'report.html'}, {out / 'results.csv'}")


@study_app.command("validate")
def validate(spec: Annotated[str, typer.Argument(help="Spec YAML file or built-in name.")]
             ) -> None:
    """Check a spec without running it: keys, methods, presets, recipes, overrides.

    Example: modbench study validate seed002-1.2b
    """
    from modbench.study.spec import expand, load_spec

    s = load_spec(spec)
    runs = expand(s)
    scales = sorted({r.scale for r in runs})
    typer.echo(f"{s.name}: valid — {len(runs)} runs, {len({r.method for r in runs})} methods, "
               f"scales {', '.join(scales)}")


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
