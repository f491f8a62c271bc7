"""The ``--methods-from`` option every command that builds or reads a model takes, kept light
(typer and the standard library only) so that ``--help`` and argument errors import nothing
else: the plugins are imported only when the option is given."""

from __future__ import annotations

from typing import Annotated

import typer

MethodsFrom = Annotated[list[str] | None, typer.Option(
    "--methods-from", metavar="PLUGIN",
    help="Load your own methods from this .py file, package folder or module (repeatable; "
         "also MODBENCH_METHODS_FROM, os.pathsep-separated; docs/methods.md).",
    show_default=False)]


def use_plugins(refs: list[str] | None) -> None:
    """Import the plugins ``--methods-from`` names (nothing when it is not given); a bad one
    is a one-line :class:`~modbench.errors.ModbenchError`."""
    if refs:
        from modbench.methods.plugins import load_plugins

        load_plugins(refs)
