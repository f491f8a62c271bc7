"""Checkpoints: written atomically, read safely, and asked for by a signal.

A checkpoint is a ``torch.save`` file of plain containers, numbers, strings and tensors. It is
read with ``weights_only=True``, so a file that carries any other pickled object (code that
would run on loading) is refused before anything of it executes. It is read memory-mapped
(``mmap=True``): the tensors stay backed by the file (the page cache, which every process of a
node shares) instead of each process copying the whole file into its own memory; a model's
``load_state_dict`` then copies each tensor into place. Pages the run writes to (an optimizer
state tensor the optimizer keeps as it is) are copied on write, so the file never changes.

**Preemption.** SLURM sends a signal before it ends a job (its time limit, ``--signal``, or a
preemption; submitit asks for SIGUSR2), torchrun passes SIGTERM to its processes.
:func:`stop_on_signals` turns SIGUSR1, SIGUSR2 and SIGTERM into a request
(:func:`stop_requested`) that the trainer reads between steps: it finishes the step, saves a
checkpoint of it and raises :class:`Preempted` (a ``SystemExit`` with
:data:`EXIT_PREEMPTED`, 75, sysexits' EX_TEMPFAIL: try again), which ``--resume`` continues
exactly. A second signal of the same kind acts as it would have without the handler. The
processes of a torchrun group also read a stop file (``MODBENCH_STOP_FILE``) that the process
that launched them creates when it is signalled.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from modbench.errors import ModbenchError
from modbench.fsutil import atomic_path
from modbench.runtime.runfolder import CHECKPOINT, is_torch_write_error, write_problem


def save_checkpoint(path: Path, state: dict[str, Any], *, keep_previous: bool = False) -> None:
    """Save ``state`` so that a crash mid-write leaves the previous checkpoint intact.

    ``keep_previous``: the checkpoint it replaces stays as :func:`previous_path` (hard-linked
    there before the new one is renamed into place, so at every moment both files are
    complete checkpoints).

    A write the file system refuses (a full disk: ``torch.save`` raises a ``RuntimeError``
    without an errno, so the free space decides; any ``OSError``) leaves the previous
    checkpoint as it was and the temporary file removed, and raises a
    :class:`~modbench.errors.ModbenchError` of one line saying what failed and what was kept
    (:func:`modbench.runtime.runfolder.write_failure`)."""
    try:
        with atomic_path(path) as tmp:
            try:
                torch.save(state, tmp)
            except RuntimeError as e:  # measured before atomic_path frees the partial file
                if not is_torch_write_error(e):
                    raise
                raise _WriteFailed(write_problem(e, tmp, _size(tmp))) from e
            if keep_previous and path.is_file():
                link = tmp.with_name(tmp.name + ".prev")
                os.link(path, link)
                os.replace(link, previous_path(path))
    except (OSError, _WriteFailed) as e:
        problem = str(e) if isinstance(e, _WriteFailed) else write_problem(e, path)
        raise ModbenchError(f"cannot write checkpoint {path}: {problem}; "
                            f"{_kept(path)}") from None


class _WriteFailed(Exception):
    """torch.save's failed write, already put in words."""


def _size(path: Path) -> int | None:
    with contextlib.suppress(OSError):
        return path.stat().st_size
    return None


def _kept(path: Path) -> str:
    """What a failed checkpoint write kept: the checkpoint already there, and its step."""
    if not path.is_file():
        return ("there was no earlier checkpoint to keep (this was the first); free some space "
                "and run it again (it starts over)")
    try:
        step = f" (step {checkpoint_step(path)})"
    except Exception:
        step = ""
    return (f"the previous checkpoint{step} is kept intact; free some space, then resume "
            "from it")


def previous_path(path: Path) -> Path:
    """Where :func:`save_checkpoint` keeps the checkpoint before ``path`` (``prev.pt``)."""
    return path.with_name("prev" + path.suffix)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint at ``path``, loaded on the CPU without unpickling arbitrary objects."""
    if not path.is_file():
        raise ModbenchError(f"no checkpoint at {path}; nothing to resume (drop --resume)")
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # a legacy (non-zip) file cannot be mapped: read it
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ModbenchError(
            f"checkpoint {path} holds objects other than tensors and plain data and was not "
            "loaded (loading it could run code); use checkpoints written by modbench only"
        ) from e
    except Exception as e:  # a truncated or foreign file
        raise ModbenchError(
            f"checkpoint {path} cannot be read ({e.__class__.__name__}: truncated, or not a "
            "checkpoint); resume from a copy of it, or train again into a new --out"
        ) from e
    if not isinstance(state, dict):
        raise ModbenchError(f"checkpoint {path} is not a modbench checkpoint (not a mapping); "
                            "use checkpoints written by modbench only")
    check_checkpoint(state, path)
    return state


def _not_modbench(path: Path, what: str) -> ModbenchError:
    return ModbenchError(f"checkpoint {path} is not a modbench checkpoint ({what}); use a "
                         "checkpoint written by modbench, or a copy of this one from before")


def check_checkpoint(state: dict[str, Any], path: Path) -> None:
    """What every modbench checkpoint holds (training runs, remove-norm outputs): ``model``,
    a mapping of parameter names to tensors, and ``step``, a whole number of steps; and,
    where present, ``metrics_offset`` a whole number of bytes. One line for each defect,
    instead of a ``KeyError`` wherever the file is read."""
    model = state.get("model")
    if not isinstance(model, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
        raise _not_modbench(path, "no 'model' mapping of tensors")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise _not_modbench(path, f"'step' is {step!r}, not a whole number of steps")
    offset = state.get("metrics_offset", 0)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise _not_modbench(path, f"'metrics_offset' is {offset!r}, not a byte count")



def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape)).replace(",)", ")")


def _kind(t: torch.Tensor) -> str:
    """What a tensor's values are, as far as copying one into another goes."""
    return "complex" if t.is_complex() else "floating" if t.is_floating_point() else (
        "bool" if t.dtype == torch.bool else "integer")


def weights_problem(expected: dict[str, Any], weights: dict[str, Any]) -> str | None:
    """The first tensor of ``weights`` (a checkpoint's ``model``) that does not fit the
    model whose ``state_dict()`` is ``expected``, in words (None: every name, shape and kind
    of value fits): a tensor the model has and the checkpoint lacks, one whose shape or kind
    (floating, complex, integer, bool) differs, one the model does not have."""
    for name, want in expected.items():
        if not isinstance(want, torch.Tensor):
            continue
        have = weights.get(name)
        if have is None:
            return f"it lacks tensor '{name}' (one of the {len(expected)} the model has)"
        if not isinstance(have, torch.Tensor):
            return f"its '{name}' is not a tensor"
        if tuple(have.shape) != tuple(want.shape):
            return (f"tensor '{name}' has shape {_shape(have)} there and {_shape(want)} in "
                    "the model")
        if _kind(have) != _kind(want):
            return (f"tensor '{name}' holds {have.dtype} there and {want.dtype} in the model "
                    f"({_kind(have)} values, not {_kind(want)})")
    extra = [name for name in weights if name not in expected]
    if extra:
        return f"it has tensor '{extra[0]}', which the model does not"
    return None


def _does_not_fit(path: Path, problem: str, model: str) -> ModbenchError:
    return ModbenchError(f"checkpoint {path} does not fit {model}: {problem}; use the "
                         "checkpoint written with this config (or a copy of it from before), or "
                         "train again into a new --out")


def check_weights(model: torch.nn.Module, weights: dict[str, Any], path: Path, *,
                  what: str = "the run's model (its config.yaml)") -> None:
    """Refuse, in one line naming the first offending tensor (:func:`weights_problem`), a
    checkpoint's weights that ``model`` cannot load (``load_state_dict`` would raise a
    ``RuntimeError`` listing every mismatch, or cast complex values to real)."""
    problem = weights_problem(model.state_dict(), weights)
    if problem is not None:
        raise _does_not_fit(path, problem, what)


def load_weights(model: torch.nn.Module, weights: dict[str, Any], path: Path, *,
                 what: str = "the run's model (its config.yaml)") -> None:
    """``model.load_state_dict(weights)`` after :func:`check_weights`: the checkpoint at
    ``path`` loaded into ``model``, or one line saying which tensor does not fit."""
    check_weights(model, weights, path, what=what)
    try:
        model.load_state_dict(weights)
    except (RuntimeError, ValueError, TypeError) as e:  # what the check cannot foresee
        raise _does_not_fit(path, first_line(e), what) from e


def first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[0] if lines else e.__class__.__name__)[:200]


def check_optimizer_state(optimizer: torch.optim.Optimizer, saved: Any, path: Path,
                          names: dict[int, str] | None = None) -> None:
    """Refuse, in one line, a checkpoint's optimizer state that ``optimizer`` cannot take:
    groups of other sizes than the optimizer's, or a per-parameter state tensor (Adam's
    moments, Muon's momentum) whose shape is not its parameter's (the step would raise a
    ``RuntimeError``). ``names``: parameter names by ``id`` of the parameter, for the message.
    An optimizer made of optimizers (Muon with AdamW: ``{"muon": …, "adamw": …}``) is checked
    part by part; a state of a layout this does not know is left to the optimizer's own
    ``load_state_dict``."""
    if not isinstance(saved, dict):
        raise _not_modbench(path, "its 'optimizer' is not a mapping")
    if "param_groups" not in saved:
        for key, part in saved.items():
            inner = getattr(optimizer, str(key), None)
            if isinstance(inner, torch.optim.Optimizer):
                check_optimizer_state(inner, part, path, names)
        return
    groups, state = saved.get("param_groups"), saved.get("state", {})
    if not isinstance(groups, list) or not isinstance(state, dict) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise _not_modbench(path, "its optimizer state has no list of parameter groups")
    have = [len(g["params"]) for g in groups]
    want = [len(g["params"]) for g in optimizer.param_groups]
    if have != want:
        raise _does_not_fit(path, f"its optimizer state has parameter groups of {have} "
                            f"parameters, the run's optimizer {want}", "the run's optimizer")
    params = {i: p for g, live in zip(groups, optimizer.param_groups, strict=True)
              for i, p in zip(g["params"], live["params"], strict=True)}
    for i, entry in state.items():
        param = params.get(i)
        if param is None:
            raise _does_not_fit(path, f"its optimizer state names parameter {i!r}, which no "
                                "group holds", "the run's optimizer")
        if not isinstance(entry, dict):
            raise _not_modbench(path, f"the optimizer state of parameter {i!r} is not a "
                                "mapping")
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 and (
                    tuple(value.shape) != tuple(param.shape)):
                name = (names or {}).get(id(param), f"parameter {i}")
                raise _does_not_fit(
                    path, f"the optimizer's '{key}' of '{name}' has shape {_shape(value)} there "
                    f"and the parameter {_shape(param)}", "the run's optimizer")

#: what a checkpoint must hold to resume training from it, besides check_checkpoint's
TRAINING_KEYS = ("optimizer", "train_time", "initial_val_loss", "metrics_offset")


def check_resumable(state: dict[str, Any], path: Path, metrics: Path) -> int:
    """The byte length of ``metrics`` (the run's ``metrics.jsonl``) that a resume from
    ``state`` keeps, checked: the training keys are there, and the log is a regular file (a
    resume cuts it back: it never follows a symbolic link) at least that long (a shorter one
    was cut or replaced since the checkpoint; a resume would extend it with zeros)."""
    missing = [k for k in TRAINING_KEYS if k not in state]
    if missing:
        raise _not_modbench(path, f"no {', '.join(missing)}: not a training checkpoint")
    offset = int(state["metrics_offset"])
    if metrics.is_symlink() or (metrics.exists() and not metrics.is_file()):
        raise ModbenchError(f"cannot resume: {metrics} is not a regular file (a symbolic link "
                            "or a folder); a resume rewrites it, so put the log itself there")
    size = metrics.stat().st_size if metrics.exists() else 0
    if size < offset:
        raise ModbenchError(f"cannot resume: {metrics} has {size} bytes but the checkpoint "
                            f"{path} was written after {offset}; the log was cut or replaced "
                            "since; restore it, or train again into a new --out")
    return offset


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file ``tensor``'s memory is mapped from (a checkpoint read by
    :func:`load_checkpoint`), or None: the process's own (anonymous) memory, or a system
    without ``/proc/self/maps``."""
    ptr = tensor.untyped_storage().data_ptr()
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= ptr < high:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint was written at, read without loading its tensors
    (memory-mapped)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        state = load_checkpoint(path)  # not a zip checkpoint: the full, checked load
    if not isinstance(state, dict):
        raise _not_modbench(path, "not a mapping")
    check_checkpoint(state, path)
    return int(state["step"])



def interrupted_run_line(folders: list[Path], resume: str) -> str:
    """The one line an interrupted ``modbench train`` prints (Ctrl-C): the step of each run
    folder's last checkpoint, read from disk (a write cut by the interrupt left the one
    before it), or that nothing was saved; and ``resume``, the command that continues."""
    if not folders:
        return "interrupted before training began: nothing was saved; run the same command again"
    steps = []
    for folder in folders:
        try:
            steps.append(checkpoint_step(folder / CHECKPOINT))
        except Exception:  # no checkpoint yet (or none readable)
            continue
    where = folders[0] if len(folders) == 1 else Path(os.path.commonpath(folders))
    if not steps:
        return (f"interrupted before the first checkpoint: nothing was saved in {where}; "
                f"start it again (from step 0) with: {resume}")
    if len(set(steps)) == 1 and len(steps) == len(folders):
        what = f"the last checkpoint (step {steps[0]})" if len(folders) == 1 else (
            f"the last checkpoints (step {steps[0]})")
    else:
        what = f"{len(steps)} of {len(folders)} runs' checkpoints (steps " + ", ".join(
            map(str, steps)) + ")"
    verb = "is" if what.startswith("the last checkpoint (") else "are"
    return f"interrupted: {what} {verb} saved in {where}; resume with: {resume}"

# -------------------------------------------------------------------------- preemption

#: the exit status of a process that saved its run on a signal and stopped (EX_TEMPFAIL)
EXIT_PREEMPTED = 75
#: the signals that ask a run to save and stop (SLURM's --signal, submitit's, torchrun's)
STOP_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM")
#: the file whose existence asks every process of a torchrun group to save and stop
STOP_FILE_ENV = "MODBENCH_STOP_FILE"

_requested: list[int] = []  # the signals received since stop_on_signals began


class Preempted(SystemExit):
    """A run saved a checkpoint of its current step on a signal and stopped; ``--resume``
    continues it exactly. A ``SystemExit`` (exit status :data:`EXIT_PREEMPTED`), so code that
    records an ``Exception`` as a failed run lets it through to the scheduler's handler."""

    def __init__(self, message: str, signum: int | None = None) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.message, self.signum = message, signum
        _requested.clear()  # the request is acted on: stop_on_signals does not raise it again

    def __str__(self) -> str:
        return self.message


def stop_requested() -> int | None:
    """The signal that asked this process to stop (0: the stop file of its group), else
    None."""
    if _requested:
        return _requested[0]
    stop_file = os.environ.get(STOP_FILE_ENV)
    if stop_file and os.path.exists(stop_file):
        return 0
    return None


def signal_name(signum: int | None) -> str:
    if not signum:
        return "the stop file of its process group"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@contextlib.contextmanager
def stop_on_signals(on_signal: Callable[[int], None] | None = None) -> Iterator[None]:
    """While inside, :data:`STOP_SIGNALS` set :func:`stop_requested` (and call
    ``on_signal``) instead of ending the process; each signal's previous handler is back
    afterwards, and a second signal of a kind gets it at once. A signal is deferred, never
    dropped: unless the body acted on it (made a :class:`Preempted`), it is raised again on
    the way out, for the previous handler (submitit's requeue, or the default: the end of
    the process) to act on once the run is saved and finished. Outside the main thread
    (where Python cannot take signals) nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}

    def handle(signum: int, frame: FrameType | None) -> None:
        _requested.append(signum)
        signal.signal(signum, previous[signum])  # the next one acts as before
        if on_signal is not None:
            on_signal(signum)

    _requested.clear()
    for name in STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(sig, handle) or signal.SIG_DFL
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        pending = _requested[:1]
        _requested.clear()
        if pending:
            signal.raise_signal(pending[0])
