"""Ctrl-C for the command lines (``modbench`` and ``python -m modbench.train``, which each
build their own typer app): typer turns an interrupt into a silent exit 130, so each notes the
SIGINT itself (:func:`note_interrupts`) and prints one line saying what was saved; and
:func:`parsed` reads the parameters a command line gives, as click would, for that line."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any


def note_interrupts(seen: list[int]) -> Callable[[], Any]:
    """Note each SIGINT in ``seen`` and raise ``KeyboardInterrupt`` as Python would; returns
    the function that puts the previous handler back. Nothing changes where SIGINT is not
    Python's default handler (ignored in a background job, or a caller's own)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        return lambda: None

    def handle(signum: int, frame: Any) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handle)
    return lambda: signal.signal(signal.SIGINT, previous)


def parsed(command: Any, prog: str, argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The (sub)command names and parameters ``argv`` gives to the click ``command``, parsed
    as click would (nothing run, no errors raised)."""
    ctx = command.make_context(prog, list(argv), resilient_parsing=True)
    names: list[str] = []
    while hasattr(command, "resolve_command"):
        args = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
        if not args:
            break
        name, command, rest = command.resolve_command(ctx, args)
        names.append(name)
        ctx = command.make_context(name, rest, parent=ctx, resilient_parsing=True)
    return names, dict(ctx.params)
