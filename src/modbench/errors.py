"""One exception type for every mistake a user can make.

The CLI turns a :class:`ModbenchError` into a single line on stderr and exit code 2,
so messages must say what is wrong *and* what to do about it, in one sentence.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ModbenchError(Exception):
    """A user-facing error: bad input, missing data, conflicting methods, ..."""


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""
