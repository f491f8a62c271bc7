"""Executors as a registry (modbench.study.executors).

A toy executor defined and registered in this file (its own options dataclass, its own
prefix of option names) runs a tiny study through ``modbench study run --executor toy``: its
runs land in the store, trained by it. An unknown executor is one line listing the registered
ones (the toy among them); an option of another executor is refused naming the executor that
takes it. And no source file outside the executors' own modules compares an executor's name:
the runner, the planner and the CLI ask the registry.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import modbench
from modbench.cli import run_cli
from modbench.errors import ModbenchError
from modbench.study import executors
from modbench.study.executors import ExecutorKind, ExecutorOptions
from modbench.study.jobs import Job, JobResult, execute_job
from modbench.study.runner import run_study
from modbench.study.spec import load_spec
from modbench.study.store import Store

SRC = Path(modbench.__file__).resolve().parent
pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class ToyOptions:
    gpus_per_run: int | None = None
    tag: str = "untagged"  # given as toy_tag (--executor-option toy-tag=...)
    width: int = 1


class ToyExecutor:
    """Runs each job in this process, as the local executor's single worker does, and
    remembers what it ran."""

    def __init__(self, options: ToyOptions) -> None:
        self.options = options
        self.gpus_per_job = 0
        self.ran: list[tuple[str, ...]] = []
        self.closed = False

    def run(self, jobs: list[Job]) -> Iterator[list[JobResult]]:
        for job in jobs:
            self.ran.append(job.keys)
            yield execute_job(job)

    def close(self) -> None:
        self.closed = True


class ToyKind(ExecutorKind):
    name = "toy"
    summary = "this test's executor"
    options_type = ToyOptions
    prefix = "toy_"

    def __init__(self) -> None:
        self.made: list[ToyExecutor] = []

    def check(self, opts: ToyOptions) -> None:
        if not opts.tag:
            raise ModbenchError("--toy-tag must not be empty")

    def create(self, opts: ToyOptions, *, verbose: bool = False) -> ToyExecutor:
        ex = ToyExecutor(opts)
        self.made.append(ex)
        return ex


@pytest.fixture
def toy() -> Iterator[ToyKind]:
    kind = executors.register(ToyKind())
    try:
        yield kind
    finally:
        executors.unregister(kind.name)


def write_spec(tmp: Path) -> Path:
    """The smallest study test_study.py runs: tiny, 4 steps, no evaluation, one seed each."""
    p = tmp / "spec.yaml"
    p.write_text(yaml.safe_dump({
        "name": "toy", "baseline": "baseline", "methods": ["qknorm"],
        "seeds": {"default": [0], "noise_floor": [0], "anchors": []}, "scales": ["tiny"],
        "overrides": ["train.steps=4", "train.eval_every=0"],
        "evaluation": {"probes": False}}))
    return p


def test_a_toy_executor_registered_here_runs_a_study(toy: ToyKind, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert "toy" in executors.names()
    spec, out = write_spec(tmp_path), tmp_path / "study"
    code = run_cli(["study", "run", str(spec), "--out", str(out), "--executor", "toy",
                    "--executor-option", "toy-tag=cli", "--executor-option", "toy_width=3",
                    "--no-progress", "--no-report"])
    assert code == 0, capsys.readouterr().err
    assert "2 runs, 0 already done, 2 trained" in capsys.readouterr().out
    (ex,) = toy.made
    assert ex.closed and ex.options == ToyOptions(tag="cli", width=3)  # read as its types
    rows = Store(out).rows()
    assert sorted(k for keys in ex.ran for k in keys) == sorted(r["key"] for r in rows)
    assert {(r["method"], r["state"], r["status"]) for r in rows} == {
        ("baseline", "done", "completed"), ("qknorm", "done", "completed")}
    for r in rows:
        assert (out / "runs" / r["key"] / "summary.json").is_file()
    # run again through run_study with the toy's own option: all done, nothing run
    again = run_study(load_spec(spec), out, executor="toy", progress=False,
                      options=ExecutorOptions(toy_tag="second"))
    assert (again["already_done"], again["trained"]) == (2, 0)
    assert toy.made[-1].options == ToyOptions(tag="second") and toy.made[-1].ran == []


def test_a_toy_executor_plans_a_dry_run(toy: ToyKind, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--dry-run asks the kind: the toy's default rows (one GPU per job unless told)."""
    spec, out = write_spec(tmp_path), tmp_path / "study"
    assert run_cli(["study", "run", str(spec), "--out", str(out), "--executor", "toy",
                    "--dry-run", "--gpus-per-run", "2"]) == 0
    text = capsys.readouterr().out
    assert "toy: 2 job(s)" in text and "2 GPU(s), 8 CPU(s), 2 processes" in text
    assert "time-outs" not in text and not out.exists() and toy.made == []


@pytest.mark.parametrize("executor,given,msg", [
    ("toy", {"slurm_partition": "gpu"},
     "--slurm-partition applies to --executor slurm only (got --executor toy)"),
    ("local", {"toy_tag": "x"}, "--toy-tag applies to --executor toy only (got --executor local)"),
    ("toy", {"toy_tag": ""}, "--toy-tag must not be empty"),
    ("toy", {"toy_colour": "red"}, "--toy-colour is no option of any executor"),
    ("toy", {"toy_width": "wide"}, "--toy-width takes a number (int), got 'wide'"),
])
def test_options_are_read_and_checked_by_their_kind(toy: ToyKind, tmp_path: Path, executor: str,
                                                    given: dict[str, Any], msg: str) -> None:
    out = tmp_path / "study"
    with pytest.raises(ModbenchError) as e:
        run_study(load_spec(write_spec(tmp_path)), out, executor=executor, progress=False,
                  options=ExecutorOptions(given))
    assert msg in str(e.value) and "\n" not in str(e.value)
    assert not out.exists() and toy.made == []


def test_an_unknown_executor_lists_the_registered_ones(toy: ToyKind, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "study"
    assert run_cli(["study", "run", str(write_spec(tmp_path)), "--out", str(out), "--executor",
                    "tay", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown executor 'tay'" in err and "use one of local, ray, slurm, toy" in err
    assert "did you mean" in err.lower() and err.count("\n") == 1 and not out.exists()


# ------------------------------------------------------------------ no name comparisons


def name_comparisons(source: str, names: set[str]) -> list[int]:
    """Lines of ``source`` that compare a value with an executor name: ``== "slurm"``,
    ``!= "local"``, ``in ("ray", "slurm")``, a ``case "ray":``, or a dict keyed by names."""
    def named(value: ast.AST | None) -> bool:
        return isinstance(value, ast.Constant) and value.value in names

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            hit = any(named(v) for side in sides for v in (
                side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]))
        elif isinstance(node, ast.MatchValue):
            hit = named(node.value)
        elif isinstance(node, ast.Dict):
            hit = sum(named(k) for k in node.keys) > 1
        else:
            hit = False
        if hit:
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_detector_finds_name_comparisons() -> None:
    names = {"local", "ray", "slurm"}
    code = ('if executor == "slurm":\n    pass\n'
            'x = executor in ("ray", "slurm")\n'
            'y = "local" != executor\n'
            'match executor:\n    case "ray":\n        pass\n'
            'z = {"ray": 1, "slurm": 2}[executor]\n'
            'w = executor == "cuda" or "local_path"\n')
    assert name_comparisons(code, names) == [1, 3, 4, 6, 8]


def test_no_source_outside_the_executors_compares_their_names() -> None:
    """The runner, the planner, the CLI and everything else ask the registry; only an
    executor's own modules (its kind in study/executors/, and the implementation module its
    kind names) may mention what it is called."""
    names = set(executors.names())
    assert {"local", "ray", "slurm"} <= names
    own = {SRC / "study" / "executors"}
    for kind in executors.kinds():
        if kind.implementation:
            module = kind.implementation.partition(":")[0]
            own.add(SRC.parent / (module.replace(".", "/") + ".py"))
    assert own == {SRC / "study" / "executors", SRC / "study" / "executors" / "ray.py",
                   SRC / "study" / "executors" / "slurm.py"}  # each kind's code is its module
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        if any(path == o or o in path.parents for o in own):
            continue
        lines = name_comparisons(path.read_text(), names)
        if lines:
            found[str(path.relative_to(SRC))] = lines
    assert found == {}


def test_a_kinds_own_options_dataclass_is_read_as_it_is(toy: ToyKind) -> None:
    """run_study(options=ToyOptions(...)) skips the flag names; --workers still goes to the
    executors that take it, and the kind's checks still run."""
    kind = executors.get("toy")
    assert kind.options(ToyOptions(tag="x"), workers=1) == ToyOptions(tag="x")
    with pytest.raises(ModbenchError, match=r"--workers applies to --executor local only \(got "
                                            r"--executor toy\)"):
        kind.options(ToyOptions(), workers=2)
    with pytest.raises(ModbenchError, match="--toy-tag must not be empty"):
        kind.options(ToyOptions(tag=""))
    local = executors.get("local")
    assert local.options(local.options_type(), workers=3).workers == 3


def test_the_executor_kinds_import_neither_ray_nor_submitit() -> None:
    """Each kind's module holds its executor too, yet ``--help`` and ``--dry-run`` need
    neither optional package: they are imported only when an executor is made or runs."""
    code = ("import sys\n"
            "import modbench.study.executors as ex\n"
            "from modbench.study.executors.slurm import StudyTask, SlurmExecutor\n"
            "from modbench.study.executors.ray import RayExecutor\n"
            "assert [ex.get(n).name for n in ('ray', 'slurm')] == ['ray', 'slurm']\n"
            "assert 'ray' not in sys.modules and 'submitit' not in sys.modules, "
            "sorted(m for m in sys.modules if m in ('ray', 'submitit'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
