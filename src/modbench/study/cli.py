"""``modbench study``: run, inspect and validate studies."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

study_app = typer.Typer(help="Run a study: methods x seeds x scales under one recipe.",
                        no_args_is_help=True)


@study_app.command("run")
def run(
    spec: Annotated[str | None, typer.Argument(
        help="Spec YAML file or built-in name [default: builtin-cpu].")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Study folder [default: studies/<spec name>].")] = None,
    executor: Annotated[str, typer.Option(help="Where runs execute: local.")] = "local",
    workers: Annotated[int | None, typer.Option(
        help="Parallel worker processes [default: one per CPU core (at most 8) without a GPU, "
             "each on one thread; 1 with a GPU].")] = None,
    until_decided: Annotated[int | None, typer.Option(
        help="Then add seeds to methods whose interval straddles the decision threshold, up "
             "to N seeds per method.")] = None,
    ensembles: Annotated[str, typer.Option(
        help="Train a method's seeds stacked in one process: auto (with a GPU), on, off.")
    ] = "auto",
    report: Annotated[bool, typer.Option(help="Write the report when done.")] = True,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Train and evaluate every run of a study that is not done yet (a killed study resumes
    by running the same command).

    Example: modbench study run my_study.yaml --out studies/mine --workers 2
    """
    from modbench.study.runner import run_study
    from modbench.study.spec import load_spec

    s = load_spec(spec)
    folder = out or Path("studies") / s.name
    c = run_study(s, folder, executor=executor, workers=workers, until_decided=until_decided,
                  ensembles=ensembles, progress=progress)
    typer.echo(f"study {s.name} in {folder}: {c['total']} runs, {c['already_done']} already "
               f"done, {c['trained']} trained, {c['diverged']} diverged, {c['failed']} failed"
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
    for r in rows:
        s = r["summary"] or {}
        loss = s.get("final_val_loss")
        extra = f"val {loss:.4f}" if isinstance(loss, float) else ""
        if r["status"] == "diverged":
            extra = f"diverged at step {s.get('diverged_at_step')}"
        if r["state"] == "failed":
            extra = (r["error"] or "").strip().splitlines()[-1][:80] if r["error"] else ""
        if r["state"] == "interrupted":
            extra = "its worker is gone; run `modbench study run` again to resume it"
        typer.echo(f"  {r['scale']:<12} {r['method']:<28} s{r['seed']:<4} "
                   f"{(r['status'] or r['state']):<10} {extra}")


@study_app.command("report")
def report(
    folder: Annotated[Path, typer.Argument(help="A study folder.")],
    metric: Annotated[str | None, typer.Option(
        help="Primary metric: val_loss, probe_avg, climb_avg or a task name "
             "[default: the spec's].")] = None,
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

    for name in sorted(builtin_specs()):
        s = load_spec(name)
        typer.echo(f"{name:<24} {s.description}")
