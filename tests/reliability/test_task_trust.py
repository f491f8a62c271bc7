"""The trust boundary of lm-evaluation-harness task files (modbench.eval.harness): a task
YAML that would run Python (``!function``, directly or through ``include:``, an included
``.py``, ``trust_remote_code``) is refused in one line unless the user trusts it
(``modbench eval --trust-task-code``, a study's ``evaluation.trust_task_code: true``); no
code runs. Tiny local task files, no network."""

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
    d = tmp / "tasks"
    d.mkdir()
    for name, text in files.items():
        (d / name).write_text(text.replace("{marker!r}", repr(str(tmp / "ran"))))
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
