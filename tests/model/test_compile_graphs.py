"""One compiled graph per method (issue 28, "One graph"): ``torch.compile`` of the training
forward gives one graph, no graph break and no recompile, with and without activation
checkpointing, for the baseline and every method of the registry that does not declare
otherwise (the same sweep as ``modbench bench --compile-check``); every method that
declares it cannot (``Method.compile_graph_breaks``) does break, so the declaration stays
true; and the check itself sees breaks and recompiles where they are (BENCHMARKS.md)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from modbench.cli import app
from modbench.config import resolve
from modbench.conformance.kit import NO_NEIGHBOUR, PASSED, CheckResult, compile_verdict
from modbench.conformance.kit import check_method as kit_check
from modbench.measure.compile_check import _Recorder, check_method
from modbench.methods import load_all
from modbench.methods._common import set_step
from modbench.methods.build import build_model
from modbench.model import attention
from modbench.train.recompute import apply_activation_checkpointing
from tests.helpers import torch_threads

pytestmark = pytest.mark.usefixtures("one_thread")

# the stream methods that keep earlier layers, an explicit attention kernel, the methods
# whose graph breaks or recompiles were removed (softcap, powernorm, prepbn) and a wrapper
# method; powernorm and prepbn update buffers in the forward, which checkpointing refuses
BOTH_MODES = ["baseline", "hyper_connections", "attnres", "value_residual", "softcap", "comt"]
NO_CHECKPOINTING = ["powernorm", "prepbn(warm_steps=0,decay_steps=30)"]


def check(method: str, checkpointing: bool) -> Any:
    return check_method(method, checkpointing=checkpointing,
                        apply_checkpointing=apply_activation_checkpointing)


@pytest.fixture(scope="module")
def plain_results() -> dict[str, Any]:
    """The conformance kit's compile check (``modbench methods check --check compile``) on
    every registered method, and its verdict on the baseline's row: the whole registry without
    checkpointing, as ``modbench bench --compile-check`` runs it, traced once for the tests
    below (the checkpointing half of the sweep is test_compile_graphs_checkpointing.py, a
    file of its own so that the two halves run in parallel under ``-n 2 --dist loadfile``)."""
    # one thread, as the tests' one_thread fixture gives, which a module fixture is set up before
    with torch_threads(1):
        row = check_method("baseline", checkpointing=False)
        status, detail = compile_verdict(row)
        results = {"baseline": CheckResult("compile", status, detail, data=row)}
        for name in sorted(load_all()):
            (results[name],) = kit_check(name, checks=["compile"], neighbour=NO_NEIGHBOUR)
    return results


@pytest.fixture(scope="module")
def plain_rows(plain_results: dict[str, Any]) -> dict[str, Any]:
    """The sweep's rows (CompileRow), by method."""
    return {name: r.data for name, r in plain_results.items()}


def test_every_method_that_does_not_declare_breaks_is_one_graph(
        plain_results: dict[str, Any], plain_rows: dict[str, Any]) -> None:
    """The whole registry, as ``modbench bench --compile-check`` runs it (issue 28's "Done
    when": the baseline and at least 40 methods one graph, no break, with and without
    checkpointing), without checkpointing: the kit's compile check passes for every method
    (1 graph, 0 breaks and 0 recompiles; or, where declared, breaks that are there). With
    checkpointing (test_compile_graphs_checkpointing.py) each of them gives the same or is
    refused for a forward that updates buffers, and at least 40 besides the baseline are not
    refused: those are one graph in both modes."""
    assert set(plain_results) == {"baseline", *load_all()}
    failed = {name: r.detail for name, r in plain_results.items() if not r.passed}
    assert not failed, failed
    assert {r.data.method for r in plain_results.values()} == set(plain_results)
    _, refused = one_graph_methods(plain_rows.values(), checkpointing=False)
    assert not refused


def one_graph_methods(rows: Iterable[Any], *, checkpointing: bool) -> tuple[set[str], set[str]]:
    """One mode's sweep rows (both halves of the registry sweep read them so): every method
    without a declaration gives 1 graph, 0 breaks and 0 recompiles, or (with checkpointing
    only) is refused for a forward that updates buffers; the baseline, at least 40 methods
    besides it and every one of ``BOTH_MODES`` are one graph. Returns (one graph, refused)."""
    clean, refused = set(), set()
    for row in rows:
        assert row.checkpointing == checkpointing, row
        if row.expected:
            continue
        if row.graphs is None:
            assert checkpointing and "updates buffers" in row.note, row
            refused.add(row.method)
            continue
        status, detail = compile_verdict(row)  # the kit's compile check: one graph
        assert status == PASSED and row.reasons == [], (row, detail)
        clean.add(row.method)
    assert "baseline" in clean
    assert len(clean - {"baseline"}) >= 40, sorted(clean)
    assert set(BOTH_MODES) <= clean
    return clean, refused


@pytest.mark.parametrize("method", NO_CHECKPOINTING)
def test_one_graph_without_checkpointing(method: str, plain_rows: dict[str, Any]) -> None:
    # the sweep's row where the sweep traced this very method (powernorm), else its own
    row = plain_rows[method] if method in plain_rows else check(method, False)
    assert (row.method, row.checkpointing) == (method, False), row
    assert (row.graphs, row.graph_breaks, row.recompiles) == (1, 0, 0), row
    refused = check(method, True)
    assert refused.graphs is None and "updates buffers" in refused.note


def test_declared_methods_do_break(plain_rows: dict[str, Any]) -> None:
    """Every method that declares breaks (``compile_graph_breaks``) breaks: read from the
    sweep's rows, which are ``check(name, False)`` of each."""
    declared = sorted(n for n, cls in load_all().items() if cls.compile_graph_breaks)
    assert "moe" in declared  # the data-dependent dispatch sizes
    for name in declared:
        row = plain_rows[name]
        assert row.graph_breaks and row.graph_breaks > 0 and row.reasons, name
        assert row.expected.startswith(f"{name}: ")


@pytest.mark.parametrize("method", ["softcap", "softcap(cap=0.002)", "powernorm",
                                    "prepbn(warm_steps=1,decay_steps=2)"])
def test_traced_forward_trains_as_eager(method: str) -> None:
    """The graph-friendly paths (softcap's explicit kernel for a slack and a binding cap, the
    device-side counts of powernorm and prepbn) give eager's numbers: losses, gradients and
    buffers over three steps, the traced graph run as recorded."""
    cfg = resolve("tiny", method=method)
    eager = build_model(cfg.model, seed=0).train()
    traced_model = copy.deepcopy(eager)
    traced = torch.compile(traced_model, backend=_Recorder())
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        idx = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=gen)
        for m in (eager, traced_model):
            set_step(m, step, 4)
        want, want_aux = eager(idx, with_aux=True, loss=True)
        got, got_aux = traced(idx, with_aux=True, loss=True)
        (want + want_aux).backward()
        (got + got_aux).backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    exact = method != "softcap"  # softcap's eager fast path is SDPA: equal to rounding
    for (name, p), q in zip(eager.named_parameters(), traced_model.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0 if exact else 1e-4,
                                       atol=0 if exact else 1e-5, msg=name)
    for (name, b), c in zip(eager.named_buffers(), traced_model.buffers(), strict=True):
        torch.testing.assert_close(c, b, rtol=0, atol=0, msg=name)
    torch._dynamo.reset()


def test_check_sees_a_host_read_and_a_recompile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host read planted in the attention kernel is a break reported at its line (and
    makes Dynamo run the block loop's frame eagerly); a Python counter the forward changes
    makes later steps recompile."""
    plain = attention.SDPAKernel.forward

    def host_read(self: Any, q: torch.Tensor, *rest: Any) -> torch.Tensor:
        if float(q.detach().sum()) > 1e30:  # the planted host read
            q = q * 2
        return plain(self, q, *rest)

    monkeypatch.setattr(attention.SDPAKernel, "forward", host_read)
    row = check("baseline", False)
    assert row.graphs and row.graphs > 1 and row.graph_breaks and row.graph_breaks > 0
    assert any("test_compile_graphs.py:" in r for r in row.reasons), row.reasons
    assert any("run eagerly" in r for r in row.reasons), row.reasons

    def counter(self: Any, q: torch.Tensor, *rest: Any) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return plain(self, q * (1.0 + 0.0 * self.calls), *rest)

    monkeypatch.setattr(attention.SDPAKernel, "forward", counter)
    row = check("baseline", False)
    assert row.recompiles and row.recompiles > 0, row


def test_cli_json_rows() -> None:
    result = CliRunner().invoke(app, ["bench", "--compile-check", "--json", "--no-progress",
                                      "--methods", "baseline,moe", "--no-checkpointing"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["method"], r["checkpointing"]) for r in rows] == [("baseline", False),
                                                               ("moe", False)]
    for r in rows:
        assert {"method", "checkpointing", "graphs", "graph_breaks", "recompiles",
                "reasons"} <= set(r)
    base, moe = rows
    assert (base["graphs"], base["graph_breaks"], base["recompiles"]) == (1, 0, 0)
    assert moe["graph_breaks"] > 0 and moe["expected"] and any(
        "moe.py:" in why for why in moe["reasons"])


def test_cli_refuses_unknown_method() -> None:
    result = CliRunner().invoke(app, ["bench", "--compile-check", "--methods", "nope"])
    assert result.exit_code == 2 and "unknown method 'nope'" in result.output
