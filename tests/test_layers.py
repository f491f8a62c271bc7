"""The package's import layers (pyproject.toml, [tool.importlinter]): no module imports a layer
above its own. Checked with import-linter on the code as it is, and shown to catch a planted
climbing import in a copy of the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import modbench

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(modbench.__file__).resolve().parent


def lint(package_parent: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the ``modbench`` package found under ``package_parent``."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"},
                          cwd=package_parent, timeout=300)


def layers() -> list[str]:
    tree = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = tree["tool"]["importlinter"]["contracts"]
    return list(contract["layers"])


def test_no_import_climbs_a_layer() -> None:
    res = lint(PACKAGE.parent, ROOT / "pyproject.toml")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "1 kept, 0 broken" in res.stdout


def test_every_top_level_module_has_a_layer() -> None:
    named = {m.strip() for layer in layers() for m in layer.split("|")}
    found = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    found |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert found == named


@pytest.mark.parametrize(("module", "climbing_import"), [
    ("model/norms.py", "import modbench.train.trainer"),  # the model reaching up to the trainer
    ("methods/_common.py", "from modbench.eval import probes"),  # methods -> eval
    ("runtime/loss.py", "import modbench.model.transformer"),  # side-by-side layers
])
def test_a_planted_climbing_import_is_caught(module: str, climbing_import: str,
                                             tmp_path: Path) -> None:
    copy = tmp_path / "src"
    shutil.copytree(PACKAGE, copy / "modbench",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    target = copy / "modbench" / module
    target.write_text(target.read_text() + f"\n{climbing_import}  # planted\n")
    res = lint(copy, ROOT / "pyproject.toml")
    assert res.returncode != 0
    assert "BROKEN" in res.stdout
    planted = module.removesuffix(".py").replace("/", ".")
    assert f"modbench.{planted}" in res.stdout
