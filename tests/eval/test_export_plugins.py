"""``modbench export --hf`` of a model whose methods come from outside modbench (plugins).

A plugin's method travels with the export: its module and the modules of its own package
that it imports become ``plugin_*.py`` files next to modbench's, their imports pointed at
them, and the export loads where neither modbench nor the plugin can be imported, with
modbench's logits. A plugin that imports a package the export cannot carry is refused in
one line naming the import, the file and the line. The export records each method's origin.

The plugins are written to a temporary folder outside the repository and loaded with
:func:`modbench.methods.plugins.load_plugins`; they are unloaded again at the end (their
registry entries, origins and modules: ``tests.helpers.plugins_restored``), so other tests
see the catalogue as it was.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from modbench.errors import ModbenchError
from modbench.eval import hf_bundle
from modbench.eval.export import export_hf
from modbench.eval.run import load_run
from modbench.methods import plugins
from modbench.methods.base import REGISTRY
from modbench.train.trainer import train
from tests.eval.test_export import bare_python, make_run
from tests.helpers import plugins_restored, tiny

__all__ = ["bare_python"]  # the fixture: a venv with torch and transformers only

# (a) one file: a learned per-head temperature on the queries (init 1.5, so it changes the
# attention from the first step); it imports names from modbench.methods' __init__
HEADTEMP = '''\
"""A learned per-head temperature on the attention queries (a test plugin)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods import Method, register
from modbench.model.spec import ModelSpec


class HeadTemperature(nn.Module):
    """``q * exp(t_h)`` per head ``h`` (q is batch, heads, time, head_dim)."""

    def __init__(self, n_heads: int, init: float) -> None:
        super().__init__()
        self.init = init
        self.log_t = nn.Parameter(torch.full((n_heads,), math.log(init)))

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return q * self.log_t.exp().to(q.dtype).view(-1, 1, 1)

    def modbench_init(self) -> None:
        nn.init.constant_(self.log_t, math.log(self.init))


@register
class HeadTemp(Method):
    name = "xp_headtemp"
    category = "attention"
    summary = "A learned temperature per attention head, scaling the queries."

    @dataclass
    class Options:
        init: float = 1.5

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        def q_norm(c: ModelConfig, layer: int) -> nn.Module:
            return HeadTemperature(c.n_heads, self.opts.init)

        spec.fill("attn.q_norm", q_norm, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return cfg.n_heads * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
'''

# (b) a package of three modules: methods.py imports its helpers relatively and absolutely,
# as modules and by name, on import and inside a method; layers.py imports rules.py
XP_LAB = {
    "__init__.py": '''\
"""A test plugin package: a ReZero-style gate on every residual branch."""

from . import methods  # noqa: F401  (registers xp_gate)
''',
    "rules.py": '''\
"""The gate's starting value."""


def gate_init(depth: int) -> float:
    return 0.5 if depth <= 4 else 0.1


OFFSET = 0.25
''',
    "layers.py": '''\
"""The gated residual merge."""

from __future__ import annotations

import torch
from torch import nn

from modbench.model.stream import StreamState
from xp_lab import rules


class ScalarGate(nn.Module):
    """``x + g * out`` with one learned scalar ``g`` per sublayer."""

    def __init__(self, init: float) -> None:
        super().__init__()
        self.init = init + rules.OFFSET
        self.gate = nn.Parameter(torch.tensor(self.init))

    def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
        return x + self.gate.to(out.dtype) * out

    def modbench_init(self) -> None:
        nn.init.constant_(self.gate, self.init)
''',
    "methods.py": '''\
"""The xp_gate method."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

import xp_lab.rules as rules
from modbench.config import ModelConfig
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec
from xp_lab.rules import gate_init

from . import layers
from .layers import ScalarGate


@register
class Gate(Method):
    name = "xp_gate"
    category = "residual"
    summary = "A learned scalar gate on every residual branch (ReZero-style)."

    @dataclass
    class Options:
        init: float | None = None

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        from .rules import gate_init as rule

        init = self.opts.init if self.opts.init is not None else rule(cfg.n_layers)
        assert init == gate_init(cfg.n_layers) == rules.gate_init(cfg.n_layers)
        assert layers.ScalarGate is ScalarGate

        def factory(c: ModelConfig, layer: int, sublayer: str) -> nn.Module:
            return ScalarGate(init)

        spec.fill("merge", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 2 * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
''',
}

# (c) a plugin whose module imports a package an export cannot carry
XP_NUMPY = HEADTEMP.replace("import math\n", "import math\n\nimport numpy as np\n").replace(
    '"xp_headtemp"', '"xp_numpy"').replace("class HeadTemp(", "class NumpyTemp(").replace(
    "math.log(init)", "float(np.log(init))")

@pytest.fixture(scope="module")
def plugin_refs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The three plugins, written to a temporary folder and loaded; unloaded afterwards."""
    folder = tmp_path_factory.mktemp("plugins").resolve()
    (folder / "xp_headtemp.py").write_text(HEADTEMP)
    (folder / "xp_numpy.py").write_text(XP_NUMPY)
    (folder / "xp_lab").mkdir()
    for name, text in XP_LAB.items():
        (folder / "xp_lab" / name).write_text(text)
    refs = {"xp_headtemp": str(folder / "xp_headtemp.py"), "xp_gate": str(folder / "xp_lab"),
            "xp_numpy": str(folder / "xp_numpy.py")}
    with plugins_restored(folder):
        plugins.load_plugins(list(refs.values()), export_env=False)
        yield refs
    assert not {"xp_headtemp", "xp_gate", "xp_numpy"} & set(REGISTRY)


def _trained(folder: Path, method: str) -> Path:
    run = folder / "run"
    train(tiny(method, 0, 4), run, progress=False)
    return run


BARE_SCRIPT = textwrap.dedent('''\
    import importlib, importlib.util, json, sys
    import torch
    for name in ("modbench", "xp_headtemp", "xp_lab"):
        assert importlib.util.find_spec(name) is None, name + " is importable"
    from transformers import AutoModelForCausalLM
    jobs = json.loads(sys.argv[1])
    out = {}
    for method, (path, plugin_file) in jobs.items():
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
        with torch.no_grad():
            logits = model(torch.load(path + "/../ids.pt")).logits
        package = type(model.model).__module__.rpartition(".")[0]
        registry = sys.modules[package + ".modbench_methods_base"].REGISTRY
        cls = registry[method]
        # the plugin's flat file executed again (register's plugin hook: a name registered
        # again by the same module is replaced, not refused)
        flat = sys.modules[package + "." + plugin_file]
        importlib.reload(flat)
        out[method] = {"logits": logits, "module": cls.__module__,
                       "again": registry[method] is not cls and
                                registry[method].__module__ == cls.__module__}
    out["modules"] = sorted(m for m in sys.modules
                            if m.split(".")[0] in ("modbench", "xp_headtemp", "xp_lab"))
    torch.save(out, sys.argv[2])
''')


def test_plugin_methods_export_and_load_without_modbench(plugin_refs: dict[str, str],
                                                         bare_python: Path,
                                                         tmp_path: Path) -> None:
    """(a) a one-file plugin and (b) a package plugin: trained, exported, and loaded where
    neither modbench nor the plugin can be imported; the logits are modbench's."""
    cases = {"xp_headtemp": "plugin_xp_headtemp", "xp_gate": "plugin_xp_lab_methods"}
    jobs, want = {}, {}
    gen = torch.Generator().manual_seed(11)
    for method, flat in cases.items():
        folder = tmp_path / method
        run = _trained(folder, method)
        out = export_hf(run, folder / "hf")
        _, model, _ = load_run(run)
        ids = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=gen)
        torch.save(ids, folder / "ids.pt")
        with torch.no_grad():
            want[method] = model(ids)
        jobs[method] = (str(out), flat)
    gate = dict(load_run(tmp_path / "xp_gate" / "run")[1].named_parameters())
    assert any(k.endswith(".gate") for k in gate)  # the plugin's merge is in the model

    hf = tmp_path / "xp_gate" / "hf"
    shipped = {p.name for p in hf.glob("plugin_*.py")}
    assert shipped == {"plugin_xp_lab_methods.py", "plugin_xp_lab_layers.py",
                       "plugin_xp_lab_rules.py"}  # no __init__.py
    methods_py = (hf / "plugin_xp_lab_methods.py").read_text().splitlines()
    source = XP_LAB["methods.py"].splitlines()
    assert len(methods_py) == len(source) + 1  # the header comment, then line for line
    assert methods_py[0].startswith("# xp_lab.methods (methods.py, sha256 ")
    assert "import xp_lab" not in "\n".join(methods_py) and "modbench." not in "\n".join(
        methods_py[1:])
    assert "from .plugin_xp_lab_layers import ScalarGate" in methods_py
    assert ("from .plugin_xp_lab_layers import __name__ as layers; "
            "from . import plugin_xp_lab_layers as layers") in methods_py
    assert "        from .plugin_xp_lab_rules import gate_init as rule" in methods_py
    assert "from .modbench_methods_base import Method, register" in (
        tmp_path / "xp_headtemp" / "hf" / "plugin_xp_headtemp.py").read_text()

    # transformers' own resolver reaches exactly the shipped files, and its import scan
    # finds nothing outside torch, transformers, yaml and the standard library
    from transformers.dynamic_module_utils import get_imports, get_relative_import_files

    reached = {Path(f).name for f in get_relative_import_files(str(hf / "modeling_modbench.py"))}
    assert reached == {p.name for p in hf.glob("*.py")} - {"modeling_modbench.py"}
    for f in hf.glob("*.py"):
        outside = set(get_imports(str(f))) - set(sys.stdlib_module_names)
        assert outside <= {"torch", "transformers", "yaml"}, (f.name, outside)

    home = tmp_path / "home"
    work = tmp_path / "work"  # not the plugins' folder: nothing importable from the cwd
    work.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "HF_HOME": str(home / "hf"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    res = subprocess.run([str(bare_python), "-c", BARE_SCRIPT, json.dumps(jobs),
                          str(tmp_path / "out.pt")], cwd=work, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["modules"] == []
    for method, flat in cases.items():
        r = got[method]
        assert r["module"].startswith("transformers_modules.") and r["module"].endswith(flat)
        assert r["again"]
        torch.testing.assert_close(r["logits"], want[method], rtol=0, atol=1e-6)


def test_export_records_each_methods_origin(plugin_refs: dict[str, str],
                                            tmp_path: Path) -> None:
    """config.json and the model card name each method's origin: built in, or the plugin,
    its module and the sha256 of its code (as the run recorded it)."""
    run, _ = make_run(tmp_path / "run", "qknorm+xp_gate")
    out = export_hf(run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert [m["name"] for m in config["modbench_methods"]] == ["qknorm", "xp_gate"]
    origins = config["modbench_method_origins"]
    assert origins["qknorm"] == {"origin": "builtin"}
    rec = origins["xp_gate"]
    assert rec == plugins.origin("xp_gate")
    assert rec["origin"] == "plugin" and rec["module"] == "xp_lab.methods"
    assert rec["plugin"] == plugin_refs["xp_gate"]
    assert set(rec["files"]) == {"xp_lab/__init__.py", "xp_lab/methods.py",
                                 "xp_lab/layers.py", "xp_lab/rules.py"}
    assert rec["sha256"] == plugins.combined_hash(rec["files"])
    card = (out / "README.md").read_text()
    assert "origin: built into modbench" in card
    assert f"methods plugin `{plugin_refs['xp_gate']}`, module `xp_lab.methods`" in card
    assert f"code sha256 `{rec['sha256']}`" in card and "(`plugin_*.py`)" in card
    head = yaml.safe_load(card.split("---")[1])
    assert "xp_gate" in head["tags"]


def test_plugin_importing_another_package_is_refused(plugin_refs: dict[str, str],
                                                     tmp_path: Path) -> None:
    """(c) ``import numpy`` in the plugin: refused in one line that names the import, the
    plugin's file and the line, before anything is written."""
    run, _ = make_run(tmp_path / "run", "xp_numpy")
    with pytest.raises(ModbenchError) as info:
        export_hf(run, tmp_path / "hf")
    msg = str(info.value)
    line = XP_NUMPY.splitlines().index("import numpy as np") + 1
    assert f"imports numpy ({plugin_refs['xp_numpy']} line {line}, module xp_numpy)" in msg
    assert "standard library, torch and PyYAML" in msg and "\n" not in msg
    assert not (tmp_path / "hf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize(("source", "message"), [
    ("import xp_lab.rules\n", "`import xp_lab.rules` binds the package xp_lab"),
    ("import xp_lab\n", "imports package xp_lab, whose __init__.py"),
    ("from . import methods, nothing_here\n",
     "imports from package xp_lab the name nothing_here, which its __init__.py defines"),
    ("from .. import x\n", "imports .. beyond its top-level package"),
    ("from modbench.methods import REGISTRY\n",
     "imports from package modbench.methods the name REGISTRY"),
])
def test_plugin_import_forms_that_cannot_travel_are_refused(plugin_refs: dict[str, str],
                                                             source: str, message: str,
                                                             tmp_path: Path) -> None:
    """Each refused form names the plugin module, its file, the line and what to write."""
    with pytest.raises(ModbenchError) as info:
        src = hf_bundle._Source("xp_lab.extra", tmp_path / "extra.py", "\n" + source)
        for imp in src.imports:
            hf_bundle._resolve(src, imp)
    msg = str(info.value)
    assert message in msg, msg
    assert f"plugin module xp_lab.extra ({tmp_path / 'extra.py'})" in msg and "line 2" in msg


def test_plugin_import_forms_that_travel(plugin_refs: dict[str, str], tmp_path: Path) -> None:
    """Modules of the plugin's package, relative or absolute, bound or by name; a name a
    package's ``__init__`` takes from one of its modules; ``TYPE_CHECKING`` imports."""
    text = textwrap.dedent('''\
        from typing import TYPE_CHECKING
        from . import rules as r, layers
        from xp_lab import rules
        from modbench.methods import Method, register
        from xp_lab.layers import (
            ScalarGate,
        )
        if TYPE_CHECKING:
            from xp_lab.nowhere import Thing
    ''')
    src = hf_bundle._Source("xp_lab.extra", tmp_path / "extra.py", text)
    bundled = {"xp_lab.rules", "xp_lab.layers", "modbench.methods.base"}
    new = hf_bundle._rewrite(src, bundled).splitlines()
    assert len(new) == len(text.splitlines())
    assert new[1] == ("from .plugin_xp_lab_rules import __name__ as r; from . import "
                      "plugin_xp_lab_rules as r; from .plugin_xp_lab_layers import __name__ "
                      "as layers; from . import plugin_xp_lab_layers as layers")
    assert new[2] == ("from .plugin_xp_lab_rules import __name__ as rules; from . import "
                      "plugin_xp_lab_rules as rules")
    assert new[3] == "from .modbench_methods_base import Method, register"
    assert new[4:7] == ["from .plugin_xp_lab_layers import (", "    ScalarGate,", ")"]
    assert new[8] == "    pass"
