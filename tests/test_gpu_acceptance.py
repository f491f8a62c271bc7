"""benchmarks/gpu_acceptance.py: its CPU dry path runs every section (or records why not) and
writes the JSON a GPU lease would; a failing or overrunning section is recorded and the script
goes on; the JSON is on disk after every section."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import helpers

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance.py"
SECTIONS = ["environment", "tests", "memory_plan", "climb_1_2b", "llama_350m", "compile_graphs",
            "fsdp_units", "nccl_2proc"]


def load_script() -> ModuleType:
    return helpers.load_script(SCRIPT, "gpu_acceptance")


@pytest.fixture(scope="module")
def dry(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("acceptance") / "dry.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data: dict[str, Any] = json.loads(out.read_text())
    return data


@pytest.mark.slow
def test_dry_path_runs_every_section(dry: dict[str, Any]) -> None:
    assert dry["schema"] == 1 and dry["device"] == "cpu" and dry["dry_run"] is True
    assert dry["complete"] is True and dry["budget_s"] == 420
    assert list(dry["sections"]) == SECTIONS
    for name, s in dry["sections"].items():
        assert s["status"] in ("ok", "skipped", "error", "cut"), name
        assert s["elapsed_s"] >= 0 and s["allotted_s"] > 0
        if s["status"] in ("error", "cut"):  # recorded, with what went wrong
            assert isinstance(s["error"], str) and s["error"], name
    # the dry path's sections all run on the CPU; only the two-process run is skipped
    assert {n: s["status"] for n, s in dry["sections"].items()} == {
        **dict.fromkeys(SECTIONS, "ok"), "nccl_2proc": "skipped"}, dry["sections"]


@pytest.mark.slow
def test_dry_path_sections_hold_what_they_measured(dry: dict[str, Any]) -> None:
    s = dry["sections"]
    assert s["environment"]["torch"] and s["environment"]["cuda_available"] in (True, False)
    tests = s["tests"]
    counts = tests["counts"]
    assert set(counts) == {"passed", "failed", "skipped", "error"} and not tests["cut"]
    assert sum(counts.values()) > 100 and counts["failed"] == counts["error"] == 0
    plan = s["memory_plan"]["rows"]
    assert [(r["preset"], r["method"]) for r in plan] == [("tiny", "baseline")]
    assert all(r["status"] == "ok" and r["micro_batch"] >= 1 and len(r["step_s"]) == 2
               for r in plan)
    # the plan (modbench.measure.plan) predicts; the CPU measures no allocation
    assert all(r["source"] == "plan" and r["predicted_bytes"] > 0 and r["measured_bytes"] is None
               for r in plan)
    climb = s["climb_1_2b"]
    assert climb["preset"] == "tiny" and climb["run_status"] == "completed"
    assert climb["tokens_per_s_steady"] > 0 and climb["steady_steps"] == 3
    # train.micro_batch_size=auto: the plan's choice on this device, recorded by the trainer
    assert climb["micro_batch"]["setting"] == "auto"
    assert 1 <= climb["micro_batch"]["chosen"] <= climb["batch"][0]
    bench = s["llama_350m"]
    assert bench["dtype"] == "fp32" and bench["compiled"] is False  # the CPU's defaults
    assert bench["bare"]["tokens_per_s"] > 0 and bench["trainer"]["tokens_per_s"] > 0
    graphs = s["compile_graphs"]
    for label in ("plain", "activation_checkpointing"):
        assert graphs[label]["graph_count"] >= 1 and graphs[label]["graph_break_count"] >= 0
    check = graphs["compile_check"]  # modbench bench --compile-check, both modes
    assert check["status"] == "ok", check
    assert [(r["method"], r["checkpointing"]) for r in check["rows"]] == [
        ("baseline", False), ("baseline", True), ("softcap", False), ("softcap", True)]
    assert all((r["graphs"], r["graph_breaks"]) == (1, 0) for r in check["rows"]), check
    units = s["fsdp_units"]
    # one unit per decoder block (issue 28) around the root; tiny ties its head, so the
    # embedding stays in the root
    assert units["units"] == ["<root>", *(f"blocks.{i}" for i in range(units["n_layers"]))]
    assert units["unit_count"] == 1 + units["n_layers"]
    assert s["nccl_2proc"]["reason"]


def test_a_failing_section_is_recorded_and_the_next_runs(tmp_path: Path) -> None:
    ga = load_script()
    out = tmp_path / "a.json"
    run = ga.Run("cpu", out, 60.0, tmp_path)

    def broken(run: Any, allot: float) -> dict[str, Any]:
        raise ValueError("no such thing")

    run.section("tests", broken)
    on_disk = json.loads(out.read_text())  # written after the section, before the next
    assert on_disk["sections"]["tests"]["status"] == "error"
    assert "ValueError: no such thing" in on_disk["sections"]["tests"]["error"]
    assert on_disk["complete"] is False
    run.section("memory_plan", lambda run, allot: {"rows": [], "allot_seen": allot})
    on_disk = json.loads(out.read_text())
    assert on_disk["sections"]["memory_plan"]["status"] == "ok"
    assert 0 < on_disk["sections"]["memory_plan"]["allot_seen"] <= 60


def test_sections_share_what_is_left_of_the_budget(tmp_path: Path) -> None:
    ga = load_script()
    run = ga.Run("cpu", tmp_path / "b.json", 100.0, tmp_path)
    shares = dict(ga.SECTIONS)
    later = sum(s for n, s in ga.SECTIONS[ga.SECTIONS.index(("tests", shares["tests"])):])
    assert run.budget.share("tests") == pytest.approx(100 * shares["tests"] / later, rel=0.02)
    assert run.budget.share("nccl_2proc") == pytest.approx(run.budget.left(), rel=0.02)
    spent = ga.Run("cpu", tmp_path / "c.json", 0.01, tmp_path)
    time.sleep(0.05)
    spent.section("tests", lambda run, allot: pytest.fail("ran with no budget left"))
    assert spent.report["sections"]["tests"]["status"] == "cut"
    assert "no time left" in spent.report["sections"]["tests"]["error"]


def test_a_child_past_its_time_is_killed(tmp_path: Path) -> None:
    ga = load_script()
    t0 = time.monotonic()
    code, _, _ = ga.run_child([sys.executable, "-c", "import time; time.sleep(60)"], 1.0)
    assert code is None and time.monotonic() - t0 < 30
    code, text, _ = ga.run_child([sys.executable, "-c", "print('hello')"], 30.0)
    assert code == 0 and text.strip() == "hello"


def test_steady_throughput_leaves_out_the_first_window() -> None:
    ga = load_script()
    records = ([{"kind": "train", "step": k, "tokens_per_s": 10.0} for k in range(1, 17)]
               + [{"kind": "val", "step": 16}]
               + [{"kind": "train", "step": k, "tokens_per_s": 100.0 if k <= 24 else 300.0}
                  for k in range(17, 33)])
    # 16 steps: 8 at 100 tok/s and 8 at 300 tok/s (per step's tokens): 16 / (8/100 + 8/300)
    assert ga.steady_tokens_per_s(records, 16) == pytest.approx(16 / (8 / 100 + 8 / 300))
    assert ga.steady_tokens_per_s(records[:16], 16) is None


def test_test_counts_come_from_pytest_and_a_cut_run_keeps_what_finished(tmp_path: Path) -> None:
    ga = load_script()
    suite = tmp_path / "test_sample.py"
    suite.write_text("import time\n\nimport pytest\n\n\ndef test_ok():\n    pass\n\n\n"
                     "def test_bad():\n    assert False\n\n\n"
                     "@pytest.mark.skip(reason='x')\ndef test_skip():\n    pass\n\n\n"
                     "def test_slow():\n    time.sleep(300)\n")
    run = ga.Run("cpu", tmp_path / "t.json", 60.0, tmp_path)
    run.size = {**run.size, "tests": [str(suite)]}
    # the cut comes at the share: pytest starts and runs the three quick tests in ~2 s (idle),
    # so 8 s leaves them room on a loaded machine without waiting 30 s for test_slow's cut
    got = ga.s_tests(run, 8.0)
    assert got["cut"] is True and got["exit_code"] is None and "cut at" in got["note"]
    assert got["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 0}
    assert [name.rsplit("::", 1)[-1] for name in got["failed"]] == ["test_bad"]


def test_one_gpu_skips_the_two_process_run(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    import torch

    ga = load_script()
    run = ga.Run("cpu", tmp_path / "n.json", 60.0, tmp_path)
    assert ga.s_nccl(run, 30.0)["status"] == "skipped"  # the dry path
    run.cuda = True
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    got = ga.s_nccl(run, 30.0)
    assert got["status"] == "skipped" and "needs 2" in got["reason"]
