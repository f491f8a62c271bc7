"""The worked example of docs/methods.md ("Your own method"), run as a user runs it: the method
in examples/headtemp/ (not in the catalogue) listed, checked by the conformance kit, decided by
a study through two worker processes, reported, loaded into pandas and exported to a Hugging
Face folder that loads, with modbench's logits, where modbench is not installed. The page
shows the example's files verbatim (checked here), so the page stays true."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from tests.eval.test_export import bare_python  # noqa: F401 - the fixture
from tests.helpers import plugins_restored

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "headtemp"
PLUGIN = EXAMPLE / "headtemp.py"
SPEC = EXAMPLE / "study.yaml"
DOC = REPO / "docs" / "methods.md"


def modbench(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MODBENCH_METHODS_FROM"}
    return subprocess.run([sys.executable, "-m", "modbench", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _section(text: str) -> str:
    start = text.index("## Your own method")
    return text[start:text.index("\n## ", start + 3)]


def test_the_page_shows_the_example_files_verbatim() -> None:
    section = _section(DOC.read_text(encoding="utf-8"))
    blocks = re.findall(r"```(python|yaml)\n(.*?)```", section, re.S)
    assert ("python", PLUGIN.read_text(encoding="utf-8")) in blocks
    assert ("yaml", SPEC.read_text(encoding="utf-8")) in blocks
    catalog = json.loads((REPO / "src/modbench/methods/catalog.json").read_text())
    assert "headtemp" not in {m["name"] for m in catalog["methods"]}  # not in the catalogue


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """README's route: `modbench study run` on the example's spec, two local workers."""
    work = tmp_path_factory.mktemp("work")
    r = modbench("study", "run", str(SPEC), "--out", "studies/headtemp", "--workers", "2",
                 "--no-progress", cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "9 runs, 0 already done, 9 trained" in r.stdout
    yield work / "studies" / "headtemp"


def test_listed_and_flops_with_the_flag(tmp_path: Path) -> None:
    r = modbench("methods", "--methods-from", str(PLUGIN), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^headtemp\s+attention\s+Learned per-head", r.stdout, re.M)
    assert f"from: {PLUGIN}" in r.stdout
    r = modbench("flops", "--preset", "tiny", "--method", "headtemp", "--json",
                 "--methods-from", str(PLUGIN), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    base = json.loads(modbench("flops", "--preset", "tiny", "--method", "baseline", "--json",
                               cwd=tmp_path).stdout)[0]
    assert row["params"] - base["params"] == 2 * 4  # tiny: 2 layers x 4 heads
    assert row["flops_ratio"] == 1.0


def test_the_conformance_kit_passes_it(tmp_path: Path) -> None:
    """`modbench methods check` (every check, compile and export included) on the example."""
    r = modbench("methods", "check", "headtemp", "--methods-from", str(PLUGIN), "--json",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout)
    checks = {c["name"]: c["status"] for c in result["results"]}
    assert set(checks.values()) == {"passed"}, checks
    assert {"init", "params", "flops", "compile", "export", "trains"} <= set(checks)


def test_study_status_report_and_notebook(study: Path,
                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """The study folder names its plugin: status and report need no flag; every run records
    the plugin's origin; load_study gives the report's verdicts."""
    recorded = yaml.safe_load((study / "spec.yaml").read_text())["methods_from"]
    assert recorded == [str(PLUGIN)]
    r = modbench("study", "status", str(study), cwd=study.parent)
    assert r.returncode == 0, r.stderr
    assert "9 runs — 9 completed" in r.stdout and "code changed" not in r.stdout
    r = modbench("study", "report", str(study), cwd=study.parent)
    assert r.returncode == 0, r.stderr
    report = (study / "report" / "report.md").read_text()
    rows = [x for x in report.splitlines() if x.startswith("| `headtemp")]
    assert len(rows) >= 2 and "left out of the verdicts" not in report
    import modbench as mb

    with plugins_restored(tmp_path_factory.getbasetemp()):
        s = mb.load_study(study)
        v = s.verdicts.set_index("method")
        assert set(v.index) == {"baseline", "headtemp", "headtemp(init=1.0)"}
        for method in ("headtemp", "headtemp(init=1.0)"):
            assert v.loc[method, "verdict"] in {"improver", "degrader", "within_noise"}
            assert f"| `{method}` | 3 |" in report and v.loc[method, "verdict"] in "".join(
                x for x in rows if x.startswith(f"| `{method}` |"))
    for run in (study / "runs").iterdir():
        meta = yaml.safe_load((run / "config.yaml").read_text())["meta"]["methods"]
        method = yaml.safe_load((run / "config.yaml").read_text())["model"]["method"]
        if method.startswith("headtemp"):
            assert meta["headtemp"]["plugin"] == str(PLUGIN)


def test_export_loads_where_modbench_is_not_installed(study: Path, bare_python: Path,  # noqa: F811
                                                      tmp_path: Path,
                                                      tmp_path_factory: pytest.TempPathFactory
                                                      ) -> None:
    from modbench.eval.run import load_run
    from modbench.methods.plugins import load_plugins

    run = next(d for d in (study / "runs").iterdir() if yaml.safe_load(
        (d / "config.yaml").read_text())["model"]["method"] == "headtemp(init=1.0)")
    out = tmp_path / "hf"
    r = modbench("export", str(run), "--hf", str(out), "--methods-from", str(PLUGIN),
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (out / "plugin_headtemp.py").is_file()
    with plugins_restored(tmp_path_factory.getbasetemp()):
        load_plugins([str(PLUGIN)])
        _, model, _ = load_run(run)
        ids = torch.randint(0, model.cfg.vocab_size, (2, 16),
                            generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            want = model(ids)
    torch.save(ids, tmp_path / "ids.pt")
    script = ("import importlib.util, sys, torch\n"
              "assert importlib.util.find_spec('modbench') is None\n"
              "assert importlib.util.find_spec('headtemp') is None\n"
              "from transformers import AutoModelForCausalLM\n"
              "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
              "with torch.no_grad():\n"
              "    torch.save(m(torch.load(sys.argv[2])).logits, sys.argv[3])\n")
    home = tmp_path / "home"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "HF_HOME": str(home / "hf"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([str(bare_python), "-c", script, str(out), str(tmp_path / "ids.pt"),
                          str(tmp_path / "logits.pt")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want, rtol=0, atol=1e-6)
