"""Help texts that wrap on word boundaries and keep their ``[default: ...]`` notes, for the
``modbench`` command and for ``python -m modbench.train`` (what each torchrun process runs),
which builds its own typer app."""

from __future__ import annotations

import re
from typing import Any

# rich markup tags, as rich.markup.escape finds them: "[default: x]" in a help text would
# otherwise be read as a style and vanish, leaving a stray space before the full stop
_MARKUP_TAG = re.compile(r"(\\*)(\[[a-z#/@][^\[]*?])")


def tidy_help(command: Any, *, escape_markup: bool) -> None:
    """Rewrite the help texts of ``command`` and its subcommands in place so that they wrap on
    word boundaries: the lines of each paragraph (blank-line separated) joined into one, so the
    terminal's width decides where lines break, not the docstring's; a paragraph that starts
    with ``\\b`` is kept as written. ``escape_markup``: escape square brackets that rich would
    read as markup."""
    for cmd in _walk(command):
        for attr in ("help", "short_help"):
            text = getattr(cmd, attr, None)
            if text:
                setattr(cmd, attr, _tidy_text(text, escape_markup))
        for param in getattr(cmd, "params", []):
            text = getattr(param, "help", None)
            if text:
                param.help = _tidy_text(text, escape_markup)


def _walk(command: Any) -> list[Any]:
    out = [command]
    for sub in getattr(command, "commands", {}).values():
        out.extend(_walk(sub))
    return out


def _tidy_text(text: str, escape_markup: bool) -> str:
    import inspect

    paragraphs = []
    for para in inspect.cleandoc(text).split("\n\n"):
        if not para.startswith("\b"):
            para = " ".join(line.strip() for line in para.splitlines() if line.strip())
        paragraphs.append(para)
    out = "\n\n".join(paragraphs)
    if escape_markup:
        out = _MARKUP_TAG.sub(lambda m: f"{m.group(1)}{m.group(1)}\\{m.group(2)}", out)
    return out
