"""What one study job is and how it runs, below every executor: a :class:`Job` (one run, or
several seeds of one configuration stacked in one process), its :class:`JobResult` s,
:func:`execute_job` (train or resume, evaluate, diagnose, record in the store's index),
:func:`lost_job_results` (what a job gone for good leaves), and the :class:`Executor` protocol.

The local executor (:mod:`modbench.study.runner`) and the cluster executors
(:mod:`modbench.study.executors.ray`, :mod:`modbench.study.executors.slurm`) all import from
here, so none of them imports another; :mod:`modbench.study.runner` re-exports these names.

A job carries its runs' configs as the validated :class:`~modbench.config.RunConfig` objects
the study resolved: in process they reach the trainer as they are; a job pickled to another
process (a local worker's pipe, a Ray task, a SLURM job) carries each config's serialised form
(:meth:`RunConfig.to_dict`), read back there by :func:`~modbench.config.from_dict`.
"""

from __future__ import annotations

import json
import shutil
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from modbench.config import RunConfig, from_dict
from modbench.errors import ModbenchError
from modbench.study.store import Store, StoreWriteError


@dataclass(frozen=True)
class Job:
    """One run, or several seeds of one configuration to train stacked in one process."""

    root: str
    keys: tuple[str, ...]
    labels: tuple[str, ...]
    configs: tuple[RunConfig, ...]
    evaluation: dict[str, Any]
    threads: int = 0
    # processes per run: > 1 trains each run as one torchrun group on that many GPUs of one
    # node (modbench.train.distributed.launch); such jobs hold one run each
    nproc: int = 1
    # the token every attempt of this job claims its runs under (cluster executors: a Ray
    # retry or a SLURM requeue takes over what the dead attempt held); None: local claims
    lease: str | None = None
    # the study's method plugins (absolute refs, modbench.methods.plugins), imported first
    # in whatever process runs the job (a local worker, a Ray task, a SLURM job)
    plugins: tuple[str, ...] = ()
    # pause the runs after this step (modbench.train.trainer.Trainer.until; the learning-rate
    # profile's halving rule): they go back to pending in the index, checkpointed, to resume
    until: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        """What a pickle of the job holds: the configs in their serialised form."""
        state = dict(self.__dict__)
        state["configs"] = tuple(c.to_dict() for c in self.configs)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The job read back in another process: each config through
        :func:`~modbench.config.from_dict` (a corrupt one: :class:`ModbenchError`, one
        line)."""
        state = dict(state)
        state["configs"] = tuple(from_dict(tree) for tree in state["configs"])
        self.__dict__.update(state)


@dataclass
class JobResult:
    key: str
    label: str
    outcome: str  # trained | skipped | failed | busy | paused
    status: str | None = None  # completed | diverged
    error: str | None = None


@dataclass
class _Member:
    key: str
    label: str
    config: RunConfig
    run: Path


def execute_job(job: Job) -> list[JobResult]:
    """Train (or resume) the job's runs, evaluate them, and record them in the store's index.

    Several runs (seeds of one configuration) train stacked in one process; members that are
    done are skipped, members another worker holds are left to it, and members whose folders
    hold checkpoints resume (stacked when their checkpoints are at one step, else one by one).
    """
    if job.threads:
        import torch

        torch.set_num_threads(job.threads)
    if job.plugins:
        from modbench.methods.plugins import load_plugins

        load_plugins(job.plugins)
    store = Store(job.root)
    results, todo = [], []
    for key, label, config in zip(job.keys, job.labels, job.configs, strict=True):
        if store.claim(key, lease=job.lease):
            todo.append(_Member(key, label, config, store.run_dir(key)))
        else:
            results.append(JobResult(key, label, "busy"))
    done = [m for m in todo if (m.run / "summary.json").is_file()]
    results += [_finish(store, job, m, json.loads((m.run / "summary.json").read_text()),
                        "skipped") for m in done]
    todo = [m for m in todo if m not in done]
    for group in _resumable_groups(todo):
        results += _train_group(store, job, group)
    return results


def _resumable_groups(members: list[_Member]) -> list[list[_Member]]:
    """Fresh members in one group, members with a checkpoint in another (a folder cut
    before its first checkpoint starts again)."""
    from modbench.runtime.runfolder import CHECKPOINT

    fresh, resume = [], []
    for m in members:
        if (m.run / CHECKPOINT).is_file():
            resume.append(m)
        else:
            if m.run.exists():
                shutil.rmtree(m.run)
            fresh.append(m)
    return [g for g in (fresh, resume) if g]


def _train_group(store: Store, job: Job, group: list[_Member]) -> list[JobResult]:
    from modbench.runtime.runfolder import CHECKPOINT
    from modbench.train.trainer import train, train_seeds

    if job.nproc > 1 and len(group) > 1:  # a torchrun group trains one run
        return [r for m in group for r in _train_group(store, job, [m])]
    resume = (group[0].run / CHECKPOINT).is_file()
    try:
        if len(group) == 1:
            m = group[0]
            if job.nproc > 1:  # a torchrun group trains to the end (no pause)
                summaries = [_launch(m.config, m.run, job.nproc, resume)]
            else:
                summaries = [train(m.config, m.run, resume=resume, progress=False,
                                   until=job.until)]
        else:
            seeds = [m.config.seed for m in group]
            try:
                summaries = train_seeds(group[0].config, seeds, [m.run for m in group],
                                        resume=resume, progress=False, until=job.until)
            except ModbenchError as e:
                if "cannot resume these seeds together" not in str(e):
                    raise
                return [r for m in group for r in _train_group(store, job, [m])]
    except StoreWriteError:
        raise  # the index cannot record anything: the study stops (run_study)
    except Exception as e:  # a crash must not stop the study: every member fails with it
        msg = _failure(e)
        for m in group:
            store.fail(m.key, msg)
        return [JobResult(m.key, m.label, "failed", error=msg.strip().splitlines()[-1])
                for m in group]
    out = []
    for m, s in zip(group, summaries, strict=True):
        if s["status"] == "paused":  # checkpointed at job.until: pending again, to resume
            store.release(m.key)
            out.append(JobResult(m.key, m.label, "paused", "paused"))
        else:
            out.append(_finish(store, job, m, s, "trained"))
    return out


def _launch(cfg: RunConfig, run: Path, nproc: int, resume: bool) -> dict[str, Any]:
    """One run as a torchrun group of ``nproc`` processes on this node's GPUs."""
    try:
        from modbench.train.distributed import launch
    except ImportError as e:
        raise ModbenchError(f"a run on {nproc} GPUs needs modbench.train.distributed, which "
                            "this installation of modbench lacks; update it, or train with "
                            "--gpus-per-run 1") from e
    summary: dict[str, Any] = launch(cfg, run, nproc, resume=resume, progress=False)
    return summary


def lost_job_results(job: Job, reason: str) -> list[JobResult]:
    """The results of a job that is gone for good (its Ray task out of retries, its SLURM job
    failed or cancelled): runs it finished count as trained, runs still pending or held under
    its lease are recorded as failed with ``reason`` (the next ``study run`` retries them),
    runs another worker holds are left to it."""
    store = Store(job.root)
    out: list[JobResult] = []
    for key, label in zip(job.keys, job.labels, strict=True):
        if store.fail_lost(key, job.lease, reason):
            out.append(JobResult(key, label, "failed", error=reason))
            continue
        row = next((r for r in store.rows() if r["key"] == key), None)
        if row is not None and row["state"] == "done":
            out.append(JobResult(key, label, "trained", row["status"]))
        else:
            out.append(JobResult(key, label, "busy"))
    return out


def _finish(store: Store, job: Job, m: _Member, summary: dict[str, Any],
            outcome: str) -> JobResult:
    """Evaluate a trained run (when the study asks and it completed), diagnose it (when the
    study asks), and record it."""
    from modbench.eval.run import evaluate_run

    try:
        evaluation = None
        ev = job.evaluation
        if summary["status"] == "completed" and (ev.get("probes") or ev.get("tasks")):
            eval_file = m.run / "eval.json"
            if eval_file.is_file():
                evaluation = json.loads(eval_file.read_text())
            else:
                from modbench.eval.harness import trusting_task_code

                with trusting_task_code(ev.get("trust_task_code") is True):
                    evaluation = evaluate_run(m.run, probes=bool(ev.get("probes")),
                                              tasks=list(ev.get("tasks") or []) or None,
                                              limit=ev.get("limit"), progress=False)
        _diagnose(m, summary, ev.get("diagnostics"))
        store.finish(m.key, summary, evaluation)
        return JobResult(m.key, m.label, outcome, summary["status"])
    except StoreWriteError:
        raise
    except Exception as e:
        msg = _failure(e)
        store.fail(m.key, msg)
        return JobResult(m.key, m.label, "failed", error=msg.strip().splitlines()[-1])


def _failure(error: Exception) -> str:
    """What a failed run records: a ``ModbenchError``'s line; a write the storage refused
    (a full disk while writing the run's files) in one line; anything else its traceback."""
    from modbench.runtime.runfolder import is_storage_error, write_failure

    if isinstance(error, ModbenchError):
        return str(error)
    if is_storage_error(error):
        where = Path(str(getattr(error, "filename", None) or "a file of the run"))
        return str(write_failure(error, where, "the run's last checkpoint is kept; free some "
                                 "space and run `modbench study run` again to resume it"))
    return traceback.format_exc()


#: ``RUN/diagnostics/`` file with the seconds a study's diagnosis of the run took
DIAGNOSE_TIME = "time.json"


def _diagnose(m: _Member, summary: dict[str, Any], asked: dict[str, Any] | None) -> None:
    """``evaluation.diagnostics``: ``modbench diagnose`` a run that did not diverge (a
    stalled one too: its layers show why), if its seed is one the spec names; the JSON only,
    into ``RUN/diagnostics/`` (the report draws the figures across runs); a run that has it
    already keeps it."""
    if not asked or summary["status"] == "diverged":
        return
    if asked.get("seeds") is not None and m.config.seed not in asked["seeds"]:
        return
    from modbench.report.diagnostics import DIAGNOSTICS_JSON, diagnose

    if not (m.run / "diagnostics" / DIAGNOSTICS_JSON).is_file():
        import time

        from modbench.fsutil import atomic_write_text

        began = time.perf_counter()
        diagnose(m.run, batches=int(asked.get("batches") or 1), figures=False, progress=False)
        # what it cost (benchmarks/time_to_decision.py reads it)
        atomic_write_text(m.run / "diagnostics" / DIAGNOSE_TIME, json.dumps(
            {"seconds": time.perf_counter() - began}) + "\n")


class Executor(Protocol):
    """Runs jobs and yields each job's results as it finishes."""

    #: GPUs each job gets (None: whatever this machine has, the local executor)
    gpus_per_job: int | None

    def run(self, jobs: list[Job]) -> Iterator[list[JobResult]]: ...

    def close(self) -> None:
        """Release what the executor started (a local Ray instance); called once, at the end."""
