"""``train.compile`` (issue 19): ``auto`` by default (compiled on CUDA, eager on the CPU), a
model that fails to compile under ``auto`` trains eagerly after a warning, and a compiled run
(CPU inductor) records what the eager run records, to float32 rounding."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from modbench.config import resolve
from modbench.errors import ModbenchError
from modbench.runtime.device import compiled
from modbench.study.spec import config_key
from modbench.train.trainer import train
from tests.helpers import read_metrics, tiny

# a compiled graph fuses element-wise work and may reorder reductions: float32 rounding,
# compounded over a few AdamW steps
RTOL = 1e-4


def test_auto_is_the_default_and_eager_on_the_cpu() -> None:
    assert resolve("tiny").train.compile == "auto"

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert compiled(f, "auto", torch.device("cpu")) is f
    assert compiled(f, False, torch.device("cuda")) is f


def test_bad_values_are_refused_in_one_line() -> None:
    for bad in ("always", 1, "maybe"):
        with pytest.raises(ModbenchError,
                           match=r"train\.compile must be auto, true, false or blocks"):
            tiny("baseline", 0, 2, f"train.compile={bad}")


def test_compile_does_not_change_the_study_key() -> None:
    keys = {config_key(tiny("baseline", 0, 2, f"train.compile={v}"))
            for v in ("auto", "true", "false")}
    assert len(keys) == 1


def test_auto_falls_back_to_eager_when_compilation_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def failing_compile(fn: Any, **_: Any) -> Any:
        def graph(*args: Any) -> Any:
            calls.append("graph")
            raise torch._dynamo.exc.Unsupported(  # type: ignore[attr-defined]
                "no rule for this op")
        return graph

    def eager(x: torch.Tensor) -> torch.Tensor:
        calls.append("eager")
        return x + 1

    monkeypatch.setattr(torch, "compile", failing_compile)
    step = compiled(eager, "auto", torch.device("cuda"))  # auto compiles on CUDA only
    with pytest.warns(UserWarning, match="train.compile=auto: torch.compile failed"):
        assert step(torch.zeros(2)).tolist() == [1.0, 1.0]
    assert step(torch.ones(2)).tolist() == [2.0, 2.0]  # no second attempt
    assert calls == ["graph", "eager", "eager"]
    strict = compiled(eager, True, torch.device("cuda"))
    with pytest.raises(torch._dynamo.exc.Unsupported):  # type: ignore[attr-defined]
        strict(torch.zeros(2))


def test_a_compiled_run_records_what_the_eager_run_records(tmp_path: Path) -> None:
    """CPU inductor, the tiny preset, 3 steps and two validations: every logged loss and grad
    norm of the compiled run equals the eager run's to RTOL."""
    common = ("train.eval_every=2", "train.device=cpu")
    eager = train(tiny("baseline", 0, 3, *common, "train.compile=false"), tmp_path / "eager",
                  progress=False)
    graph = train(tiny("baseline", 0, 3, *common, "train.compile=true"), tmp_path / "graph",
                  progress=False)
    assert graph["status"] == eager["status"] == "completed"
    assert graph["final_val_loss"] == pytest.approx(eager["final_val_loss"], rel=RTOL)
    want, got = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "graph")
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    for w, g in zip(want, got, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in w:
                assert math.isfinite(g[key])
                assert g[key] == pytest.approx(w[key], rel=RTOL), (key, w["step"])


def test_blocks_compiles_each_decoder_block_and_trains_as_eager(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train.compile=blocks``: every decoder block is compiled on its own (one graph per
    block, however deep the model: Dynamo's per-code limit of 8 would otherwise run the rest
    eagerly in silence), the rest of the forward eager; the run records what the eager run
    records. Dynamo's own eager backend stands in for inductor: the graphs, not codegen."""
    graphs: list[int] = []
    real = torch.compile

    def counting(fn: Any = None, *args: Any, **kwargs: Any) -> Any:
        def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
            graphs.append(len(gm.graph.nodes))
            return gm.forward
        kwargs["backend"] = backend
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(torch, "compile", counting)
    torch._dynamo.reset()
    deep = ("model.n_layers=10", "train.eval_every=2", "train.device=cpu")
    eager = train(tiny("baseline", 0, 2, *deep, "train.compile=false"), tmp_path / "eager",
                  progress=False)
    assert graphs == []
    blocks = train(tiny("baseline", 0, 2, *deep, "train.compile=blocks"), tmp_path / "blocks",
                   progress=False)
    # one graph per block for training and one for validation (eval mode, no gradients)
    assert len(graphs) == 20
    assert blocks["final_val_loss"] == pytest.approx(eager["final_val_loss"], rel=1e-6)
    want, got = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "blocks")
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in want]
    for w, g in zip(want, got, strict=True):
        for key in ("loss", "val_loss"):
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-6), (key, w["step"])
    torch._dynamo.reset()
