"""The ``modbench train`` command; also ``python -m modbench.train`` (the same arguments),
which is what each process of a torchrun group runs.

Exit codes: 0 every run completed; 2 a usage or input error (one line on stderr, no run
folder); 3 a run ended ``diverged`` or ``stalled`` (its folder and summary are written all
the same), so a shell script or a scheduler can tell it from success. A process inside a
torchrun group exits 0 for a diverged run (torchrun would report a non-zero exit as a crash of
the group); the command that started the group (``modbench train --nproc N``) exits 3. 75
(sysexits' EX_TEMPFAIL): the run was stopped by SIGUSR1, SIGUSR2 or SIGTERM (a scheduler's
pre-emption or time-out warning), finished its step and saved it; ``--resume`` continues it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from modbench.errors import ModbenchError
from modbench.helptext import tidy_help
from modbench.methods.options import MethodsFrom, use_plugins

EXIT_DIVERGED = 3  # a run's status is one of UNSUCCESSFUL (the CLI's exit codes: docs/cli.md)
UNSUCCESSFUL = ("diverged", "stalled")


# The options of `modbench train`.
_PresetOpt = Annotated[str | None, typer.Option(
    help="Model/training preset (`modbench presets`) [default: cpu-small].")]
_MethodOpt = Annotated[str | None, typer.Option(
    help="Method string: names joined by '+', options in parentheses (`modbench "
         "methods`) [default: baseline].")]
_SeedOpt = Annotated[int | None, typer.Option(
    help="Init seed; the data order never depends on it [default: 0].")]
_SeedsOpt = Annotated[str | None, typer.Option(
    help="Several init seeds, comma-separated (e.g. 0,1,2): trained stacked in one "
         "process on the same batches, one run folder each (OUT/s<seed>); a method that "
         "cannot stack trains them one at a time.")]
_StepsOpt = Annotated[int | None, typer.Option(
    help="Optimizer steps [default: the preset's].")]
_OutOpt = Annotated[Path | None, typer.Option(
    help="Run folder; with --seeds the parent of one folder per seed [default: a new "
         "folder under runs/ named after the preset, method, seed and time].")]
_RecipeOpt = Annotated[str | None, typer.Option(
    help="Recipe (`modbench recipes`) [default: the preset's].")]
_ConfigOpt = Annotated[Path | None, typer.Option(
    help="YAML file with any subset of the config keys.")]
_CheckpointEveryOpt = Annotated[int | None, typer.Option(
    help="Write a checkpoint every K steps.")]
_ResumeOpt = Annotated[bool, typer.Option(
    help="Continue the run in --out from its last checkpoint (its config.yaml is the "
         "starting point; other options must agree with it). The checkpoint may come "
         "from any number of processes.")]
_SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY=VALUE",
    help="Dotted override, repeatable (e.g. recipe.lr=1e-3; docs/config.md).")]
_NprocOpt = Annotated[int | None, typer.Option(
    help="Train with N processes on this node (torchrun; one per GPU on CUDA, gloo on "
         "the CPU): DDP, or FSDP with --set train.parallel=fsdp. train.batch_size is the "
         "global batch and must divide by N; the data order equals one process's.")]
_MaxRestartsOpt = Annotated[int | None, typer.Option(
    help="With --nproc: start the group again up to N times after a process failed or was "
         "killed, each time resuming from the last checkpoint (train.max_restarts) "
         "[default: 0].")]
_ProgressOpt = Annotated[bool, typer.Option(help="Show a progress bar.")]


def train_command(
    preset: _PresetOpt = None,
    method: _MethodOpt = None,
    seed: _SeedOpt = None,
    seeds: _SeedsOpt = None,
    steps: _StepsOpt = None,
    out: _OutOpt = None,
    recipe: _RecipeOpt = None,
    config: _ConfigOpt = None,
    checkpoint_every: _CheckpointEveryOpt = None,
    resume: _ResumeOpt = False,
    set_: _SetOpt = None,
    nproc: _NprocOpt = None,
    max_restarts: _MaxRestartsOpt = None,
    progress: _ProgressOpt = True,
    methods_from: MethodsFrom = None,
) -> None:
    """Train one model and write config.yaml, metrics.jsonl and summary.json to its folder.

    With no arguments: the baseline `cpu-small` model on the built-in corpus (a few minutes
    on 2 idle CPU cores).

    Exit code 0 when the run completed, 3 when it diverged or stalled (its folder is written
    all the same), 2 for a usage or input error (nothing written).

    Example: modbench train --preset tiny --method post_ln+qknorm --seed 1 --steps 50 --out runs/t
    """
    from modbench.train.runs import TrainOptions, parse_seeds, train_runs

    use_plugins(methods_from)
    trained = train_runs(TrainOptions(
        preset=preset, method=method, seed=seed, seeds=parse_seeds(seeds, seed), steps=steps,
        out=out, recipe=recipe, config=config, checkpoint_every=checkpoint_every, resume=resume,
        overrides=list(set_ or []), nproc=nproc, progress=progress,
        max_restarts=max_restarts), note=typer.echo)
    if trained.report:
        for folder, summary in trained.runs:
            _print_summary(summary, folder)
    if trained.judge:  # a torchrun group's member exits 0 (module docstring)
        _exit_for([summary for _, summary in trained.runs])


def _exit_for(summaries: list[dict[str, Any]]) -> None:
    """Exit with :data:`EXIT_DIVERGED` when any run diverged or stalled."""
    if any(s.get("status") in UNSUCCESSFUL for s in summaries):
        raise typer.Exit(EXIT_DIVERGED)


def _print_summary(s: dict[str, Any], out: Path) -> None:
    typer.echo(f"run:     {out}")
    at = s.get(f"{s['status']}_at_step")  # diverged_at_step (and stalled_at_step, if kept)
    typer.echo(f"status:  {s['status']}" + (f" at step {at}" if at is not None else ""))
    if s["final_val_loss"] is not None:
        typer.echo(f"val:     loss {s['initial_val_loss']:.3f} -> {s['final_val_loss']:.3f} "
                   f"(ppl {s['val_ppl']:.1f})")
    tps = s["tokens_per_s"]
    typer.echo(f"train:   {s['steps']} steps, {s['tokens']:,} tokens, {s['params']:,} params"
               + (f", {tps:,.0f} tokens/s" if tps else "")
               + (f", {s['processes']} processes ({s['parallel']})" if "processes" in s else ""))


def interrupted_train_line(params: dict[str, Any], mark: int = 0) -> str:
    """The one line an interrupted ``modbench train`` prints, from its parsed ``params``: the
    step of the last checkpoint of each run folder this process opened after ``mark``
    (modbench.runtime.runfolder.runs_mark), or that nothing was saved, and the command that
    resumes."""
    import shlex

    from modbench.runtime.checkpoint import interrupted_run_line
    from modbench.runtime.runfolder import runs_written

    out, seeds = params.get("out"), params.get("seeds")
    folders = runs_written(mark)
    if not folders and out is not None:  # --nproc: the group's processes wrote
        folders = ([Path(out) / f"s{s.strip()}" for s in seeds.split(",") if s.strip()]
                   if seeds else [Path(out)])
        folders = [f for f in folders if (f / "config.yaml").is_file()]
    if out is None and folders:
        out = folders[0] if len(folders) == 1 else folders[0].parent
    resume = " ".join(["modbench train", "--out", shlex.quote(str(out)),
                       *(["--seeds", shlex.quote(seeds)] if seeds else []),
                       *(["--nproc", str(params["nproc"])] if params.get("nproc") else []),
                       "--resume"])
    return interrupted_run_line(folders, resume)


def main(argv: list[str] | None = None) -> int:
    """``python -m modbench.train ARGS``: ``modbench train ARGS`` in this process (under
    torchrun: one process of the group). A user error is one line on stderr, exit code 2; a
    diverged or stalled run exits 3 (outside a torchrun group); Ctrl-C exits 130 with one line
    saying what was saved and the command that resumes (printed by the group's rank 0 only:
    the terminal's Ctrl-C reaches every process)."""
    from modbench.interrupts import note_interrupts, parsed
    from modbench.runtime.runfolder import runs_mark

    args = sys.argv[1:] if argv is None else argv
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(train_command)
    command = typer.main.get_command(app)
    tidy_help(command, escape_markup=app.rich_markup_mode == "rich")  # as `modbench train`
    interrupts: list[int] = []  # typer turns Ctrl-C into a silent 130: note it here
    restore = note_interrupts(interrupts)
    mark = runs_mark()
    try:  # without standalone mode, click returns the code of an Exit (a diverged run's 3)
        code = command.main(args=args, prog_name="python -m modbench.train",
                            standalone_mode=False)
    except ModbenchError as e:
        line = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        interrupts.append(0)
        code = 130
    except Exception as e:  # click's usage errors (the same exit code as `modbench`), Abort
        if type(e).__name__ == "Abort":
            print("aborted", file=sys.stderr, flush=True)
            return 130
        show = getattr(e, "show", None)
        if callable(show) and hasattr(e, "exit_code"):
            show()
            return int(e.exit_code)
        raise
    finally:
        restore()
    if interrupts and code == 130:
        if os.environ.get("RANK", "0") == "0":
            try:
                line = interrupted_train_line(parsed(command, "train", args)[1], mark)
            except Exception:  # the line is a courtesy: never a traceback of its own
                line = "interrupted"
            print(line, file=sys.stderr, flush=True)
        return 130
    return code if isinstance(code, int) and not isinstance(code, bool) else 0
