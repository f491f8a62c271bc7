"""``modbench plan`` on absurd shapes and impossible options (issue 47): refused by arithmetic
before any model is built or traced, in one line, exit 2; and the advice a refusal or a note
gives is true (each count or micro-batch it names plans, exit 0)."""

from __future__ import annotations

import re
import time

import pytest
from tests.helpers import cli

from modbench.measure.plan import MAX_PLANNED_BATCH, MAX_PLANNED_LAYERS, divisors


def _one_line(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, _, err = cli(capsys, "plan", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ")
    return lines[0]


def _advised(line: str) -> list[int]:
    """The numbers of a refusal's ``use 1, 2, 4 or 8``."""
    words = re.search(r"use ((?:\d+, )*\d+(?: or \d+)?)", line)
    assert words is not None, line
    return [int(x) for x in re.findall(r"\d+", words.group(1))]


def test_a_hundred_thousand_layers_refused_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: no answer in 45 s, past 1 GB (every layer built, then traced)."""
    start = time.monotonic()
    line = _one_line(capsys, "--preset", "tiny", "--set", "model.n_layers=100000")
    assert time.monotonic() - start < 10
    assert "model.n_layers=100000" in line and f"at most {MAX_PLANNED_LAYERS}" in line


def test_a_batch_beyond_the_search_refused_and_a_large_one_searched_fast(
        capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(capsys, "--preset", "tiny", "--set",
                     f"train.batch_size={MAX_PLANNED_BATCH * 4}")
    assert "train.batch_size" in line and "smaller batch" in line
    assert divisors(10**11)[:2] == [10**11, 5 * 10**10] and len(divisors(10**11)) == 144
    start = time.monotonic()
    code, _, err = cli(capsys, "plan", "--preset", "tiny", "--set",
                       "train.batch_size=100000000000", "--json")
    assert code == 0, err
    assert time.monotonic() - start < 60  # divisors by trial division to the square root


def test_an_impossible_micro_batch_refused_with_those_that_divide(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: exit 0, 'needs --nproc 2 --parallel fsdp (micro-batch 4, peak 0.0 GB)'."""
    line = _one_line(capsys, "--preset", "tiny", "--micro-batch", "99999999999")
    assert "does not divide the 8 sequences the process trains on a step" in line
    assert _advised(line) == [1, 2, 4, 8]
    line = _one_line(capsys, "--preset", "tiny", "--nproc", "2", "--micro-batch", "8")
    assert "each of the 2 processes" in line and _advised(line) == [1, 2, 4]
    for mb in _advised(line):  # the advice is true: each plans
        code, _, err = cli(capsys, "plan", "--preset", "tiny", "--nproc", "2",
                           "--micro-batch", str(mb), "--json")
        assert code == 0, err


def test_process_counts_refused_with_those_that_split_the_batch(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: 'use a batch size divisible by 0'."""
    for bad in ("0", "-3"):
        line = _one_line(capsys, "--preset", "tiny", "--nproc", bad)
        assert f"--nproc must be at least 1 (one process a GPU), got {bad}" in line
    line = _one_line(capsys, "--preset", "tiny", "--nproc", "3")
    assert _advised(line) == [1, 2, 4, 8] and "divisible by 3" in line
    code, _, err = cli(capsys, "plan", "--preset", "tiny", "--nproc", "4", "--json")
    assert code == 0, err


@pytest.mark.parametrize(("args", "expected"), [
    (["--micro-batch", "0"], "--micro-batch must be at least 1 sequence, got 0"),
    (["--ensembles", "0"], "--ensembles must be at least 1"),
    (["--parallel", "zero"], "--parallel must be ddp or fsdp, got 'zero'"),
])
def test_each_option_by_itself_in_one_line(args: list[str], expected: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert expected in _one_line(capsys, "--preset", "tiny", *args)


def test_a_model_no_process_count_holds_is_not_told_to_add_processes(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: 'does not fit 64 FSDP processes either: --nproc N with train.parallel=fsdp …'."""
    code, out, err = cli(capsys, "plan", "--preset", "tiny", "--set", "model.d_model=16777216")
    assert code == 0, err
    note = [line for line in out.splitlines() if line.startswith("tiny baseline:")]
    assert len(note) == 1 and "does not fit 64 FSDP processes either" in note[0], out
    assert "--nproc" not in note[0] and note[0].endswith("use a smaller model")
