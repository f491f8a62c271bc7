"""The SLURM signal's lead time (issue 46 item 3): each array asks SLURM to signal its tasks
early enough to finish the step under way and write the checkpoint, planned from the job's
step FLOPs and checkpoint bytes, instead of a fixed 300 s that a 3B run's save alone (36 GB)
can outlast."""

from __future__ import annotations

import math

import pytest

from modbench.config import resolve
from modbench.measure.plan import checkpoint_bytes
from modbench.study.costs import DEFAULT_MFU, run_flops
from modbench.study.executors.slurm import (
    EXIT_SLACK_S,
    LEAD_PEAK_TFLOPS,
    SAVE_BYTES_PER_S,
    SIGNAL_DELAY_S,
    lead_for,
    signal_lead_s,
)
from modbench.study.jobs import Job


def job(cfg: object, nproc: int = 1, seeds: int = 1) -> Job:
    return Job("x", tuple(f"k{i}" for i in range(seeds)), tuple(f"l{i}" for i in range(seeds)),
               tuple(cfg for _ in range(seeds)), {}, nproc=nproc)  # type: ignore[misc]


def test_a_3b_run_asks_for_its_step_and_its_save_not_a_fixed_300_s() -> None:
    big = resolve("climb-3b")
    ckpt = 4 * 3 * 3.0e9  # fp32 weights and AdamW's two moments: about 12 bytes a parameter
    assert checkpoint_bytes(big) == pytest.approx(ckpt, rel=0.05)
    step = run_flops(big) / big.train.steps / (8 * LEAD_PEAK_TFLOPS * 1e12 * DEFAULT_MFU)
    save = checkpoint_bytes(big) / SAVE_BYTES_PER_S  # about 180 s: over half the old lead
    want = math.ceil(1.5 * (step + save) + EXIT_SLACK_S)
    assert want > SIGNAL_DELAY_S
    assert signal_lead_s([job(big, nproc=8)]) == want
    # one GPU takes 8 times the step; a job's lead is the array's largest
    assert signal_lead_s([job(big, nproc=8), job(big, nproc=1)]) == signal_lead_s(
        [job(big, nproc=1)]) > want
    # never more than half the time limit, never less than the floor
    assert signal_lead_s([job(big, nproc=1)], time_min=12) == 360
    assert signal_lead_s([job(big, nproc=1)], time_min=4) == SIGNAL_DELAY_S


def test_small_runs_keep_the_floor_and_stacked_seeds_add_up() -> None:
    tiny = resolve("tiny")
    assert signal_lead_s([job(tiny)]) == SIGNAL_DELAY_S
    assert lead_for(0.0, 0.0) == SIGNAL_DELAY_S
    assert lead_for(200.0, 100.0) == math.ceil(1.5 * 300 + EXIT_SLACK_S)
    mid = resolve("climb-1.2b")
    one, three = (signal_lead_s([job(mid, seeds=k)]) for k in (1, 3))
    assert one == SIGNAL_DELAY_S < three  # three stacked seeds step and save three states
