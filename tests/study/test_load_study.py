"""modbench.load_study / load_run (modbench.api): a real small study read into DataFrames whose
runs are the index's and the run folders', whose verdicts are load_results' comparisons in the
report's own columns, and whose curves are metrics.jsonl; the one-line errors; the example of
docs/studies.md ("In a notebook") run as written; and `import modbench` still light."""

from __future__ import annotations

import json
import math
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

import modbench
from modbench.analysis.results import RunRow, StudyResults
from modbench.api import CURVE_COLUMNS, RUN_CURVE_COLUMNS, TABLE2_COLUMNS, run_columns
from modbench.errors import ModbenchError
from modbench.report.blocks import fmt
from modbench.report.columns import TRAINED_COLUMNS, VERDICT_COLUMNS, record_fields
from modbench.study.reporting import write_study_report
from modbench.study.results import load_results
from modbench.study.runner import run_study
from modbench.study.spec import load_spec

DOCS = Path(__file__).resolve().parents[2] / "docs" / "studies.md"
SPEC = {
    "name": "notebook-test", "baseline": "baseline", "methods": ["qknorm", "post_ln"],
    "seeds": {"default": [0], "noise_floor": [0, 1, 2], "anchors": []},
    "scales": ["tiny"], "overrides": ["train.steps=8", "train.eval_every=4"],
    "data": {"probe_mix": 0.25}, "evaluation": {"probes": True, "limit": 5},
    "claim": {"source": "a test", "text": "QK-norm does at least as well",
              "expect": {"qknorm": ["improver", "within_noise"]}},
}


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 runs of the tiny preset, 8 steps each (validated at 0, 4 and 8), probes scored, and
    the study's report written."""
    tmp = tmp_path_factory.mktemp("notebook")
    (tmp / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    out = tmp / "s"
    c = run_study(load_spec(tmp / "spec.yaml"), out, progress=False)
    assert (c["trained"], c["failed"]) == (5, 0)
    write_study_report(out)
    return out


def same(a: Any, b: Any) -> bool:
    """Equal, NaN and None counting as one missing value."""
    missing = [x is None or (isinstance(x, float) and math.isnan(x)) for x in (a, b)]
    return all(missing) if any(missing) else a == b


def test_runs_are_the_index_and_the_run_folders(study: Path) -> None:
    st = modbench.load_study(study)
    runs = st.runs
    db = sqlite3.connect(study / "index.sqlite")
    index = db.execute("SELECT key, scale, method, seed, state, status FROM runs "
                       "ORDER BY scale, method, seed").fetchall()
    db.close()
    assert len(index) == 5
    assert [tuple(r) for r in runs[["key", "scale", "method", "seed", "state", "status"]]
            .itertuples(index=False)] == index
    tasks = ["cloze", "induction", "mqar"]
    assert list(runs.columns) == run_columns(tasks)
    scalar = {f for f in RunRow.__dataclass_fields__
              if f not in ("last_grad_norms", "tasks", "task_items")}
    assert scalar <= set(runs.columns)  # every value of a RunRow is a column
    for r in runs.itertuples(index=False):
        folder = study / "runs" / r.key
        assert Path(r.run_dir) == folder
        s = json.loads((folder / "summary.json").read_text())
        ev = json.loads((folder / "eval.json").read_text())
        assert r.val_loss == s["final_val_loss"] and r.primary == s["final_val_loss"]
        assert (r.steps, r.steps_planned, r.tokens, r.params) == (
            s["steps"], s["steps_planned"], s["tokens"], s["params"])
        assert r.steps == 8
        assert (r.initial_val_loss, r.unigram_loss, r.batches_sha256) == (
            s["initial_val_loss"], s["unigram_loss"], s["batches_sha256"])
        assert r.status == s["status"] == "completed"
        for t in tasks:
            assert getattr(r, t) == ev["tasks"][t]["accuracy"]
    # a number no run has is NaN in a float column, not None
    assert runs["diverged_at_step"].dtype == "float64" and runs["diverged_at_step"].isna().all()
    # another decision metric: the probes' mean is what `primary` and the verdicts read
    probes = modbench.load_study(study, metric="probe_avg")
    assert probes.metric == "probe_avg"
    assert probes.runs["primary"].tolist() == pytest.approx(runs[tasks].mean(axis=1).tolist())
    by = probes.verdicts.set_index("method")["mean"]
    assert by["baseline"] == pytest.approx(
        runs[runs.method == "baseline"][tasks].mean(axis=1).mean())


def test_verdicts_are_load_results_in_the_report_columns(study: Path) -> None:
    st = modbench.load_study(study)
    results = load_results(study)
    assert isinstance(st.results, StudyResults) and st.metric == results.metric == "val_loss"
    v = st.verdicts
    # the columns: the scale, then every column of the report's two Table-2 tables, each as
    # the values its cell shows (no column left as text)
    assert list(v.columns) == ["scale", *record_fields(TABLE2_COLUMNS, "val_loss")]
    assert all(c.values is not None and c.names for c in TABLE2_COLUMNS)
    assert {n for c in TABLE2_COLUMNS for n in c.names} == set(v.columns) - {"scale"}
    # ... and those are the columns the written report has
    md = (study / "report" / "report.md").read_text(encoding="utf-8")
    section = md[md.index("## Methods against the baseline — tiny"):]
    verdict_table, trained_table = tables(section)[:2]
    assert verdict_table[0] == [c.title("val_loss") for c in VERDICT_COLUMNS]
    assert trained_table[0] == [c.title("val_loss") for c in TRAINED_COLUMNS]
    # value by value, load_results' comparisons
    res = results.comparisons["tiny"]
    assert v["method"].tolist() == [r.method for r in res] == ["baseline", "post_ln", "qknorm"]
    assert (v["scale"] == "tiny").all()
    for row, r in zip(v.to_dict("records"), res, strict=True):
        against = not r.is_baseline  # the baseline's own row leaves these empty
        expect = {
            "n": r.n, "n_diverged": r.n_diverged, "n_stalled": r.n_stalled, "mean": r.mean,
            "std": r.std, "verdict": str(r.verdict),
            "fewer_seeds": r.fewer_seeds and str(r.verdict) not in ("diverged", "stalled"),
            **{k: (x if against else None) for k, x in {
                "delta": r.delta, "ci_low": r.ci[0], "ci_high": r.ci[1], "z": r.z,
                "test": r.test, "t": r.t, "df": r.df, "p": r.p, "mde": r.mde,
                "mde_sigma": r.mde_sigma,
                **{f"p_{c}": p for c, p in r.p_adjusted.items()},
                **{f"significant_{c}": r.significant[c] for c in r.p_adjusted}}.items()}}
        for k, want in expect.items():
            assert same(row[k], want), (r.method, k, row[k], want)
        flops = results.flops_of("tiny", r.method)
        assert flops is not None
        assert (row["train_flops_per_token"], row["flops_ratio"]) == (
            flops.train_flops_per_token, flops.flops_ratio)
        mine = [x for x in results.rows if x.method == r.method]
        assert (row["steps_min"], row["steps_max"], row["steps_planned"]) == (8, 8, 8)
        assert row["tokens_min"] == row["tokens_max"] == mine[0].tokens
        assert row["params"] == mine[0].params
        # the report shows these very values
        cells = next(line for line in verdict_table[1:] if line[0] == f"`{r.method}`")
        head = verdict_table[0]
        assert cells[head.index("verdict")] == row["verdict"] + (" †" if row["fewer_seeds"]
                                                                 else "")
        assert cells[head.index("p holm")] == ("" if not against else fmt(row["p_holm"], 3) + (
            " *" if row["significant_holm"] else ""))
        assert cells[head.index("val_loss")].startswith(fmt(row["mean"]))
    # the claim, the spec, the names
    assert st.claim is not None and results.claim is not None
    assert st.claim.rows == results.claim.rows and st.claim.text == SPEC["claim"]["text"]
    assert st.spec["claim"]["expect"] == SPEC["claim"]["expect"]
    assert (st.name, st.baseline, st.folder) == ("notebook-test", "baseline", study)
    assert st.spec["methods"] == SPEC["methods"]
    assert "notebook-test" in repr(st) and "5 runs" in repr(st)


def tables(md: str) -> list[list[list[str]]]:
    """The markdown tables of ``md``: per table its lines' cells, the header first."""
    out: list[list[list[str]]] = []
    lines = md.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            out.append([])
        if line.startswith("|") and not line.startswith("|---"):
            out[-1].append([c.strip() for c in line.strip().strip("|").split("|")])
    return out


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_curves_are_the_metrics_logs(study: Path) -> None:
    st = modbench.load_study(study)
    curves = st.curves
    assert list(curves.columns) == list(CURVE_COLUMNS)
    assert set(curves["run"]) == set(st.runs["key"])
    for r in st.runs.itertuples(index=False):
        mine = curves[curves.run == r.key]
        assert set(zip(mine.scale, mine.method, mine.seed, strict=True)) == {
            (r.scale, r.method, r.seed)}
        records = jsonl(Path(r.run_dir) / "metrics.jsonl")
        want = [(rec["step"], k, float(x)) for rec in records for k, x in rec.items()
                if k not in ("kind", "step")]
        assert list(zip(mine.step, mine.metric, mine.value, strict=True)) == want
        val = mine[mine.metric == "val_loss"]
        assert val.step.tolist() == [0, 4, 8]
        assert val.value.iloc[-1] == r.val_loss
        train = mine[mine.metric == "loss"]
        assert train.step.tolist() == list(range(1, 9))
    assert set(curves.metric) == {"loss", "lr", "grad_norm", "tokens_per_s", "tokens",
                                  "val_loss", "val_ppl"}


def test_load_run_reads_a_run_folder(study: Path, tmp_path: Path) -> None:
    st = modbench.load_study(study)
    key = st.runs["key"][0]
    folder = study / "runs" / key
    run = modbench.load_run(folder)
    assert run.folder == folder and run.status == "completed"
    assert run.config == yaml.safe_load((folder / "config.yaml").read_text())
    assert run.config["model"]["method"] == "baseline"
    assert run.summary == json.loads((folder / "summary.json").read_text())
    assert run.eval == json.loads((folder / "eval.json").read_text())
    assert list(run.curves.columns) == list(RUN_CURVE_COLUMNS)
    assert run.metrics is run.curves
    from_study = st.curves[st.curves.run == key][list(RUN_CURVE_COLUMNS)]
    assert run.curves.reset_index(drop=True).equals(from_study.reset_index(drop=True))
    # a run cut short: no summary, no evaluation, a non-finite step logged as null
    cut = tmp_path / "cut"
    shutil.copytree(folder, cut, ignore=shutil.ignore_patterns("checkpoints"))
    (cut / "summary.json").unlink()
    (cut / "eval.json").unlink()
    with open(cut / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "train", "step": 9, "loss": None, "lr": 0.001,
                            "grad_norm": None, "nonfinite": True}) + "\n")
    partial = modbench.load_run(cut)
    assert (partial.summary, partial.eval, partial.status) == (None, None, None)
    last = partial.curves[partial.curves.step == 9]
    assert last.metric.tolist() == ["loss", "lr", "grad_norm"]  # the flag is not a curve
    assert last.value.isna().tolist() == [True, False, True]
    assert "not finished" in repr(partial)


def one_line_error(call: Any, *args: Any) -> str:
    with pytest.raises(ModbenchError) as e:
        call(*args)
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_a_folder_that_is_not_a_study_or_a_run_is_one_line(study: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    run = next((study / "runs").iterdir())
    missing = tmp_path / "nowhere"
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")

    text = one_line_error(modbench.load_study, missing)
    assert str(missing) in text and "does not exist" in text and "study run --out" in text
    text = one_line_error(modbench.load_study, empty)
    assert str(empty) in text and "not a study folder" in text and "modbench study run" in text
    text = one_line_error(modbench.load_study, a_file)
    assert str(a_file) in text and "is not a folder" in text
    text = one_line_error(modbench.load_study, run)
    assert text == (f"{run} is a run folder, not a study folder; read it with "
                    f"modbench.load_run({str(run)!r})")

    text = one_line_error(modbench.load_run, study)
    assert str(study) in text and "is a study folder" in text and "load_study" in text
    text = one_line_error(modbench.load_run, empty)
    assert str(empty) in text and "has no config.yaml" in text and "train --out" in text
    text = one_line_error(modbench.load_run, missing)
    assert str(missing) in text and "does not exist" in text
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged, ignore=shutil.ignore_patterns("checkpoints"))
    (damaged / "summary.json").write_text('{"status": "compl')
    text = one_line_error(modbench.load_run, damaged)
    assert str(damaged / "summary.json") in text and "train the run again" in text

    # without pandas: one line naming the extra
    monkeypatch.setitem(sys.modules, "pandas", None)
    for call, where in ((modbench.load_study, study), (modbench.load_run, run)):
        text = one_line_error(call, where)
        assert "pip install 'modbench[notebook]'" in text


def test_import_modbench_imports_neither_pandas_nor_torch() -> None:
    code = (
        "import sys, modbench\n"
        "heavy = [m for m in ('pandas', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert 'load_study' in dir(modbench) and 'modbench.api' not in sys.modules\n"
        "try:\n"
        "    modbench.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_name' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
        "from modbench import load_run, load_study, Study, Run\n"
        "import modbench.api as api\n"
        "assert load_study is api.load_study and Run is api.Run\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]


def docs_example() -> str:
    """The python block of docs/studies.md's "In a notebook" section."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## In a notebook"):]
    section = section[:section.index("\n## ", 1)]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    return block


def test_the_docs_example_runs_on_a_study(study: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    code = docs_example()
    assert 'modbench.load_study("studies/smoke")' in code
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "smoke").symlink_to(study, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {}
    try:
        exec(compile(code, f"{DOCS}:In a notebook", "exec"), ns)
        st = ns["study"]
        runs = st.runs
        means = runs.groupby("method")["val_loss"].mean()
        assert ns["means"]["tiny"].to_dict() == pytest.approx(means.to_dict())
        assert ns["table"]["method"].tolist() == ["post_ln", "qknorm"]
        assert len(ns["ax"].get_lines()) == len(runs)  # one line per run
        assert ns["ax"].get_ylabel() == "validation loss"
        assert ns["run"].folder == Path("studies/smoke/runs") / runs["key"][0]
        printed = capsys.readouterr().out
        assert "notebook-test" in printed and "0.003 completed" in printed
    finally:
        plt.close("all")


def test_an_empty_study_gives_empty_frames_with_their_columns(tmp_path: Path) -> None:
    from modbench.study.store import Store

    Store(tmp_path / "s").register("k", "tiny", "baseline", 0)  # pending, never trained
    st = modbench.load_study(tmp_path / "s")
    assert st.runs["state"].tolist() == ["pending"] and st.runs["status"].isna().all()
    assert st.verdicts.empty and list(st.verdicts.columns) == [
        "scale", *record_fields(TABLE2_COLUMNS, st.metric)]
    assert st.curves.empty and list(st.curves.columns) == list(CURVE_COLUMNS)
    assert st.spec == {} and st.claim is None and st.name == "s"
    assert isinstance(st.runs, pd.DataFrame)
