"""Positive controls of the task-file trust boundary (test_task_trust.py): each payload does
run on lm-eval's own code path (its template renderer, ``get_metric``, its YAML loader,
``get_prompt``, a whole task through ``run_tasks --trust-task-code``), so the refusals there
are what keeps the marker unwritten; the sandbox lm-eval renders in under modbench stops a
document's value that names an attribute; lm-eval's own task files pass the check. Local
files, no network."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.model import LM  # noqa: E402
from tests.reliability.conftest import long_variant  # noqa: E402
from tests.reliability.test_task_trust import EVIL, ROUTES, SHELL, _folder  # noqa: E402

from modbench.errors import ModbenchError  # noqa: E402
from modbench.eval.harness import check_task_files  # noqa: E402


def test_template_payload_runs_in_lm_evals_renderer_and_not_in_the_sandbox(
        tmp_path: Path) -> None:
    from jinja2.exceptions import SecurityError
    from lm_eval.utils import apply_template

    from modbench.eval.harness import _harness_guards

    payload = SHELL.replace("MARKER", str(tmp_path / "ran"))
    with _harness_guards(False), pytest.raises(SecurityError):  # as run_tasks renders it
        apply_template(payload, {})
    assert not (tmp_path / "ran").exists()
    apply_template(payload, {})  # lm-eval as it is: the shell command runs
    assert (tmp_path / "ran").exists()


def test_metric_folder_payload_runs_through_lm_evals_get_metric(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("evaluate")
    import subprocess

    d = _folder(tmp_path, {"mymetric/mymetric.py": EVIL})
    # in a fresh process: lm-eval's and evaluate's state left by other test files of this
    # worker must not decide whether the payload's route runs
    code = ("import sys, evaluate\n"
            f"evaluate.config.HF_MODULES_CACHE = {str(tmp_path / 'modules')!r}\n"
            "from lm_eval.api.registry import get_metric\n"
            "get_metric(sys.argv[1])\n")  # what lm-eval does with a name it does not know
    subprocess.run([sys.executable, "-c", code, str(d / "mymetric")], capture_output=True,
                   timeout=300)
    assert (tmp_path / "ran").exists()


def test_tag_in_metadata_runs_as_lm_eval_reads_the_file(tmp_path: Path) -> None:
    loader = pytest.importorskip("lm_eval.tasks._yaml_loader")
    d = _folder(tmp_path, {**ROUTES["metadata-function"], "evilmod.py": EVIL})
    loader.load_yaml(d / "mytask.yaml")
    assert (tmp_path / "ran").exists()


def test_prompt_file_payload_runs_through_lm_evals_get_prompt(tmp_path: Path) -> None:
    from lm_eval.prompts import get_prompt

    _folder(tmp_path, ROUTES["use_prompt-file"])
    get_prompt(f"{tmp_path / 'prompts.yaml'}:p").apply({})
    assert (tmp_path / "ran").exists()


class _FakeLM(LM):  # type: ignore[misc]
    """Answers every request at once: enough for lm-eval to build and run a task."""

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:  # type: ignore[type-arg]
        return [(-1.0, True) for _ in requests]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:  # type: ignore[type-arg]
        return [-1.0 for _ in requests]

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list:  # type: ignore[type-arg]
        return ["" for _ in requests]


def _data_task(d: Path, extra: str, rows: list[dict[str, str]]) -> Path:
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    f = d / "mytask.yaml"
    f.write_text(f"task: mytask\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                 f"    test: {d}/data.jsonl\ntest_split: test\noutput_type: loglikelihood\n"
                 "doc_to_target: ' {{answer}}'\n" + extra)
    return f


def test_the_flag_is_what_lets_a_template_run(tmp_path: Path) -> None:
    from modbench.eval.harness import run_tasks

    d = tmp_path / "tasks"
    d.mkdir()
    f = _data_task(d, f'doc_to_text: "{SHELL.replace("MARKER", str(tmp_path / "ran"))}"\n',
                   [{"question": "q", "answer": "a"}])
    with pytest.raises(ModbenchError, match="doc_to_text reaches the attribute '__init__'"):
        run_tasks(_FakeLM(), [str(f)])
    assert not (tmp_path / "ran").exists()
    out = run_tasks(_FakeLM(), [str(f)], trust_code=True)  # trusted: lm-eval as it is
    assert out["mytask"]["n"] == 1 and (tmp_path / "ran").exists()


def test_a_name_from_the_data_reaching_an_attribute_stops_in_the_sandbox(
        tmp_path: Path) -> None:
    """A subscript by a document's value passes the static check (``choices[label]`` is
    everyday); if the value names an attribute, the sandbox lm-eval renders in stops it."""
    from lm_eval.utils import apply_template

    from modbench.eval.harness import run_tasks

    d = tmp_path / "tasks"
    d.mkdir()
    f = _data_task(d, "doc_to_text: '{{ cycler[key] }}'\n",
                   [{"key": "__init__", "answer": "a"}])
    assert "Cycler.__init__" in apply_template("{{ cycler[key] }}", {"key": "__init__"})
    with pytest.raises(ModbenchError) as e:
        run_tasks(_FakeLM(), [str(f)])
    assert "\n" not in str(e.value) and "as it was rendered" in str(e.value)


# The check does not refuse what lm-eval's own tasks do.
STANDARD = ["arc/arc_easy.yaml", "arc/arc_challenge.yaml", "hellaswag/hellaswag.yaml",
            "lambada/lambada_openai.yaml", "piqa/piqa.yaml", "winogrande/default.yaml",
            "openbookqa/openbookqa.yaml", "sciq/sciq.yaml", "siqa/siqa.yaml",
            "super_glue/boolq/default.yaml", "race/race.yaml", "truthfulqa/truthfulqa_mc2.yaml",
            "gsm8k/gsm8k.yaml", "mmlu/default/mmlu_abstract_algebra.yaml"]


def _installed() -> Path:
    from modbench.eval.harness import _installed_tasks

    root = _installed_tasks()
    assert root is not None
    return root


@pytest.mark.parametrize("rel", STANDARD)
def test_standard_lm_eval_task_files_pass(rel: str) -> None:
    path = _installed() / rel
    if not path.is_file():
        pytest.skip(f"this lm-eval has no {rel}")
    check_task_files([str(path)], trust=False)  # with their folders, includes, !functions


def test_a_local_task_including_a_standard_one_passes(tmp_path: Path) -> None:
    """hellaswag.yaml names `!function utils.process_docs` beside it: installed code."""
    d = _folder(tmp_path, {"mytask.yaml": f"include: {_installed() / 'hellaswag/hellaswag.yaml'}"
                           "\ntask: my_hellaswag\n"
                           "doc_to_text: '{{query.strip()}} {{ endings[label|int] }}'\n"})
    check_task_files([str(d / "mytask.yaml")], trust=False)


@long_variant
def test_every_installed_lm_eval_task_file_long(record: Any) -> None:
    """All of lm-eval's own task files through the checks one by one (each with what it
    includes): none refused for a template, a filter or a tag; the rest refused for a route
    that does run code: `hf_evaluate` or a metric outside lm-eval's registry (a script from
    the Hub), `trust_remote_code`, `unsafe_code`, promptsource's templates."""
    from modbench.eval import harness as h

    reasons: Counter[str] = Counter()
    files = sorted(_installed().rglob("*.yaml"))
    for path in files:
        read: dict[Path, Any] = {}
        todo = [path.resolve()]
        while todo:
            real = todo.pop().resolve()
            if real not in read and real.is_file():
                read[real] = h.read_task_yaml(real)
                todo += h._includes(read[real], real)
        real = path.resolve()
        merged = h._merged(real, read)
        what = (h._code_in(read[real], real) or h._config_problem(read[real], real)
                or (h._metric_problem(merged) if isinstance(merged, dict) else None))
        if what is not None:
            reasons[what.split(" ")[0].rstrip(":")] += 1
    record({"task files": len(files), "refused": sum(reasons.values()), "by field": reasons})
    assert set(reasons) <= {"metric_list", "trust_remote_code", "unsafe_code", "use_prompt"}, \
        reasons
