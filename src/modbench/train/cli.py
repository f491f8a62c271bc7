"""The ``modbench train`` command; also ``python -m modbench.train`` (the same arguments),
which is what each process of a torchrun group runs."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from modbench.errors import ModbenchError


def train_command(
    preset: Annotated[str | None, typer.Option(
        help="Model/training preset (`modbench presets`) [default: cpu-small].")] = None,
    method: Annotated[str | None, typer.Option(
        help="Method string: names joined by '+', options in parentheses "
             "[default: baseline].")] = None,
    seed: Annotated[int | None, typer.Option(
        help="Init seed; the data order never depends on it [default: 0].")] = None,
    seeds: Annotated[str | None, typer.Option(
        help="Several init seeds, comma-separated (e.g. 0,1,2): trained stacked in one "
             "process on the same batches, one run folder each (OUT/s<seed>); a method that "
             "cannot stack trains them one at a time.")] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps (preset default).")] = None,
    out: Annotated[Path | None, typer.Option(
        help="Run folder (default: runs/<preset>-<method>-s<seed>-<time>; with --seeds the "
             "parent of one folder per seed).")] = None,
    recipe: Annotated[str | None, typer.Option(
        help="Recipe (`modbench recipes`; default: the preset's).")] = None,
    config: Annotated[Path | None, typer.Option(
        help="YAML file with any subset of the config keys.")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(
        help="Write a checkpoint every K steps.")] = None,
    resume: Annotated[bool, typer.Option(
        help="Continue the run in --out from its last checkpoint (its config.yaml is the "
             "starting point; other options must agree with it). The checkpoint may come "
             "from any number of processes.")] = False,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Dotted override key=value, repeatable (e.g. recipe.lr=1e-3).")] = None,
    nproc: Annotated[int | None, typer.Option(
        help="Train with N processes on this node (torchrun; one per GPU on CUDA, gloo on "
             "the CPU): DDP, or FSDP with --set train.parallel=fsdp. train.batch_size is the "
             "global batch and must divide by N; the data order equals one process's.")
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Train one model and write config.yaml, metrics.jsonl and summary.json to its folder.

    With no arguments: the baseline `cpu-small` model on the built-in corpus (a few minutes
    on 2 CPU cores).

    Example: modbench train --preset tiny --method post_ln+qknorm --seed 1 --steps 50 --out runs/t
    """
    from modbench.config import resolve
    from modbench.methods.build import plan
    from modbench.train.distributed import check_world, launch
    from modbench.train.trainer import train as run_train
    from modbench.train.trainer import train_seeds

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
    if nproc is not None and nproc > 1:
        check_world(cfg.train, nproc, len(seed_list) or 1)
    if out is None:
        if resume:
            raise ModbenchError("--resume needs --out, the folder of the run to continue")
        safe = cfg.model.method.replace("+", "_").replace("(", "_").replace(")", "")
        safe = "".join(c if c.isalnum() or c in "_-.=" else "_" for c in safe)[:80]
        which = f"s{cfg.seed}" if not seed_list else "seeds" + "_".join(map(str, seed_list))
        out = Path("runs") / f"{cfg.preset}-{safe}-{which}-{time.strftime('%Y%m%d-%H%M%S')}"
    if nproc is not None and nproc > 1:
        _print_summary(launch(cfg, out, nproc, resume=resume, progress=progress), out)
        return
    if not seed_list:
        summary = run_train(cfg, out, resume=resume, progress=progress)
        if int(os.environ.get("RANK") or 0) == 0:  # one summary from a torchrun group
            _print_summary(summary, out)
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
    typer.echo(f"status:  {s['status']}" + (
        f" at step {s['diverged_at_step']}" if s["status"] == "diverged" else ""))
    if s["final_val_loss"] is not None:
        typer.echo(f"val:     loss {s['initial_val_loss']:.3f} -> {s['final_val_loss']:.3f} "
                   f"(ppl {s['val_ppl']:.1f})")
    tps = s["tokens_per_s"]
    typer.echo(f"train:   {s['steps']} steps, {s['tokens']:,} tokens, {s['params']:,} params"
               + (f", {tps:,.0f} tokens/s" if tps else "")
               + (f", {s['processes']} processes ({s['parallel']})" if "processes" in s else ""))


def main(argv: list[str] | None = None) -> int:
    """``python -m modbench.train ARGS``: ``modbench train ARGS`` in this process (under
    torchrun: one process of the group). A user error is one line on stderr, exit code 2."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(train_command)
    try:
        app(args=sys.argv[1:] if argv is None else argv, prog_name="python -m modbench.train",
            standalone_mode=False)
    except ModbenchError as e:
        line = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # click's usage errors (the same exit code as `modbench`), Abort
        if type(e).__name__ == "Abort":
            print("interrupted", file=sys.stderr, flush=True)
            return 130
        show = getattr(e, "show", None)
        if callable(show) and hasattr(e, "exit_code"):
            show()
            return int(e.exit_code)
        raise
    return 0
