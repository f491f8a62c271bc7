"""The trust boundary of lm-evaluation-harness task files (modbench.eval.harness): without
``--trust-task-code`` (a study: ``evaluation.trust_task_code: true``) every route by which a
task file, what it includes or a YAML beside it could run code is refused in one line, exit
2, before lm-eval sees it: a ``!function`` or other tag (anywhere, an included ``.py``),
``trust_remote_code``, a template that reaches past the document (Jinja), a metric lm-eval
would hand to ``evaluate.load``, a filter outside lm-eval's registry, ``process_docs`` /
``process_results`` / ``custom_dataset`` / ``class``, a prompt file, ``unsafe_code``, a
dataset loading script. Each payload would write a marker file; none is ever written, and
where lm-eval's own code path can run it here, a positive control shows that it would.
Tiny local task files, no network."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tests.helpers import cli

from modbench.errors import ModbenchError
from modbench.eval.harness import check_task_files, read_task_yaml
from modbench.study.spec import load_spec

EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\ndef f(doc):\n    return doc\n"
PLAIN = "task: mytask\ndataset_path: json\noutput_type: loglikelihood\n"


def _folder(tmp: Path, files: dict[str, str]) -> Path:
    """The task folder ``tmp/tasks`` holding ``files``; in their text ``{marker!r}`` is the
    marker's path quoted for Python, ``MARKER`` its path, ``TASKS`` the folder's."""
    d = tmp / "tasks"
    d.mkdir()
    for name, text in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text.replace("{marker!r}", repr(str(tmp / "ran")))
                              .replace("MARKER", str(tmp / "ran")).replace("TASKS", str(d)))
    return d


CASES = {
    "function-in-file": {"mytask.yaml": PLAIN + "process_docs: !function evilmod.f\n"},
    "function-through-include": {
        "mytask.yaml": "include: base.yaml\n" + PLAIN,
        "base.yaml": "process_docs: !function evilmod.f\n"},
    "function-two-includes-deep": {
        "mytask.yaml": "include: [a.yaml]\n" + PLAIN,
        "a.yaml": "include: b.yml\n", "b.yml": "doc_to_text: !function evilmod.f\n"},
    "include-of-code": {"mytask.yaml": "include: evilmod.py\n" + PLAIN},
    "python-tag": {"mytask.yaml": PLAIN + "x: !!python/name:os.system\n"},
    "remote-code-dataset": {"mytask.yaml": PLAIN + "dataset_kwargs: {trust_remote_code: true}\n"},
    "sibling-yaml": {"mytask.yaml": PLAIN, "other.yaml": "task: t2\nx: !function evilmod.f\n"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_task_code_refused_unless_trusted(case: str, tmp_path: Path) -> None:
    d = _folder(tmp_path, {**CASES[case], "evilmod.py": EVIL})
    with pytest.raises(ModbenchError) as e:
        check_task_files([str(d / "mytask.yaml")], trust=False)
    msg = str(e.value)
    assert "\n" not in msg and "--trust-task-code" in msg
    check_task_files([str(d / "mytask.yaml")], trust=True)  # trusted: no refusal
    assert not (tmp_path / "ran").exists()  # reading never imports the module


def test_plain_task_file_passes_and_function_file_reads_without_constructor_error(
        tmp_path: Path) -> None:
    d = _folder(tmp_path, {"mytask.yaml": "include: base.yaml\n" + PLAIN,
                           "base.yaml": "num_fewshot: 0\n",
                           "fn.yaml": PLAIN.replace("mytask", "fntask")
                           + "process_docs: !function evilmod.f\n"})
    (d / "fn.yaml").rename(tmp_path / "fn.yaml")
    check_task_files([str(d / "mytask.yaml")], trust=False)
    data = read_task_yaml(tmp_path / "fn.yaml")
    assert data["task"] == "fntask"  # the tag is inert, not a ConstructorError


def test_include_cycle_and_missing_include_are_one_line(tmp_path: Path) -> None:
    d = _folder(tmp_path, {"mytask.yaml": "include: a.yaml\n" + PLAIN,
                           "a.yaml": "include: mytask.yaml\n"})
    check_task_files([str(d / "mytask.yaml")], trust=False)  # a cycle: each read once
    (d / "a.yaml").write_text("include: gone.yaml\n")
    with pytest.raises(ModbenchError, match=r"gone\.yaml does not exist"):
        check_task_files([str(d / "mytask.yaml")], trust=False)


def test_task_file_alias_bomb_refused(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join(['*a' + str(i - 1)] * 10)}]" for i in range(1, 9)]
    d = _folder(tmp_path, {"mytask.yaml": PLAIN + "\n".join(lines) + "\n"})
    with pytest.raises(ModbenchError, match="aliases"):
        check_task_files([str(d / "mytask.yaml")], trust=False)


def test_modbench_eval_refuses_task_code_in_one_line(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    d = _folder(tmp_path, {**CASES["function-through-include"], "evilmod.py": EVIL})
    run = tmp_path / "run"  # enough of a run folder to reach the task check
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("preset: tiny\n")
    (run / "checkpoints" / "last.pt").write_bytes(b"")
    # in process: tests.helpers.cli runs what `python -m modbench` runs
    code, _, err = cli(capsys, "eval", str(run), "--tasks", str(d / "mytask.yaml"),
                       "--no-progress")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "--trust-task-code" in err
    assert not (tmp_path / "ran").exists() and not (run / "eval.json").exists()


def test_study_spec_refuses_task_code_unless_it_trusts_it(tmp_path: Path) -> None:
    d = _folder(tmp_path, {**CASES["function-in-file"], "evilmod.py": EVIL})
    spec = {"name": "t", "methods": [], "scales": ["tiny"],
            "evaluation": {"tasks": [str(d / "mytask.yaml")]}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ModbenchError, match="trust_task_code: true"):
        load_spec(path)
    spec["evaluation"]["trust_task_code"] = True  # type: ignore[index]
    path.write_text(yaml.safe_dump(spec))
    assert load_spec(path).evaluation.trust_task_code is True
    spec["evaluation"]["trust_task_code"] = "yes"  # type: ignore[index]
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ModbenchError, match=r"'evaluation\.trust_task_code' must be true or"):
        load_spec(path)
    assert not (tmp_path / "ran").exists()


# Issue 47: the routes a task file still had to run code without the flag, with exit 0.
# SHELL would run `touch MARKER` wherever lm-eval renders it (its templates are unsandboxed).
SHELL = "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}"
T = PLAIN + "doc_to_text: '{{question}}'\n"  # a task that is fine but for what a case adds
ROUTES: dict[str, dict[str, str]] = {
    "jinja-doc_to_text": {"mytask.yaml": PLAIN + f'doc_to_text: "{SHELL}"\n'},
    "jinja-subscripts": {"mytask.yaml": PLAIN + "doc_to_target: \"{{ cycler['__init__']"
                         "['__globals__']['os'].system('touch MARKER') }}\"\n"},
    "jinja-attr-filter": {"mytask.yaml": PLAIN + "doc_to_choice: \"{{ (cycler|attr('__init__')"
                          "|attr('__globals__'))['os'].system('touch MARKER') }}\"\n"},
    "jinja-map-attribute": {"mytask.yaml": PLAIN + "description: \"{{ ([cycler]|map(attribute="
                            "'__init__.__globals__')|first).os.system('touch MARKER') }}\"\n"},
    "jinja-lipsum-gen_prefix": {"mytask.yaml": PLAIN + "gen_prefix: \"{{ lipsum.__globals__"
                                ".os.system('touch MARKER') }}\"\n"},
    "jinja-set-then-reach": {"mytask.yaml": PLAIN + "doc_to_text: \"{% set g = cycler.__init__ %}"
                             "{{ g.__globals__.os.system('touch MARKER') }}\"\n"},
    "jinja-fewshot_config": {"mytask.yaml": PLAIN + f'fewshot_config:\n  doc_to_text: "{SHELL}"\n'},
    "jinja-doc_to_image-list": {"mytask.yaml": PLAIN + f'doc_to_image: [img, "{SHELL}"]\n'},
    "jinja-through-include": {"mytask.yaml": "include: base.yaml\n" + PLAIN,
                              "base.yaml": f'doc_to_text: "{SHELL}"\n'},
    "jinja-group-inline-task": {"mytask.yaml": "group: mygroup\ntask:\n  - task: arc_easy\n"
                                f'    doc_to_text: "{SHELL}"\n'},
    "jinja-sibling-yaml": {"mytask.yaml": T, "other.yaml": f'task: t2\ndoc_to_text: "{SHELL}"\n'},
    "jinja-calls-format": {"mytask.yaml": PLAIN + "doc_to_text: \"{{ '{0.__init__.__globals__"
                           "[os].system}'.format(cycler) }}\"\n"},
    "metric-local-folder": {"mytask.yaml": T + "metric_list:\n  - metric: TASKS/mymetric\n",
                            "mymetric/mymetric.py": EVIL},
    "metric-script": {"mytask.yaml": T + "metric_list:\n  - metric: TASKS/mymetric/mymetric.py\n",
                      "mymetric/mymetric.py": EVIL},
    "metric-unregistered-name": {"mytask.yaml": T + "metric_list:\n  - metric: mymetric\n"},
    "metric-hf-evaluate": {"mytask.yaml": T + "metric_list:\n  - metric: acc\n"
                           "    hf_evaluate: true\n"},
    "metric-through-include": {"mytask.yaml": "include: base.yaml\n" + T,
                               "base.yaml": "metric_list:\n  - metric: TASKS/mymetric\n",
                               "mymetric/mymetric.py": EVIL},
    "aggregation-function": {"mytask.yaml": T + "metric_list:\n  - metric: acc\n"
                             "    aggregation: !function evilmod.f\n"},
    "filter-unregistered": {"mytask.yaml": T + "filter_list:\n  - name: x\n    filter:\n"
                            "      - function: evilmod.f\n"},
    "filter-custom-function": {"mytask.yaml": T + "filter_list:\n  - name: x\n    filter:\n"
                               "      - function: custom\n"
                               "        filter_fn: !function evilmod.f\n"},
    "process_results-function": {"mytask.yaml": T + "process_results: !function evilmod.f\n"},
    "process_docs-name": {"mytask.yaml": T + "process_docs: evilmod.f\n"},
    "custom_dataset-function": {"mytask.yaml": T + "custom_dataset: !function evilmod.f\n"},
    "class-function": {"mytask.yaml": T + "class: !function evilmod.f\n"},
    "fewshot-sampler-function": {"mytask.yaml": T + "fewshot_config:\n"
                                 "  sampler: !function evilmod.f\n"},
    "metadata-function": {"mytask.yaml": T + "metadata:\n  note: !function evilmod.f\n"},
    "dataset-script": {"mytask.yaml": T.replace("dataset_path: json", "dataset_path: "
                                                "TASKS/evilds/evilds.py"),
                       "evilds/evilds.py": EVIL},
    "dataset-script-folder": {"mytask.yaml": T.replace("dataset_path: json",
                                                       "dataset_path: TASKS/evilds"),
                              "evilds/evilds.py": EVIL},
    "use_prompt-file": {"mytask.yaml": T + "use_prompt: 'TASKS/../prompts.yaml:p'\n",
                        "../prompts.yaml": f'prompts:\n  p:\n    doc_to_text: "{SHELL}"\n'
                                           "    doc_to_target: x\n"},
    "unsafe_code": {"mytask.yaml": T + "unsafe_code: true\n"},
}
ALL_CASES = {**CASES, **ROUTES}


@pytest.mark.parametrize("case", sorted(ROUTES))
def test_every_route_refused_unless_trusted(case: str, tmp_path: Path) -> None:
    d = _folder(tmp_path, {**ROUTES[case], "evilmod.py": EVIL})
    with pytest.raises(ModbenchError) as e:
        check_task_files([str(d / "mytask.yaml")], trust=False)
    msg = str(e.value)
    assert "\n" not in msg and "would run code" in msg and "--trust-task-code" in msg, msg
    check_task_files([str(d / "mytask.yaml")], trust=True)  # the user vouches for it
    assert not (tmp_path / "ran").exists()


def _fake_run(tmp: Path) -> Path:
    run = tmp / "run"  # enough of a run folder to reach the task check
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("preset: tiny\n")
    (run / "checkpoints" / "last.pt").write_bytes(b"")
    return run


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_eval_and_study_validate_refuse_every_route_in_one_line(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _folder(tmp_path, {**ALL_CASES[case], "evilmod.py": EVIL})
    run = _fake_run(tmp_path)
    before = sorted(p.name for p in run.rglob("*"))
    code, out, err = cli(capsys, "eval", str(run), "--tasks", str(d / "mytask.yaml"),
                         "--no-progress")
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "--trust-task-code" in err and not out
    assert sorted(p.name for p in run.rglob("*")) == before  # no eval.json, no lock left
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "t", "methods": ["baseline"], "scales": ["tiny"],
                                    "evaluation": {"tasks": [str(d / "mytask.yaml")]}}))
    code, out, err = cli(capsys, "study", "validate", str(spec))
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "trust_task_code: true" in err
    assert not (tmp_path / "ran").exists()


TEMPLATES_OK = [
    "{{question}}", "Question: {{question.strip()}}\nAnswer:", "{{choices.text}}",
    "{{choices['text'][answer|int]}}", "{{ endings[label] }}", "{{ answer.split('####')[-1] }}",
    "{% for c in choices %}{{ loop.index }}. {{ c }}\n{% endfor %}", "{{ ctx|length }}",
    "{{ ['A', 'B', 'C'].index(answerKey) }}", "{{ x|regex_replace('a+', 'b') }}",
    "{{ range(3)|list }}", "{% if a is defined %}{{ a }}{% else %}-{% endif %}",
    "{{ items|map('upper')|join(', ') }}", "{{ rows|map(attribute='text')|join(' ') }}",
    "{{ d.get('k', '') }}", "{% macro m(x) %}[{{x}}]{% endmacro %}{{ m(q) }}",
    "{{ '%s?'|format(q) }}", "{{ q ~ '?' }}", "{# a comment #}{{ q }}", "plain text", "question",
]
TEMPLATES_REFUSED = {
    "{{ x.__class__ }}": "attribute '__class__'",
    "{{ x['__class__'] }}": "attribute '__class__'",
    "{{ x|attr('y') }}": "filter 'attr'",
    "{{ x|map('attr', 'y') }}": "maps the filter 'attr'",
    "{{ x|map(attribute=name) }}": "computed name",
    "{{ x|sort(attribute='a._b') }}": "attribute 'a._b'",
    "{{ x.format(y) }}": "calls .format()",
    "{{ x.append(1) }}": "calls .append()",
    "{{ f(1) }}": "calls f()",
    "{{ x['strip']() }}": "computed callable",
    "{{ x|nosuchfilter }}": "filter 'nosuchfilter'",
    "{% include 'other' %}": "loads another template",
    "{% import 'm' as m %}": "loads another template",
    "{% set ns = namespace() %}{% set ns._x = 1 %}": "attribute '_x'",
    "{{ x is nosuchtest }}": "test 'nosuchtest'",
    "{{ unclosed": "not a valid Jinja template",
}


def test_template_whitelist() -> None:
    from modbench.eval.harness import template_problem

    for ok in TEMPLATES_OK:
        assert template_problem(ok) is None, ok
    for bad, why in TEMPLATES_REFUSED.items():
        problem = template_problem(bad)
        assert problem is not None and why in problem, (bad, problem)
