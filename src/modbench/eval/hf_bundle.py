"""The modbench source an exported model needs, and the code of the methods plugins it uses,
bundled into the export as flat files that import only the Python standard library, torch,
PyYAML and each other.

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

A submodule imported by name from its package (``from modbench.methods import plugins``)
is bound to its flat file, and a name a package's ``__init__`` takes from one of its modules
(``from modbench.methods import register``) is imported from that module's flat file.

A method from outside modbench (a plugin, :mod:`modbench.methods.plugins`) travels the same
way: its module, and every module of its own top-level package that it imports (on import or
inside a function: a method's forward may import its helpers late), become ``plugin_*.py``
files (``mylab.methods`` -> ``plugin_mylab_methods.py``), their imports of their own package
(absolute or relative, ``from . import layers`` and ``import mylab.layers as layers`` too)
and of modbench pointed at the flat files.

PyYAML is allowed because transformers itself requires it (``modbench.config`` reads YAML);
anything else outside the standard library and torch is refused, naming the module, its file
and the line, as is an import form this rewrite cannot express (``import modbench.x as y``,
``from modbench import x``, ``import mylab.layers`` without ``as``, a name a package's
``__init__`` defines itself). Package ``__init__`` modules are not bundled (nothing the model
needs runs in them).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import re
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

from modbench.errors import ModbenchError

ROOT = "modbench"

#: What ``hf_remote/modeling_modbench.py`` imports from the bundle (the model config,
#: the planner that fills the model's slots, the decoder, RoPE), and
#: ``modbench.methods.plugins``, whose hooks ``register`` calls (whether a name may be
#: registered again, as when a plugin's flat file is executed a second time; an outside
#: class's origin), bundled even where only a function imports it; the methods' modules are
#: added per export.
ENTRY_MODULES = ("modbench.config", "modbench.methods.build", "modbench.methods.plugins",
                 "modbench.model.rope", "modbench.model.transformer")

#: Third-party packages bundled code may import: torch, and PyYAML, which transformers
#: requires, so it is there wherever transformers is.
ALLOWED_PACKAGES = frozenset({"torch", "yaml"})

#: The generated file that imports the exported model's method classes by name.
METHODS_MODULE = "modbench_exported_methods"

#: The prefix of a plugin module's flat file; modbench's own start with ``modbench_``.
PLUGIN_PREFIX = "plugin_"

_LOAD, _CALL, _NEVER = "load", "call", "never"  # when an import statement runs


def flat_name(module: str) -> str:
    """The bundled file's module name: ``modbench.model.spec`` -> ``modbench_model_spec``, a
    plugin's ``mylab.methods`` -> ``plugin_mylab_methods``."""
    flat = module.replace(".", "_")
    return flat if _top(module) == ROOT else PLUGIN_PREFIX + flat


def _top(module: str) -> str:
    return module.split(".")[0]


def _is_plugin(module: str) -> bool:
    return _top(module) != ROOT


#: one piece of a rewritten import: ``(kind, module, text)``: ``prefix`` (the statement's
#: ``from X`` pointed at X's flat file), ``names`` (``from .flat import text``), ``bind``
#: (the module bound to the name ``text``), ``whole`` (``import modbench.x``: refused)
_Part = tuple[str, str, str]


class _Import:
    """One import statement of a module that imports modbench or (in a plugin's module) the
    plugin's own package: its node, the absolute module it names, when it runs (on import,
    inside a function, never), and whether it imports the plugin's own package (followed
    inside functions too). ``parts``: how it is rewritten, once resolved."""

    def __init__(self, node: ast.Import | ast.ImportFrom, target: str, when: str) -> None:
        self.node, self.target, self.when = node, target, when
        self.own = _is_plugin(target)
        self.parts: list[_Part] | None = None

    @property
    def followed(self) -> bool:
        """Whether the bundle must carry what it imports: it runs on import, or it imports
        the plugin's own code inside a function."""
        return self.when == _LOAD or (self.when == _CALL and self.own)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _describe(module: str, path: Path | None) -> str:
    if not _is_plugin(module):
        return module
    return f"plugin module {module}" + (f" ({path})" if path is not None else "")


def _unsupported(module: str, node: ast.stmt, what: str, path: Path | None = None,
                 fix: str | None = None) -> ModbenchError:
    if fix is None:
        fix = ("write `from modbench.x.y import name` there" if not _is_plugin(module) else
               "write `from .module import name` or `from package.module import name` there")
    return ModbenchError(
        f"cannot bundle {_describe(module, path)} into a self-contained export: line "
        f"{node.lineno} {what}; {fix} (see docs/export.md)")


def _roots(module: str) -> frozenset[str]:
    """The top-level packages whose imports are followed from ``module``: modbench, and a
    plugin module's own package."""
    return frozenset({ROOT, _top(module)})


def _own_imports(module: str, tree: ast.Module, is_package: bool,
                 path: Path | None = None) -> list[_Import]:
    """The statements of ``tree`` (the source of ``module``) that import modbench modules or
    modules of ``module``'s own top-level package."""
    package = module if is_package else module.rpartition(".")[0]
    roots = _roots(module)
    found: list[_Import] = []

    def record(node: ast.Import | ast.ImportFrom, when: str) -> None:
        if isinstance(node, ast.ImportFrom):
            name = "." * node.level + (node.module or "")
            try:
                target = importlib.util.resolve_name(name, package) if node.level else name
            except ImportError:
                raise _unsupported(module, node, f"imports {name} beyond its top-level "
                                   "package", path) from None
            if _top(target) not in roots:
                return
            if _top(target) == ROOT and (node.module is None or target == ROOT):
                raise _unsupported(module, node, f"imports names from package {target}", path)
            found.append(_Import(node, target, when))
            return
        ours = [a.name for a in node.names if _top(a.name) in roots]
        if ours:
            if len(node.names) != 1:
                raise _unsupported(module, node, "imports several modules in one statement",
                                   path, fix="import one module per statement")
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


def _spec(module: str) -> ModuleSpec | None:
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _is_package(module: str) -> bool:
    spec = _spec(module)
    return spec is not None and spec.submodule_search_locations is not None


class _Source:
    """A module's source text and its imports of modbench and of its own package."""

    def __init__(self, module: str, path: Path, text: str, is_package: bool = False) -> None:
        self.module, self.path, self.text = module, path, text
        self.imports = _own_imports(module, ast.parse(text, str(path)), is_package, path)

    @classmethod
    def of(cls, module: str) -> _Source:
        path = _find_source(module)
        return cls(module, path, path.read_text(encoding="utf-8"), _is_package(module))


def _find_source(module: str) -> Path:
    spec = _spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        where = ("export from a source install of modbench" if not _is_plugin(module) else
                 "a plugin's methods must be defined in a .py file (not an interactive "
                 "session or a compiled module) to be exported")
        raise ModbenchError(f"cannot bundle {module} into the export: no Python source file "
                            f"found for it; {where}")
    return Path(spec.origin)


def _defining_module(package: str, name: str) -> str | None:
    """The module that defines ``package.name`` (a class or function its ``__init__``
    imports from one of its modules), or None."""
    try:
        obj = getattr(importlib.import_module(package), name)
    except Exception:  # any failure means: not resolvable
        return None
    home = getattr(obj, "__module__", None)
    if not isinstance(home, str) or home == package or _is_package(home):
        return None
    return home if getattr(sys.modules.get(home), name, None) is obj else None


def _resolve(src: _Source, imp: _Import) -> list[_Part]:
    """How ``imp`` is rewritten: the modules it needs and the form of each; refuses a form
    the flat files cannot express."""
    node, target = imp.node, imp.target

    def refuse(what: str, fix: str | None = None) -> ModbenchError:
        return _unsupported(src.module, node, what, src.path, fix)

    if isinstance(node, ast.Import):
        if _is_package(target):
            raise refuse(f"imports package {target}, whose __init__.py an export does not "
                         "carry", f"import the module that defines what you need (`from "
                         f"{target}.module import name`)")
        if not imp.own:
            return [("whole", target, "")]
        asname = node.names[0].asname
        if asname is None:
            short = target.rpartition(".")[2]
            raise refuse(f"`import {target}` binds the package {_top(target)}, whose "
                         "__init__.py an export does not carry",
                         f"write `import {target} as {short}` or `from {target} import name`")
        return [("bind", target, asname)]
    if not _is_package(target):
        return [("prefix", target, "")]
    parts: list[_Part] = []
    names: dict[str, list[str]] = {}
    for alias in node.names:
        if alias.name == "*":
            raise refuse(f"imports * from package {target}",
                         "import the names from the modules that define them")
        sub = f"{target}.{alias.name}"
        if _spec(sub) is not None:  # a submodule
            if _is_package(sub):
                raise refuse(f"imports package {sub}, whose __init__.py an export does not "
                             "carry", f"import its modules (`from {sub}.module import name`)")
            parts.append(("bind", sub, alias.asname or alias.name))
            continue
        home = _defining_module(target, alias.name)
        if home is None or _top(home) not in _roots(src.module):
            raise refuse(f"imports from package {target} the name {alias.name}, which its "
                         "__init__.py defines and an export does not carry",
                         "import it from the module that defines it")
        names.setdefault(home, []).append(
            alias.name if alias.asname is None else f"{alias.name} as {alias.asname}")
    parts += [("names", home, ", ".join(n)) for home, n in names.items()]
    return parts


def _closure(entries: list[str]) -> dict[str, _Source]:
    """Every module reachable from ``entries`` through the imports the bundle follows (those
    that run on import, and a plugin's imports of its own package wherever they are)."""
    found: dict[str, _Source] = {}
    todo = list(entries)
    while todo:
        module = todo.pop()
        if module in found:
            continue
        found[module] = src = _Source.of(module)
        for imp in src.imports:
            if not imp.followed:
                continue
            imp.parts = _resolve(src, imp)
            todo += [target for _, target, _ in imp.parts]
    return found


_FROM = re.compile(r"\Afrom[\s\\]*[.\w\s\\]*?(?=\bimport\b)")


def _render(src: _Source, imp: _Import, old: str, parts: list[_Part]) -> str:
    """The statement ``old`` rewritten to import the flat files of ``parts``."""
    if len(parts) == 1 and parts[0][0] == "prefix":
        m = _FROM.match(old)
        if m is None:
            raise _unsupported(src.module, imp.node, "has an import this rewrite cannot read",
                               src.path)
        return f"from .{flat_name(parts[0][1])} " + old[m.end():]
    out = []
    for kind, module, text in parts:
        flat = flat_name(module)
        if kind == "whole":
            raise _unsupported(src.module, imp.node, f"imports module {module} as a whole",
                               src.path)
        if kind == "bind":
            # the first statement is what transformers follows to copy the file along (it
            # reads `from .name import` lines); the second binds the module to the name
            out.append(f"from .{flat} import __name__ as {text}; from . import {flat} as {text}")
        else:
            out.append(f"from .{flat} import {text}")
    return "; ".join(out)


def _rewrite(src: _Source, bundled: set[str]) -> str:
    """``src``'s text with its imports of modbench and of its own package made relative
    (bundled targets), ``pass`` (type-checking only) or ``raise ImportError`` (run inside a
    function, not bundled). Every other byte is kept, and so are line numbers."""
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
        parts = imp.parts
        if parts is None:
            try:
                parts = _resolve(src, imp)
            except ModbenchError:
                if imp.followed:
                    raise
        if parts is not None and all(target in bundled for _, target, _ in parts):
            new = _render(src, imp, old, parts)
        elif imp.when == _NEVER:
            new = "pass"
        elif imp.when == _CALL and not imp.own:
            msg = f"{imp.target} is not part of this exported model; install modbench to use it"
            new = f"raise ImportError({msg!r})"
        else:  # pragma: no cover - every followed import is bundled
            raise AssertionError(imp.target)
        new += "\n" * (old.count("\n") - new.count("\n"))
        edits.append((begin, end, new.encode("utf-8")))
    for begin, end, new_bytes in sorted(edits, reverse=True):
        data = data[:begin] + new_bytes + data[end:]
    return data.decode("utf-8")


def _check(name: str, text: str, files: set[str], source: Path | None = None,
           module: str | None = None) -> None:
    """Refuse a bundled file that imports anything but the standard library, torch, PyYAML
    and other files of the bundle. ``source`` and ``module``: the file it was made from and
    its module, named in the message instead of ``name`` (line numbers are the source's)."""

    def at(lineno: int) -> str:
        return f"{source or name} line {lineno}" + (f", module {module}" if module else "")

    for node in ast.walk(ast.parse(text, name)):
        if isinstance(node, ast.Import):
            tops = [_top(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops = [_top(node.module)]
        elif isinstance(node, ast.ImportFrom):
            wanted = [node.module] if node.module else [a.name for a in node.names]
            if node.level != 1 or any(f"{w}.py" not in files for w in wanted):
                raise ModbenchError(f"cannot export: {at(node.lineno)} imports "
                                    f"{'.' * node.level}{node.module or ''}, which is not "
                                    "in the bundle")
            continue
        else:
            continue
        for top in tops:
            if top not in sys.stdlib_module_names and top not in ALLOWED_PACKAGES:
                raise ModbenchError(
                    f"cannot export: the model's code imports {top} ({at(node.lineno)}), "
                    "which may not be installed where the export loads: an export carries "
                    "modbench's modules and a plugin's own package, and may import nothing "
                    "else but the standard library, torch and PyYAML, anywhere in a file "
                    "(transformers refuses remote code that imports a missing package even "
                    "inside a function); remove that import from the model's modules")


def _methods_file(method_classes: list[type]) -> str:
    lines = ['"""The method classes of this exported model, by name (written by '
             '`modbench export`)."""', "", "from __future__ import annotations", ""]
    entries = []
    used: set[str] = set()
    for cls in sorted(set(method_classes), key=lambda c: (c.__module__, c.__name__)):
        module = sys.modules.get(cls.__module__)
        if module is None or getattr(module, cls.__name__, None) is not cls:
            raise ModbenchError(f"cannot export method class {cls.__qualname__}: it is not a "
                                f"top-level name of {cls.__module__}")
        local, n = cls.__name__, 1
        while local in used or local == "METHOD_CLASSES":  # two modules' classes of one name
            local, n = f"{cls.__name__}_{n}", n + 1
        used.add(local)
        alias = "" if local == cls.__name__ else f" as {local}"
        lines.append(f"from .{flat_name(cls.__module__)} import {cls.__name__}{alias}")
        entries.append(f"    {getattr(cls, 'name', cls.__name__)!r}: {local},")
    lines += ["", "METHOD_CLASSES: dict[str, type] = {", *entries, "}", ""]
    return "\n".join(lines)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bundle(method_classes: list[type], header: str = "") -> dict[str, str]:
    """The files (name -> text) an export needs besides ``hf_remote``'s two: the bundled
    modbench modules, the modules of the methods plugins the model uses (``plugin_*.py``)
    and :data:`METHODS_MODULE`, which imports ``method_classes`` (the exported model's
    methods) and maps their names to them. ``header`` (a comment) heads every bundled
    modbench module; a plugin's module is headed by its module, file and sha256."""
    entries = [*ENTRY_MODULES, *(c.__module__ for c in method_classes)]
    found = _closure(entries)
    names: dict[str, str] = {}
    for module in sorted(found):
        flat = flat_name(module)
        if flat == METHODS_MODULE:
            raise ModbenchError(f"cannot export: module {module} would bundle to the file "
                                f"{flat}.py, which the export writes itself; rename it")
        clash = [m for m, f in names.items() if f == flat]
        if clash:
            raise ModbenchError(f"cannot export: modules {clash[0]} and {module} bundle to "
                                f"the same file {flat}.py; rename one of them")
        names[module] = flat
    files: dict[str, str] = {}
    for module, src in sorted(found.items()):
        text = _rewrite(src, set(found))
        files[f"{names[module]}.py"] = text
    files[f"{METHODS_MODULE}.py"] = _methods_file(method_classes)
    for module, src in found.items():
        _check(f"{names[module]}.py", files[f"{names[module]}.py"], set(files), src.path,
               module)
    _check(f"{METHODS_MODULE}.py", files[f"{METHODS_MODULE}.py"], set(files))
    if header:
        for module, src in found.items():
            if _is_plugin(module):
                note = (f"# {module} ({src.path.name}, sha256 {_sha256(src.path)}), a "
                        "methods plugin's module bundled by `modbench export`, its imports of "
                        f"{_top(module)} and modbench pointed at this folder's files\n")
            else:
                note = f"# {module} ({src.path.name}), {header}\n"
            files[f"{names[module]}.py"] = note + files[f"{names[module]}.py"]
    return files
