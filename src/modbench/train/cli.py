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
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from modbench.errors import ModbenchError
from modbench.helptext import tidy_help
from modbench.methods.options import MethodsFrom, use_plugins

EXIT_DIVERGED = 3  # a run's status is one of UNSUCCESSFUL (the CLI's exit codes: docs/cli.md)
UNSUCCESSFUL = ("diverged", "stalled")


def train_command(
    preset: Annotated[str | None, typer.Option(
        help="Model/training preset (`modbench presets`) [default: cpu-small].")] = None,
    method: Annotated[str | None, typer.Option(
        help="Method string: names joined by '+', options in parentheses (`modbench "
             "methods`) [default: baseline].")] = None,
    seed: Annotated[int | None, typer.Option(
        help="Init seed; the data order never depends on it [default: 0].")] = None,
    seeds: Annotated[str | None, typer.Option(
        help="Several init seeds, comma-separated (e.g. 0,1,2): trained stacked in one "
             "process on the same batches, one run folder each (OUT/s<seed>); a method that "
             "cannot stack trains them one at a time.")] = None,
    steps: Annotated[int | None, typer.Option(
        help="Optimizer steps [default: the preset's].")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Run folder; with --seeds the parent of one folder per seed [default: a new "
             "folder under runs/ named after the preset, method, seed and time].")] = None,
    recipe: Annotated[str | None, typer.Option(
        help="Recipe (`modbench recipes`) [default: the preset's].")] = None,
    config: Annotated[Path | None, typer.Option(
        help="YAML file with any subset of the config keys.")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(
        help="Write a checkpoint every K steps.")] = None,
    resume: Annotated[bool, typer.Option(
        help="Continue the run in --out from its last checkpoint (its config.yaml is the "
             "starting point; other options must agree with it). The checkpoint may come "
             "from any number of processes.")] = False,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KEY=VALUE",
        help="Dotted override, repeatable (e.g. recipe.lr=1e-3; docs/config.md).")] = None,
    nproc: Annotated[int | None, typer.Option(
        help="Train with N processes on this node (torchrun; one per GPU on CUDA, gloo on "
             "the CPU): DDP, or FSDP with --set train.parallel=fsdp. train.batch_size is the "
             "global batch and must divide by N; the data order equals one process's.")
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    methods_from: MethodsFrom = None,
) -> None:
    """Train one model and write config.yaml, metrics.jsonl and summary.json to its folder.

    With no arguments: the baseline `cpu-small` model on the built-in corpus (a few minutes
    on 2 idle CPU cores).

    Exit code 0 when the run completed, 3 when it diverged or stalled (its folder is written
    all the same), 2 for a usage or input error (nothing written).

    Example: modbench train --preset tiny --method post_ln+qknorm --seed 1 --steps 50 --out runs/t
    """
    from modbench.config import resolve
    from modbench.methods.build import plan
    from modbench.train.distributed import check_world, launch
    from modbench.train.trainer import train as run_train
    from modbench.train.trainer import train_seeds

    use_plugins(methods_from)
    seed_list = _seed_list(seeds, seed)
    if nproc is not None:
        if nproc < 1:
            raise ModbenchError(f"--nproc must be at least 1, got {nproc}")
        if os.environ.get("WORLD_SIZE") and nproc > 1:
            raise ModbenchError("--nproc starts a torchrun group, but this process already runs "
                                "in one (WORLD_SIZE is set); drop --nproc")
    overrides = list(set_ or [])
    if checkpoint_every is not None:
        overrides.append(f"train.checkpoint_every={checkpoint_every}")
    first = out / f"s{seed_list[0]}" if seed_list and out is not None else out
    if resume and config is None and first is not None and (first / "config.yaml").is_file():
        config = first / "config.yaml"
    cfg = resolve(preset, recipe=recipe, yaml_file=config, method=method, seed=seed, steps=steps,
                  overrides=overrides)
    if resume and first is not None:
        _check_same_code(first)
    if nproc is not None and nproc > 1:
        check_world(cfg.train, nproc, len(seed_list) or 1, cfg.recipe.optimizer)
    if out is None:
        if resume:
            raise ModbenchError("--resume needs --out, the folder of the run to continue")
        safe = cfg.model.method.replace("+", "_").replace("(", "_").replace(")", "")
        safe = "".join(c if c.isalnum() or c in "_-.=" else "_" for c in safe)[:80]
        which = f"s{cfg.seed}" if not seed_list else "seeds" + "_".join(map(str, seed_list))
        out = Path("runs") / f"{cfg.preset}-{safe}-{which}-{time.strftime('%Y%m%d-%H%M%S')}"
    if nproc is not None and nproc > 1:
        summary = launch(cfg, out, nproc, resume=resume, progress=progress)
        _print_summary(summary, out)
        _exit_for([summary])
        return
    if not seed_list:
        summary = run_train(cfg, out, resume=resume, progress=progress)
        if int(os.environ.get("RANK") or 0) == 0:  # one summary from a torchrun group
            _print_summary(summary, out)
        if int(os.environ.get("WORLD_SIZE") or 1) == 1:  # a group member exits 0 (docstring)
            _exit_for([summary])
        return
    p = plan(cfg.model)
    if p.stackable:
        summaries = train_seeds(cfg, seed_list, out, resume=resume, progress=progress)
        typer.echo(f"stacked {len(seed_list)} seeds in one process")
    else:
        typer.echo(f"note: method '{p.method}' cannot stack seeds in one process "
                   f"({p.stack_note}); training them one at a time")
        summaries = []
        for s in seed_list:
            one = resolve(preset, recipe=recipe, yaml_file=config, method=method, seed=s,
                          steps=steps, overrides=overrides)
            summaries.append(run_train(one, out / f"s{s}", resume=resume, progress=progress))
    for s, summary in zip(seed_list, summaries, strict=True):
        _print_summary(summary, out / f"s{s}")
    _exit_for(summaries)


def _check_same_code(run: Path) -> None:
    """Refuse to resume a run whose outside methods' code is not the code it trained with
    (the two halves of its curve would come from two versions of the method)."""
    from modbench.methods.plugins import check_recorded

    check_recorded(run, "resume it")


def _exit_for(summaries: list[dict[str, Any]]) -> None:
    """Exit with :data:`EXIT_DIVERGED` when any run diverged or stalled."""
    if any(s.get("status") in UNSUCCESSFUL for s in summaries):
        raise typer.Exit(EXIT_DIVERGED)


def _seed_list(seeds: str | None, seed: int | None) -> list[int]:
    """``--seeds 0,1,2`` as distinct ints ([] when not given)."""
    if seeds is None:
        return []
    if seed is not None:
        raise ModbenchError("give --seed or --seeds, not both")
    try:
        out = [int(x) for x in seeds.split(",") if x.strip()]
    except ValueError:
        raise ModbenchError(f"--seeds takes comma-separated integers, e.g. 0,1,2; got "
                            f"{seeds!r}") from None
    if not out or len(set(out)) != len(out):
        raise ModbenchError(f"--seeds needs distinct init seeds, e.g. 0,1,2; got {seeds!r}")
    return out


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
