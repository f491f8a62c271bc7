"""Task files, generated (the trust boundary, docs/reliability.md): random lm-evaluation-harness
task folders (a task file, what it includes, a YAML beside it, a group with an inline task)
built from fields around each route to code, and random Jinja templates built from the
document's fields, Jinja's helpers, attributes, subscripts, filters, calls and a payload that
would write a marker file. Properties, without ``--trust-task-code``:

* ``check_task_files`` accepts or refuses with one line (a ``ModbenchError``), never another
  exception; ``modbench study validate`` of a spec naming the file exits 0, or 2 with one
  ``error:`` line;
* a folder holding any component that runs code is refused; one holding none is accepted;
* a template it accepts writes no marker when rendered as modbench renders it (Jinja's
  sandbox) nor as lm-eval renders it (unsandboxed), with a document whose values name
  attributes (``__init__``) too. Refused templates are rendered unsandboxed in a scratch
  folder as well, to count the drawn payloads that would have written the marker.

``derandomize=True``: CI tries the same examples every time. Joins the config fuzzing of
test_bad_config.py.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tests.reliability.conftest import long_points, long_variant  # noqa: E402

from modbench.cli import run_cli  # noqa: E402
from modbench.errors import ModbenchError  # noqa: E402
from modbench.eval.harness import check_task_files, template_problem  # noqa: E402

EXAMPLES = {"folder": 150, "template": 300}
OUTCOMES: Counter[str] = Counter()
EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\ndef f(doc):\n    return doc\n"
RUN = "'touch MARKER'"  # a call's argument: the shell command that writes the marker

# --- task folders: fields around each route, each marked "ok" or "code" ---------------------
SHELL = "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}"
TEMPLATES_OK = ["{{question}}", "Question: {{question.strip()}}\\nAnswer:", "{{choices.text}}",
                "{{ choices[label|int] }}", "{{ answer.split('#')[-1] }}", "question",
                "{% for c in choices %}{{ loop.index }}. {{ c }} {% endfor %}",
                "{{ ['A', 'B'].index(label) }}", "{{ x|regex_replace('a+', 'b') }}",
                "{{ rows|map(attribute='text')|join(' ') }}", "plain text"]
TEMPLATES_CODE = [SHELL, "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}",
                  "{{ (cycler|attr('__init__')|attr('__globals__')).os.system('touch MARKER') }}",
                  "{{ self.__init__.__globals__.__builtins__.exec('import os') }}",
                  "{{ namespace.__init__.__globals__.os.system('touch MARKER') }}",
                  "{% set g = joiner.__init__.__globals__ %}{{ g.os.system('touch MARKER') }}",
                  "{{ '{0.__class__}'.format(question) }}", "{% include 'x' %}",
                  "{{ question|map('attr', '__class__')|list }}"]
TEMPLATED = ["doc_to_text", "doc_to_target", "doc_to_choice", "description", "gen_prefix"]
FIELDS: dict[str, list[tuple[Any, str]]] = {
    "metric_list": [([{"metric": "acc"}], "ok"),
                    ([{"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
                     "ok"),
                    ([{"metric": "exact_match", "ignore_case": True}], "ok"),
                    ([{"metric": "TASKS/mymetric"}], "code"),
                    ([{"metric": "TASKS/mymetric/mymetric.py"}], "code"),
                    ([{"metric": "mymetric"}], "code"),
                    ([{"metric": "acc", "hf_evaluate": True}], "code"),
                    ([{"metric": "acc", "aggregation": "!function evilmod.f"}], "code")],
    "filter_list": [([{"name": "x", "filter": [{"function": "take_first"}]}], "ok"),
                    ([{"name": "x", "filter": [{"function": "regex", "regex_pattern": "(\\d+)"},
                                               {"function": "take_first"}]}], "ok"),
                    ([{"name": "x", "filter": [{"function": "evilmod.f"}]}], "code"),
                    ([{"name": "x", "filter": [{"function": "custom",
                                                "filter_fn": "!function evilmod.f"}]}], "code")],
    "process_docs": [("!function evilmod.f", "code"), ("evilmod.f", "code")],
    "process_results": [("!function evilmod.f", "code")],
    "custom_dataset": [("!function evilmod.f", "code")],
    "class": [("!function evilmod.f", "code")],
    "metadata": [({"version": 1.0}, "ok"), ({"note": "!function evilmod.f"}, "code")],
    "dataset_path": [("json", "ok"), ("org/dataset", "ok"),
                     ("TASKS/evilds/evilds.py", "code"), ("TASKS/evilds", "code")],
    "dataset_kwargs": [({"data_files": {"test": "x.jsonl"}}, "ok"),
                       ({"trust_remote_code": True}, "code")],
    "use_prompt": [("qa-basic:q-newline-a", "ok"), ("TASKS/../prompts.yaml:p", "code"),
                   ("promptsource:p", "code")],
    "unsafe_code": [(False, "ok"), (True, "code")],
    "num_fewshot": [(0, "ok"), (5, "ok")],
    "output_type": [("loglikelihood", "ok"), ("multiple_choice", "ok"), ("nonsense", "ok")],
    "fewshot_config": [({"sampler": "first_n"}, "ok"), ({"sampler": "!function evilmod.f"}, "code"),
                       ({"doc_to_text": "{{question}}"}, "ok"), ({"doc_to_text": SHELL}, "code")],
    **{k: [*[(t, "ok") for t in TEMPLATES_OK], *[(t, "code") for t in TEMPLATES_CODE],
           (3, "ok"), (["{{question}}", "b"], "ok"), ([SHELL], "code")] for k in TEMPLATED},
}
PLACES = ["file", "include", "sibling", "group"]  # where a component lands


def _dump(d: dict[str, Any]) -> str:
    """YAML of ``d``, its ``'!function X'`` strings turned into tags."""
    text = yaml.safe_dump(d, default_flow_style=False, allow_unicode=True, width=1000)
    return text.replace("'!function evilmod.f'", "!function evilmod.f")


@st.composite
def task_folders(draw: Any) -> tuple[dict[str, str], str]:
    """The files of a task folder (``mytask.yaml`` first) and ``code`` or ``ok``."""
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True))
    parts: dict[str, dict[str, Any]] = {p: {} for p in PLACES}
    kind = "ok"
    for k in keys:
        value, label = draw(st.sampled_from(FIELDS[k]))
        place = draw(st.sampled_from(PLACES))
        parts[place][k] = value
        kind = "code" if label == "code" else kind
    main: dict[str, Any] = {"task": "mytask", "dataset_path": "json",
                            "output_type": "loglikelihood", "doc_to_text": "{{question}}"}
    files: dict[str, str] = {}
    if parts["include"]:
        main["include"] = "base.yaml"
        files["base.yaml"] = _dump(parts["include"])
    main.update(parts["file"])
    files = {"mytask.yaml": _dump(main), **files}
    if parts["sibling"]:
        files["other.yaml"] = _dump({"task": "other", **parts["sibling"]})
    if parts["group"]:
        files["group.yaml"] = _dump({"group": "g", "task": [{"task": "arc_easy",
                                                             **parts["group"]}]})
    return files, kind


# --- templates: random expressions over the document and Jinja's helpers -------------------
NAMES = ["question", "choices", "label", "answer", "k", "cycler", "lipsum", "namespace",
         "joiner", "range", "dict", "self"]
OS = ["cycler.__init__.__globals__.os", "lipsum.__globals__['os']",  # steps toward a payload
      "(joiner|attr('__init__')|attr('__globals__')).os", "cycler['__init__'].__globals__.os",
      "namespace.__init__.__globals__.get('os')", "cycler[k].__globals__.os"]
ATTRS = ["text", "strip", "get", "__init__", "__globals__", "__class__", "__builtins__", "os",
         "system", "popen", "mro", "_x", "keys", "items"]
KEYS = ["'text'", "0", "-1", "'__init__'", "'__globals__'", "'os'", "'system'", "k", "label",
        "'_' ~ '_init__'", "'__builtins__'"]
METHODS = ["strip", "split", "get", "index", "format", "system", "popen", "join", "read",
           "append", "replace", "keys", "items", "exec", "eval", "__import__", "system",
           "system", "popen"]
FILTERS = ["length", "string", "join", "upper", "attr('__init__')", "attr('text')",
           "map('upper')", "map('attr', '__class__')", "map(attribute='__class__')",
           "map(attribute='text')", "first", "list", "int", "sort(attribute='text')",
           "selectattr('text')", "regex_replace('a', 'b')", "format(1)", "nosuch", "tojson",
           "items", "d('x')"]
ARGS = [RUN, RUN, "question", "'os'", "1", "'text'", "", "k"]


def expressions() -> Any:
    def extend(inner: Any) -> Any:
        return st.one_of(
            st.tuples(inner, st.sampled_from(ATTRS)).map(lambda t: f"{t[0]}.{t[1]}"),
            st.tuples(inner, st.sampled_from(KEYS)).map(lambda t: f"{t[0]}[{t[1]}]"),
            st.tuples(inner, st.sampled_from(FILTERS)).map(lambda t: f"({t[0]}|{t[1]})"),
            st.tuples(inner, st.sampled_from(METHODS), st.sampled_from(ARGS)).map(
                lambda t: f"{t[0]}.{t[1]}({t[2]})"),
            st.tuples(st.sampled_from(NAMES), st.sampled_from(ARGS)).map(
                lambda t: f"{t[0]}({t[1]})"),
            st.tuples(inner, st.sampled_from(KEYS), st.sampled_from(ARGS)).map(
                lambda t: f"{t[0]}[{t[1]}]({t[2]})"),
            st.tuples(inner, inner).map(lambda t: f"{t[0]} ~ {t[1]}"),
            st.tuples(inner, st.sampled_from(["system", "popen"])).map(
                lambda t: f"{t[0]}.{t[1]}({RUN})"))  # the shell, on whatever it reached
    return st.recursive(st.sampled_from(NAMES + OS + OS), extend, max_leaves=6)


@st.composite
def templates(draw: Any) -> str:
    e = draw(expressions())
    form = draw(st.sampled_from(["{{ %s }}", "{%% set v = %s %%}{{ v }}",
                                 "{%% for x in %s %%}{{ x }}{%% endfor %%}",
                                 "Q: {{ question }} {{ %s }}"]))
    return form % e


# --- the properties -------------------------------------------------------------------------
@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="modbench-taskfuzz-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _write(tmp: Path, files: dict[str, str]) -> Path:
    d = tmp / "tasks"
    for name, text in {**files, "evilmod.py": EVIL, "mymetric/mymetric.py": EVIL,
                       "evilds/evilds.py": EVIL,
                       "../prompts.yaml": f'prompts:\n  p:\n    doc_to_text: "{SHELL}"\n'
                                          "    doc_to_target: x\n"}.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text.replace("{marker!r}", repr(str(tmp / "ran")))
                              .replace("MARKER", str(tmp / "ran")).replace("TASKS", str(d)))
    return d


def _validate(spec: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = run_cli(["study", "validate", str(spec)])
    return code, err.getvalue()


def _folder_case(files: dict[str, str], kind: str, mode: str = "", cli: bool = False) -> None:
    with scratch() as tmp:
        d = _write(tmp, files)
        try:
            check_task_files([str(d / "mytask.yaml")], trust=False)
            verdict = "accepted"
        except ModbenchError as e:
            verdict = "refused"
            assert "\n" not in str(e), str(e)
        OUTCOMES[f"task folder ({kind}){mode} {verdict}"] += 1
        assert verdict == ("refused" if kind == "code" else "accepted"), files
        if cli:
            spec = tmp / "spec.yaml"
            spec.write_text(yaml.safe_dump({"name": "t", "methods": ["baseline"],
                                            "scales": ["tiny"],
                                            "evaluation": {"tasks": [str(d / "mytask.yaml")]}}))
            code, err = _validate(spec)
            assert (code, len(err.strip().splitlines())) == (
                (2, 1) if verdict == "refused" else (0, 0)), (code, err)
            assert code == 0 or err.startswith("error: ")
        assert not (tmp / "ran").exists()


DOC = {"question": "q", "choices": ["a", "b"], "label": 1, "answer": "x#y", "k": "__init__",
       "text": "t"}


def _template_case(source: str, mode: str = "") -> None:
    from lm_eval.utils import apply_template

    from modbench.eval.harness import _harness_guards

    with scratch() as tmp:
        source = source.replace("MARKER", str(tmp / "ran"))
        problem = template_problem(source)
        OUTCOMES[f"template{mode} {'refused' if problem else 'accepted'}"] += 1
        if problem is not None:
            assert "\n" not in problem
            with contextlib.suppress(Exception):  # would lm-eval have run it? (the figures)
                apply_template(source, DOC)
            if (tmp / "ran").exists():
                OUTCOMES[f"template{mode} refused, would have written the marker"] += 1
            return
        with _harness_guards(False), contextlib.suppress(Exception):  # as modbench renders
            apply_template(source, DOC)
        assert not (tmp / "ran").exists(), source
        with contextlib.suppress(Exception):  # as lm-eval renders it, unsandboxed
            apply_template(source, DOC)
        assert not (tmp / "ran").exists(), source


def _settings(n: int) -> Any:
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_settings(EXAMPLES["folder"])
@given(case=task_folders(), cli=st.integers(0, 3).map(lambda i: i == 0))
def test_random_task_folders(case: tuple[dict[str, str], str], cli: bool) -> None:
    _folder_case(*case, cli=cli)  # a quarter of them through `modbench study validate` too


@_settings(EXAMPLES["template"])
@given(source=templates())
def test_random_templates(source: str) -> None:
    pytest.importorskip("lm_eval")
    _template_case(source)


@pytest.mark.parametrize("text", [b"task: [", b"- a\n- b\n", b"", b"42", b"\xff\xfe not utf-8",
                                  b"task: t\ninclude: nope.yaml", b"task: t\ninclude: [[1]]",
                                  b"task: t\ndoc_to_text: {a: 1}", b"task: t\nmetric_list: 3",
                                  b"task: t\nfilter_list: [{filter: 3}]", b"task: t\nx: &a [*a]"])
def test_task_files_that_are_not_task_files(text: bytes, tmp_path: Path) -> None:
    """Accepted or refused in one line, never another exception."""
    d = tmp_path / "tasks"
    d.mkdir()
    (d / "mytask.yaml").write_bytes(text)
    try:
        check_task_files([str(d / "mytask.yaml")], trust=False)
        OUTCOMES["task file not a task accepted"] += 1
    except ModbenchError as e:
        assert "\n" not in str(e)
        OUTCOMES["task file not a task refused"] += 1


LONG = max(1, long_points() // 30)  # the long run: this many times the examples


@long_variant
@_settings(EXAMPLES["folder"] * LONG)
@given(case=task_folders(), cli=st.integers(0, 3).map(lambda i: i == 0))
def test_random_task_folders_long(case: tuple[dict[str, str], str], cli: bool) -> None:
    _folder_case(*case, mode=" (long)", cli=cli)


@long_variant
@_settings(EXAMPLES["template"] * LONG)
@given(source=templates())
def test_random_templates_long(source: str) -> None:
    pytest.importorskip("lm_eval")
    _template_case(source, " (long)")


def test_record_task_fuzz_figures(record: Any) -> None:
    """Runs last in this module: how many inputs were tried and how they came out."""
    record({"examples": {k: v for k, v in sorted(OUTCOMES.items()) if "(long)" not in k}})
    assert OUTCOMES["task folder (code) refused"] and OUTCOMES["task folder (ok) accepted"]
    assert OUTCOMES["template refused"] and OUTCOMES["template accepted"]
    assert OUTCOMES["template refused, would have written the marker"]  # real payloads drawn


@long_variant
def test_record_task_fuzz_figures_long(record: Any) -> None:
    record({"examples": {k: v for k, v in sorted(OUTCOMES.items()) if "(long)" in k}})
