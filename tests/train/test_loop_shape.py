"""The training loop reads as the recipe (issue 48): ``Trainer.run_all`` stays short, its
parts named methods (validation, the stall stop, checkpoints and the stop signal at the
window's end, the final validation), so a reader follows the loop on one screen."""

from __future__ import annotations

import ast
from pathlib import Path

import modbench.train.trainer as trainer

MAX_RUN_ALL = 60


def _method(name: str) -> ast.FunctionDef:
    tree = ast.parse(Path(trainer.__file__).read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_run_all_is_at_most_60_lines() -> None:
    f = _method("run_all")
    assert f.end_lineno is not None
    assert f.end_lineno - f.lineno + 1 <= MAX_RUN_ALL


def test_run_all_calls_its_named_parts() -> None:
    """The loop's points are named methods it calls, not inline blocks."""
    called = {n.func.attr for n in ast.walk(_method("run_all"))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert {"_open_run", "_prefetcher", "_train_step", "_log_window", "_at_window_end",
            "_final_validation", "_finish", "_close_run"} <= called
    at_end = {n.func.attr for n in ast.walk(_method("_at_window_end"))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert {"_validate", "_stop_if_stalled", "_checkpoint", "_stop_signal",
            "_save_and_stop"} <= at_end
