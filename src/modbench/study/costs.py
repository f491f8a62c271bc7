"""What a study's runs cost, read without training or writing anything: the FLOPs of a run
(training and validation), the sustained throughput of a GPU that turns FLOPs into
GPU-hours, the runs a study folder has done, and the summary row a stage gives the dry run
(:class:`StagePlan`). Below both the stages (:mod:`modbench.study.stages`), which cost
their own runs, and the dry run (:mod:`modbench.study.plan`), which lists them; the
estimate's equations are in :mod:`modbench.study.plan`'s docstring.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from modbench.config import RunConfig
from modbench.errors import ModbenchError, suggest
from modbench.measure.flops import flop_report

#: Model FLOPs utilisation assumed when ``--mfu`` is left out: what a dense decoder of about
#: 1B parameters sustains in bf16 on an H100-class GPU with a well-tuned trainer is about
#: 0.3-0.45; the estimate takes the low end. modbench's own eager step at 60M parameters
#: measured 0.056 (BENCHMARKS.md): small models sit far below, so measure yours.
DEFAULT_MFU = 0.30
DEFAULT_GPU = "H100"


@dataclass(frozen=True)
class Throughput:
    """Sustained training FLOP/s of one GPU: its dense bf16 peak times the MFU."""

    gpu: str
    peak_tflops: float
    mfu: float
    mfu_assumed: bool = True

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.mfu


def throughput(gpu_type: str | None = None, gpu_tflops: float | None = None,
               mfu: float | None = None) -> Throughput:
    """``--gpu-type`` (a name of :data:`PEAK_BF16_TFLOPS`), or ``--gpu-tflops`` (the dense
    bf16 peak in TFLOP/s), and ``--mfu``."""
    from modbench.measure.bench import PEAK_BF16_TFLOPS

    if mfu is not None and not 0 < mfu <= 1:
        raise ModbenchError(f"--mfu must be a fraction in (0, 1], got {mfu}")
    if gpu_tflops is not None:
        if gpu_tflops <= 0:
            raise ModbenchError(f"--gpu-tflops must be positive, got {gpu_tflops}")
        name = gpu_type or "GPU"
        peak = gpu_tflops
    else:
        name = gpu_type or DEFAULT_GPU
        known = {k.lower(): k for k in PEAK_BF16_TFLOPS}
        if name.lower() not in known:
            raise ModbenchError(f"unknown --gpu-type '{name}'{suggest(name, PEAK_BF16_TFLOPS)}; "
                                f"use one of {', '.join(PEAK_BF16_TFLOPS)} or give its dense "
                                "bf16 peak with --gpu-tflops")
        name = known[name.lower()]
        peak = PEAK_BF16_TFLOPS[name]
    return Throughput(name, float(peak), DEFAULT_MFU if mfu is None else mfu, mfu is None)


def validations(cfg: RunConfig) -> int:
    """Validation passes of a full run: before training, every ``eval_every`` steps before
    the last, and at the end."""
    tc = cfg.train
    return 2 + ((tc.steps - 1) // tc.eval_every if tc.eval_every else 0)


def run_flops(cfg: RunConfig) -> float:
    """FLOPs of one run trained to its last step: training plus its validation passes."""
    r = flop_report(cfg.model, cfg.train.seq_len)
    tc = cfg.train
    train = r.train_flops_per_token * tc.steps * tc.batch_size * tc.seq_len
    val = r.forward_flops_per_token * tc.eval_sequences * tc.seq_len * validations(cfg)
    return float(train + val)


@dataclass
class StagePlan:
    """A stage after the study's own (:mod:`modbench.study.stages`: sequential looks, a tuned
    study's tuning and tuned stages) as the dry run lists it: its folder, its runs, those done,
    the FLOPs of the rest and what the stage is. ``known``: whether its runs
    are fixed already (the tuning stage's always; the tuned stage's once the tuning stage has
    chosen every value, else its FLOPs are those at the grid's costliest value)."""

    name: str
    folder: Path
    runs: int
    done: int
    flops: float
    what: str
    known: bool = True
    gpu_hours: float | None = None
    upper_bound: bool = False  # flops (and GPU-hours) are an upper bound, not the estimate
    runs_bound: bool = False  # runs too: at most so many (the sequential looks')


def done_keys(folder: Path) -> set[str]:
    """Keys of the runs the folder's index has done, read without writing anything (no index,
    or one that cannot be read: none)."""
    index = folder / "index.sqlite"
    if not index.is_file():
        return set()
    # a closed index (no write-ahead log beside it) is read as immutable: SQLite then creates
    # no -wal/-shm files; an index in use is read through the log its writers keep
    live = index.with_name(index.name + "-wal").exists()
    try:
        db = sqlite3.connect(f"{index.resolve().as_uri()}?{'mode=ro' if live else 'immutable=1'}",
                             uri=True)
        try:
            return {r[0] for r in db.execute("SELECT key FROM runs WHERE state='done'")}
        finally:
            db.close()
    except sqlite3.Error:
        return set()
