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


class _FakeLM:
    """An lm-eval LM answering every request at once (built on first use: lm_eval's LM)."""

    def __new__(cls) -> object:
        from lm_eval.api.model import LM

        class Fake(LM):  # type: ignore[misc]
            def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:  # type: ignore[type-arg]
                return [(-1.0, True) for _ in requests]

            def loglikelihood_rolling(self, requests: list,  # type: ignore[type-arg]
                                      disable_tqdm: bool = False) -> list:  # type: ignore[type-arg]
                return [-1.0 for _ in requests]

            def generate_until(self, requests: list, disable_tqdm: bool = False) -> list:  # type: ignore[type-arg]
                return ["" for _ in requests]

        return Fake()


def _fake_run(tmp: Path) -> Path:
    run = tmp / "run"  # enough of a run folder to reach the task checks
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("preset: tiny\n")
    (run / "checkpoints" / "last.pt").write_bytes(b"")
    return run


def test_unknown_task_is_one_line_with_close_names(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a 49-line KeyError traceback from inside lm-eval, exit 1, after the model had
    loaded and validated. Now refused before any work, with lm-eval's closest names."""
    from tests.helpers import cli

    run = _fake_run(tmp_path)
    code, _, err = cli(capsys, "eval", str(run), "--tasks", "arc_esy", "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: unknown task 'arc_esy'") and "arc_easy" in err
    code, _, err = cli(capsys, "eval", str(run), "--tasks", "no_such_task", "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "unknown task 'no_such_task'" in err
    # a name lm-eval does not know that is a file: lm-eval read it as a task file, unchecked,
    # and imported the module its !function names
    (tmp_path / "evilmod.py").write_text(
        f"import pathlib\npathlib.Path({str(tmp_path / 'ran')!r}).write_text('ran')\n"
        "def f(docs):\n    return docs\n")
    evil = tmp_path / "evil.txt"
    evil.write_text("task: evil\ndataset_path: json\nprocess_docs: !function evilmod.f\n")
    code, _, err = cli(capsys, "eval", str(run), "--tasks", str(evil), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "is a file but not a task file" in err and not (tmp_path / "ran").exists()
    assert not (run / "eval.json").exists()


def test_folders_files_and_yml_named_as_tasks_are_one_line(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from modbench.errors import ModbenchError
    from modbench.eval.harness import _make_manager, check_task_names

    monkeypatch.chdir(tmp_path)
    manager = _make_manager(((), True))  # lm-eval's own tasks (kept from the test above)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModbenchError, match="folder that holds no task YAML file"):
        check_task_names(["empty"], [], manager)
    files = write_tasks(tmp_path / "tasks")
    with pytest.raises(ModbenchError, match=r"is a folder, not a task; .*mc\.yaml"):
        check_task_names(["tasks"], [], manager)
    (tmp_path / "evil.txt").write_text("task: evil\nprocess_docs: !function evilmod.f\n")
    # lm-eval would read a name it does not know as a task file, unchecked
    with pytest.raises(ModbenchError, match="is a file but not a task file"):
        check_task_names(["evil.txt"], [], manager)
    yml = Path(files[0]).with_suffix(".yml")
    Path(files[0]).rename(yml)
    local = _make_manager(((str(yml.parent.resolve()),), False))
    with pytest.raises(ModbenchError, match=r"rename it to end in \.yaml"):
        check_task_names([], [str(yml)], local)
    assert check_task_names([], [files[1]], local) == ["mbtest_cloze"]


def test_a_group_file_runs_under_its_group_name(tmp_path: Path) -> None:
    from modbench.eval.harness import run_tasks

    files = write_tasks(tmp_path / "tasks")
    group = tmp_path / "tasks" / "both.yaml"
    group.write_text("group: mbtest_both\ntask: [mbtest_mc, mbtest_cloze]\n")
    out = run_tasks(_FakeLM(), [str(group)])
    assert {"mbtest_mc", "mbtest_cloze"} <= set(out), out
    assert len(files) == 2


def test_no_git_complaint_on_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capfd: pytest.CaptureFixture[str]) -> None:
    """lm-eval runs `git describe` to record a commit; outside a repository git said "fatal:
    not a git repository" on stderr at every `modbench eval --tasks`."""
    import shutil
    import subprocess

    from modbench.eval.harness import run_tasks

    monkeypatch.chdir(tmp_path)
    files = write_tasks(tmp_path / "tasks")
    if shutil.which("git") is not None:  # the control: lm-eval's own call complains here
        from lm_eval.loggers.utils import get_git_commit_hash

        if subprocess.run(["git", "rev-parse"], capture_output=True).returncode == 0:
            pytest.skip("the temporary folder is inside a git repository")
        capfd.readouterr()
        get_git_commit_hash()
        assert "not a git repository" in capfd.readouterr().err
    out = run_tasks(_FakeLM(), files)
    assert out["mbtest_mc"]["n"] == len(MC)
    err = capfd.readouterr().err
    assert "not a git repository" not in err and "fatal:" not in err, err
