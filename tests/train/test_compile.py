"""``train.compile`` (issue 19): ``auto`` by default (compiled on CUDA; on the CPU where the
run repays its compilation, issue 32), a model that fails to compile under ``auto`` trains
eagerly after a warning (once per study), and a compiled run (CPU inductor) records what the
eager run records, to float32 rounding."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from modbench.config import resolve
from modbench.errors import ModbenchError
from modbench.runtime.device import (
    CPU_COLD_COMPILE_S,
    CPU_COLD_COMPILE_S_PER_LAYER,
    CPU_COMPILE_SPEEDUP,
    CPU_EAGER_FLOPS_PER_THREAD,
    CPU_WARM_COMPILE_S,
    WARN_ONCE_ENV,
    choose_compile,
    compiled,
    graph_compiled_before,
    note_compiled,
)
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


CPU = torch.device("cpu")


def _steps_to_repay(cost_s: float, step_flops: float) -> float:
    """The steps after which the compiled step's saving equals ``cost_s`` (one thread),
    from the rule's own constants."""
    eager_step = step_flops / CPU_EAGER_FLOPS_PER_THREAD
    return cost_s / (eager_step * (1 - 1 / CPU_COMPILE_SPEEDUP))


def test_auto_on_the_cpu_compiles_only_a_run_long_enough_to_repay_it() -> None:
    flops, layers = 2e9, 10
    cold = _steps_to_repay(CPU_COLD_COMPILE_S + CPU_COLD_COMPILE_S_PER_LAYER * layers, flops)
    warm = _steps_to_repay(CPU_WARM_COMPILE_S, flops)
    assert warm < cold

    def choice(steps: float, is_warm: bool) -> bool | str:
        return choose_compile("auto", CPU, steps=int(steps), step_flops=flops, layers=layers,
                              warm=is_warm, threads=1).setting

    assert choice(cold * 0.9, False) is False and choice(cold * 1.1, False) == "try"
    assert choice(warm * 0.9, True) is False and choice(warm * 1.1, True) == "try"
    # between the two: a graph already in the cache compiles, a cold one does not
    assert choice((warm + cold) / 2, True) == "try" and choice((warm + cold) / 2, False) is False
    said = choose_compile("auto", CPU, steps=int(cold * 0.9), step_flops=flops, layers=layers,
                          warm=False, threads=1).why
    assert said.startswith("eager:") and "cold" in said
    # more threads make the eager step shorter: the same run no longer repays a cold compile
    assert choose_compile("auto", CPU, steps=int(cold * 1.1), step_flops=flops, layers=layers,
                          warm=False, threads=4).setting is False


def test_settings_other_than_auto_on_the_cpu_are_kept() -> None:
    for setting in (True, False, "blocks"):
        c = choose_compile(setting, CPU, steps=10**6, step_flops=1e12, layers=4, warm=False)
        assert c.setting == setting and c.why == ""
    on_gpu = choose_compile("auto", torch.device("cuda"), steps=1, step_flops=1.0, layers=4,
                            warm=False)
    assert on_gpu.setting == "auto" and on_gpu.compiled


def test_a_compiled_graph_is_noted_in_the_inductor_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert not graph_compiled_before("abc")
    note_compiled("abc")
    note_compiled("abc")
    assert graph_compiled_before("abc") and not graph_compiled_before("abd")
    assert (tmp_path / "inductor" / "modbench-compiled-graphs.txt").read_text().split() == [
        "abc"]


def test_try_calls_back_once_after_the_first_compiled_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    noted: list[int] = []
    step = compiled(lambda x: x * 3, "try", CPU, on_compiled=lambda: noted.append(1))
    assert step(torch.ones(1)).item() == 3.0 and step(torch.ones(1)).item() == 3.0
    assert noted == [1]


def test_a_failed_compile_warns_once_per_study(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_compile(fn: Any, **_: Any) -> Any:
        def graph(*args: Any) -> Any:
            raise torch._dynamo.exc.Unsupported(  # type: ignore[attr-defined]
                "no rule for this op")
        return graph

    monkeypatch.setattr(torch, "compile", failing_compile)

    def runs(n: int) -> int:
        """Warnings given by n runs' steps, each run its own compiled step."""
        with pytest.warns() as caught:
            for _ in range(n):
                assert compiled(lambda x: x + 1, "try", CPU)(torch.zeros(1)).item() == 1.0
            import warnings

            warnings.warn("end", UserWarning, stacklevel=1)  # pytest.warns needs one
        return sum("torch.compile failed" in str(w.message) for w in caught)

    monkeypatch.delenv(WARN_ONCE_ENV, raising=False)
    assert runs(3) == 3  # outside a study: every run says it
    monkeypatch.setenv(WARN_ONCE_ENV, str(tmp_path / "warned"))
    assert runs(3) == 1  # in a study: the first run says it


def test_a_run_says_what_auto_chose(tmp_path: Path) -> None:
    s = train(tiny("baseline", 0, 2, "train.device=cpu"), tmp_path / "r", progress=False)
    assert s["compiled"] is False
    assert s["compile_choice"].startswith("eager:")
