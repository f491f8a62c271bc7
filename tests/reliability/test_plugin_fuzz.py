"""Method plugins, generated (issue 47): random ``--methods-from`` refs and the files they name
go through ``modbench flops --preset tiny --methods-from REF`` and ``modbench train --preset
tiny --steps 1 --out X --methods-from REF`` (``run_cli``, in process). Each command works
(exit 0) or gives exactly one ``error:`` line and exit 2: never a traceback, never another
exit code, no run folder ``X`` after a refusal, and the method registry, the plugins' records,
``sys.modules`` and ``MODBENCH_METHODS_FROM`` as they were before.

Refs: a missing path, a ``.py`` file, a folder with or without ``__init__.py`` (one with a
submodule it imports), a file that is not ``.py``, a name that is not a module name or names
another module (``json.py``), a dotted module name (importable or not). Files: from parts that
register a method (complete, without its FLOPs or its configure, with a configure that
raises), a built-in's name, a name that is not lower_snake_case, a bad category, the same name
twice, nothing; raise an exception at import (of many kinds: ``SystemExit`` and
``BaseException`` subclasses, one whose ``__str__`` raises, one with a megabyte message),
import a missing module, fail to parse; random bytes; empty and megabyte-sized files.
Each example runs inside ``tests.helpers.plugins_restored`` (what a test that loads plugins
gives back). ``derandomize=True``: CI tries the same examples every time.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tests.helpers import cli_built_once, plugins_restored, torch_threads  # noqa: E402
from tests.reliability.conftest import long_points, long_variant  # noqa: E402

from modbench.cli import run_cli  # noqa: E402
from modbench.methods import base, plugins  # noqa: E402

EXAMPLES = 100  # each runs `flops`; a quarter also `train` (~0.3 s where it trains)
OUTCOMES: Counter[str] = Counter()

HEADER = "from modbench.methods.base import Method, register\n"
CONFIGURE = "    def configure(self, spec, cfg):\n        pass\n"
COUNTED = ("    def extra_flops(self, cfg, seq_len):\n        return 0.0\n"
           "    def extra_params(self, cfg):\n        return 0\n")


def _method(cls: str, name: str, category: str = "'residual'", body: str = "") -> str:
    return (f"@register\nclass {cls}(Method):\n    name = {name}\n    category = {category}\n"
            f"    summary = 'generated'\n{body}")


#: exceptions a plugin raises at import: what `raise` is followed by
RAISED = ["ValueError('bad value')", "KeyError('k')", "RuntimeError('multi\\nline')",
          "ImportError('no')", "ZeroDivisionError()", "AttributeError('a')",
          "AssertionError()", "OSError(5, 'io')", "SystemExit(3)", "SystemExit(0)",
          "SystemExit('bye')", "GeneratorExit()", "RecursionError()", "MemoryError()",
          "StopIteration()", "UnicodeDecodeError('utf-8', b'\\xff', 0, 1, 'bad')",
          "Custom('mine')", "Base()", "BadStr()", "ValueError('x' * 1_000_000)", "Exception()"]
EXCEPTIONS = ("class Custom(Exception):\n    pass\nclass Base(BaseException):\n    pass\n"
              "class BadStr(Exception):\n    def __str__(self):\n"
              "        raise RuntimeError('no')\n")


@st.composite
def plugin_source(draw: Any, tag: str) -> bytes:
    """A plugin file's bytes: Python parts drawn in order (a method registered in one of many
    ways, statements, an exception raised), random bytes, or nothing at all."""
    shape = draw(st.sampled_from(["parts"] * 8 + ["bytes", "empty", "huge"]))
    if shape == "bytes":
        return draw(st.binary(max_size=300))
    if shape == "empty":
        return b""
    # half are plugins a user would write (methods, with or without their FLOPs, and
    # statements); the rest mix in every way a plugin can go wrong
    clean = draw(st.booleans())
    header = HEADER if clean else draw(st.sampled_from([HEADER, HEADER, HEADER, ""]))
    parts = [EXCEPTIONS]
    fresh = f"fz_{tag}"
    kinds = ["good", "good", "no-flops", "statement", "print"] if clean else [
        "good", "good", "good", "no-flops", "no-configure", "configure-raises",
        "builtin-name", "bad-name", "bad-category", "twice", "statement", "raise",
        "import-missing", "relative-import", "syntax", "print"]
    rnd = draw(st.randoms(use_true_random=False))
    for i in range(rnd.randint(1 if clean else 0, 3)):
        kind = rnd.choice(kinds)
        cls = f"M{i}"
        if kind == "good":
            parts.append(_method(cls, repr(f"{fresh}_{i}"), body=CONFIGURE + COUNTED))
        elif kind == "no-flops":
            parts.append(_method(cls, repr(f"{fresh}_{i}"), body=CONFIGURE))
        elif kind == "no-configure":
            parts.append(_method(cls, repr(f"{fresh}_{i}"), body=COUNTED))
        elif kind == "configure-raises":
            exc = draw(st.sampled_from(RAISED[:8]))
            parts.append(_method(cls, repr(f"{fresh}_{i}"), body=COUNTED + (
                f"    def configure(self, spec, cfg):\n        raise {exc}\n")))
        elif kind == "builtin-name":
            name = draw(st.sampled_from(["baseline", "qknorm", "post_ln", "geglu"]))
            parts.append(_method(cls, repr(name), body=CONFIGURE + COUNTED))
        elif kind == "bad-name":
            name = draw(st.sampled_from(["''", "'Bad'", "'1x'", "'a-b'", "'x y'", "None", "3",
                                         "'qk norm'", "'a+b'", "'x(y)'", "'é'"]))
            parts.append(_method(cls, name, body=CONFIGURE))
        elif kind == "bad-category":
            parts.append(_method(cls, repr(f"{fresh}_{i}"),
                                 draw(st.sampled_from(["'nope'", "None", "3", "''"])),
                                 CONFIGURE))
        elif kind == "twice":
            parts.append(_method(cls, repr(f"{fresh}_t"), body=CONFIGURE + COUNTED))
            parts.append(_method(cls + "b", repr(f"{fresh}_t"), body=CONFIGURE + COUNTED))
        elif kind == "statement":
            parts.append(draw(st.sampled_from(["x = 1\n", "import json\n", "pass\n",
                                               "def f():\n    return 1\n", "y = [i for i in "
                                               "range(10)]\n"])))
        elif kind == "raise":
            parts.append(f"raise {draw(st.sampled_from(RAISED))}\n")
        elif kind == "import-missing":
            parts.append("import modbench_fuzz_no_such_module\n")
        elif kind == "relative-import":
            parts.append("from . import sibling\n")
        elif kind == "syntax":
            parts.append(draw(st.sampled_from(["def (:\n", "class\n", "x = = 1\n", "\tpass\n",
                                               "return 1\n", "'unterminated\n"])))
        else:  # to stdout: the contract is about stderr and the exit code
            parts.append("print('plugin says hello')\n")
    text = (header + "".join(parts)).encode()
    if shape == "huge":  # a megabyte of comments around whatever was drawn
        return b"# padding\n" * 100_000 + text
    return text


@dataclass
class Case:
    """A plugin on disk (``files``, relative to the example's folder) and the ref naming it."""

    files: dict[str, bytes] = field(default_factory=dict)
    ref: str = ""  # relative to the example's folder unless absolute or a module name
    kind: str = ""
    absolute: bool = True


STEMS = ["fzplug", "fz_mod", "fzplug2", "json", "class", "fz-plug", "9fz", "fz plug", "torch"]


@st.composite
def cases(draw: Any) -> Case:
    tag = str(draw(st.integers(0, 10**6)))
    # the ref's kind and name uniformly (hypothesis favours a list's first elements)
    rnd = draw(st.randoms(use_true_random=False))
    kind = rnd.choice(["file"] * 6 + ["package"] * 2 + [
        "folder-no-init", "not-py", "missing", "module", "symlink"])
    stem = rnd.choice(STEMS[:3] * 4 + STEMS[3:])
    if kind == "file":
        return Case({f"{stem}.py": draw(plugin_source(tag))}, f"{stem}.py", kind)
    if kind == "symlink":
        return Case({"target.txt": draw(plugin_source(tag))}, f"{stem}.py", kind)
    if kind == "package":
        files = {f"{stem}/__init__.py": draw(plugin_source(tag))}
        if draw(st.booleans()):  # __init__ imports a submodule that does the rest
            files[f"{stem}/__init__.py"] = b"from . import sub\n" + files[f"{stem}/__init__.py"]
            files[f"{stem}/sub.py"] = draw(plugin_source(tag + "s"))
        return Case(files, stem + draw(st.sampled_from(["", "/"])), kind)
    if kind == "folder-no-init":
        return Case({f"{stem}/mod.py": draw(plugin_source(tag))}, stem, kind)
    if kind == "not-py":
        suffix = draw(st.sampled_from([".txt", ".pyc", "", ".py.bak", ".PY"]))
        return Case({f"{stem}{suffix}": draw(plugin_source(tag))}, f"{stem}{suffix}", kind)
    if kind == "missing":
        ref = draw(st.sampled_from(["nothing.py", "no/such/dir", "~/modbench-fuzz-none.py",
                                    "./nothing.py"]))
        return Case({}, ref, kind, absolute=not ref.startswith(("~", "./")))
    ref = draw(st.sampled_from(["modbench_fuzz_no_such_module", "json", "os.path",
                                "modbench.methods.qknorm", "tests.helpers", "a..b", "-x",
                                "modbench_fuzz_no_such_module.sub"]))
    return Case({}, ref, kind, absolute=False)


def _write(case: Case, folder: Path) -> str:
    for rel, data in case.files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if case.kind == "symlink":
        (folder / case.ref).symlink_to(folder / "target.txt")
    return str(folder / case.ref) if case.absolute else case.ref


def _state() -> tuple[Any, ...]:
    return (dict(base.REGISTRY), dict(plugins._PLUGINS), dict(plugins._ORIGINS),
            os.environ.get(plugins.ENV))


REASONS = ["does not exist", "is not a package", "is not a .py file", "not a valid module name",
           "would be imported as module", "is not importable", "registers no method",
           "the name of a built-in", "registered twice", "defines no configure",
           "does not document", "failed to plan", "failed to import"]


def _reason(line: str) -> str:
    """What a refusal says, in a few words (for the figures)."""
    return next((r for r in REASONS if r in line), "other")


def _run(argv: list[str], folder: Path, out: Path | None, what: str, mode: str = "") -> int:
    """``modbench *argv`` in process, inside plugins_restored; the contract checked."""
    with plugins_restored(folder):
        before, modules = _state(), set(sys.modules)
        stdout, stderr = io.StringIO(), io.StringIO()
        with torch_threads(), contextlib.redirect_stdout(stdout), \
                contextlib.redirect_stderr(stderr):
            code = run_cli(argv)
        err = stderr.getvalue()
        assert "Traceback" not in err + stdout.getvalue(), err
        assert code in (0, 2), (code, err)
        if code == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), err
            assert out is None or not out.exists(), f"refused but left {out}"
            loaded = {r: p for r, p in plugins._PLUGINS.items() if r not in before[1]}
            if not loaded:  # the plugin was refused: nothing of it is left
                assert _state() == before, "a refused plugin left registrations or records"
                left = {m for m in set(sys.modules) - modules
                        if str(getattr(sys.modules[m], "__file__", "") or "").startswith(
                            str(folder))}
                assert not left, f"a refused plugin left modules {sorted(left)}"
                OUTCOMES[f"{what} refused"] += 1
            else:  # it loaded, and the command refused one of its methods (not its load)
                assert "methods plugin" not in lines[0], lines[0]
                added = set(base.REGISTRY) - set(before[0])
                assert added == {m for p in loaded.values() for m in p.methods}, added
                OUTCOMES[f"{what} refused a method of a plugin that loaded"] += 1
            OUTCOMES[f"refused: {_reason(lines[0])}{mode}"] += 1
        else:
            assert out is None or (out / "summary.json").is_file()
            OUTCOMES[f"{what} worked"] += 1
    return code


def _case(case: Case, train: bool, mode: str = "") -> None:
    folder = Path(tempfile.mkdtemp(prefix="modbench-plugin-"))
    try:
        ref = _write(case, folder)
        flops = _run(["flops", "--preset", "tiny", "--methods-from", ref], folder, None,
                     f"flops{mode}", mode)
        OUTCOMES[f"ref {case.kind}{mode}"] += 1
        if train:
            out = folder / "X"
            code = _run(["train", "--preset", "tiny", "--steps", "1", "--no-progress",
                         "--set", "train.eval_sequences=2", "--set", "train.batch_size=2",
                         "--set", "train.threads=1",
                         "--out", str(out), "--methods-from", ref], folder, out,
                        f"train{mode}", mode)
            # the same plugin loads, or not, in both; flops also counts every method
            assert code == 2 or flops in (0, 2), (code, flops)
            if flops == 0:
                assert code == 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def _cli_built_once() -> Iterator[None]:
    """The CLI's typer command built once for the cases, each run on a fresh copy; and each
    command run once before (its own lazy imports are not the plugin's)."""
    with cli_built_once():
        folder = Path(tempfile.mkdtemp(prefix="modbench-plugin-"))
        try:
            _run(["flops", "--preset", "tiny"], folder, None, "warm-up")
            _run(["train", "--preset", "tiny", "--steps", "1", "--no-progress", "--set",
                  "train.threads=1", "--out",
                  str(folder / "X")], folder, folder / "X", "warm-up")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        yield


def _settings(n: int) -> Any:
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


@_settings(EXAMPLES)
@given(case=cases(), train=st.integers(0, 3).map(lambda i: i == 0))
def test_random_plugins(case: Case, train: bool) -> None:
    _case(case, train)


@pytest.mark.parametrize("source", [
    HEADER + _method("M", "'fz_good'", body=CONFIGURE + COUNTED),  # works in both
    HEADER + EXCEPTIONS + "raise BadStr()\n",  # was: RuntimeError from the message
    "import sys\nsys.exit(3)\n",  # was: exit 3, nothing said
    HEADER + _method("M", "'fz_nocfg'", body=COUNTED),  # flops: NotImplementedError
    HEADER + _method("M", "'fz_noflops'", body=CONFIGURE),  # flops: NotImplementedError
    HEADER + _method("M", "'fz_raises'", body=COUNTED + (
        "    def configure(self, spec, cfg):\n        raise ValueError('boom')\n")),
])
def test_plugins_the_fuzz_found(source: str) -> None:
    """What the generated plugins found, kept as examples (each through both commands)."""
    _case(Case({"fzplug.py": source.encode()}, "fzplug.py", "file"), train=True,
          mode=" (found)")


LONG = max(1, long_points() // 30)  # the long run: this many times the examples


@long_variant
@_settings(EXAMPLES * LONG)
@given(case=cases(), train=st.integers(0, 3).map(lambda i: i == 0))
def test_random_plugins_long(case: Case, train: bool) -> None:
    _case(case, train, " (long)")


def test_record_plugin_fuzz_figures(record: Any) -> None:
    """Runs last in this module: how many inputs were tried and how they came out."""
    record({"examples": {k: v for k, v in sorted(OUTCOMES.items()) if "(long)" not in k}})
    assert OUTCOMES["flops refused"] and OUTCOMES["flops worked"]
    assert OUTCOMES["train refused"] and OUTCOMES["train worked"]


@long_variant
def test_record_plugin_fuzz_figures_long(record: Any) -> None:
    record({"examples": {k: v for k, v in sorted(OUTCOMES.items()) if "(long)" in k}})
