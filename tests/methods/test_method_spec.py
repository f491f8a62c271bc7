"""A method string is parsed once per process (MethodSpec), its canonical string is what a run
records, and a study's run keys are the ones the stores already hold."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import modbench.methods.base as base
from modbench.config import ModelConfig, resolve
from modbench.errors import ModbenchError
from modbench.measure.compile_check import declared_breaks
from modbench.measure.flops import flop_report
from modbench.methods.base import REGISTRY, Method, MethodSpec, method_spec, register
from modbench.methods.build import plan, plan_run, reads_train_seq_len
from modbench.model.spec import ModelSpec
from modbench.study.spec import config_key, load_spec, run_spec


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """An empty spec cache for the test, and the texts parsed while it runs."""
    seen: list[str] = []
    real = base._parse

    def counting(text: str) -> list[Method]:
        seen.append(text)
        return real(text)

    monkeypatch.setattr(base, "_SPECS", {})
    monkeypatch.setattr(base, "_parse", counting)
    yield seen


def test_a_method_string_is_parsed_once_for_every_caller(parses: list[str]) -> None:
    text = "layerscale(init=1e-4)+qknorm(scope=head)"
    cfg = resolve("tiny", method=text)
    spec = MethodSpec.parse(text)
    assert spec.names == ("layerscale", "qknorm")
    assert spec.canonical == "layerscale(init=0.0001)+qknorm"
    assert spec.methods[0].opts.init == 1e-4
    p = plan(cfg.model)
    reads_train_seq_len(cfg.model)
    flop_report(cfg.model)
    declared_breaks(text)
    assert method_spec(cfg.model) is spec and MethodSpec.parse(text) is spec
    assert list(p.methods) == list(spec.methods)  # the same instances
    assert parses == [text]
    # the trainer's copy is planned from the same spec and records its canonical string
    run, _ = plan_run(cfg)
    assert run.model.method == spec.canonical == p.method
    assert parses == [text]


def test_each_distinct_text_is_its_own_parse(parses: list[str]) -> None:
    a, b = MethodSpec.parse("post_ln+qknorm"), MethodSpec.parse(" post_ln + qknorm ")
    assert a is not b and a.canonical == b.canonical == "post_ln+qknorm"
    assert MethodSpec.parse("baseline").methods == () == MethodSpec.parse("").methods
    assert MethodSpec.parse("").canonical == "baseline"
    assert parses == ["post_ln+qknorm", " post_ln + qknorm ", "baseline", ""]


@pytest.mark.parametrize("text,msg", [
    ("post_ln+qknrom", "did you mean 'qknorm'"),
    ("qknorm+qknorm", "listed twice"),
    ("layerscale(init=big)", "should be"),
])
def test_a_bad_string_is_refused_every_time(parses: list[str], text: str, msg: str) -> None:
    for _ in range(2):  # a failure is not cached as a spec
        with pytest.raises(ModbenchError, match=msg):
            MethodSpec.parse(text)
    assert parses == [text, text]


def _throwaway(tag: str) -> type[Method]:
    class _T(Method):
        name = "zz_spec_cache"
        category = "placement"
        citation = summary = "test"

        def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
            pass

    _T.__qualname__ = f"_T{tag}"
    return _T


def test_a_spec_follows_the_registry(parses: list[str]) -> None:
    """A cached spec whose method was removed from the registry, or registered again as
    another class, is not handed out."""
    first, second = _throwaway("a"), _throwaway("b")
    try:
        register(first)
        assert type(MethodSpec.parse("zz_spec_cache").methods[0]) is first
        REGISTRY.pop("zz_spec_cache")
        with pytest.raises(ModbenchError, match="unknown method 'zz_spec_cache'"):
            MethodSpec.parse("zz_spec_cache")
        register(second)
        assert type(MethodSpec.parse("zz_spec_cache").methods[0]) is second
        assert MethodSpec.parse("zz_spec_cache") is MethodSpec.parse("zz_spec_cache")
    finally:
        REGISTRY.pop("zz_spec_cache", None)
    assert parses == ["zz_spec_cache"] * 3


#: run keys computed by the code before MethodSpec (commit 6cc1275): a study store's runs must
#: keep them, or every study would train its runs again
KEYS_BEFORE: dict[tuple[str, str], str] = {
    ("tiny", "baseline"): "7ea6ebd57e3d1ecc",
    ("tiny", "post_ln+qknorm"): "153d895425f55e9c",
    ("tiny", " post_ln + qknorm "): "483feda5530e2e3d",
    ("tiny", "layerscale(init=1e-4)"): "1281f64fd5c0cf1c",
    ("tiny", "layerscale(init=1e-4)+qknorm(scope=full)"): "5c29e6d5d3aab1e6",
    ("tiny", "sigmoid"): "491a4c7d62c36d2d",
    ("cpu-deep", "sigmoid"): "1822b3650cc1b827",  # keeps model.train_seq_len in its key
    ("cpu-deep", "post_ln+qknorm"): "848e2b0056894b9d",
}
#: study run keys as of 2026-11-27: the stall stop's patience (300) and margin (0.05) changed on
#: purpose then, so runs stopped under the old rule train again (docs/runs.md); any other change
#: to them retrains every study
STUDY_KEYS_BEFORE: dict[tuple[str, str, str, int], str] = {
    ("builtin-cpu", "cpu-deep", "baseline", 0): "ec765ea89d906eb2",
    ("builtin-cpu", "cpu-deep", "post_ln+comt", 0): "ca3c3599291e0b36",
    ("smoke-tiny", "tiny", "layerscale", 0): "954e77b4887530e0",
}


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_run_keys_are_the_ones_stores_hold(monkeypatch: pytest.MonkeyPatch, cache: str) -> None:
    monkeypatch.setattr(base, "_SPECS", {})
    if cache == "warm":
        for _, text in KEYS_BEFORE:
            MethodSpec.parse(text)
    got = {k: config_key(resolve(k[0], method=k[1])) for k in KEYS_BEFORE}
    assert got == KEYS_BEFORE
    study: dict[tuple[str, str, str, int], Any] = {}
    for name, scale, method, seed in STUDY_KEYS_BEFORE:
        run = run_spec(load_spec(name), scale, method, seed)
        study[(name, scale, method, seed)] = run.key
    assert study == STUDY_KEYS_BEFORE
