"""Every job's memory plan checked against its executor's GPU (issue 46): ``study run
--dry-run`` names each job's parallel mode, micro-batch and planned peak, and both the dry
run and a real run refuse, before any data is prepared or hashed, the jobs that fit nothing:
one line a job, the memory it needs against what the GPU has, exit 2. Where the executor's
GPU is not known (the local executor without CUDA) nothing is planned or said."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from modbench.cli import run_cli
from modbench.runtime.gpus import lookup
from modbench.study import executors
from modbench.study.fits import JobsDoNotFit
from modbench.study.runner import run_study
from modbench.study.spec import load_spec

pytestmark = pytest.mark.usefixtures("one_thread")

# tiny's shape made 6.7B parameters wide: its fp32 weights, gradients and AdamW state alone
# (107 GB) overflow an H100 80 GB, at any micro-batch; two layers trace in a second
HUGE = ["model.d_model=32768", "model.d_ff=1024"]


def write_spec(tmp: Path, overrides: list[str], methods: list[str] | None = None) -> Path:
    p = tmp / "spec.yaml"
    p.write_text(yaml.safe_dump({
        "name": "fits", "baseline": "baseline", "methods": methods or ["qknorm"],
        "seeds": {"default": [0], "noise_floor": [0], "anchors": []}, "scales": ["tiny"],
        "overrides": ["train.steps=4", "train.eval_every=0", *overrides],
        "evaluation": {"probes": False}}))
    return p


@pytest.fixture
def data_spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every call that prepares or opens (hashes) a study's data."""
    import modbench.runtime.data as runtime_data
    import modbench.study.runner as runner

    calls: list[str] = []

    def spy(name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            calls.append(name)
            raise AssertionError(f"{name} called: data work before the memory check")
        return record

    monkeypatch.setattr(runner, "_prepare_data", spy("_prepare_data"))
    monkeypatch.setattr(runtime_data, "open_data", spy("open_data"))
    return calls


def _refusals(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: job ")]


def test_the_dry_run_refuses_jobs_that_cannot_fit_an_h100_naming_each(
        tmp_path: Path, data_spy: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    spec, out = write_spec(tmp_path, HUGE), tmp_path / "study"
    code = run_cli(["study", "run", str(spec), "--out", str(out), "--executor", "slurm",
                    "--dry-run"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = _refusals(captured.err)
    assert [line.split()[2:4] for line in lines] == [["tiny/baseline", "s0"],
                                                      ["tiny/qknorm", "s0"]]
    for line in lines:
        assert "does not fit one NVIDIA H100 SXM 80GB: it needs " in line
        need = re.search(r"it needs ([\d.]+) GB a GPU", line)
        has = re.search(r"the GPU has ([\d.]+) GB usable of 80.0 GB", line)
        assert need and has and float(need[1]) > float(has[1]) == 69.9
        assert "use " in line and "a smaller model" in line
    assert "2 of 2 job(s) do not fit" in captured.err.splitlines()[-1]
    assert data_spy == [] and not out.exists()


def test_a_real_run_refuses_them_before_any_data_work(
        tmp_path: Path, data_spy: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The local executor on a machine with an H100 (its CUDA device, faked here): the
    study refuses both jobs before its data is prepared or opened, and leaves no folder."""
    kind = executors.get("local")
    monkeypatch.setattr(type(kind), "memory_gpu",
                        lambda self, gpus, gpu_type=None: lookup("h100"))
    spec, out = write_spec(tmp_path, HUGE), tmp_path / "study"
    with pytest.raises(JobsDoNotFit) as e:
        run_study(load_spec(spec), out, progress=False)
    assert len(e.value.lines) == 3 and "\n" not in str(e.value)
    assert data_spy == [] and not out.exists()
    code = run_cli(["study", "run", str(spec), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(_refusals(err)) == 2, err
    assert data_spy == [] and not out.exists()


def test_the_dry_run_names_each_jobs_parallel_mode_and_planned_peak(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, ["train.parallel=auto"])
    code = run_cli(["study", "run", str(spec), "--out", str(tmp_path / "s"), "--executor",
                    "slurm", "--gpus-per-run", "2", "--gpu-type", "H200", "--dry-run"])
    text = capsys.readouterr().out
    assert code == 0
    assert "on an NVIDIA H200 141GB: 124.8 GB usable a GPU of 141.0 GB" in text
    rows = re.findall(r"^\s+\d+\s+(tiny/\S+ s0)\s+(ddp|fsdp)\s+(\d+)\s+([\d.]+)$", text, re.M)
    assert [r[:2] for r in rows] == [("tiny/baseline s0", "ddp"), ("tiny/qknorm s0", "ddp")]
    assert all(int(r[2]) == 4 and 0 <= float(r[3]) < 1 for r in rows)  # 4 rows a process
    assert "parallel: ddp for 2 job(s)" in text


def test_nothing_is_planned_where_the_gpu_is_not_known(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The local executor without CUDA, and a GPU given only by its peak (--gpu-tflops):
    no memory rows, no check, even for jobs that would fit no GPU."""
    spec = write_spec(tmp_path, HUGE)
    if executors.get("local").memory_gpu(1) is None:  # no CUDA here
        assert run_cli(["study", "run", str(spec), "--out", str(tmp_path / "a"),
                        "--dry-run"]) == 0
        assert "memory" not in capsys.readouterr().out
    assert run_cli(["study", "run", str(spec), "--out", str(tmp_path / "b"), "--executor",
                    "slurm", "--gpu-tflops", "400", "--dry-run"]) == 0
    assert "memory" not in capsys.readouterr().out
    assert executors.get("slurm").memory_gpu(0) is None  # --gpus-per-run 0


#: MODBENCH_FULL_PLANS=1: the whole seed002-3b sweep (13 methods, a few minutes on two cores);
#: by default its baseline and the two methods that need FSDP (the same code path, a minute)
FULL = os.environ.get("MODBENCH_FULL_PLANS") == "1"


@pytest.mark.slow
def test_seed002_3b_on_8_h100s_plans_every_job_to_fit_and_names_its_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's command. Before: DDP kept a second copy of the gradients (11.9 GB a
    process at 3B) and planned 71.4 GB against 69.9 GB usable, unchecked. Now every job fits:
    DDP with bucket views where it fits, FSDP for the two methods whose activations leave no
    room for a whole replica."""
    monkeypatch.chdir(tmp_path)
    spec = "seed002-3b"
    if not FULL:  # the spec itself, its methods cut to the baseline and the FSDP pair
        from importlib import resources

        tree = yaml.safe_load(resources.files("modbench.study.specs").joinpath(
            "seed002-3b.yaml").read_text(encoding="utf-8"))
        tree.update(methods=["softpick", "attnres"],
                    seeds={"default": [42], "noise_floor": [42], "anchors": []})
        spec = str(tmp_path / "seed002-3b-cut.yaml")
        Path(spec).write_text(yaml.safe_dump(tree))
    code = run_cli(["study", "run", spec, "--executor", "slurm", "--gpus-per-run", "8",
                    "--dry-run"])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = re.findall(r"^\s+\d+\s+climb-3b/(\S+) (s\d+)\s+(ddp|fsdp)\s+(\d+)\s+([\d.]+)$", text,
                      re.M)
    assert len(rows) == (17 if FULL else 3)  # every run a job (torchrun groups never stack)
    modes = {method: mode for method, _, mode, _, _ in rows}
    assert {m for m, mode in modes.items() if mode == "fsdp"} == {"softpick", "attnres"}
    assert modes["baseline"] == "ddp"
    assert all(float(gb) <= 69.9 for *_, gb in rows)
    assert "on an NVIDIA H100 SXM 80GB: 69.9 GB usable a GPU of 80.0 GB" in text
    assert (f"parallel: ddp for {15 if FULL else 1} job(s), fsdp for 2 job(s)") in text
