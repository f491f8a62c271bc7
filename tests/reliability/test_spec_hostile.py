"""Hostile and careless study specs (modbench.study.spec.check_spec): a name that is not a
safe folder name, fields of the wrong type or range, a YAML alias bomb: one line each, before
anything is written; a study refused at its start leaves no folder behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.helpers import cli

from modbench.errors import ModbenchError
from modbench.study.spec import load_spec

BASE: dict[str, Any] = {"name": "ok", "methods": [], "scales": ["tiny"],
                        "overrides": ["train.steps=2", "train.eval_every=0"],
                        "evaluation": {"probes": False}}


def _spec(tmp: Path, **kw: Any) -> Path:
    tree = {**BASE, **kw}
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize("kw,msg", [
    ({"name": "../x"}, "'name' must be a folder name"),
    ({"name": "/tmp/abs"}, "'name' must be a folder name"),
    ({"name": ".hidden"}, "'name' must be a folder name"),
    ({"name": 123}, "'name' must be a folder name.*got 123"),
    ({"name": ["a", "b"]}, "'name' must be a folder name"),
    ({"name": "x" * 300}, "at most 100 characters"),
    ({"name": ""}, "'name' must be a folder name"),
    ({"description": ["a"]}, "'description' must be a string"),
    ({"seeds": {"default": "abc"}}, "'seeds.default' must be a non-empty list of whole"),
    ({"seeds": {"default": [True]}}, "'seeds.default' must be"),
    ({"seeds": {"default": [-1]}}, "'seeds.default' must be"),
    ({"seeds": {"noise_floor": [0.5]}}, "'seeds.noise_floor' must be"),
    ({"methods": "qknorm"}, "'methods' must be a list"),
    ({"methods": [1]}, "'methods' must be a list of method strings"),
    ({"scales": []}, "'scales' must be a non-empty list"),
    ({"data": {"source": 5}}, "'data.source' must be"),
    ({"data": {"data_seed": "x"}}, "'data.data_seed' must be a whole number"),
    ({"data": {"probe_mix": 2}}, "'data.probe_mix' must be a number from 0 to 1"),
    ({"evaluation": {"limit": 0}}, "'evaluation.limit' must be"),
    ({"evaluation": {"probes": "yes"}}, "'evaluation.probes' must be true or false"),
    ({"evaluation": {"tasks": "piqa"}}, "'evaluation.tasks' must be a list"),
    ({"claim": {"text": 3}}, "'claim.text' must be a string"),
])
def test_bad_field_is_one_line(tmp_path: Path, kw: dict[str, Any], msg: str) -> None:
    with pytest.raises(ModbenchError, match=msg) as e:
        load_spec(_spec(tmp_path, **kw))
    assert "\n" not in str(e.value)


def test_good_names_pass(tmp_path: Path) -> None:
    for name in ("a", "my-study_2.1", "x" * 100):
        assert load_spec(_spec(tmp_path, name=name)).name == name


def test_alias_bomb_refused_before_expansion(tmp_path: Path) -> None:
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join(['*a' + str(i - 1)] * 10)}]" for i in range(1, 10)]
    # 10**10 strings once expanded: never built, the composed graph is counted instead
    text = "name: bomb\nscales: [tiny]\n" + "\n".join(lines) + "\ndescription: *a9\n"
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with pytest.raises(ModbenchError, match="aliases"):
        load_spec(path)


def test_plain_aliases_still_work(tmp_path: Path) -> None:
    path = tmp_path / "alias.yaml"
    path.write_text("name: a\nscales: &s [tiny]\nmethods: [qknorm]\nseeds: {anchors: [qknorm]}\n"
                    "overrides: &o [train.steps=2]\n")
    assert load_spec(path).scales == ["tiny"]


@pytest.fixture
def study(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
          capsys: pytest.CaptureFixture[str]) -> Any:
    """``study(args)``: ``modbench study run *args`` in process (tests.helpers.cli, what
    `python -m modbench` runs) from ``tmp_path`` as the working folder: its exit code and
    stderr."""
    monkeypatch.chdir(tmp_path)

    def run(args: list[str]) -> tuple[int, str]:
        code, _, err = cli(capsys, "study", "run", *args, "--no-progress", "--no-report",
                           "--workers", "1")
        return code, err

    return run


def test_refused_study_leaves_nothing(tmp_path: Path, study: Any) -> None:
    spec = _spec(tmp_path, data={"source": str(tmp_path / "no-such-data")})
    code, err = study([str(spec), "--out", str(tmp_path / "s")])
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "s").exists()  # no index.sqlite, runs/, spec.yaml


def test_name_outside_studies_refused_without_out(tmp_path: Path, study: Any) -> None:
    spec = _spec(tmp_path, name="../escaped")
    code, err = study([str(spec)])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "studies").exists()
