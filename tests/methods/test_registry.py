"""The conformance kit (modbench.conformance) applied to every registered method and a few
compositions: one definition of a correct method, the same for built-ins and plugins
(``modbench methods check``); plus the parsing and composition rules of method strings.

The kit's checks replace this file's former per-method tests with the same assertions or
stronger ones: ``trains`` (30 tiny steps, every loss finite, training and validation loss
down by at least 0.3, or the kit's MIN_DROP for ngpt and unified_norm), ``gradients`` (every
parameter a finite gradient), ``params`` (extra_params at two shapes), ``flops`` (extra_flops
against torch's FLOP counter, which tests/analysis/test_flops.py ran per method before),
``causal`` (evaluation mode, and training mode where no leak is declared) and ``entry`` (the
docstring states Citation and Init); and it adds options, conflicts, forward, init (the
declared starts_as_baseline), state_dict, determinism and export (the export that
tests/eval/test_export.py ran per method before). Its ``compile`` check runs in
tests/model/test_compile_graphs.py, which sweeps the registry with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from modbench.config import ModelConfig
from modbench.conformance.kit import check_method, format_table
from modbench.errors import ModbenchError
from modbench.methods import REGISTRY, Method, load_all, parse_methods, register
from modbench.methods.build import build_model
from modbench.model.spec import ModelSpec
from tests.helpers import read_metrics, tiny

ALL = sorted(load_all())
COMBOS = ["post_ln+qknorm", "post_ln+qknorm+layerscale", "hybrid_norm(form=seed002)"]


@pytest.mark.parametrize("method", ALL + COMBOS)
def test_method_conforms(method: str, tmp_path: Path, one_thread: None) -> None:
    """Every check of the kit but compile passes (tests/model/test_compile_graphs.py runs that
    one over the registry)."""
    results = check_method(method, skip=["compile"], workdir=tmp_path)
    assert not any(r.failed for r in results), "\n" + format_table(results, method)
    # skipped only where a check does not apply: init for a method that does not declare
    # starts_as_baseline, export without transformers
    skipped = {r.name for r in results if r.skipped}
    claims = all(type(m).starts_as_baseline for m in parse_methods(method))
    assert skipped - {"export"} == (set() if claims else {"init"}), skipped


# ------------------------------------------------------------------------- parsing


def test_unknown_method_suggests_nearest() -> None:
    with pytest.raises(ModbenchError, match=r"unknown method 'qknrom'.*did you mean 'qknorm'"):
        parse_methods("post_ln+qknrom")


def test_parse_options_and_canonical_label() -> None:
    ms = parse_methods("layerscale(init=1e-4)+qknorm(scope=head)")
    assert ms[0].opts.init == 1e-4
    assert [m.label for m in ms] == ["layerscale(init=0.0001)", "qknorm"]


@pytest.mark.parametrize("text,msg", [
    ("qknorm+qknorm", "listed twice"),
    ("baseline+qknorm", "cannot be combined"),
    ("qknorm(scop=full)", "did you mean 'scope'"),
    ("layerscale(init=big)", "should be"),
    ("qknorm(", "cannot read"),
])
def test_bad_method_strings(text: str, msg: str) -> None:
    with pytest.raises(ModbenchError, match=msg):
        parse_methods(text)


# ---------------------------------------------------------------- composition rules


@pytest.fixture
def temp_methods() -> Iterator[list[str]]:
    """Register throw-away methods and remove them afterwards."""
    added: list[str] = []
    yield added
    for name in added:
        REGISTRY.pop(name, None)


def _placement_method(name: str) -> type[Method]:
    class _P(Method):
        category = "placement"
        citation = "test"
        summary = "test"

        def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
            spec.fill("placement", lambda site, layer, n: site == "final", by=self.name)

        def extra_params(self, cfg: ModelConfig) -> int:
            return 0

    _P.name = name
    return _P


def test_same_slot_conflict_names_both(temp_methods: list[str]) -> None:
    register(_placement_method("zz_only_final"))
    temp_methods.append("zz_only_final")
    cfg = tiny("post_ln+zz_only_final").model
    with pytest.raises(ModbenchError, match=r"'post_ln' and 'zz_only_final'.*placement"):
        build_model(cfg)


def test_compatible_methods_sharing_a_slot_key_are_allowed(temp_methods: list[str]) -> None:
    """Two methods filling a slot with the same component (same key) do not conflict."""

    @dataclass
    class _O:
        pass

    class _SameQK(Method):
        name = "zz_same_qk"
        category = "attention"
        citation = summary = "test"

        def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
            from modbench.model.norms import RMSNorm

            spec.fill("attn.q_norm", lambda c, layer: RMSNorm(c.head_dim), by=self.name,
                      key="rmsnorm-head")

    register(_SameQK)
    temp_methods.append("zz_same_qk")
    build_model(tiny("qknorm+zz_same_qk").model)


def test_recipe_exceptions_applied_and_recorded(temp_methods: list[str], tmp_path: Path) -> None:
    class _NoWD(_placement_method("zz_nowd")):  # type: ignore[misc]
        recipe_exceptions: ClassVar[dict[str, Any]] = {"weight_decay": 0.0, "warmup_steps": 0}

        def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
            pass

    _NoWD.name = "zz_nowd"
    register(_NoWD)
    temp_methods.append("zz_nowd")
    from modbench.train.trainer import Trainer

    tr = Trainer(tiny("zz_nowd", steps=3), tmp_path / "r", progress=False)
    tr.run()
    assert all(g["weight_decay"] == 0.0 for g in tr.optimizer.param_groups)
    text = (tmp_path / "r" / "config.yaml").read_text()
    assert "recipe_exceptions:\n  weight_decay: 0.0\n  warmup_steps: 0" in text
    first = read_metrics(tmp_path / "r")[1]
    assert first["kind"] == "train" and first["lr"] == pytest.approx(3e-3)  # no warm-up


def test_conflicting_recipe_exceptions(temp_methods: list[str]) -> None:
    for name, wd in (("zz_wd0", 0.0), ("zz_wd1", 0.01)):
        cls = type(name, (_placement_method(name),), {
            "recipe_exceptions": {"weight_decay": wd},
            "configure": lambda self, spec, cfg: None})
        cls.name = name
        register(cls)
        temp_methods.append(name)
    from modbench.train.trainer import Trainer

    with pytest.raises(ModbenchError, match=r"'zz_wd0' and 'zz_wd1'.*weight_decay"):
        Trainer(tiny("zz_wd0+zz_wd1"), "/nonexistent/never-written", progress=False)


def test_every_method_has_a_row_in_docs_methods() -> None:
    """docs/methods.md's table lists every registered method with its category."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "methods.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| ([a-z]+) \|", text, re.M))
    for name, cls in load_all().items():
        assert rows.get(name) == cls.category, f"docs/methods.md has no row for {name}"
