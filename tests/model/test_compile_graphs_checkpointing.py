"""One compiled graph per method with activation checkpointing (issue 28, "One graph"): the
checkpointing half of the registry sweep of test_compile_graphs.py (``modbench bench
--compile-check``), in a file of its own so that the two halves of the sweep run in parallel
under ``-n 2 --dist loadfile``. test_compile_graphs.py requires every method that does not
declare breaks to be one graph without checkpointing; this file requires each of them to be
one graph with checkpointing too, or to be refused for a forward that updates buffers, and at
least 40 besides the baseline (and the methods of ``BOTH_MODES``) not to be refused: those are
one graph, no break and no recompile in both modes."""

from __future__ import annotations

import pytest

from modbench.measure.compile_check import run_compile_check
from modbench.methods import load_all
from modbench.train.recompute import apply_activation_checkpointing
from tests.model.test_compile_graphs import NO_CHECKPOINTING, one_graph_methods

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_method_that_does_not_declare_breaks_is_one_graph_with_checkpointing() -> None:
    rows = run_compile_check(["baseline", *sorted(load_all())], modes=(True,),
                             apply_checkpointing=apply_activation_checkpointing, progress=False)
    assert {row.method for row in rows} == {"baseline", *load_all()}
    _, refused = one_graph_methods(rows, checkpointing=True)
    assert {m.split("(")[0] for m in NO_CHECKPOINTING} <= refused
