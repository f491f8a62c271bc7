"""Methods from outside the package (modbench.methods.plugins): a .py file, a package folder,
a module, MODBENCH_METHODS_FROM and an installed entry point; the origin and code hash each
run records; the study skip key that follows the code; one-line refusals of bad plugins with
nothing written. Every plugin is written to a temporary folder outside the repository."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from modbench.errors import ModbenchError
from modbench.methods import plugins
from modbench.methods.base import REGISTRY, MethodSpec
from tests.helpers import cli, plugins_restored

REPO = Path(__file__).resolve().parents[2]

#: a real method that is not in the catalogue: ReZero's scalar residual gate
#: (Bachlechner et al. 2020, arXiv 2003.04887), x + alpha F(x) with alpha = 0 at init
REZERO = '''"""ReZero: x + alpha F(x), one scalar alpha per sublayer (arXiv 2003.04887)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.methods.base import Method, register


class Gate(nn.Module):
    def __init__(self, init: float) -> None:
        super().__init__()
        self.init = init
        self.alpha = nn.Parameter(torch.tensor(float(init)))

    def forward(self, x, out, state):
        return x + self.alpha.to(out.dtype) * out

    def modbench_init(self) -> None:
        nn.init.constant_(self.alpha, self.init)


@register
class ReZero(Method):
    name = "NAME"
    category = "residual"
    citation = "Bachlechner et al. 2020, arXiv 2003.04887"
    summary = "x + alpha F(x), a scalar alpha per sublayer, 0 at init"

    @dataclass
    class Options:
        init: float = 0.0

    def configure(self, spec, cfg):
        spec.fill("merge", lambda c, layer, sub: Gate(self.opts.init), by=self.name)

    def extra_params(self, cfg):
        return 2 * cfg.n_layers

    def extra_flops(self, cfg, seq_len):
        return 0.0
'''


def rezero(folder: Path, name: str = "rezero", file: str | None = None) -> Path:
    """Write the ReZero plugin registering ``name`` to ``folder/<file or name>.py``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{file or name}.py"
    path.write_text(REZERO.replace('"NAME"', repr(name)))
    return path


@pytest.fixture(autouse=True)
def plugin_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each test starts and ends with no plugin loaded (tests.helpers.plugins_restored)."""
    with plugins_restored(tmp_path_factory.getbasetemp()):
        yield


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def modbench(*args: str, cwd: Path, env: dict[str, str] | None = None,
             timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``python -m modbench ARGS`` in a fresh process (no plugin loaded unless asked)."""
    e = {k: v for k, v in os.environ.items() if k != plugins.ENV}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "modbench", *args], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=timeout)


# --- loading ---------------------------------------------------------------------------------

def test_file_plugin_is_listed_with_its_origin(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                               ) -> None:
    path = rezero(tmp_path / "lab")
    code, out, err = cli(capsys, "methods", "--methods-from", str(path))
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("rezero"))
    assert "residual" in line and f"from: {path}" in out
    code, out, _ = cli(capsys, "methods", "--json", "--methods-from", str(path))
    rows = {r["name"]: r for r in json.loads(out)}
    assert len(rows) == len([n for n in REGISTRY if plugins.is_builtin(REGISTRY[n])]) + 1
    o = rows["rezero"]["origin"]
    assert (o["origin"], o["plugin"], o["module"]) == ("plugin", str(path), "rezero")
    assert o["sha256"] == plugins.combined_hash({"rezero.py": sha(path)})
    assert rows["qknorm"].get("origin") is None  # built-ins as the catalog lists them


def test_relative_refs_are_taken_from_the_working_folder(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    rezero(tmp_path / "lab")
    monkeypatch.chdir(tmp_path)
    (p,) = plugins.load_plugins(["lab/rezero.py"])
    assert p.ref == str(tmp_path / "lab" / "rezero.py") and p.methods == ["rezero"]
    assert plugins.load_plugins(["./lab/rezero.py"])[0] is p  # imported once
    # every process this one starts loads it too
    assert os.environ[plugins.ENV] == p.ref
    assert MethodSpec.parse("rezero(init=0.5)+qknorm").canonical == "rezero(init=0.5)+qknorm"


def test_package_plugin_hashes_the_modules_it_imports(tmp_path: Path) -> None:
    """A plugin split over modules of one package: its origin lists the files the registering
    module pulls in (relative and absolute imports, the packages' __init__), not the others;
    editing one of them changes the hash."""
    pkg = tmp_path / "mylab"
    (pkg / "parts").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import methods  # noqa\n")
    (pkg / "parts" / "__init__.py").write_text("")
    (pkg / "parts" / "gate.py").write_text(
        REZERO.split("@register")[0].replace("from modbench.methods.base import Method, "
                                             "register\n", ""))
    (pkg / "unused.py").write_text("X = 1\n")
    (pkg / "methods.py").write_text(
        "from dataclasses import dataclass\n"
        "from modbench.methods.base import Method, register\n"
        "from .parts.gate import Gate\n"
        "import mylab.parts\n\n"
        "@register\nclass Gated(Method):\n    name = 'pkg_gate'\n    category = 'residual'\n"
        "    summary = 'a gate'\n\n    def configure(self, spec, cfg):\n"
        "        spec.fill('merge', lambda c, layer, sub: Gate(0.0), by=self.name)\n")
    (p,) = plugins.load_plugins([str(pkg)])
    assert (p.module, p.kind, p.methods) == ("mylab", "package", ["pkg_gate"])
    o = plugins.origin("pkg_gate")
    assert o["module"] == "mylab.methods"
    assert sorted(o["files"]) == ["mylab/__init__.py", "mylab/methods.py",
                                  "mylab/parts/__init__.py", "mylab/parts/gate.py"]
    assert o["files"]["mylab/parts/gate.py"] == sha(pkg / "parts" / "gate.py")
    before = plugins.combined_hash(o["files"])
    assert o["sha256"] == before
    (pkg / "parts" / "gate.py").write_text((pkg / "parts" / "gate.py").read_text() + "# edit\n")
    files = {k: sha(tmp_path / k) for k in o["files"]}
    assert plugins.combined_hash(files) != before


def test_module_ref_and_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A dotted module name imports an importable module (PYTHONPATH here, an installed
    package in use); MODBENCH_METHODS_FROM loads plugins in any command, flops included."""
    rezero(tmp_path / "site", "envgate", file="labmod")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv(plugins.ENV, "labmod")
    code, out, err = cli(capsys, "flops", "--preset", "tiny", "--method", "envgate")
    assert code == 0, err
    assert "envgate" in out
    assert plugins.origin("envgate")["plugin"] == "labmod"


def test_installed_entry_point_is_loaded(tmp_path: Path) -> None:
    """A distribution on sys.path declaring the 'modbench.methods' group: `modbench methods`
    lists its method, with the entry point as its origin; without one the check costs a scan
    of metadata folders and loads nothing."""
    site = tmp_path / "site"
    rezero(site, "epgate", file="ep_lab")
    info = site / "ep_lab-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-lab\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[modbench.methods]\neplab = ep_lab\n")
    r = modbench("methods", "--json", cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr
    rows = {x["name"]: x for x in json.loads(r.stdout)}
    assert rows["epgate"]["origin"]["plugin"] == "entry_point:eplab"
    assert rows["epgate"]["origin"]["sha256"] == plugins.combined_hash(
        {"ep_lab.py": sha(site / "ep_lab.py")})
    assert not plugins.has_entry_points()  # this environment declares none


# --- one line, exit 2, nothing written -------------------------------------------------------

BAD = {
    "missing file": (None, "does not exist"),
    "syntax error": ("def broken(:\n", "SyntaxError"),
    "import error": ("import no_such_package_xyz\n", "no_such_package_xyz"),
    "error on import": ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    "no method": ("X = 1\n", "registers no method"),
    "built-in name": (REZERO.replace('"NAME"', "'layerscale'"), "name of a built-in"),
    "bad name": (REZERO.replace('"NAME"', "'Bad-Name'"), "lower_snake_case"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_plugins_one_line_nothing_written(case: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    text, expect = BAD[case]
    path = tmp_path / "lab" / "bad_plugin.py"
    if text is not None:
        path.parent.mkdir()
        path.write_text(text)
    before = set(REGISTRY)
    out = tmp_path / "run"
    code, _, err = cli(capsys, "train", "--preset", "tiny", "--steps", "2", "--out", str(out),
                       "--methods-from", str(path), "--no-progress")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], err
    assert str(path) in lines[0]
    assert not out.exists()
    assert set(REGISTRY) == before and "bad_plugin" not in sys.modules  # nothing left behind
    assert plugins.ENV not in os.environ


def test_two_plugins_with_one_name_are_refused_by_name(tmp_path: Path) -> None:
    a = rezero(tmp_path / "a", "samegate", file="gate_a")
    b = rezero(tmp_path / "b", "samegate", file="gate_b")
    plugins.load_plugins([str(a)])
    with pytest.raises(ModbenchError, match=r"'samegate' is registered twice: by plugin "
                       rf"{a} and by plugin {b}"):
        plugins.load_plugins([str(b)])
    assert REGISTRY["samegate"].__module__ == "gate_a"


def test_file_named_like_an_installed_module_is_refused(tmp_path: Path) -> None:
    path = rezero(tmp_path, "jsongate", file="json")
    with pytest.raises(ModbenchError, match="imported as module 'json'"):
        plugins.load_plugins([str(path)])


def test_nothing_is_imported_from_the_working_folder(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A plugin file in the current folder is not loaded unless named."""
    rezero(tmp_path, "cwdgate")
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "flops", "--preset", "tiny", "--method", "cwdgate")
    assert code == 2 and "unknown method 'cwdgate'" in err and "--methods-from" in err


# --- every command checks a method string as train does --------------------------------------

@pytest.mark.parametrize("args,expect", [
    (["flops", "--method", "post_ln+sandwich"], "cannot be combined"),
    (["flops", "--method", "rezero+layerscale"], "'rezero' and 'layerscale'"),
    (["flops", "--method", "rezero(init=x)"], "should be float"),
    (["plan", "--method", "rezero+layerscale", "--gpu", "cpu"], "'rezero' and 'layerscale'"),
])
def test_flops_and_plan_check_methods_like_train(args: list[str], expect: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = rezero(tmp_path)
    code, _, err = cli(capsys, *args, "--preset", "tiny", "--methods-from", str(path))
    assert code == 2 and expect in err, err
    code, _, err = cli(capsys, "train", *args[1:3], "--preset", "tiny", "--steps", "1",
                       "--out", str(tmp_path / "r"), "--methods-from", str(path))
    assert code == 2 and expect in err, err


# --- provenance: runs record it, keys follow the code, runs are refused without it -----------

def test_run_records_origin_and_is_refused_without_its_code(tmp_path: Path) -> None:
    """`train` records the plugin's origin in config.yaml; in a process without the plugin,
    eval and export name the plugin and the option; with the code edited since, they and
    --resume refuse the run (two versions of the method)."""
    path = rezero(tmp_path / "lab")
    run = tmp_path / "run"
    r = modbench("train", "--preset", "tiny", "--method", "rezero", "--steps", "4", "--out",
                 str(run), "--no-progress", "--methods-from", str(path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    meta = yaml.safe_load((run / "config.yaml").read_text())["meta"]["methods"]
    assert meta["rezero"]["sha256"] == plugins.combined_hash({"rezero.py": sha(path)})
    assert meta["rezero"]["plugin"] == str(path)
    r = modbench("eval", str(run), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: run {run} uses method 'rezero', which is not loaded; it was recorded from "
        f"{path} (module rezero): load it with --methods-from {path} or "
        f"MODBENCH_METHODS_FROM={path}"]
    path.write_text(path.read_text() + "# edited\n")
    for args in (["eval", str(run)], ["export", str(run), "--hf", str(tmp_path / "hf")],
                 ["train", "--out", str(run), "--resume", "--no-progress"]):
        r = modbench(*args, "--methods-from", str(path), cwd=tmp_path)
        assert r.returncode == 2, args
        assert "trained method 'rezero' with other code than is loaded now" in r.stderr
        assert "rezero.py" in r.stderr
    assert not (tmp_path / "hf").exists()


def test_skip_key_holds_outside_code_only(tmp_path: Path) -> None:
    from modbench.study.spec import StudySpec, expand

    path = rezero(tmp_path)
    plugins.load_plugins([str(path)])
    spec = StudySpec(name="k", methods=["rezero", "qknorm"], scales=["tiny"])
    runs = {r.method: r for r in expand(spec)}
    from modbench.study.spec import config_key

    for name in ("baseline", "qknorm"):  # the key the store had before plugins existed
        d = runs[name].config.to_dict()
        assert "method_code" not in json.dumps(d)
        assert runs[name].key == config_key(runs[name].config)
    # the plugin's key is its config's hash with the code hash in it: a copy of the method
    # under the same name with other code gets another key
    key = runs["rezero"].key
    rec = plugins._ORIGINS["rezero"]
    plugins._ORIGINS["rezero"] = {**rec, "sha256": "0" * 64}
    assert config_key(runs["rezero"].config) != key
    plugins._ORIGINS["rezero"] = rec
    assert config_key(runs["rezero"].config) == key


def test_study_with_a_plugin_retrains_exactly_its_runs_after_an_edit(tmp_path: Path) -> None:
    """The whole route in fresh processes: a spec naming its plugin relative to itself, two
    local workers; status and report need no flag; editing the plugin retrains exactly the
    plugin's runs, and status and the report name the runs trained with the old code."""
    lab = tmp_path / "lab"
    path = rezero(lab)
    (lab / "study.yaml").write_text(
        "name: lab\nmethods: [rezero]\nmethods_from: [./rezero.py]\n"
        "seeds: {default: [0, 1], noise_floor: [0, 1]}\nscales: [tiny]\n"
        "overrides: ['train.steps=12', 'train.eval_every=6']\nevaluation: {probes: false}\n")
    out = tmp_path / "studies" / "lab"
    r = modbench("study", "run", str(lab / "study.yaml"), "--out", str(out), "--workers", "2",
                 "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "4 runs, 0 already done, 4 trained" in r.stdout
    assert yaml.safe_load((out / "spec.yaml").read_text())["methods_from"] == [str(path)]
    workers = {json.loads((d / "summary.json").read_text()).get("status")
               for d in (out / "runs").iterdir()}
    assert workers == {"completed"}
    path.write_text(path.read_text() + "# edited\n")
    r = modbench("study", "status", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    stale = [x for x in r.stdout.splitlines() if "code changed since it trained" in x]
    assert len(stale) == 2 and all("rezero" in x and "rezero.py" in x for x in stale)
    r = modbench("study", "run", str(lab / "study.yaml"), "--out", str(out), "--workers", "2",
                 "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "4 runs, 2 already done, 2 trained" in r.stdout  # the baseline's kept
    report = (out / "report" / "report.md").read_text()
    for seed in (0, 1):
        assert (f"tiny/rezero/s{seed} is left out of the verdicts: it was trained with other "
                "code than is loaded now (rezero: code changed (rezero.py); a run with the "
                "loaded code replaces it)") in report
    # in a notebook: the study folder names its plugin, so no flag either
    import modbench as mb

    study = mb.load_study(out)
    assert len(study.runs) == 4 and set(study.runs["method"]) == {"baseline", "rezero"}
    assert set(study.results.code_changed) == {"tiny/rezero/s0", "tiny/rezero/s1"}
    assert list(study.verdicts["method"]) == ["baseline", "rezero"]
    assert plugins.origin("rezero")["plugin"] == str(path)
