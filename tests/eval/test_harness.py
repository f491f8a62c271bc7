"""lm-evaluation-harness both ways (in process and through an exported Hugging Face
checkpoint), on local task files this test writes; they must agree. The export itself is
tested in test_export.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from modbench.cli import run_cli
from modbench.eval.export import export_hf
from modbench.eval.harness import SUITES, make_adapter, run_tasks
from modbench.eval.run import load_run
from modbench.runtime.data import open_data
from modbench.train.trainer import train
from tests.helpers import tiny

MC = [
    {"question": "The module for regular expressions is", "choices": [" re", " os", " sys"],
     "answer": 0},
    {"question": "To open a file you call", "choices": [" open", " close", " seek"], "answer": 0},
    {"question": "A list literal is written with", "choices": [" brackets", " quotes"],
     "answer": 0},
    {"question": "Return the number of items in a", "choices": [" list", " tomato"],
     "answer": 0},
]
CLOZE = [
    {"context": "Return the number of items in the", "word": "list"},
    {"context": "This function returns a new", "word": "object"},
    {"context": "Raise an exception if the file does not", "word": "exist"},
]


def write_tasks(folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (folder / "cloze.jsonl").write_text("".join(json.dumps(d) + "\n" for d in CLOZE))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "mc.yaml").write_text(
        f"task: mbtest_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder}/mc.jsonl\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (folder / "cloze.yaml").write_text(
        f"task: mbtest_cloze\n{common}dataset_kwargs:\n  data_files:\n"
        f"    test: {folder}/cloze.jsonl\noutput_type: loglikelihood\n"
        "doc_to_text: '{{context}}'\ndoc_to_target: ' {{word}}'\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return [str(folder / "mc.yaml"), str(folder / "cloze.yaml")]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("harness") / "run"
    train(tiny("qknorm", 0, 25), out, progress=False)
    return out


@pytest.fixture
def managers(monkeypatch: pytest.MonkeyPatch) -> list[dict]:  # type: ignore[type-arg]
    """The keyword arguments of every lm_eval task manager made while the test runs."""
    import lm_eval.tasks

    made: list[dict] = []  # type: ignore[type-arg]
    real = lm_eval.tasks.TaskManager

    def spy(*args: object, **kwargs: object) -> object:
        made.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", spy)
    return made


def loglikelihoods(res: dict) -> list[float]:  # type: ignore[type-arg]
    return [s["resps"][0][0][0] for s in res["samples"]["mbtest_cloze"]]


def test_in_process_and_exported_agree(run_dir: Path, tmp_path: Path) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    files = write_tasks(tmp_path / "tasks")
    cfg, model, _ = load_run(run_dir)
    lm = make_adapter(model, open_data(cfg, progress=False).tokenizer(), batch_size=3)
    # the local folder alone: indexing lm_eval's thousands of built-in task files takes
    # 10-25 s a manager here
    manager = TaskManager(include_path=[str(tmp_path / "tasks")], include_defaults=False)
    kw = dict(tasks=["mbtest_mc", "mbtest_cloze"], task_manager=manager, log_samples=True,
              bootstrap_iters=0)
    ours = lm_eval.simple_evaluate(model=lm, **kw)
    out = export_hf(run_dir, tmp_path / "hf")
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={out},trust_remote_code=True,dtype=float32",
        batch_size=2, device="cpu", **kw)
    assert loglikelihoods(ours) == pytest.approx(loglikelihoods(theirs), abs=1e-4)
    for task in ("mbtest_mc", "mbtest_cloze"):
        assert ours["results"][task]["acc,none"] == theirs["results"][task]["acc,none"]
    # run_tasks (what `modbench eval --tasks` uses) reports the same, per item
    summary = run_tasks(lm, files)
    assert summary["mbtest_mc"]["score"] == ours["results"]["mbtest_mc"]["acc,none"]
    assert summary["mbtest_mc"]["n"] == len(MC) and len(summary["mbtest_cloze"]["items"]) == 3


def test_cli_eval_tasks_and_suites(run_dir: Path, tmp_path: Path,
                                   managers: list[dict],  # type: ignore[type-arg]
                                   capsys: pytest.CaptureFixture[str]) -> None:
    files = write_tasks(tmp_path / "tasks")
    assert run_cli(["eval", str(run_dir), "--tasks", files[0], "--tasks", files[1],
                    "--no-progress"]) == 0
    # local task files only: the manager indexes their folder, not the built-in tasks
    assert managers == [{"include_path": [str((tmp_path / "tasks").resolve())],
                         "include_defaults": False}]
    ev = json.loads((run_dir / "eval.json").read_text())
    assert {"mbtest_mc", "mbtest_cloze"} <= set(ev["tasks"])
    assert ev["tasks"]["mbtest_mc"]["n"] == len(MC)
    capsys.readouterr()
    assert run_cli(["eval", "--list-suites"]) == 0
    out = capsys.readouterr().out
    assert "climb12" in out and all(t in out for t in SUITES["climb12"])
    assert len(SUITES["climb12"]) == 12
