"""``modbench methods check`` and ``modbench methods new``: typer command functions that the
main CLI mounts under ``modbench methods``.

Exit codes: 0 every check run passed (or was skipped), 1 a check failed (the table names the
first), 2 a usage error (an unknown method, check, preset or slot, a plugin that does not
load, a file that exists: one ``error:`` line on stderr).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from modbench.conformance.kit import CheckResult

# Only typer and the standard library at module level: `modbench --help` and argument errors
# answer without importing torch; each command imports what it runs.

EXIT_FAILED = 1  # a check failed
EXIT_USAGE = 2  # usage or input error: one line on stderr


def _usage_error(e: Exception) -> typer.Exit:
    typer.echo(f"error: {' '.join(str(e).split())}", err=True)
    return typer.Exit(EXIT_USAGE)


def _echo_results(results: list[CheckResult], method: str, preset: str, as_json: bool) -> bool:
    """Print the kit's results (the table, or JSON); whether every check run passed."""
    from modbench.conformance.kit import first_failure, format_table

    failed = first_failure(results)
    if as_json:
        typer.echo(json.dumps({"method": method, "preset": preset,
                               "results": [r.to_dict() for r in results],
                               "failed": failed.name if failed else None}, indent=2))
    else:
        typer.echo(format_table(results, method))
    return failed is None


# The arguments and options of `methods check`.
_MethodArg = Annotated[str, typer.Argument(
    help="The method to check: a name or a method string, e.g. qknorm or "
         "'layerscale(init=1e-4)' or post_ln+qknorm.")]
_MethodsFromOpt = Annotated[list[str] | None, typer.Option(
    "--methods-from", metavar="PLUGIN",
    help="Load your own methods from this .py file, package folder or module first "
         "(repeatable; also MODBENCH_METHODS_FROM; docs/methods.md).",
    show_default=False)]
_CheckOpt = Annotated[list[str] | None, typer.Option(
    "--check", metavar="NAME",
    help="Run only these checks (repeatable, or comma-separated; 'slow' is compile and "
         "export). Default: all.")]
_SkipOpt = Annotated[list[str] | None, typer.Option(
    "--skip", metavar="NAME", help="Leave out these checks (repeatable, or "
    "comma-separated; 'slow' is compile and export).")]
_FastOpt = Annotated[bool, typer.Option(
    "--fast", help="Leave out the slow checks (compile, export); the same as --skip "
    "slow.")]
_PresetOpt = Annotated[str, typer.Option(
    "--preset", help="The model and run shape the checks build and train.")]
_WithOpt = Annotated[str | None, typer.Option(
    "--with", metavar="METHOD",
    help="The method it is also checked composed with (default: the first of qknorm, "
         "geglu, layerscale, softcap, ssmax that fills none of its slots; 'none': "
         "alone only).")]
_WorkdirOpt = Annotated[Path | None, typer.Option(
    "--workdir", help="Keep the training runs and the export in this new or empty "
    "folder (default: a temporary folder, removed).")]
_JsonOpt = Annotated[bool, typer.Option(
    "--json", help="Print JSON: the method, the preset and every check's result.")]


def check_command(
    name: _MethodArg,
    methods_from: _MethodsFromOpt = None,
    check: _CheckOpt = None,
    skip: _SkipOpt = None,
    fast: _FastOpt = False,
    preset: _PresetOpt = "tiny",
    neighbour: _WithOpt = None,
    workdir: _WorkdirOpt = None,
    as_json: _JsonOpt = False,
) -> None:
    """Check a method with the conformance kit: one table, one row per check.

    The checks, in order (docs/methods.md, "Checking a method"): entry (citation, summary,
    docstring), options (typed defaults that parse back), conflicts (slots filled under its own
    name; a second filler of one refused naming both), params (extra_params against the built
    model), forward (finite logits), flops (extra_flops against torch's FLOP counter), init (a
    declared starts_as_baseline: the baseline's logits at init), causal, gradients (every
    parameter a finite gradient), state_dict (save and load: the same logits), trains (30
    steps, the loss drops), determinism (two identical runs, identical losses), compile (slow:
    one graph, or only declared breaks), export (slow: the Hugging Face export gives the same
    logits). The model-building checks run the method alone and composed with a neighbour.

    Exit code 1 when a check fails (the last line names the first), 2 for a usage error.

    Example: modbench methods check my_gate --methods-from my_gate.py

    Example: modbench methods check qknorm --fast --skip determinism
    """
    from modbench.errors import ModbenchError

    try:
        if methods_from:
            from modbench.methods.plugins import load_plugins

            load_plugins(list(methods_from))
        from modbench.conformance.kit import NO_NEIGHBOUR, check_method
        from modbench.methods.base import MethodSpec

        method = MethodSpec.parse(name).canonical
        chosen = None if neighbour is None else (
            NO_NEIGHBOUR if neighbour.strip().lower() == "none" else neighbour)
        results = check_method(name, preset=preset, checks=check,
                               skip=[*(skip or []), *(["slow"] if fast else [])],
                               neighbour=chosen, workdir=workdir)
    except ModbenchError as e:
        raise _usage_error(e) from None
    if not _echo_results(results, method, preset, as_json):
        raise typer.Exit(EXIT_FAILED)


def new_command(
    name: Annotated[str, typer.Argument(
        help="The new method's name, lower_snake_case (also its file's name).")],
    slot: Annotated[str, typer.Option(
        "--slot", help="What it changes: attn.qk (per-head q/k transform), attn.out_gate "
        "(gate on the heads' output), ffn.act (FFN activation), norm (norm type), merge "
        "(residual merge).")],
    out: Annotated[Path, typer.Option(
        "--out", help="Folder for NAME.py and test_NAME.py (created if missing).")
    ] = Path("."),
) -> None:
    """Write a template method for one slot and a test that runs the conformance kit on it.

    NAME.py is a working, commented method (an identity at initialisation, so it declares
    starts_as_baseline) that passes every check as written; test_NAME.py loads it as a plugin
    and asserts the kit passes. Edit the equation, then check it. Nothing is written over an
    existing file.

    Example: modbench methods new my_gate --slot attn.out_gate --out mylab/
    """
    from modbench.conformance.scaffold import write_method
    from modbench.errors import ModbenchError

    try:
        method_file, test_file = write_method(name, slot, out)
    except ModbenchError as e:
        raise _usage_error(e) from None
    typer.echo(f"wrote {method_file}")
    typer.echo(f"wrote {test_file}")
    typer.echo(f"check it: modbench methods check {name} --methods-from {method_file}")
    typer.echo(f"or:       pytest {test_file}")
