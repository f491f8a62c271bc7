"""Small helpers shared by tests."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from modbench.config import RunConfig, resolve
from modbench.model.stream import Record, StreamState


def load_script(path: Path, name: str) -> ModuleType:
    """A script of benchmarks/ imported as module ``name`` (registered in sys.modules, which
    its dataclasses need)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tiny(method: str = "baseline", seed: int = 0, steps: int = 30, *overrides: str) -> RunConfig:
    return resolve("tiny", method=method, seed=seed, steps=steps, overrides=list(overrides))


def read_metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


@dataclass
class Captured(StreamState):
    """The forward's final StreamState, with the records of its sublayers (``history``)."""

    history: list[Record] = field(default_factory=list)


def run_capturing(model: torch.nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, Captured]:
    """Logits, and the forward's final StreamState with every sublayer's record (input,
    output, after), taken through the stream's recorder hook."""
    seen: list[StreamState] = []
    records: list[Record] = []
    stream = model.stream  # type: ignore[union-attr]
    finish = stream.finish

    def capture(state: StreamState) -> torch.Tensor:
        seen.append(state)
        return finish(state)

    stream.finish = capture
    handle = stream.add_recorder(records.append)
    try:
        logits = model(idx)
    finally:
        del stream.finish
        handle.remove()
    final = seen[0]
    fields = {f.name: getattr(final, f.name) for f in dataclasses.fields(StreamState)}
    return logits, Captured(**fields, history=records)


@contextlib.contextmanager
def cli_built_once() -> Iterator[None]:
    """``run_cli`` builds the typer command of ``modbench`` (``typer.main.get_command``, ~0.1 s
    here) on every call, most of a refused command's time. Inside this context each app is
    built once and every call gets a deep copy of that build (~0.02 s): the same command, as
    new, which run_cli tidies and runs as it would a fresh one."""
    import typer.main

    real = typer.main.get_command
    built: dict[int, Any] = {}

    def get_command(app: Any) -> Any:
        if id(app) not in built:
            built[id(app)] = (app, real(app))  # app kept: its id stays this app's
        return copy.deepcopy(built[id(app)][1])

    typer.main.get_command = get_command
    try:
        yield
    finally:
        typer.main.get_command = real


def cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``modbench *argv`` in process (``run_cli``: what ``python -m modbench`` runs): its exit
    code and this call's own stdout and stderr (whatever was captured before is dropped)."""
    from modbench.cli import run_cli

    capsys.readouterr()
    code = run_cli(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@contextlib.contextmanager
def torch_threads(n: int | None = None) -> Iterator[None]:
    """Torch's thread count as it was, given back on leaving: a run in process sets its own
    (``train.threads``), which would otherwise outlive it. ``n`` sets it for the block."""
    threads = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def plugins_restored(temp: Path) -> Iterator[None]:
    """Method plugins loaded in the block are gone after it: the registry, the plugins'
    records, the modules they imported (those whose files lie under ``temp``, a test's
    temporary folders), MODBENCH_METHODS_FROM (which loading a plugin sets) and the parsed
    method strings, as they were before."""
    import os
    import sys

    from modbench.methods import base, plugins

    env = os.environ.pop(plugins.ENV, None)
    base.load_all()
    registry, modules = dict(base.REGISTRY), set(sys.modules)
    state = (dict(plugins._PLUGINS), dict(plugins._ORIGINS), plugins._env_loaded)
    try:
        yield
    finally:
        base.REGISTRY.clear()
        base.REGISTRY.update(registry)
        for m in set(sys.modules) - modules:
            if str(getattr(sys.modules[m], "__file__", None) or "").startswith(str(temp)):
                del sys.modules[m]
        plugins._PLUGINS.clear()
        plugins._PLUGINS.update(state[0])
        plugins._ORIGINS.clear()
        plugins._ORIGINS.update(state[1])
        plugins._env_loaded = state[2]
        base._SPECS.clear()
        if env is None:
            os.environ.pop(plugins.ENV, None)
        else:
            os.environ[plugins.ENV] = env


class Stopped(Exception):
    """What :class:`RecordingExecutor` raises after its ``stop``-th run, as a kill would."""


class RecordingExecutor:
    """A study executor (``modbench.study.jobs.Executor``) that trains nothing: it finishes
    each run of a job in the job's results store with the final validation loss
    ``loss(folder name, method, seed)`` and records ``(folder name, method, seed)`` per run
    (``ran``; ``keys``: ``(folder name, run key)``) and per wave (``waves``, each sorted).
    ``stop``: raise :class:`Stopped` before the run after that many. Patch it in with
    :meth:`install`."""

    gpus_per_job = None
    workers = 1

    def __init__(self, loss: Any, stop: int | None = None) -> None:
        self.loss, self.stop = loss, stop
        self.ran: list[tuple[str, str, int]] = []
        self.keys: list[tuple[str, str]] = []
        self.waves: list[list[tuple[str, str, int]]] = []
        self.made = self.closed = 0

    def install(self, monkeypatch: Any) -> RecordingExecutor:
        """Make ``modbench.study.runner`` use this executor (and prepare no data)."""
        import modbench.study.runner as runner

        def make(*args: Any, **kwargs: Any) -> RecordingExecutor:
            self.made += 1
            return self

        monkeypatch.setattr(runner, "make_executor", make)
        monkeypatch.setattr(runner, "_prepare_data", lambda runs, progress: None)
        return self

    def run(self, jobs: list[Any]) -> Iterator[list[Any]]:
        from modbench.study.jobs import JobResult
        from modbench.study.store import Store

        wave = []
        for job in jobs:
            store = Store(job.root)
            rows = {r["key"]: r for r in store.rows()}
            out = []
            for key, label in zip(job.keys, job.labels, strict=True):
                if self.stop is not None and len(self.ran) >= self.stop:
                    raise Stopped
                method, seed = rows[key]["method"], int(rows[key]["seed"])
                assert store.claim(key)
                folder = Path(job.root).name
                store.finish(key, {"status": "completed", "stalled_at_step": None,
                                   "final_val_loss": self.loss(folder, method, seed)}, None)
                self.ran.append((folder, method, seed))
                self.keys.append((folder, key))
                wave.append((folder, method, seed))
                out.append(JobResult(key, label, "trained", "completed"))
            yield out
        self.waves.append(sorted(wave))

    def close(self) -> None:
        self.closed += 1
