"""``modbench study run`` options checked where they are parsed (issue 47): ``--dry-run``
refuses what the run refuses, each problem in its own line (exit 2), and nothing is written.
Before, ``--until-decided 0|-1|1`` and ``--spending nosuch`` passed under ``--dry-run`` and
the run refused both in one message that lumped the two checks together."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tests.helpers import cli

from modbench.train import trackers

SPEC = {"name": "options", "methods": ["qknorm"], "scales": ["tiny"],
        "seeds": {"default": [0], "noise_floor": [0]},
        "overrides": ["train.steps=2", "train.eval_every=0", "train.threads=1"],
        "evaluation": {"probes": False}}

UNTIL = ("--until-decided must be at least 2 seeds per group (a look compares two or more), "
         "got {}; give 2 or more, or leave it out to run the spec's seeds only")
SPENDING = "--spending must be one of obrien_fleming, pocock, got 'nosuch'"
FUTILITY = ("--futility must be a conditional power between 0 and 1, exclusive (e.g. 0.1), "
            "got {}; leave it out to never stop a method for futility")

CASES = {
    "until-0": (["--until-decided", "0"], UNTIL.format(0)),
    "until-negative": (["--until-decided", "-1"], UNTIL.format(-1)),
    "until-1": (["--until-decided", "1"], UNTIL.format(1)),
    "spending": (["--spending", "nosuch"], SPENDING),  # without --until-decided too
    "until-3-spending": (["--until-decided", "3", "--spending", "nosuch"], SPENDING),
    "futility-1.5": (["--until-decided", "3", "--futility", "1.5"], FUTILITY.format(1.5)),
    "futility-0": (["--until-decided", "3", "--futility", "0"], FUTILITY.format(0.0)),
}


def _spec(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({**SPEC, **changes}))
    return path


def _refused(capsys: pytest.CaptureFixture[str], spec: Path, out: Path, *args: str) -> str:
    code, _, err = cli(capsys, "study", "run", str(spec), "--out", str(out), "--no-progress",
                       *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert not out.exists()  # nothing written, submitted or started
    return lines[0].removeprefix("error: ")


@pytest.mark.parametrize("case", sorted(CASES))
def test_dry_run_refuses_what_the_run_refuses(case: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    args, expected = CASES[case]
    spec = _spec(tmp_path)
    dry = _refused(capsys, spec, tmp_path / "dry", *args, "--dry-run")
    real = _refused(capsys, spec, tmp_path / "real", *args)
    assert dry == real == expected


def test_two_bad_options_one_problem_a_message(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec(tmp_path)
    line = _refused(capsys, spec, tmp_path / "s", "--until-decided", "1", "--spending", "nosuch")
    assert line in (UNTIL.format(1), SPENDING)  # one of them, never both in one message
    fixed = _refused(capsys, spec, tmp_path / "s", "--until-decided", "2", "--spending",
                     "nosuch")
    assert fixed == SPENDING


def test_the_spec_and_its_options_checked_under_dry_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """What the run refuses of a spec with the options (before: the dry run printed jobs)."""
    tuned = _spec(tmp_path, tuning={"key": "recipe.lr", "grid": [1e-3, 3e-3], "seeds": [100]})
    for dry in (["--dry-run"], []):
        line = _refused(capsys, tuned, tmp_path / "t", "--until-decided", "3", *dry)
        assert line.startswith("--until-decided adds seeds a tuned study's stages do not")
    # a tracker whose package is missing (as where tensorboard is not installed)
    monkeypatch.setitem(trackers.PACKAGES, "tensorboard", ("modbench_no_such_package", "tb"))
    tracked = _spec(tmp_path, overrides=[*SPEC["overrides"],  # type: ignore[misc]
                                         "train.trackers=[tensorboard]"])
    for dry in (["--dry-run"], []):
        line = _refused(capsys, tracked, tmp_path / "k", *dry)
        assert "train.trackers includes tensorboard but the modbench_no_such_package" in line
    code, _, err = cli(capsys, "study", "run", str(_spec(tmp_path)), "--out",
                       str(tmp_path / "ok"), "--until-decided", "2", "--spending", "pocock",
                       "--dry-run")
    assert code == 0 and err == "" and not (tmp_path / "ok").exists(), err


def test_futility_under_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--futility 0.1`` is accepted under ``--dry-run`` (nothing new refused), and the
    sequential stage's row says a stopped method gets no more seeds; nothing is written."""
    spec = _spec(tmp_path)
    code, out, err = cli(capsys, "study", "run", str(spec), "--out", str(tmp_path / "s"),
                         "--until-decided", "3", "--futility", "0.1", "--dry-run")
    assert code == 0, err
    assert "only to methods not yet decided nor stopped for futility (below 0.1)" in out
    assert not (tmp_path / "s").exists()
