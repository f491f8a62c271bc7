"""No import cycle between modbench's modules, counting the imports inside functions.

import-linter's layers contract (pyproject.toml) sees only which packages import which; a loop
between two modules of one package, closed by an import inside a function (``from
modbench.report.build import Block`` in a function of ``report/diagnostics.py``), passes it and
hides that neither module can be read without the other. This test parses every module under
``src/modbench`` with :mod:`ast`, collects every import of a modbench module wherever it stands
(module level, functions, ``if TYPE_CHECKING:``), and also ``importlib.import_module`` with a
literal name, resolves relative imports and ``from pkg import name`` where ``name`` is a
submodule, and fails listing each strongly connected component of more than one module.
(Names built at run time, such as the method registry's ``f"modbench.methods.{name}"``, are
not followed: they are plugin loading, not a dependency of the code that loads them. A module's
import of its own parent package, as ``methods/base.py`` reads ``modbench.methods.__path__``,
is no edge either: Python has imported every parent package before the module itself.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import modbench

SRC = Path(modbench.__file__).resolve().parent


def _module_names(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``: dotted name -> file."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The deepest known module that ``name`` is, or is inside (``pkg.mod.Attr`` -> pkg.mod)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``module`` (at ``path``) imports, anywhere in its body."""
    root = module.split(".")[0]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from pkg import sub`` imports the submodule pkg.sub where there is one
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
              and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
              == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for target in targets:
            if target.split(".")[0] != root:
                continue
            resolved = _resolve(target, known)
            if resolved is not None and not (module + ".").startswith(resolved + "."):
                found.add(resolved)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """The module graph of the package at ``root``: module -> the modules it imports."""
    known = _module_names(root)
    return {name: _imports(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "; ".join(edges)


def test_no_import_cycle_in_modbench() -> None:
    graph = import_graph(SRC)
    assert len(graph) > 100, "the walk found too few modules: is SRC the package folder?"
    loops = cycles(graph)
    assert not loops, "import cycles (each an SCC, its edges):\n" + "\n".join(
        f"  {' <-> '.join(c)}: {_describe(c, graph)}" for c in loops)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "toy"


def test_finds_a_loop_closed_inside_a_function(tmp_path: Path) -> None:
    toy = _write(tmp_path, {
        "toy/__init__.py": "",
        "toy/report/__init__.py": "",
        "toy/report/build.py": "from toy.report.diag import study\n",
        "toy/report/diag.py": "def study():\n    from .build import Block\n    return Block\n",
        "toy/other.py": "import toy.report.build\n",
    })
    graph = import_graph(toy)
    assert graph["toy.report.diag"] == {"toy.report.build"}
    assert cycles(graph) == [["toy.report.build", "toy.report.diag"]]


def test_resolves_submodules_relative_imports_and_import_module(tmp_path: Path) -> None:
    toy = _write(tmp_path, {
        "toy/__init__.py": "",
        "toy/a/__init__.py": "from . import b\n",
        "toy/a/b.py": "import importlib\n\n\ndef f():\n"
                      "    return importlib.import_module('toy.c').X\n",
        "toy/c.py": "from toy.a import b as _b\nX = 1\n",
        "toy/d.py": "from toy.c import X\nfrom ..outside import nothing\n",
    })
    graph = import_graph(toy)
    assert graph["toy.a"] == {"toy.a.b"}
    assert graph["toy.a.b"] == {"toy.c"}
    assert graph["toy.c"] == {"toy.a.b"}
    assert graph["toy.d"] == {"toy.c"}
    assert cycles(graph) == [["toy.a.b", "toy.c"]]


def test_a_chain_is_not_a_cycle(tmp_path: Path) -> None:
    toy = _write(tmp_path, {
        "toy/__init__.py": "def __getattr__(name):\n    from toy.a import f\n    return f\n",
        "toy/a.py": "from toy import b\n",
        "toy/b.py": "def f():\n    from toy.c import g\n    return g\n",
        "toy/c.py": "import toy\n\ng = toy.__name__\n",  # its own parent: no edge
    })
    graph = import_graph(toy)
    assert graph["toy"] == {"toy.a"} and graph["toy.c"] == set()
    assert cycles(graph) == []
