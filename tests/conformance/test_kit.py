"""The conformance kit (modbench.conformance.kit) names the exact check a broken method fails:
planted methods with one defect each (tests/conformance/planted.py: a parameter count that
lies, a NaN in the forward, a false "starts as the baseline" claim, three ways of taking a slot
without the slot rules seeing it) fail that check first, while the same method without the
defect passes every check; the table, the check selection and the CLI commands
(modbench.conformance.cli: exit 0 / 1 / 2, one ``error:`` line, torch-free import)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from modbench.conformance.checks import CHECKS, SLOW_CHECKS
from modbench.conformance.cli import check_command, new_command
from modbench.conformance.kit import (
    CheckResult,
    check_method,
    first_failure,
    format_table,
    select_checks,
)
from modbench.errors import ModbenchError
from modbench.methods.base import REGISTRY, register
from modbench.methods.build import build_model
from tests.conformance.planted import PLANTED, Correct
from tests.helpers import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def planted() -> Iterator[None]:
    """The planted methods registered for the test, removed afterwards."""
    for cls in [Correct, *(c for c, _ in PLANTED.values())]:
        register(cls)
    yield
    for name in ["zz_correct", *PLANTED]:
        REGISTRY.pop(name, None)


def upto(check: str) -> list[str]:
    """The checks up to and including ``check``: what must pass before it, and it."""
    return list(CHECKS[:CHECKS.index(check) + 1])


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_defect_fails_its_check_first(name: str, planted: None) -> None:
    """Every check before the defect's passes (or is skipped), and the defect's fails,
    named first in the table."""
    want = PLANTED[name][1]
    results = check_method(name, checks=upto(want))
    table = format_table(results, name)
    failed = first_failure(results)
    assert failed is not None and failed.name == want, table
    assert [r.name for r in results if r.failed] == [want], table
    assert table.splitlines()[-1].startswith(f"FAILED: {want} (first of 1 failed check)")


def test_what_each_defect_is_called(planted: None) -> None:
    """The one-line details say what is wrong and what to do."""
    def detail(name: str) -> str:
        (r,) = check_method(name, checks=[PLANTED[name][1]])
        assert r.failed
        return r.detail

    assert detail("zz_lying_params") == (
        "the built model has +256 parameters over the baseline at 2 layers, 2 KV heads, "
        "tied; extra_params says +128")
    assert "are not finite (NaN or inf)" in detail("zz_nan_forward")
    assert "declares starts_as_baseline, but at init (2 layers, seed 0)" in detail(
        "zz_false_start")
    assert ("fills the placement slot as 'baseline', not as itself" in
            detail("zz_as_baseline"))
    assert "by=self.name" in detail("zz_restores")
    text = detail("zz_overwrites")
    assert "filling the placement slot before it, nothing was refused" in text
    assert "never by writing spec.fills" in text


def test_the_slot_defects_are_silent_without_the_kit(planted: None) -> None:
    """What the conflicts check guards: composed with another placement in one order, each
    builds without an error and one of the two placements is silently dropped; in the other
    order the error (where there is one) names 'baseline', not the method."""
    from modbench.methods.build import plan

    for text, winner in (("zz_as_baseline+sandwich", "sandwich"),
                         ("sandwich+zz_overwrites", "zz_overwrites"),
                         ("zz_restores+sandwich", "sandwich")):
        assert plan(tiny(text).model).spec.owner("placement") == winner, text
    build_model(tiny("zz_as_baseline+sandwich").model)
    with pytest.raises(ModbenchError, match="'sandwich' and 'baseline' both set the placement"):
        plan(tiny("sandwich+zz_as_baseline").model)


def test_the_method_without_a_defect_passes_every_check(planted: None) -> None:
    """The planted methods' common base without a defect: every check passes (init too, which
    it declares), composed with qknorm. (The slow ones are left out here: the same method is
    the merge template of tests/conformance/test_scaffold.py, which passes them all.)"""
    results = check_method("zz_correct", skip=["slow"])
    fast = [c for c in CHECKS if c not in SLOW_CHECKS]
    assert [r.name for r in results] == fast
    assert all(r.passed for r in results), format_table(results, "zz_correct")
    by = {r.name: r for r in results}
    assert "with qknorm" in by["params"].detail and "with qknorm" in by["init"].detail
    assert format_table(results).splitlines()[-1] == f"passed: {len(fast)} checks"


def test_a_declared_identity_that_holds_only_at_tiny_is_caught() -> None:
    """mix_ln equals the baseline at tiny (2 layers: no Post-LN layer) but not deeper: a claim
    of starts_as_baseline would be refused by the check's deeper shape."""
    cls = REGISTRY["mix_ln"]
    cls.starts_as_baseline = True  # type: ignore[misc]
    try:
        (r,) = check_method("mix_ln", checks=["init"])
    finally:
        del cls.starts_as_baseline
    assert r.failed and "(8 layers, seed 0)" in r.detail, r.detail


def test_skipped_and_selected_checks(tmp_path: Path) -> None:
    assert select_checks(None, ["slow"]) == [c for c in CHECKS if c not in SLOW_CHECKS]
    assert select_checks(["params,flops", "entry"]) == ["entry", "params", "flops"]
    assert select_checks(["slow"]) == list(SLOW_CHECKS)
    with pytest.raises(ModbenchError, match=r"unknown check 'parms' in --check \(did you mean "
                                            r"'params'\?\); the checks are: entry, "):
        select_checks(["parms"])
    with pytest.raises(ModbenchError, match="no check left to run"):
        select_checks(["export"], ["export"])
    results = check_method("qknorm", checks=["init", "entry"], neighbour="")
    assert [(r.name, r.status) for r in results] == [("entry", "passed"), ("init", "skipped")]
    assert results[1].detail == "qknorm does not declare starts_as_baseline"
    with pytest.raises(ModbenchError, match="'baseline' is what the checks compare against"):
        check_method("baseline", checks=["entry"])
    with pytest.raises(ModbenchError, match="unknown method 'qknrom'"):
        check_method("qknrom", checks=["entry"])
    (tmp_path / "kept").write_text("")
    with pytest.raises(ModbenchError, match="exists and is not an empty folder"):
        check_method("qknorm", checks=["entry"], workdir=tmp_path)


def test_table() -> None:
    results = [CheckResult("entry", "passed", "fine", 0.01),
               CheckResult("params", "failed", "off by one", 1.5),
               CheckResult("init", "skipped", "not declared"),
               CheckResult("trains", "failed", "no drop", 2.0)]
    lines = format_table(results, "zz").splitlines()
    assert lines[0] == "method zz"
    assert lines[1].split() == ["check", "result", "time", "detail"]
    assert lines[3].split()[:3] == ["params", "failed", "1.5s"]
    assert lines[-1] == "FAILED: params (first of 2 failed checks): off by one"
    assert first_failure(results) == results[1]


# ------------------------------------------------------------------ the CLI commands


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    """The two commands as the main CLI will mount them (``modbench methods check|new``)."""
    a = typer.Typer(add_completion=False)
    a.command("check")(check_command)
    a.command("new")(new_command)
    return a


def test_check_command_exit_codes(app: typer.Typer, planted: None) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["check", "qknorm", "--check", "entry,options,conflicts"])
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.splitlines()[-1] == "passed: 3 checks"
    bad = runner.invoke(app, ["check", "zz_lying_params", "--check", "params", "--json"])
    assert bad.exit_code == 1, bad.output
    report = json.loads(bad.stdout)
    assert report["failed"] == "params" and report["method"] == "zz_lying_params"
    table = runner.invoke(app, ["check", "zz_lying_params", "--skip", "slow", "--skip",
                                "trains,determinism", "--with", "none"])
    assert table.exit_code == 1
    # (flops fails too: the FLOP report's parameter count is the formula's)
    assert table.stdout.splitlines()[-1].startswith("FAILED: params (first of 2 failed")
    for argv, message in ((["check", "qknrom"], "unknown method 'qknrom'"),
                          (["check", "qknorm", "--check", "parms"], "unknown check 'parms'"),
                          (["check", "qknorm", "--preset", "huge"], "preset"),
                          (["check", "qknorm", "--methods-from", "/nonexistent/x.py"],
                           "does not exist")):
        res = runner.invoke(app, argv)
        assert res.exit_code == 2, (argv, res.output)
        err = res.stderr.strip()
        assert err.startswith("error: ") and "\n" not in err and message in err, (argv, err)


def test_new_command(app: typer.Typer, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["new", "zz_gate", "--slot", "attn.out_gate", "--out",
                              str(tmp_path / "lab")])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "lab").iterdir()) == ["test_zz_gate.py",
                                                                  "zz_gate.py"]
    assert "modbench methods check zz_gate --methods-from" in res.stdout
    again = runner.invoke(app, ["new", "zz_gate", "--slot", "merge", "--out",
                                str(tmp_path / "lab")])
    assert again.exit_code == 2 and "exists" in again.stderr
    bad = runner.invoke(app, ["new", "zz_gate", "--slot", "kernel", "--out", str(tmp_path)])
    assert bad.exit_code == 2
    assert bad.stderr.startswith("error: unknown slot 'kernel' for a new method; the slots "
                                 "are: attn.qk (")


def test_the_commands_help_and_import_without_torch() -> None:
    """Importing the CLI module (what `modbench --help` does) imports no torch; the check
    command's help names every check and has an example."""
    code = ("import sys, modbench.conformance.cli, modbench.conformance.scaffold; "
            "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert res.stdout.strip() == "[]"
    doc = check_command.__doc__ or ""
    for name in CHECKS:
        assert name in doc, name
    assert "Example: modbench methods check" in doc
    assert "Example: modbench methods new" in (new_command.__doc__ or "")
