"""The modbench source an exported model needs, bundled into the export as flat files that
import only the Python standard library, torch, PyYAML and each other.

``modbench export --hf`` writes these files next to ``modeling_modbench.py``, so the export
loads with ``trust_remote_code=True`` where modbench is not installed (a checkpoint on the
Hugging Face Hub, say). :func:`bundle` starts from the modules the remote code imports
(:data:`ENTRY_MODULES`) and the modules of the exported model's methods, follows every
``modbench`` import that runs when a module is imported, and copies each module's source
verbatim except for those imports, which become relative imports of flat sibling files::

    from modbench.model.spec import ModelSpec   ->   from .modbench_model_spec import ModelSpec

That is the form transformers' remote-code loader understands: it copies along, recursively,
every file named by a ``from .name import ...`` line. An import of a modbench module that
runs only inside a function (``load_all``'s walk over the methods package, say) and whose
module is not bundled becomes ``raise ImportError(...)``: the model never calls it; one under
``if TYPE_CHECKING:`` becomes ``pass``.

PyYAML is allowed because transformers itself requires it (``modbench.config`` reads YAML);
anything else outside the standard library and torch is refused, naming the module and line,
as is an import form this rewrite cannot express (``import modbench.x as y``,
``from modbench.x import submodule``). Package ``__init__`` modules are not bundled (nothing
the model needs runs in them).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

from modbench.errors import ModbenchError

ROOT = "modbench"

#: What ``hf_remote/modeling_modbench.py`` imports from the bundle (the model config, the
#: planner that fills the model's slots, the decoder, RoPE); the methods' modules are added
#: per export.
ENTRY_MODULES = ("modbench.config", "modbench.methods.build", "modbench.model.rope",
                 "modbench.model.transformer")

#: Third-party packages bundled code may import: torch, and PyYAML, which transformers
#: requires, so it is there wherever transformers is.
ALLOWED_PACKAGES = frozenset({"torch", "yaml"})

#: The generated file that imports the exported model's method classes by name.
METHODS_MODULE = "modbench_exported_methods"

_LOAD, _CALL, _NEVER = "load", "call", "never"  # when an import statement runs


def flat_name(module: str) -> str:
    """The bundled file's module name: ``modbench.model.spec`` -> ``modbench_model_spec``."""
    return module.replace(".", "_")


class _Import:
    """One ``modbench`` import statement of a module: its node, the absolute module it
    imports, and when it runs (on import, inside a function, never)."""

    def __init__(self, node: ast.Import | ast.ImportFrom, target: str, when: str) -> None:
        self.node, self.target, self.when = node, target, when


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _unsupported(module: str, node: ast.stmt, what: str) -> ModbenchError:
    return ModbenchError(
        f"cannot bundle {module} into a self-contained export: line {node.lineno} {what}; "
        f"write `from modbench.x.y import name` there (see docs/export.md)")


def _modbench_imports(module: str, tree: ast.Module, is_package: bool) -> list[_Import]:
    """The statements of ``tree`` (the source of ``module``) that import modbench modules."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[_Import] = []

    def record(node: ast.Import | ast.ImportFrom, when: str) -> None:
        if isinstance(node, ast.ImportFrom):
            name = "." * node.level + (node.module or "")
            target = importlib.util.resolve_name(name, package) if node.level else name
            if target.split(".")[0] != ROOT:
                return
            if node.module is None or target == ROOT:
                raise _unsupported(module, node, f"imports names from package {target}")
            found.append(_Import(node, target, when))
            return
        ours = [a.name for a in node.names if a.name.split(".")[0] == ROOT]
        if ours:
            if len(node.names) != 1:
                raise _unsupported(module, node, "imports several modules in one statement")
            found.append(_Import(node, ours[0], when))

    def walk(node: ast.AST, when: str) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            record(node, when)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                walk(stmt, _NEVER)
            for stmt in node.orelse:
                walk(stmt, when)
        else:
            inner = _CALL if when == _LOAD and isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) else when
            for child in ast.iter_child_nodes(node):
                walk(child, inner)

    walk(tree, _LOAD)
    return found


def _is_package(module: str) -> bool:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.submodule_search_locations is not None


class _Source:
    """A module's source text and its modbench imports."""

    def __init__(self, module: str, path: Path, text: str, is_package: bool = False) -> None:
        self.module, self.path, self.text = module, path, text
        self.imports = _modbench_imports(module, ast.parse(text, str(path)), is_package)

    @classmethod
    def of(cls, module: str) -> _Source:
        path = _find_source(module)
        return cls(module, path, path.read_text(encoding="utf-8"), _is_package(module))


def _find_source(module: str) -> Path:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ModbenchError(f"cannot bundle {module} into the export: no Python source file "
                            "found for it; export from a source install of modbench")
    return Path(spec.origin)


def _closure(entries: list[str]) -> dict[str, _Source]:
    """Every module reachable from ``entries`` through imports that run on import."""
    found: dict[str, _Source] = {}
    todo = list(entries)
    while todo:
        module = todo.pop()
        if module in found:
            continue
        found[module] = src = _Source.of(module)
        for imp in src.imports:
            if imp.when != _LOAD:
                continue
            if _is_package(imp.target):  # its __init__ is not bundled
                raise _unsupported(module, imp.node, f"imports from package {imp.target}")
            todo.append(imp.target)
    return found


def _rewrite(src: _Source, bundled: set[str]) -> str:
    """``src``'s text with its modbench imports made relative (bundled targets), ``pass``
    (type-checking only) or ``raise ImportError`` (run inside a function, not bundled).
    Every other byte is kept, and so are line numbers."""
    data = src.text.encode("utf-8")
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    edits: list[tuple[int, int, bytes]] = []
    for imp in src.imports:
        node = imp.node
        assert node.end_lineno is not None and node.end_col_offset is not None
        begin = starts[node.lineno - 1] + node.col_offset  # ast offsets are UTF-8 bytes
        end = starts[node.end_lineno - 1] + node.end_col_offset
        old = data[begin:end].decode("utf-8")
        if imp.target in bundled:
            if isinstance(node, ast.Import):
                raise _unsupported(src.module, node, f"imports module {imp.target} as a whole")
            new, n = re.subn(r"\Afrom\s+[.\w]+", f"from .{flat_name(imp.target)}", old)
            if n != 1:
                raise _unsupported(src.module, node, "has an import this rewrite cannot read")
        elif imp.when == _NEVER:
            new = "pass"
        elif imp.when == _CALL:
            msg = f"{imp.target} is not part of this exported model; install modbench to use it"
            new = f"raise ImportError({msg!r})"
        else:  # pragma: no cover - every import that runs on import is bundled
            raise AssertionError(imp.target)
        new += "\n" * (old.count("\n") - new.count("\n"))
        edits.append((begin, end, new.encode("utf-8")))
    for begin, end, new_bytes in sorted(edits, reverse=True):
        data = data[:begin] + new_bytes + data[end:]
    return data.decode("utf-8")


def _check(name: str, text: str, files: set[str]) -> None:
    """Refuse a bundled file that imports anything but the standard library, torch, PyYAML
    and other files of the bundle."""
    for node in ast.walk(ast.parse(text, name)):
        if isinstance(node, ast.Import):
            tops = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops = [node.module.split(".")[0]]
        elif isinstance(node, ast.ImportFrom):
            if node.level != 1 or not node.module or f"{node.module}.py" not in files:
                raise ModbenchError(f"cannot export: {name} line {node.lineno} imports "
                                    f"{'.' * node.level}{node.module or ''}, which is not "
                                    "in the bundle")
            continue
        else:
            continue
        for top in tops:
            if top not in sys.stdlib_module_names and top not in ALLOWED_PACKAGES:
                raise ModbenchError(
                    f"cannot export: the model's code imports {top} ({name} line "
                    f"{node.lineno}); a self-contained export may import only torch, yaml "
                    "and the standard library, so keep that import out of modbench's model "
                    "and method modules (or inside a function)")


def _methods_file(method_classes: list[type]) -> str:
    lines = ['"""The method classes of this exported model, by name (written by '
             '`modbench export`)."""', "", "from __future__ import annotations", ""]
    entries = []
    for cls in sorted(set(method_classes), key=lambda c: (c.__module__, c.__name__)):
        module = sys.modules.get(cls.__module__)
        if module is None or getattr(module, cls.__name__, None) is not cls:
            raise ModbenchError(f"cannot export method class {cls.__qualname__}: it is not a "
                                f"top-level name of {cls.__module__}")
        lines.append(f"from .{flat_name(cls.__module__)} import {cls.__name__}")
        entries.append(f"    {getattr(cls, 'name', cls.__name__)!r}: {cls.__name__},")
    lines += ["", "METHOD_CLASSES: dict[str, type] = {", *entries, "}", ""]
    return "\n".join(lines)


def bundle(method_classes: list[type], header: str = "") -> dict[str, str]:
    """The files (name -> text) an export needs besides ``hf_remote``'s two: the bundled
    modbench modules and :data:`METHODS_MODULE`, which imports ``method_classes`` (the
    exported model's methods) and maps their names to them. ``header`` (a comment) heads
    every bundled module."""
    entries = [*ENTRY_MODULES, *(c.__module__ for c in method_classes)]
    found = _closure(entries)
    names: dict[str, str] = {}
    for module in sorted(found):
        flat = flat_name(module)
        if flat in names.values() or flat == METHODS_MODULE:
            raise ModbenchError(f"cannot export: two modules bundle to the same file {flat}.py")
        names[module] = flat
    files: dict[str, str] = {}
    for module, src in sorted(found.items()):
        note = f"# {module} ({src.path.name}), {header}\n" if header else ""
        files[f"{names[module]}.py"] = note + _rewrite(src, set(found))
    files[f"{METHODS_MODULE}.py"] = _methods_file(method_classes)
    for name, text in files.items():
        _check(name, text, set(files))
    return files
