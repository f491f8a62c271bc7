"""Function length (issue 48, item 3): no function of ``src/modbench`` over 120 lines, at most
six over 80, and ``Trainer.run_all`` at most 60.

A function's length counts from its first decorator line (or its ``def`` line) to its last
line, as :mod:`ast` gives them; methods and functions nested in functions count on their
own (and inside the function that holds them). A long function is split along the meaning of
its code (named helpers, each doing one thing; a CLI command a thin layer over the Python
API), not cut into arbitrary pieces.
"""

from __future__ import annotations

import ast
from pathlib import Path

import modbench

SRC = Path(modbench.__file__).resolve().parent
HARD_LIMIT = 120  # no function longer
SOFT_LIMIT = 80  # at most MAX_OVER_SOFT functions longer
MAX_OVER_SOFT = 6
RUN_ALL_LIMIT = 60  # Trainer.run_all: the trainer's top level reads in one screen


def _length(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    start = min([d.lineno for d in node.decorator_list] + [node.lineno])
    assert node.end_lineno is not None
    return node.end_lineno - start + 1


def function_lengths(source: str, filename: str) -> list[tuple[str, int, str, int]]:
    """``(file, line, qualified name, length)`` of every function and method in ``source``."""
    out: list[tuple[str, int, str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                out.append((filename, child.lineno, prefix + child.name, _length(child)))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename=filename), "")
    return out


def _all_functions() -> list[tuple[str, int, str, int]]:
    rows: list[tuple[str, int, str, int]] = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).as_posix()
        rows += function_lengths(path.read_text(encoding="utf-8"), rel)
    return rows


def _listing(rows: list[tuple[str, int, str, int]]) -> str:
    return "\n".join(f"  {f}:{line} {name}: {n} lines"
                     for f, line, name, n in sorted(rows, key=lambda r: -r[3]))


def test_the_measure_counts_decorators_nesting_and_methods() -> None:
    src = ("import functools\n\n"
           "@functools.cache\n"
           "@staticmethod\n"
           "def f():\n"
           "    def g():\n"
           "        return 1\n"
           "    return g\n\n"
           "class C:\n"
           "    async def m(self):\n"
           + "        x = 1\n" * 119
           + "        return x\n")
    rows = {name: (line, n) for _, line, name, n in function_lengths(src, "x.py")}
    assert rows == {"f": (5, 6), "f.g": (6, 2), "C.m": (11, 121)}
    assert len(_all_functions()) > 1000  # the scan sees the package


def test_no_function_over_the_hard_limit() -> None:
    over = [r for r in _all_functions() if r[3] > HARD_LIMIT]
    assert not over, (f"{len(over)} functions over {HARD_LIMIT} lines; split each along what "
                      f"its parts mean:\n{_listing(over)}")


def test_few_functions_over_the_soft_limit() -> None:
    over = [r for r in _all_functions() if r[3] > SOFT_LIMIT]
    assert len(over) <= MAX_OVER_SOFT, (
        f"{len(over)} functions over {SOFT_LIMIT} lines, at most {MAX_OVER_SOFT} may be; "
        f"split the longest:\n{_listing(over)}")


def test_trainer_run_all_reads_in_one_screen() -> None:
    path = SRC / "train" / "trainer.py"
    rows = [r for r in function_lengths(path.read_text(encoding="utf-8"), "train/trainer.py")
            if r[2] == "Trainer.run_all"]
    assert len(rows) == 1, "Trainer.run_all not found in src/modbench/train/trainer.py"
    _, line, _, n = rows[0]
    assert n <= RUN_ALL_LIMIT, (f"Trainer.run_all (train/trainer.py:{line}) is {n} lines, "
                                f"at most {RUN_ALL_LIMIT}")
