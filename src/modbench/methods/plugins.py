"""Methods from outside the package: plugins, where each method came from, and its code's hash.

A *plugin* is Python code that registers methods with :func:`modbench.methods.base.register`
and lives outside ``modbench.methods``. It is imported only when named:

- ``--methods-from REF`` on a command (repeatable), or ``MODBENCH_METHODS_FROM`` (refs joined by
  ``os.pathsep``), or a study spec's ``methods_from`` list (relative to the spec's file);
- an installed package that declares the entry-point group ``modbench.methods``
  (``[project.entry-points."modbench.methods"] mylab = "mylab.methods"``), which the user chose
  to install.

A ref is a ``.py`` file (imported as a module named after the file), a package folder (one
holding ``__init__.py``, imported as a package named after the folder, its submodules with it),
or the dotted name of an importable module. Nothing is ever imported from the current
directory implicitly: no ``sys.path`` entry is added.

Every method has an *origin* (:func:`origin`): ``{"origin": "builtin"}`` for the catalogue's,
and for any other the plugin that loaded it, its module, the source files that module pulls in
from its own top-level package (followed through its imports, :func:`module_sources`), each
file's sha256 and one sha256 over them all, taken when the class was registered: the code that
runs, not the file as it is later. A run records its methods' origins (``config.yaml``'s
``meta.methods``), and a study's skip key holds the hash of each outside method it uses
(:func:`code_hashes`; built-in methods add nothing, so existing stores keep their keys).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modbench.errors import ModbenchError
from modbench.methods.registry import REGISTRY, load_builtins

ENV = "MODBENCH_METHODS_FROM"
ENTRY_POINT_GROUP = "modbench.methods"
BUILTIN_PREFIX = "modbench.methods."
#: the option every command that builds or reads a model takes
OPTION = "--methods-from"


@dataclass
class Plugin:
    """One loaded plugin: the ref it was loaded from, its module and the methods it
    registered."""

    ref: str
    module: str
    kind: str  # file | package | module | entry_point
    methods: list[str] = field(default_factory=list)


#: loaded plugins by ref (an absolute path, a module name, or ``entry_point:NAME``)
_PLUGINS: dict[str, Plugin] = {}
#: the origin of each registered outside method, by name (:func:`origin`)
_ORIGINS: dict[str, dict[str, Any]] = {}
#: the plugin being imported now (its registrations are attributed to it)
_loading: Plugin | None = None
_entry_points_loaded = False
_env_loaded: str | None = None


def is_builtin(cls: type) -> bool:
    """Whether ``cls`` is one of the catalogue's methods (defined in ``modbench.methods``, or
    in its flat copy ``modbench_methods_*.py`` inside a Hugging Face export)."""
    module = cls.__module__
    return module.startswith(BUILTIN_PREFIX) or module.rpartition(".")[2].startswith(
        "modbench_methods_")


# --- registration hooks (called by modbench.methods.base.register) -------------------------

def check_registration(name: str, cls: type, existing: type | None) -> bool:
    """Called by ``register`` before ``cls`` takes ``name``: refuse an outside method that
    takes a built-in's name or another plugin's, in one line. Returns whether ``existing`` may
    be replaced (the same module imported again, as after an edit)."""
    if existing is None or existing is cls:
        return True
    if is_builtin(cls):
        return False
    where = _where(cls)
    if is_builtin(existing):
        raise ModbenchError(f"{where} registers method '{name}', the name of a built-in method; "
                            "rename your method (a plugin may not replace a built-in)")
    if existing.__module__ == cls.__module__ and existing.__qualname__ == cls.__qualname__:
        return True  # its module imported again (reloaded after an edit)
    raise ModbenchError(f"method '{name}' is registered twice: by {_where(existing)} and by "
                        f"{where}; rename one of them")


def record_origin(name: str, cls: type) -> None:
    """Called by ``register`` after an outside method took ``name``: its origin, with the hash
    of its module's code as it is now (while the module is being imported)."""
    if is_builtin(cls):
        return
    rec: dict[str, Any] = {"origin": "plugin" if _loading else "module",
                           "module": cls.__module__}
    if _loading is not None:
        rec["plugin"] = _loading.ref
        _loading.methods.append(name)
    files = _files_of(cls.__module__)
    if files is not None:
        root, sources = files
        rec["files"] = {rel: _sha(path) for rel, path in sources.items()}
        rec["sha256"] = combined_hash(rec["files"])
        rec["root"] = str(root)
    _ORIGINS[name] = rec


def _where(cls: type) -> str:
    rec = _ORIGINS.get(getattr(cls, "name", ""))
    if rec is not None and rec.get("module") == cls.__module__ and rec.get("plugin"):
        return f"plugin {rec['plugin']}"
    if _loading is not None and (cls.__module__ == _loading.module
                                 or cls.__module__.startswith(_loading.module + ".")):
        return f"plugin {_loading.ref}"
    return f"module {cls.__module__}"


# --- origins and hashes ----------------------------------------------------------------------

def origin(name: str) -> dict[str, Any]:
    """Where the registered method ``name`` came from: ``{"origin": "builtin"}``, or for an
    outside method its plugin ref, module, files with their sha256 and the combined hash."""
    cls = REGISTRY.get(name)
    if cls is None:
        raise ModbenchError(f"unknown method '{name}'; run `modbench methods` to list them")
    if is_builtin(cls):
        return {"origin": "builtin"}
    rec = _ORIGINS.get(name)
    if rec is None or rec.get("module") != cls.__module__:
        record_origin(name, cls)  # registered by a route that skipped register's hook
        rec = _ORIGINS[name]
    return dict(rec)


def origins(names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The origin of each method named, by name (what a run records)."""
    return {n: origin(n) for n in names}


def code_hashes(names: Iterable[str]) -> dict[str, str]:
    """The source hash of each outside method among ``names`` (built-ins are left out, so a
    method string of built-ins gives ``{}``); a method without source files (defined in an
    interactive session) hashes its class's name and module."""
    import hashlib

    out: dict[str, str] = {}
    for n in names:
        rec = origin(n)
        if rec["origin"] != "builtin":
            out[n] = rec.get("sha256") or hashlib.sha256(
                f"{rec['module']}:{n}".encode()).hexdigest()
    return out


def combined_hash(files: dict[str, str]) -> str:
    """One sha256 over a plugin's files (relative path and each file's sha256, sorted):
    where the files lie does not change it."""
    import hashlib

    blob = "".join(f"{rel}\0{sha}\n" for rel, sha in sorted(files.items()))
    return hashlib.sha256(blob.encode()).hexdigest()


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files_of(module: str) -> tuple[Path, dict[str, Path]] | None:
    """The root folder and the source files (relative path -> path) of ``module``'s code, or
    None for a module without a source file."""
    try:
        sources = module_sources(module)
    except ModbenchError:
        return None
    if not sources:
        return None
    root = _root_of(module)
    return root, {_rel(p, root): p for p in sources.values()}


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name


def _module_file(module: str) -> Path | None:
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None) if mod is not None else None
    if file is None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        file = spec.origin if spec is not None else None
    if not file or not str(file).endswith(".py"):
        return None
    return Path(file).resolve()


def _root_of(module: str) -> Path:
    """The folder a module's relative paths are taken from: its top-level package's parent
    (for ``mylab.methods``: the folder holding ``mylab/``), or a lone module's folder."""
    top = module.split(".")[0]
    f = _module_file(top)
    if f is None:
        f = _module_file(module)
        assert f is not None
        return f.parent
    return f.parent.parent if f.name == "__init__.py" else f.parent


def module_sources(module: str) -> dict[str, Path]:
    """``module``'s source file and those of the modules of its own top-level package that it
    imports (statically, anywhere in the file, relative or absolute), and theirs in turn: the
    code a plugin brings. Package ``__init__`` files on the way are included. Modules of other
    packages (torch, modbench) are not followed."""
    import ast

    top = module.split(".")[0]
    found: dict[str, Path] = {}
    todo = [module]
    parts = module.split(".")
    todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages' __init__
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = _module_file(name)
        if path is None:
            continue
        found[name] = path
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        except (OSError, SyntaxError, UnicodeDecodeError) as e:
            raise ModbenchError(f"cannot read {path} ({e.__class__.__name__})") from None
        for target in _imports(name, tree, path.name == "__init__.py"):
            if target.split(".")[0] == top and target not in found:
                todo.append(target)
                sub = target.split(".")
                todo += [".".join(sub[:i]) for i in range(1, len(sub))]
    return found


def _imports(module: str, tree: Any, is_package: bool) -> list[str]:
    """The absolute module names ``tree`` imports (``from pkg import sub`` gives ``pkg`` and
    ``pkg.sub``: the name may be a submodule)."""
    import ast

    package = module if is_package else module.rpartition(".")[0]
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target:
                out.append(target)
                out += [f"{target}.{a.name}" for a in node.names if a.name != "*"]
    return out


# --- loading ---------------------------------------------------------------------------------

def split_refs(text: str | None) -> list[str]:
    """The refs of ``MODBENCH_METHODS_FROM`` (joined by ``os.pathsep``)."""
    return [r.strip() for r in (text or "").split(os.pathsep) if r.strip()]


def is_path_ref(ref: str) -> bool:
    """Whether ``ref`` names a file or folder (rather than a module): it ends in ``.py``,
    holds a path separator, starts with ``.`` or ``~``, or names an existing path."""
    return (ref.endswith(".py") or "/" in ref or os.sep in ref or ref.startswith((".", "~"))
            or Path(ref).exists())


def resolve_ref(ref: str, base: Path | None = None) -> str:
    """``ref`` as it is recorded: a path made absolute (relative to ``base``, a study spec's
    folder, or the current directory), a module name as it is."""
    if is_path_ref(ref):
        p = Path(ref).expanduser()
        if not p.is_absolute():
            p = (base or Path.cwd()) / p
        return str(p.resolve())
    return ref


def load_plugins(refs: Sequence[str], *, base: Path | None = None,
                 export_env: bool = True) -> list[Plugin]:
    """Import each plugin of ``refs`` (once per process), after the built-in methods, and
    return them. ``base``: the folder relative refs are taken from (a spec's folder).
    ``export_env``: add them to ``MODBENCH_METHODS_FROM`` so processes this one starts (study
    workers, torchrun groups, cluster jobs) load them too.

    Every failure is one :class:`ModbenchError` line naming the ref: a missing file, a file
    that cannot be imported (its exception), a module not found, a plugin that registers no
    method, a name a built-in or another plugin has."""
    load_builtins()  # first: a plugin may not take a built-in's name
    out = []
    for raw in refs:
        ref = resolve_ref(raw, base)
        plugin = _PLUGINS.get(ref)
        if plugin is None:
            plugin = _import_plugin(ref, raw)
        out.append(plugin)
    if export_env and out:
        known = split_refs(os.environ.get(ENV))
        add = [p.ref for p in out if p.kind != "entry_point" and p.ref not in known]
        if add:
            os.environ[ENV] = os.pathsep.join([*known, *add])
    return out


def _import_plugin(ref: str, raw: str) -> Plugin:
    global _loading
    if is_path_ref(raw):
        path = Path(ref)
        if not path.exists():
            raise ModbenchError(f"methods plugin {raw} does not exist; pass a .py file, a "
                                f"package folder or an importable module name to {OPTION}")
        if path.is_dir():
            if not (path / "__init__.py").is_file():
                raise ModbenchError(f"methods plugin folder {raw} is not a package (no "
                                    "__init__.py); pass a .py file or a package folder")
            module, kind, file = path.name, "package", path / "__init__.py"
        elif path.suffix != ".py":
            raise ModbenchError(f"methods plugin {raw} is not a .py file; pass a .py file, a "
                                "package folder or an importable module name")
        else:
            module, kind, file = path.stem, "file", path
        if not module.isidentifier():
            raise ModbenchError(f"methods plugin {raw}: '{module}' is not a valid module name; "
                                "rename it (letters, digits and _)")
        _check_free_name(module, file, raw)
    else:
        module, kind, file = ref, "module", None
    plugin = Plugin(ref, module, kind)
    _PLUGINS[ref] = plugin
    before = set(sys.modules)
    _loading = plugin
    try:
        if file is None:
            importlib.import_module(module)
        else:
            _import_file(module, file, kind == "package")
    except ModbenchError:
        _forget(plugin, before)
        raise
    except ModuleNotFoundError as e:
        _forget(plugin, before)
        if e.name and module.startswith(e.name):
            raise ModbenchError(f"methods plugin module '{raw}' is not importable (no module "
                                f"named {e.name!r}); install its package, or pass the .py "
                                "file or package folder") from None
        raise ModbenchError(f"methods plugin {raw} failed to import: {_one_line(e)}") from None
    except BaseException as e:  # a plugin's own error, sys.exit() too: one line
        _forget(plugin, before)
        if isinstance(e, KeyboardInterrupt):  # Ctrl-C while it imported
            raise
        raise ModbenchError(f"methods plugin {raw} failed to import: {_one_line(e)}") from None
    finally:
        _loading = None
    if not plugin.methods:
        _forget(plugin, before)
        raise ModbenchError(f"methods plugin {raw} registers no method; decorate your Method "
                            "subclass with @register (modbench.methods.base), see "
                            "docs/methods.md")
    return plugin


def _one_line(e: BaseException) -> str:
    """An exception in one line: its class, the first line of its message (at most 300
    characters; none where its ``__str__`` itself fails) and the deepest ``.py`` frame."""
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({Path(e.filename or '?').name}, line {e.lineno})"
    tb = e.__traceback__
    where = ""
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(".py"):
            where = f" ({Path(tb.tb_frame.f_code.co_filename).name}, line {tb.tb_lineno})"
        tb = tb.tb_next
    try:
        message = str(e).strip()
    except Exception:  # a plugin's exception whose own __str__ raises
        message = ""
    text = message.splitlines()[0][:300] if message else ""
    name = getattr(type(e), "__name__", "an exception")
    return f"{name}: {text}{where}" if text else f"{name}{where}"


def blame(e: BaseException, methods: Iterable[Any], what: str) -> ModbenchError | None:
    """The one-line error for ``e`` where it was raised in the code of an outside method
    among ``methods`` (a frame of its module, or of a module of its top-level package), naming
    the method and its plugin; None where no outside method's code raised it (modbench's
    own: its traceback stands). ``what``: what the method was doing."""
    outside = {type(m).__module__.split(".")[0]: m for m in methods
               if not is_builtin(type(m))}
    if not outside:
        return None
    hit = None
    tb = e.__traceback__
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        hit = outside.get(module.split(".")[0], hit)
        tb = tb.tb_next
    if hit is None:
        return None
    return ModbenchError(f"method '{hit.name}' ({_where(type(hit))}) failed {what}: "
                         f"{_one_line(e)}; fix it (docs/methods.md, 'Your own method'), or "
                         "leave it out")


def _check_free_name(module: str, file: Path, raw: str) -> None:
    """A file or package plugin is imported under its own name: refuse a name another module
    already has (an installed package, the standard library, another plugin's file)."""
    have = sys.modules.get(module)
    have_file = getattr(have, "__file__", None) if have is not None else None
    if have is not None:
        if have_file and Path(have_file).resolve() == file.resolve():
            return
        raise ModbenchError(f"methods plugin {raw} would be imported as module '{module}', "
                            f"which is already {have_file or 'a loaded module'}; rename the "
                            "file or folder")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin and Path(spec.origin).resolve() != file.resolve():
        raise ModbenchError(f"methods plugin {raw} would be imported as module '{module}', "
                            f"which names {spec.origin}; rename the file or folder")


def _import_file(module: str, file: Path, package: bool) -> None:
    spec = importlib.util.spec_from_file_location(
        module, file, submodule_search_locations=[str(file.parent)] if package else None)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    spec.loader.exec_module(mod)


def _forget(plugin: Plugin, modules_before: set[str]) -> None:
    """Undo a failed plugin: its registrations, its modules, its entry."""
    for name in plugin.methods:
        cls = REGISTRY.get(name)
        if cls is not None and not is_builtin(cls):
            del REGISTRY[name]
        _ORIGINS.pop(name, None)
    for m in set(sys.modules) - modules_before:
        del sys.modules[m]
    _PLUGINS.pop(plugin.ref, None)


def load_from_env() -> list[Plugin]:
    """Load the plugins ``MODBENCH_METHODS_FROM`` names (again only when it changed)."""
    global _env_loaded
    text = os.environ.get(ENV, "")
    if text == _env_loaded:
        return []
    _env_loaded = text
    return load_plugins(split_refs(text), export_env=False)


def has_entry_points() -> bool:
    """Whether an installed distribution declares the ``modbench.methods`` entry-point group:
    a scan of the metadata folders on ``sys.path`` (a few milliseconds, no import of
    ``importlib.metadata`` unless one does)."""
    marker = f"[{ENTRY_POINT_GROUP}]".encode()
    for d in sys.path:
        try:
            it = os.scandir(d or ".")
        except OSError:
            continue
        with it:
            for e in it:
                if not e.name.endswith((".dist-info", ".egg-info")):
                    continue
                try:
                    with open(os.path.join(e.path, "entry_points.txt"), "rb") as f:
                        if marker in f.read():
                            return True
                except OSError:
                    continue
    return False


def load_entry_points() -> list[Plugin]:
    """Import the modules installed packages declare under ``modbench.methods`` (once)."""
    global _entry_points_loaded, _loading
    if _entry_points_loaded or not has_entry_points():
        _entry_points_loaded = True
        return []
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    out = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ref = f"entry_point:{ep.name}"
        if ref in _PLUGINS:
            continue
        plugin = Plugin(ref, ep.module, "entry_point")
        _PLUGINS[ref] = plugin
        before = set(sys.modules)
        _loading = plugin
        try:
            ep.load()
        except ModbenchError:
            _forget(plugin, before)
            raise
        except Exception as e:
            _forget(plugin, before)
            raise ModbenchError(f"methods plugin {ep.name} (entry point {ep.value} of "
                                f"{getattr(ep.dist, 'name', '?')}) failed to import: "
                                f"{_one_line(e)}; fix or uninstall it") from None
        finally:
            _loading = None
        out.append(plugin)
    return out


def load_everything() -> dict[str, Any]:
    """The registry with the built-in methods and every plugin asked for outside a command's
    flag (entry points, ``MODBENCH_METHODS_FROM``): what :func:`modbench.methods.base.load_all`
    returns."""
    load_builtins()
    load_entry_points()
    load_from_env()
    return REGISTRY


def loaded() -> list[Plugin]:
    """The plugins this process has loaded, in order."""
    return list(_PLUGINS.values())


def plugins_requested(methods_from: Sequence[str] = ()) -> bool:
    """Whether any plugin is asked for (a ref given, the variable set, an entry point
    installed): what decides whether ``modbench methods`` needs the live registry."""
    return bool(methods_from) or bool(split_refs(os.environ.get(ENV))) or has_entry_points()


def unknown_method_hint(name: str, recorded: dict[str, Any] | None = None) -> str:
    """The tail of an unknown-method error: where the method was recorded from (a run's or
    study's record), and the option that loads it."""
    if recorded and recorded.get("origin") not in (None, "builtin"):
        src = recorded.get("plugin") or recorded.get("module")
        return (f"; it was recorded from {src} (module {recorded.get('module')}): load it with "
                f"{OPTION} {src} or {ENV}={src}")
    return f"; load your own methods with {OPTION} FILE (docs/methods.md)"


def stale_methods(recorded: dict[str, Any]) -> dict[str, str]:
    """Of a run's recorded origins (``meta.methods``), the outside methods whose loaded code
    differs from the recorded code, each with a line saying how."""
    out: dict[str, str] = {}
    for name, rec in (recorded or {}).items():
        if not isinstance(rec, dict) or rec.get("origin") in (None, "builtin"):
            continue
        if name not in REGISTRY:
            out[name] = "not loaded"
            continue
        now = origin(name)
        if now.get("sha256") != rec.get("sha256"):
            changed = sorted(k for k in set(now.get("files", {})) | set(rec.get("files", {}))
                             if now.get("files", {}).get(k) != rec.get("files", {}).get(k))
            out[name] = "code changed" + (f" ({', '.join(changed)})" if changed else "")
    return out


def recorded_origins(run: Path) -> dict[str, Any]:
    """The method origins a run folder recorded (``config.yaml``'s ``meta.methods``; ``{}``
    for a run from before they were recorded, or an unreadable file)."""
    import yaml

    try:
        tree = yaml.safe_load((Path(run) / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    meta = tree.get("meta") if isinstance(tree, dict) else None
    found = meta.get("methods") if isinstance(meta, dict) else None
    return found if isinstance(found, dict) else {}


def check_recorded(run: Path, doing: str) -> None:
    """Refuse, in one line, to use a run folder whose outside methods are not loaded (naming
    the plugin each was recorded from and the option that loads it) or whose loaded code
    differs from the code the run trained with. ``doing``: what was asked (for the message)."""
    recorded = recorded_origins(run)
    registry = load_everything()
    for name, rec in sorted(recorded.items()):
        if not isinstance(rec, dict) or rec.get("origin") in (None, "builtin"):
            continue
        if name not in registry:
            raise ModbenchError(f"run {run} uses method '{name}', which is not loaded"
                                f"{unknown_method_hint(name, rec)}")
    stale = stale_methods(recorded)
    if stale:
        name, why = sorted(stale.items())[0]
        raise ModbenchError(f"run {run} trained method '{name}' with other code than is loaded "
                            f"now ({why}); to {doing} load the code it trained with, or train "
                            "a new run")
