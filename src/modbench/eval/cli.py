"""The ``modbench eval`` command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def eval_command(
    run_dir: Annotated[Path, typer.Argument(help="A run folder written by `modbench train`.")],
    probes: Annotated[bool, typer.Option(
        help="Also run the offline probes (mqar, induction, cloze).")] = False,
    limit: Annotated[int | None, typer.Option(
        help="At most N items per probe (and N validation sequences).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Evaluation batch size.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Evaluate a trained run: validation loss, and with --probes the offline capability
    probes; writes RUN_DIR/eval.json with per-item results.

    Example: modbench eval runs/t --probes --limit 100
    """
    from modbench.eval.run import evaluate_run

    r = evaluate_run(run_dir, probes=probes, limit=limit, batch_size=batch_size,
                     progress=progress)
    v = r["validation"]
    typer.echo(f"run:        {run_dir} (step {r['step']})")
    if v["loss"] is not None:
        typer.echo(f"validation: loss {v['loss']:.4f} (ppl {v['ppl']:.1f}, "
                   f"{v['sequences']} sequences)")
    for name, t in r["tasks"].items():
        acc = "n/a" if t["accuracy"] is None else f"{t['accuracy']:.3f}"
        typer.echo(f"{name + ':':<11} accuracy {acc} over {t['n']} items "
                   f"(chance {t['chance']:.4f})")
    typer.echo(f"wrote {Path(run_dir) / 'eval.json'}")
