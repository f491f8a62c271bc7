"""One trainer for every method.

The loop (:meth:`Trainer.run`) owns the schedule, the batches, clipping, metrics, validation,
divergence detection, stall detection (at the end: :mod:`modbench.runtime.stall`; at each
validation too under ``train.stop_stalled_after``, which stops a stalled run there) and
atomic checkpoints. The numerical work of a step goes through an
engine (:mod:`modbench.train.engine`: one model on one device today; an ensemble or a
distributed run is another engine under the same loop). Everything else attaches as a
:class:`~modbench.runtime.callback.Callback` at the loop's named points: the methods' own
callbacks (nGPT's renormalisation, step-aware norms), probe scoring (``train.eval_probes``),
per-layer logging (``train.log_layers``) and the caller's.

The seed split: the init seed fixes the weights, the data seed the batch order, so every
method and every init seed sees the same batch at the same step.

A fresh start may take its initial weights from another run (``train.init_from``: a run
folder or a checkpoint file; ignored on resume): after the usual initialisation the trainer
loads that checkpoint's model weights, through each method's ``grow_state_dict`` hook (e.g.
TokenFormer growth), and records the source under ``meta.init_from`` in ``config.yaml``.

Several processes (torchrun, ``WORLD_SIZE > 1``; :mod:`modbench.train.distributed`) run the
same loop over a :class:`~modbench.train.distributed.DistributedEngine` (DDP or FSDP2, per
``train.parallel``): each process trains on its slice of the same global batch, every
callback runs on every process, and only rank 0 writes files.

A stop signal (SIGUSR1, SIGUSR2, SIGTERM: a scheduler's warning before a time limit or a
preemption; :func:`modbench.runtime.checkpoint.stop_on_signals`) is read after every step
(a group agrees on it at each step: :meth:`Trainer._stop_between`): the run finishes its
step, saves a checkpoint of it (every process of a group at the same step) and raises
:class:`~modbench.runtime.checkpoint.Preempted` (exit status 75); ``--resume`` continues it
exactly.

The run folder's files are described in :mod:`modbench.runtime.runfolder` and docs/runs.md.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import hashlib
import json
import math
import shutil
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from modbench.config import EXECUTION_KEYS, ModelConfig, RunConfig, dump_yaml, from_dict
from modbench.data.unigram import UnigramLevel, unigram_level
from modbench.errors import ModbenchError
from modbench.eval.layer_logging import LayerLogging
from modbench.eval.probes import ProbeScoring
from modbench.fsutil import atomic_write_text
from modbench.methods.base import Method
from modbench.methods.build import plan_run, reads_train_seq_len
from modbench.runtime.callback import Callback
from modbench.runtime.checkpoint import (
    Preempted,
    check_optimizer_state,
    check_resumable,
    check_weights,
    checkpoint_step,
    first_line,
    load_checkpoint,
    previous_path,
    save_checkpoint,
    signal_name,
    stop_on_signals,
    stop_requested,
)
from modbench.runtime.data import Prefetcher, open_data_in_group
from modbench.runtime.device import (
    CompileChoice,
    autocast_for,
    choose_compile,
    graph_compiled_before,
    note_compiled,
    resolve_device,
    return_freed_activations,
)
from modbench.runtime.lock import LOCK_NAME, FolderLock
from modbench.runtime.loss import finite_or_none, perplexity
from modbench.runtime.runfolder import (
    CHECKPOINT,
    CONFIG,
    METRICS,
    SUMMARY,
    MetricsLog,
    code_version,
    read_metrics,
    val_points,
)
from modbench.runtime.stall import StallCheck, check_stall, stalled_at, summary_fields
from modbench.train.distributed import (
    FLIGHT_RECORDER,
    DistributedEngine,
    check_world,
    collective_failure,
    current_world,
    fsdp_param_dtype,
    local_batch,
    rank_device,
)
from modbench.train.engine import Engine, LocalEngine, StepValue, host_floats
from modbench.train.live import TrainProgress
from modbench.train.optim import build_optimizer
from modbench.train.recompute import apply_activation_checkpointing
from modbench.train.schedule import lr_at
from modbench.train.trackers import make_trackers

LAST_GRAD_NORMS = 10
SYNC_EVERY = 16  # steps per read-back on an accelerator (Trainer.sync_every)


@dataclass
class Progress:
    """Where a member's run stands: what a checkpoint saves besides the weights, and the
    outcome."""

    step: int = 0  # optimizer steps done when the loop (re)starts
    train_time: float = 0.0
    # this process's seconds in validation (callbacks' on_eval included) and its first step's
    # (a compiled step compiles there): the time-to-decision benchmark's shares
    val_time: float = 0.0
    first_step_time: float | None = None
    initial_val: float | None = None
    last_val: float | None = None
    status: str = "completed"  # completed | diverged | stalled (decided at the end: _finish)
    diverged_at: int | None = None
    stalled_at: int | None = None
    stopped_at: int | None = None  # steps done when train.stop_stalled_after stopped it
    # every validation (step, loss; None: not finite), for the stall rule (runtime.stall)
    vals: list[tuple[int, float | None]] = field(default_factory=list)
    grad_norms: collections.deque[tuple[int, float | None]] = field(
        default_factory=lambda: collections.deque(maxlen=LAST_GRAD_NORMS))
    # sha256 chained over every training batch seen, in step order (None: a resume from a
    # checkpoint that did not record it)
    batches_sha256: str | None = ""
    final: bool = False  # resumed from the checkpoint written after the last validation

    @property
    def live(self) -> bool:
        return self.status == "completed"

    def diverge(self, at: int) -> None:
        self.status, self.diverged_at = "diverged", at

    def stall(self, at: int) -> None:
        """A finished run that stayed at the unigram level from step ``at``."""
        self.status, self.stalled_at = "stalled", at

    def saw(self, batch: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Chain the step's batch (and loss mask) into :attr:`batches_sha256`."""
        if self.batches_sha256 is None:
            return
        h = hashlib.sha256(self.batches_sha256.encode())
        h.update(batch.numpy().tobytes())
        if mask is not None:
            h.update(mask.numpy().tobytes())
        self.batches_sha256 = h.hexdigest()


@dataclass
class _Pending:
    """A step trained but not yet read back: its live members and their losses and grad
    norms as the engine returned them (on the device), then as read (:meth:`Trainer._read_back`:
    floats, for the members still live at this step)."""

    step: int
    lr: float
    members: list[Member]
    batch: torch.Tensor
    mask: torch.Tensor | None
    losses: list[StepValue]
    norms: list[StepValue]
    read: list[tuple[Member, float, float, bool]] = field(default_factory=list)  # finite?


class Member:
    """One seed's run in a trainer: its config, folder, callbacks, progress and log. It is
    what callbacks receive as ``run`` (:class:`~modbench.runtime.callback.TrainingRun`)."""

    def __init__(self, trainer: Trainer, index: int, cfg: RunConfig, out: Path,
                 callbacks: list[Callback]) -> None:
        self.trainer, self.index, self.cfg, self.out = trainer, index, cfg, out
        self.callbacks = callbacks
        self.prog = Progress()
        self.log: MetricsLog | _NoLog

    @property
    def model(self) -> nn.Module:
        return self.trainer.engine.models[self.index]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.engine.optimizers[self.index]

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    @property
    def data(self) -> Any:
        return self.trainer.data

    @property
    def compiled(self) -> bool:
        """Whether the training forward runs through ``torch.compile`` (``train.compile`` as
        the trainer chose it: :func:`~modbench.runtime.device.choose_compile`)."""
        return self.trainer.compile_choice.compiled

    @property
    def step(self) -> int:
        return self.trainer.step


@contextlib.contextmanager
def onednn_off() -> Iterator[None]:
    """torch's oneDNN (mkldnn) CPU kernels off in the block (``train.onednn`` false), then as
    they were. torch's switch also sets oneDNN's TF32 flag, which warns on a machine without
    an Intel GPU at every switch; that warning says nothing about this run and is silenced."""
    quiet = "TF32 acceleration on top of oneDNN"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=quiet)
        switch = torch.backends.mkldnn.flags(enabled=False)
        switch.__enter__()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=quiet)
            switch.__exit__(None, None, None)


class Trainer:
    """Train one run, or several seeds of one run stacked (``seeds``). Construct (which
    validates everything and writes nothing), then :meth:`run` (one run) or :meth:`run_all`.

    ``seeds``: train these init seeds of ``cfg`` together, every member on the same batches,
    in one process (:class:`~modbench.train.engine.LocalEngine`); ``out_dir`` is then one folder
    per seed, or a parent folder that gets ``s<seed>/`` per seed. Each member's folder is an
    ordinary run folder. The method must be stackable (``Plan.stackable``).

    The caller's config is not changed: :attr:`cfg` (the first member's) is the run's own
    copy, with the canonical method string and the methods' recipe exceptions.
    """

    def __init__(
        self,
        cfg: RunConfig,
        out_dir: str | Path | Sequence[str | Path],
        *,
        seeds: Sequence[int] | None = None,
        resume: bool = False,
        callbacks: Sequence[Callback] = (),
        progress: bool = True,
        until: int | None = None,
    ) -> None:
        self.resume, self.progress = resume, progress
        if until is not None and (isinstance(until, bool) or not isinstance(until, int)
                                  or until < 1):
            raise ModbenchError(f"cannot pause a run at step {until!r}: give a whole number "
                                "of steps, at least 1")
        #: pause after this many steps (None: train to train.steps); see :meth:`run_all`
        self.until = until
        # 1. methods: unknown or conflicting ones fail here, before any file is written
        self.cfg, self.plan = plan_run(cfg)
        outs, cfgs = _member_runs(self.cfg, out_dir, seeds)
        if len(cfgs) > 1 and not self.plan.stackable:
            raise ModbenchError(f"method '{self.plan.method}' cannot stack seeds in one process "
                                f"({self.plan.stack_note}); train its seeds one at a time")
        tc = self.cfg.train
        self.members = [Member(self, k, c, o, [
            *(cb for m in self.plan.methods for cb in m.callbacks()),
            *([ProbeScoring(tc.eval_probes)] if tc.eval_probes else []),
            *([LayerLogging()] if tc.log_layers else []), *callbacks])
            for k, (c, o) in enumerate(zip(cfgs, outs, strict=True))]
        # several processes (torchrun): this one's rank; what they cannot do fails here
        self.world = current_world()
        check_world(tc, self.world.size, len(self.members), self.cfg.recipe.optimizer)
        if tc.activation_checkpointing and len(self.members) > 1:
            raise ModbenchError("train.activation_checkpointing cannot be used with stacked "
                                "seeds (--seeds); train the seeds one at a time or set "
                                "train.activation_checkpointing=false")
        if self.world.main:  # trackers (train.trackers) last: they send what the others add
            for m in self.members:
                m.callbacks += make_trackers(m.cfg, m.out)
        # 2. the run folders (and the initial weights of a fresh start); rank 0 holds each
        # folder's lock (runtime.lock: one writer per run folder) until the run ends
        self.locks = ([FolderLock(m.out, "modbench train") for m in self.members]
                      if self.world.main else [])
        try:
            for lock in self.locks:
                lock.acquire()
            for m in self.members:
                self._check_out_dir(m)
            self.init_checkpoint = (None if resume or tc.init_from is None
                                    else init_checkpoint(tc.init_from))
            self.device = rank_device(resolve_device(tc.device), self.world)
            self.world.init(self.device, tc.dist_timeout)
            # train.parallel=auto and train.micro_batch_size=auto: the memory plan's, before
            # the data is opened (hashing a large corpus) and before a file is written
            self.parallel, self.micro_batch = self._layout()
            # 3. data (missing, corrupt, wrong vocabulary, wrong packing); in a group rank 0
            # prepares the built-in corpus, one process per node hashes the shards, and every
            # process refuses damaged data in the same line (runtime.data.open_data_in_group)
            try:
                self.data = open_data_in_group(
                    self.cfg, progress and self.world.main, rank=self.world.rank,
                    local_rank=self.world.local_rank, size=self.world.size)
            except BaseException as e:
                failed = collective_failure(e, self.world, tc.dist_timeout)
                if failed is not None:
                    raise failed from None
                raise
        except BaseException:
            self.release_locks()
            raise
        self.out, self.step = self.members[0].out, 0
        # steps between two reads of the losses back from the device: every step on the CPU
        # (nothing runs ahead there), a window on an accelerator so the host queues work
        # without waiting; a member that diverges within a window is caught at its end
        self.sync_every = 1 if self.device.type == "cpu" else SYNC_EVERY

    def release_locks(self) -> None:
        """Let other writers at the run folders (done at the end of :meth:`run_all`)."""
        for lock in self.locks:
            lock.release()

    @property
    def model(self) -> nn.Module:
        """The first member's model (the model of a single run)."""
        return self.engine.models[0]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first member's optimizer."""
        return self.engine.optimizers[0]

    # ----------------------------------------------------------------------- the loop

    def run(self) -> dict[str, Any]:
        """Train one run (see :meth:`run_all`) and return its summary."""
        if len(self.members) != 1:
            raise ValueError("this trainer stacks several seeds: call run_all()")
        return self.run_all()[0]

    def run_all(self) -> list[dict[str, Any]]:
        """Train every member to ``train.steps`` (or to its divergence) and return their
        summaries, which are also written to each ``summary.json``.

        With :attr:`until` below ``train.steps`` the run pauses there instead: each member
        still training is validated and checkpointed at that step and gets a summary with
        status ``paused`` that is not written (its folder stays a run to ``--resume``, which
        goes on exactly as if it had not paused); a member that diverged or stalled before
        ends as usual.

        The recipe, in order: open the run (threads, the stop signals, a fresh start or the
        checkpoint's step), validate at step 0, then for each step the training step
        (:meth:`_train_step`); at the end of a window of steps (:meth:`_window_closes`) the
        host reads the step values back and logs them, and at its named points
        (:meth:`_at_window_end`) validates, stops a stalled member, checkpoints and answers a
        stop signal; at the end a last validation and checkpoint (:meth:`_final_validation`)
        and each member's summary."""
        tc = self.cfg.train
        signals = self._open_run()
        bar = TrainProgress(tc.steps, self.step, self._label(),
                            enabled=self.progress and self.world.main)
        batches = self._prefetcher(self.step)
        stop = self.stop_step
        began = self.step
        try:
            self._emit(self.members, "on_train_start")
            for m in self.members:
                if m.prog.initial_val is None:
                    m.prog.initial_val = self._validate(m, 0)
            pending: list[_Pending] = []  # steps whose loss and grad norm are on the device
            t_window = time.perf_counter()
            for step in range(self.step, stop):
                if not any(m.prog.live for m in self.members):
                    break
                live, closes = self._train_step(step, batches, pending)
                if step == began:  # start-up is over: collectives wait dist_step_timeout
                    self.world.settle(tc.dist_step_timeout)
                if not closes:
                    continue
                self.engine.synchronize()
                self._log_window(pending, (time.perf_counter() - t_window) / len(pending), bar)
                pending = []
                if step + 1 == tc.steps:
                    break
                self._at_window_end(live, step + 1)
                t_window = time.perf_counter()
            if stop < tc.steps:
                summaries = self._pause(stop, began)
            else:
                self._final_validation()
                summaries = [self._finish(m) for m in self.members]
        except BaseException as e:
            failed = self._group_error(e)
            if failed is not None:
                raise failed from None
            raise
        finally:
            self._close_run(batches, bar, signals)
        return summaries

    def _open_run(self) -> contextlib.ExitStack:
        """Set the thread count (and oneDNN off where ``train.onednn`` is false), catch the stop
        signals (SIGUSR1/SIGUSR2/SIGTERM from SLURM, submitit or torchrun: save the step and
        stop) and set :attr:`step` to where training starts (0, or a checkpoint's step); a
        failure here ends the process group as the loop's own does. Returns the signals'
        context (with the oneDNN switch), closed last by :meth:`_close_run`."""
        tc = self.cfg.train
        if tc.threads > 0:
            torch.set_num_threads(tc.threads)
        signals = contextlib.ExitStack()
        signals.enter_context(stop_on_signals())
        if not tc.onednn:  # other CPU kernels for this run, restored when it closes
            signals.enter_context(onednn_off())
        try:
            self.step = self._start()
        except BaseException as e:
            signals.close()
            self.world.end()
            self.release_locks()
            failed = self._group_error(e)
            if failed is not None:
                raise failed from None
            raise
        if not self.world.main:  # only rank 0 reads whole batches and writes the hash
            for m in self.members:
                m.prog.batches_sha256 = None
        return signals

    def _prefetcher(self, start: int) -> Prefetcher:
        """The batches from ``start`` on, read ahead (this rank's rows of each)."""
        tc = self.cfg.train
        w, r = self.world.size, self.world.rank
        rows = tc.batch_size // w
        return Prefetcher(self.data, range(start, tc.steps), tc.batch_size,
                          self.cfg.data.data_seed, pin=self.device.type == "cuda",
                          rows=None if self.world.main else (r * rows, (r + 1) * rows))

    def _train_step(self, step: int, batches: Prefetcher,
                    pending: list[_Pending]) -> tuple[list[Member], bool]:
        """One optimizer step of the live members (learning rate, batch, backward, clipping,
        update, with the callbacks' points between), its values left on the device in
        ``pending``; where the step closes a window they are read back first (a member whose
        loss is not finite stops there). Returns the members still live and whether the
        window closed."""
        tc = self.cfg.train
        live = [m for m in self.members if m.prog.live]
        self.step, done = step, step + 1
        lr = lr_at(step, self.cfg.recipe, tc.steps)
        self.engine.set_lr(lr)
        batch, mask = batches.get(step)
        self._emit(live, "on_batch", step, batch)
        idx = [m.index for m in live]
        losses = self.engine.backward(batch, mask, idx)
        norms = self.engine.clip_grad_norm(self.cfg.recipe.grad_clip, idx)
        self._emit(live, "after_backward", step)
        pending.append(_Pending(step, lr, live, batch, mask, losses, norms))
        # a stop asked mid-window closes it here, so the save starts a step after the signal,
        # not up to a window later (a host flag, agreed by the group: _stop_between)
        closes = self._window_closes(done) or self._stop_between(done)
        if closes:
            live = self._read_back(pending)
        self.engine.update([m.index for m in live])
        self._emit(live, "after_optimizer_step", step)
        return live, closes

    def _window_closes(self, done: int) -> bool:
        """Whether the host reads the device back after ``done`` steps: only where it must, at
        the end of a window of ``sync_every`` steps, and before a validation, a checkpoint or
        the end."""
        tc = self.cfg.train
        return (done in (tc.steps, self.stop_step) or _every(self.sync_every, done)
                or _every(tc.eval_every, done) or _every(tc.checkpoint_every, done))

    @property
    def stop_step(self) -> int:
        """The step this call trains to: :attr:`until` when it is below ``train.steps``."""
        steps = self.cfg.train.steps
        return steps if self.until is None else min(self.until, steps)

    def _at_window_end(self, live: list[Member], done: int) -> None:
        """The named points after a window, in order, for each live member: validation (a
        non-finite loss is a divergence), the stall stop (after a validation), the checkpoint;
        then a stop signal saves every live member and stops."""
        tc = self.cfg.train
        for m in live:
            if _every(tc.eval_every, done) and not math.isfinite(self._validate(m, done)):
                m.prog.diverge(done)
            if m.prog.live and _every(tc.eval_every, done):
                self._stop_if_stalled(m, done)
            if m.prog.live and _every(tc.checkpoint_every, done):
                self._checkpoint(m, done)
        signum = self._stop_signal()
        if signum is not None:
            self._save_and_stop([m for m in live if m.prog.live], done, signum)

    def _final_validation(self) -> None:
        """A last validation and checkpoint of each member still training (a non-finite loss
        there is a divergence at the last step)."""
        steps = self.cfg.train.steps
        for m in (m for m in self.members if m.prog.live and not m.prog.final):
            if math.isfinite(self._validate(m, steps)):
                self._checkpoint(m, steps)
            else:
                m.prog.diverge(steps)

    def _pause(self, stop: int, began: int) -> list[dict[str, Any]]:
        """The end of a run paused at step ``stop`` (:attr:`until`): each member still training
        is validated there (unless the loop just did) and checkpointed (unless it was), and
        gets an unwritten summary with status ``paused``; the others their own summary. A call
        that trained nothing (its checkpoint already at or past ``stop``) saves nothing."""
        tc = self.cfg.train
        trained = began < stop  # this call trained steps (else it resumed at or past stop)
        out: list[dict[str, Any]] = []
        for m in self.members:
            if not m.prog.live:
                out.append(self._finish(m))
                continue
            if trained and not _every(tc.eval_every, stop) \
                    and not math.isfinite(self._validate(m, stop)):
                m.prog.diverge(stop)
                out.append(self._finish(m))
                continue
            if trained and not _every(tc.checkpoint_every, stop):
                self._checkpoint(m, stop)
            out.append({"status": "paused", "method": m.cfg.model.method, "seed": m.cfg.seed,
                        "steps": stop if trained else began, "steps_planned": tc.steps,
                        "val_loss": finite_or_none(m.prog.last_val)})
        return out

    def _close_run(self, batches: Prefetcher, bar: TrainProgress,
                   signals: contextlib.ExitStack) -> None:
        """Whatever happened: stop the read-ahead, the bar and the logs, leave the process
        group, release the run folders, and last the signals (a signal the run did not act on
        is raised again here)."""
        batches.close()
        bar.close()
        for m in self.members:
            if hasattr(m, "log"):
                m.log.close()
        self.world.end()
        self.release_locks()
        signals.close()

    # ------------------------------------------------------------------ the loop's parts

    def _emit(self, members: Sequence[Member], hook: str, *args: Any) -> None:
        for m in members:
            for cb in m.callbacks:
                getattr(cb, hook)(m, *args)

    def _label(self) -> str:
        seeds = ",".join(str(m.cfg.seed) for m in self.members)
        return f"{self.cfg.model.method} s{seeds}"

    def _tokens(self, steps: int) -> int:
        return steps * self.cfg.train.batch_size * self.cfg.train.seq_len

    def _read_back(self, pending: list[_Pending]) -> list[Member]:
        """Read a window's losses and grad norms from the device (one transfer) and check
        them step by step, chaining each step's batch into the members' batch hash: a
        member's first non-finite loss or grad norm ends its run at that step (diverged; its
        later steps in the window are dropped, their batches unseen). Returns the members
        whose last step is finite, the ones the last step's update may apply to."""
        values = host_floats([v for p in pending for v in (*p.losses, *p.norms)])
        i = 0
        for p in pending:
            n = len(p.members)
            losses, norms, i = values[i:i + n], values[i + n:i + 2 * n], i + 2 * n
            for m, loss, g in zip(p.members, losses, norms, strict=True):
                if not m.prog.live:
                    continue
                m.prog.saw(p.batch, p.mask)
                m.prog.grad_norms.append((p.step + 1, finite_or_none(g)))
                finite = math.isfinite(loss) and math.isfinite(g)
                if not finite:
                    m.prog.diverge(p.step + 1)
                p.read.append((m, loss, g, finite))
        return [m for m, _, _, finite in pending[-1].read if finite]

    def _log_window(self, pending: list[_Pending], dt: float, bar: TrainProgress) -> None:
        """The window's metrics records, in step order (``dt``: the seconds each step took,
        on average); a member's non-finite step is logged as a ``nonfinite`` record."""
        for p in pending:
            for m, loss, g, finite in p.read:
                if finite:
                    self._record(m, p.step, p.lr, loss, g, dt)
                else:
                    m.log.write({"kind": "train", "step": p.step + 1,
                                 "loss": finite_or_none(loss), "lr": p.lr,
                                 "grad_norm": finite_or_none(g), "nonfinite": True})
        last = pending[-1]
        bar.update(last.step + 1, last.read[0][1] if last.read else None, self._tokens(1) / dt)

    def _record(self, m: Member, step: int, lr: float, loss: float, grad_norm: float,
                dt: float) -> None:
        """The step's metrics record: offered to the callbacks, then logged."""
        m.prog.train_time += dt
        if m.prog.first_step_time is None:
            m.prog.first_step_time = dt
        done = step + 1
        record = {"kind": "train", "step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": self._tokens(1) / dt,
                  "tokens": self._tokens(done)}
        self._emit([m], "on_step_end", step, record)
        if self.cfg.train.logs(done):
            m.log.write(record)

    def _validate(self, m: Member, step: int) -> float:
        """A member's validation loss at ``step``, logged (with what callbacks add) and
        remembered."""
        tc = self.cfg.train
        began = time.perf_counter()
        v = self.engine.validation_loss(m.index, self.data, tc.eval_sequences,
                                        self.micro_batch or tc.batch_size)
        record = {"kind": "val", "step": step, "val_loss": finite_or_none(v),
                  "val_ppl": perplexity(v)}
        self._emit([m], "on_eval", step, record)
        m.prog.val_time += time.perf_counter() - began
        m.log.write(record)
        m.prog.last_val = v
        m.prog.vals.append((step, finite_or_none(v)))
        return v

    def _stop_if_stalled(self, m: Member, done: int) -> None:
        """``train.stop_stalled_after``: after the validation at step ``done``, stop a member
        whose losses since some step ``s`` after warm-up all sat at the unigram level, for at
        least that many steps, falling by less than ``train.stall_margin`` (the stall rule of
        :mod:`modbench.runtime.stall` over the points so far, the patience in steps). It ends
        here with status ``stalled`` and ``stalled_at_step`` ``s``, its checkpoint saved at
        ``done`` (docs/runs.md)."""
        level = self._unigram_level() if m.cfg.train.stop_stalled_after else None
        at = None if level is None else stop_stalled_at(m.cfg, m.prog.vals, level.val_loss, done)
        if at is not None:
            m.prog.stall(at)
            m.prog.stopped_at = done
            self._checkpoint(m, done)  # its last weights (modbench diagnose / eval read them)

    def _group_error(self, error: BaseException) -> ModbenchError | None:
        """A collective of the group that timed out or lost a process, as one line."""
        return collective_failure(error, self.world, self.cfg.train.dist_timeout)

    def _stop_between(self, done: int) -> bool:
        """Whether a stop was asked before a step that closes no window (read every step:
        a host flag, no device sync). One process reads its flag; a group agrees on it at
        every such step through a host-side (gloo) all-reduce, so every process closes the
        window at the same step (the window end's agreement, :meth:`_stop_signal`, then
        decides the stop). Never at the last step: the run ends there anyway."""
        if done >= self.stop_step:
            return False
        got = stop_requested() is not None
        if self.world.size < 2:
            return got
        flag = torch.tensor([int(got)], dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX,
                                     group=self._host_group)
        return bool(flag.item())

    @property
    def _host_group(self) -> Any:
        """A gloo group of the processes for host-side flags (None: the default group is gloo
        already); made on first use, at the same step on every process."""
        if not hasattr(self, "_host"):
            gloo = torch.distributed.get_backend() == "gloo"
            self._host = None if gloo else torch.distributed.new_group(backend="gloo")
        return self._host

    def _stop_signal(self) -> int | None:
        """The signal that asked the run to stop (0: its group's stop file), agreed by every
        process of a group (the same step for all: one all-reduce); None: go on."""
        got = stop_requested()
        if self.world.size < 2:
            return got
        flag = torch.tensor([-1 if got is None else got], dtype=torch.int64,
                            device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        agreed = int(flag.item())
        return None if agreed < 0 else agreed

    def _save_and_stop(self, members: Sequence[Member], done: int, signum: int) -> None:
        """Save each live member at step ``done`` (unless its periodic checkpoint just did)
        and raise :class:`Preempted`; every process gathers, and waits for rank 0's write."""
        for m in members:
            if not _every(self.cfg.train.checkpoint_every, done):
                self._checkpoint(m, done)
        self.world.barrier()  # the checkpoint is on disk before any process exits
        where = ", ".join(str(m.out) for m in members) or str(self.out)
        message = (f"stopped by {signal_name(signum)} after step {done}: checkpoint saved in "
                   f"{where}; continue with --resume")
        if self.world.main:
            print(message, file=sys.stderr, flush=True)
        raise Preempted(message, signum)

    def _checkpoint(self, m: Member, step: int) -> None:
        """Save a member's state (:meth:`_save`). Several processes wait for rank 0's write
        under ``train.dist_timeout``: a large checkpoint's write may take longer than
        ``train.dist_step_timeout``, which the next step's collective would wait under."""
        with self.world.patient():
            self._save(m, step)
            if self.world.steady is not None:
                self.world.barrier()

    def _save(self, m: Member, step: int) -> None:
        """Save a member's state. Stacked members keep their previous checkpoint too: a kill
        between two members' writes leaves them a step they all have. Several processes:
        every one gathers the state, rank 0 writes it."""
        state = self.engine.state_dict(m.index)
        if not self.world.main:
            return
        save_checkpoint(m.out / CHECKPOINT, {
            **state, "step": step, "train_time": m.prog.train_time,
            "metrics_offset": m.log.tell(), "initial_val_loss": m.prog.initial_val,
            "last_val_loss": m.prog.last_val, "grad_norms": [list(g) for g in m.prog.grad_norms],
            "val_history": [list(v) for v in m.prog.vals],
            "config": m.cfg.to_dict(), "batches_sha256": m.prog.batches_sha256,
            "data_fingerprint": self.data.fingerprint(),
        }, keep_previous=len(self.members) > 1)

    def _start(self) -> int:
        """Build the models, optimizers and engine; then load each member's checkpoint (a
        resume: its progress, and its log cut back to the checkpoint) or write its
        ``config.yaml``. Returns the step the loop starts at. Fresh run folders whose set-up
        fails are removed."""
        tc = self.cfg.train
        ckpts = _resume_points(self.members) if self.resume else {}
        self.world.barrier()  # every process has read the folders before rank 0 writes
        created = [lock.folder for lock in self.locks if lock.created]  # rank 0's
        try:
            models = [self.plan.build(m.cfg.seed, self.device) for m in self.members]
            init_from = {m.index: load_initial_weights(models[m.index], self.plan.methods,
                                                       m.cfg.model, self.init_checkpoint)
                         for m in self.members
                         if m.index not in ckpts and self.init_checkpoint is not None}
            if tc.activation_checkpointing:
                return_freed_activations(self.device)  # the memory it frees leaves the process
                for model in models:
                    apply_activation_checkpointing(model, self.plan.method,
                                                   tc.activation_checkpointing)
            self.engine: Engine = self._engine(models)
            offsets = [self._resume(m, ckpts[m.index]) if m.index in ckpts
                       else self._fresh(m, init_from.get(m.index)) for m in self.members]
            starts = {m.prog.step for m in self.members}
            if len(starts) > 1:  # some members resumed, others start afresh
                raise ModbenchError(f"cannot resume these seeds together: they stand at steps "
                                    f"{sorted(starts)}; resume each on its own")
        except BaseException:
            for out in created:
                shutil.rmtree(out, ignore_errors=True)
            raise
        for m, offset in zip(self.members, offsets, strict=True):
            m.log = (MetricsLog(m.out / METRICS, truncate_at=offset) if self.world.main
                     else _NoLog())
            if m.cfg.train.micro_batch_size == "auto":  # config.yaml keeps auto; the
                m.cfg.train.micro_batch_size = self.micro_batch  # callbacks read the choice
        return starts.pop()

    def _layout(self) -> tuple[str, int | None]:
        """How this run's processes hold it (:func:`modbench.measure.plan.layout`):
        ``train.parallel`` (``auto``: DDP where the memory plan fits the device with DDP, else
        FSDP; ddp with one process and on the CPU) and the sequences a forward takes
        (``train.micro_batch_size``, or for ``auto`` the largest that divides the process's
        batch and fits the device), planned against the device's memory or
        ``train.device_memory_gb``; each choice printed once. A run that fits nothing is
        refused in one line."""
        tc = self.cfg.train
        from modbench.measure.plan import gb, layout
        from modbench.runtime.gpus import device_memory_bytes

        nbytes = (int(tc.device_memory_gb * 1e9) if tc.device_memory_gb is not None
                  else device_memory_bytes(self.device))
        lay = layout(self.cfg, nbytes, nproc=self.world.size, ensembles=len(self.members),
                     device_type=self.device.type, checkpointing=apply_activation_checkpointing)
        mp = lay.plan
        say = self.world.main and self.progress
        if lay.chosen and mp is not None and say:
            why = "".join(f"; {t.parallel.upper()}'s peak {gb(t.peak_bytes)} does not fit"
                          for t in lay.rejected)
            print(f"train.parallel=auto: {lay.parallel} across the {self.world.size} processes "
                  f"(planned peak {gb(mp.peak_bytes)} of {gb(mp.usable_bytes)} usable a "
                  f"process{why})", file=sys.stderr, flush=True)
        if tc.micro_batch_size != "auto":
            mb = tc.micro_batch_size
            return lay.parallel, mb if isinstance(mb, int) else None
        assert mp is not None  # a micro-batch to choose is always planned
        if say:
            print(f"train.micro_batch_size=auto: {mp.micro_batch} of the "
                  f"{tc.batch_size // self.world.size} sequences a process trains on a step "
                  f"(planned peak {gb(mp.peak_bytes)} of {gb(nbytes)}; modbench plan)",
                  file=sys.stderr, flush=True)
        return lay.parallel, mp.micro_batch

    def _engine(self, models: list[nn.Module]) -> Engine:
        """The engine: the members on this device, or one member across the processes."""
        cfg, tc = self.cfg, self.cfg.train
        autocast = autocast_for(cfg.recipe.precision, self.device)
        graph = self._graph_key(len(models))
        self.compile_choice = self._compile_choice(len(models), graph)
        setting = self.compile_choice.setting

        def on_compiled() -> None:
            note_compiled(graph)  # later runs of this graph compile it warm
        if self.compile_choice.why and self.world.main and self.progress:
            print(f"train.compile=auto on the CPU: {self.compile_choice.why}",
                  file=sys.stderr, flush=True)
        if self.world.size > 1:
            dtype = fsdp_param_dtype(tc.fsdp_param_dtype, cfg.recipe.precision, self.device)
            engine = DistributedEngine(
                models[0], lambda model: build_optimizer(model, cfg.recipe), self.device,
                autocast, self.world, parallel=self.parallel,
                n_micro=local_batch(tc, self.world.size, self.micro_batch)[1],
                compile=setting, param_dtype=dtype, on_compiled=on_compiled)
            if engine.units and self.world.main and self.progress:
                print(f"train.parallel=fsdp: {len(engine.units)} FSDP2 units "
                      f"({', '.join(engine.units[:3])}{', ...' if len(engine.units) > 3 else ''})"
                      f", parameters gathered in {str(dtype).removeprefix('torch.')}",
                      file=sys.stderr, flush=True)
            return engine
        return LocalEngine(
            models, [build_optimizer(model, cfg.recipe) for model in models], self.device,
            autocast, n_micro=tc.batch_size // (self.micro_batch or tc.batch_size),
            compile=setting, on_compiled=on_compiled)

    def _graph_key(self, members: int) -> str:
        """What makes one compiled training graph: the model, the batch's shape, the stacked
        seeds, the precision and torch's version (:func:`note_compiled`)."""
        tc = self.cfg.train
        blob = json.dumps({"model": self.cfg.to_dict()["model"], "members": members,
                           "rows": self.micro_batch or tc.batch_size // self.world.size,
                           "seq": tc.seq_len, "precision": self.cfg.recipe.precision,
                           "compile": tc.compile, "torch": torch.__version__},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def _compile_choice(self, members: int, graph: str) -> CompileChoice:
        """``train.compile`` for this run (:func:`choose_compile`: ``auto`` on the CPU compiles
        only where the run repays its compilation; warm where ``graph``, its
        :meth:`_graph_key`, compiled into this cache before)."""
        tc = self.cfg.train
        if tc.compile != "auto" or self.device.type != "cpu":
            return CompileChoice(tc.compile)
        from modbench.measure.flops import flop_report

        try:
            per_token = flop_report(self.cfg.model, tc.seq_len).train_flops_per_token
        except NotImplementedError:  # a method without its FLOPs (a user's own): no estimate
            return CompileChoice(False, "eager: the run's FLOPs are not known (a method "
                                        "without extra_flops), so no saving can be estimated")
        return choose_compile(tc.compile, self.device, steps=tc.steps,
                              step_flops=per_token * tc.batch_size * tc.seq_len * members,
                              layers=self.cfg.model.n_layers,
                              warm=graph_compiled_before(graph))

    def _resume(self, m: Member, path: Path) -> int:
        state = load_checkpoint(path)
        if self.world.main:  # keys, offset and log checked before the log is cut back
            check_resumable(state, path, m.out / METRICS)
        self._check_same_data(m, state.get("data_fingerprint"))
        # the weights' and the optimizer state's names and shapes, in one line naming the
        # first tensor that does not fit (else load_state_dict's RuntimeError, or the step's)
        model, optimizer = self.engine.models[m.index], self.engine.optimizers[m.index]
        check_weights(model, state["model"], path)
        check_optimizer_state(optimizer, state["optimizer"], path,
                              {id(p): name for name, p in model.named_parameters()})
        try:
            self.engine.load_state_dict(m.index, state)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise ModbenchError(f"checkpoint {path} does not load into the run's model and "
                                f"optimizer ({e.__class__.__name__}: "
                                f"{first_line(e)}); use the checkpoint written with this "
                                "config, or train again into a new --out") from e
        step = int(state["step"])
        m.prog = Progress(step=step, train_time=state["train_time"],
                          initial_val=state["initial_val_loss"],
                          last_val=state.get("last_val_loss"),
                          batches_sha256=state.get("batches_sha256"),
                          final=step == m.cfg.train.steps and "last_val_loss" in state)
        m.prog.grad_norms.extend((int(s), g) for s, g in state.get("grad_norms", ()))
        m.prog.vals = ([(int(s), v) for s, v in state["val_history"]] if "val_history" in state
                       # a checkpoint from before val_history: its log up to the checkpoint
                       # (none where this process cannot see the folder: later points only)
                       else val_points(read_metrics(m.out, int(state["metrics_offset"]))))
        return int(state["metrics_offset"])

    def _fresh(self, m: Member, init_from: dict[str, Any] | None) -> int | None:
        """Write a fresh member's ``config.yaml`` (``init_from``: where its initial weights
        came from); a folder a killed run left before its first checkpoint (``--resume`` on
        it) starts again, its log emptied. Only rank 0 writes."""
        if not self.world.main:
            return None
        from modbench.methods.plugins import origins

        meta: dict[str, Any] = {"code": code_version(),
                                # where each method came from (built in, or a plugin with the
                                # sha256 of its code: modbench.methods.plugins)
                                "methods": origins(x.name for x in self.plan.methods),
                                "slots": self.plan.spec.describe(),
                                "params": self.plan.count_params(),
                                "data": {"fingerprint": self.data.fingerprint()}}
        if init_from is not None:
            meta["init_from"] = init_from
        if m.cfg.train.micro_batch_size == "auto":
            meta["micro_batch_size"] = self.micro_batch  # what auto chose on this device
        if m.cfg.train.parallel == "auto" and self.world.size > 1:
            meta["parallel"] = self.parallel  # what auto chose for these processes
        m.out.mkdir(parents=True, exist_ok=True)
        for stale in (m.out / CHECKPOINT, previous_path(m.out / CHECKPOINT)):
            stale.unlink(missing_ok=True)  # a stacked member restarted with the others
        atomic_write_text(m.out / CONFIG, dump_yaml(m.cfg) + "\n"
                          + yaml.safe_dump({"meta": meta}, sort_keys=False))
        return 0 if (m.out / METRICS).is_file() else None

    def _finish(self, m: Member) -> dict[str, Any]:
        """A member's summary: computed, offered to its callbacks, written to
        ``summary.json``."""
        cfg, tc, prog = m.cfg, m.cfg.train, m.prog
        level = self._unigram_level()
        stall = check_stall(cfg, prog.vals, level if prog.status == "completed" else None)
        if stall.stalled_at is not None:  # finite losses, but no more than token frequencies
            prog.stall(stall.stalled_at)
        completed = prog.status in ("completed", "stalled")  # it trained to the end
        steps_done = (prog.diverged_at - 1 if prog.diverged_at is not None
                      else prog.stopped_at or tc.steps)
        ran = steps_done - prog.step  # steps this process trained
        summary = {
            "status": prog.status,
            "method": cfg.model.method,
            "preset": cfg.preset,
            "recipe": cfg.recipe.name,
            "seed": cfg.seed,
            "data_seed": cfg.data.data_seed,
            "steps": steps_done,
            "steps_planned": tc.steps,
            "tokens": self._tokens(steps_done),
            "params": sum(p.numel() for p in m.model.parameters()),
            "initial_val_loss": finite_or_none(prog.initial_val),
            "final_val_loss": finite_or_none(prog.last_val) if completed else None,
            "val_ppl": perplexity(prog.last_val) if completed else None,
            "tokens_per_s": self._tokens(ran) / prog.train_time if prog.train_time > 0 else None,
            "diverged_at_step": prog.diverged_at,
            **summary_fields(StallCheck(level, prog.stalled_at)),
            "last_grad_norms": [{"step": s, "grad_norm": g} for s, g in prog.grad_norms],
            "device": str(self.device),
            "train_time_s": prog.train_time,
            "val_time_s": prog.val_time,  # this process's (a resumed run: since the resume)
            "first_step_s": prog.first_step_time,
            "compiled": self.compile_choice.compiled,
            **({"compile_choice": self.compile_choice.why} if self.compile_choice.why else {}),
            "batches_sha256": prog.batches_sha256,
            "micro_batch_size": self.micro_batch or tc.batch_size // self.world.size,
            **({"stacked_seeds": [x.cfg.seed for x in self.members]}
               if len(self.members) > 1 else {}),
            **({"processes": self.world.size, "parallel": self.parallel}
               if self.world.size > 1 else {}),
            **({"fsdp_units": self.engine.units}
               if getattr(self.engine, "units", None) else {}),
        }
        self._emit([m], "on_train_end", summary)
        if self.world.main:
            atomic_write_text(m.out / SUMMARY, json.dumps(summary, indent=2) + "\n")
        return summary

    def _unigram_level(self) -> UnigramLevel | None:
        """The unigram level of the run's data (the stall rule's reference), computed once;
        None where the data cannot give it (the run's summary then says so by nulls)."""
        if not hasattr(self, "_unigram"):
            try:
                self._unigram: UnigramLevel | None = unigram_level(
                    self.data, self.cfg.train.eval_sequences)
            except (OSError, ValueError, ModbenchError):
                self._unigram = None
        return self._unigram

    # ------------------------------------------------------------------ set-up checks

    def _check_same_data(self, m: Member, recorded: str | None) -> None:
        """A resumed run must read the tokens it started on (old checkpoints: not recorded)."""
        now = self.data.fingerprint()
        if recorded is not None and recorded != now:
            raise ModbenchError(
                f"cannot resume {m.out}: the data at {self.data.path} changed since the run "
                f"started (fingerprint {recorded[:12]} then, {now[:12]} now); resume on the "
                "data it started with, or start a new run"
            )

    def _check_out_dir(self, m: Member) -> None:
        if self.resume:
            cfg_file = m.out / CONFIG
            if (m.out / METRICS).is_symlink():  # a resume cuts the log: never a link's target
                raise ModbenchError(f"cannot resume: {m.out / METRICS} is a symbolic link; a "
                                    "resume rewrites it, so put the log itself there")
            if not cfg_file.is_file():
                raise ModbenchError(f"cannot resume: {m.out} has no {CONFIG}; run without "
                                    "--resume")
            stored = yaml.safe_load(cfg_file.read_text())
            stored.pop("meta", None)
            # keys added to the config since the run started hold their defaults there
            diff = sorted(k for k in _diff_keys(_with_defaults(stored), m.cfg.to_dict())
                          if k not in EXECUTION_KEYS)
            if "model.train_seq_len" in diff and not reads_train_seq_len(m.cfg.model):
                diff.remove("model.train_seq_len")  # a folder from before the key: no
                # method here reads it
            if diff:
                raise ModbenchError(
                    f"cannot resume {m.out}: the config differs from its config.yaml in "
                    f"{', '.join(diff)}; repeat the original command with --resume"
                )
        elif m.out.exists() and any(p.name != LOCK_NAME and not p.name.startswith(
                FLIGHT_RECORDER) for p in m.out.iterdir()):  # NCCL's dumps: a restart's start
            raise ModbenchError(
                f"run folder {m.out} already exists and is not empty; use --resume to "
                "continue it or choose another --out"
            )


class _NoLog:
    """The metrics log of a process other than rank 0: it writes nothing."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def tell(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _with_defaults(stored: Any) -> Any:
    """A stored config tree with the keys it lacks (added since it was written) at their
    defaults; a tree that is not a valid config is returned as it is (the comparison then
    names what differs)."""
    try:
        return from_dict(stored).to_dict() if isinstance(stored, dict) else stored
    except ModbenchError:
        return stored


def _resume_points(members: list[Member]) -> dict[int, Path]:
    """The checkpoint each member resumes from. Stacked members resume from the newest step
    they all have: a kill between two members' checkpoint writes leaves some a step ahead,
    and those go back to the previous checkpoint they kept. When they share none (some were
    killed before their first checkpoint) all start afresh, from step 0."""
    if len(members) == 1:
        last = members[0].out / CHECKPOINT
        return {0: last} if last.is_file() else {}
    have: dict[int, dict[int, Path]] = {}
    for m in members:
        for path in (m.out / CHECKPOINT, previous_path(m.out / CHECKPOINT)):
            if path.is_file():
                have.setdefault(m.index, {})[checkpoint_step(path)] = path
    common = set.intersection(*(set(h) for h in have.values())) if len(have) == len(
        members) else set()
    if not common:  # step 0 is the one they all have: every member starts afresh
        return {}
    step = max(common)
    return {k: h[step] for k, h in have.items()}


def _member_runs(cfg: RunConfig, out_dir: str | Path | Sequence[str | Path],
                 seeds: Sequence[int] | None) -> tuple[list[Path], list[RunConfig]]:
    """Each member's folder and config: ``cfg`` itself, or one copy per seed."""
    if seeds is None:
        if not isinstance(out_dir, str | Path):
            raise ValueError("one run takes one out_dir; pass seeds=[...] for several")
        return [Path(out_dir)], [cfg]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ModbenchError(f"--seeds needs distinct init seeds, got {list(seeds)}")
    if isinstance(out_dir, str | Path):
        outs = [Path(out_dir) / f"s{s}" for s in seeds]
    else:
        outs = [Path(o) for o in out_dir]
        if len(outs) != len(seeds):
            raise ValueError(f"{len(seeds)} seeds but {len(outs)} run folders")
    cfgs = []
    for s in seeds:
        c = copy.deepcopy(cfg)
        c.seed = int(s)
        cfgs.append(c)
    return outs, cfgs


def stop_stalled_at(cfg: RunConfig, vals: Sequence[tuple[int, float | None]], level: float,
                    done: int) -> int | None:
    """``train.stop_stalled_after``'s rule after the validation at step ``done``: the step
    ``s`` a run of ``cfg`` with these validation points ``(step, loss)`` has sat at the
    unigram ``level`` since (:func:`modbench.runtime.stall.stalled_at` over the points so
    far, with the patience as its least stretch ``done - s`` in steps, no fraction of the
    schedule, and ``train.stop_stalled_margin`` as the margin), or None: go on (also when the
    key is null). With ``train.stop_stalled_every`` the rule looks only at some validations,
    each at least that many steps after the one before (from step 0, as close to it as the
    validation cadence allows): at the others it says go on, and it reads only those points."""
    tc = cfg.train
    if tc.stop_stalled_after is None:
        return None
    if tc.stop_stalled_every:
        vals = stop_looks(vals, tc.stop_stalled_every)
        if not vals or vals[-1][0] != done:
            return None
    return stalled_at(vals, level, steps=done, warmup=cfg.recipe.warmup_for(tc.steps),
                      margin=tc.stop_stalled_margin, patience=0.0,
                      min_steps=tc.stop_stalled_after)


def stop_looks(vals: Sequence[tuple[int, float | None]],
               every: int) -> list[tuple[int, float | None]]:
    """The validation points the stall stop looks at under ``train.stop_stalled_every``: the
    first, then each one at least ``every`` steps after the last one looked at."""
    looks: list[tuple[int, float | None]] = []
    for s, v in vals:
        if not looks or s - looks[-1][0] >= every:
            looks.append((s, v))
    return looks


def _every(k: int, done: int) -> bool:
    return bool(k) and done % k == 0


def init_checkpoint(source: str | Path) -> Path:
    """The checkpoint file that ``train.init_from`` names: the file itself, or a run folder's
    ``checkpoints/last.pt``."""
    path = Path(str(source))
    if path.is_dir() and (path / CHECKPOINT).is_file():
        return path / CHECKPOINT
    if path.is_file():
        return path
    raise ModbenchError(
        f"train.init_from={source} is neither a checkpoint file nor a run folder with "
        f"{CHECKPOINT}; give the folder of a finished run"
    )


def load_initial_weights(model: nn.Module, methods: Sequence[Method], new_cfg: ModelConfig,
                         path: Path) -> dict[str, Any]:
    """Load the model weights of checkpoint ``path`` into ``model`` (a fresh start from
    another run's weights). Each method's ``grow_state_dict`` hook may first map them onto
    the new shapes; then names and shapes must match the model exactly. Returns what the
    run's config records under ``meta.init_from``."""
    state = load_checkpoint(path)
    if "model" not in state or "config" not in state:
        raise ModbenchError(f"{path} is not a modbench training checkpoint (no model weights "
                            "or config); give a run folder written by `modbench train`")
    old_cfg = from_dict(state["config"]).model
    weights: dict[str, Any] = state["model"]
    target = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for m in methods:
        weights = m.grow_state_dict(weights, old_cfg, new_cfg, target)
    missing = sorted(set(target) - set(weights))
    extra = sorted(set(weights) - set(target))
    if missing or extra:
        which = (f"lacks parameter '{missing[0]}'" if missing
                 else f"has parameter '{extra[0]}' that this model does not")
        raise ModbenchError(
            f"cannot initialise from {path}: it {which} (method {old_cfg.method!r} there, "
            f"{new_cfg.method!r} here); initialise from a run of the same architecture"
        )
    for k, v in target.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise ModbenchError(
                f"cannot initialise from {path}: parameter '{k}' has shape "
                f"{tuple(weights[k].shape)} there and {tuple(v.shape)} here; only a method "
                "with a growth rule (tokenformer slots) may change shapes"
            )
    model.load_state_dict(weights)
    return {"checkpoint": str(path), "step": state.get("step"), "method": old_cfg.method}


def _diff_keys(a: Any, b: Any, prefix: str = "") -> Iterable[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in set(a) | set(b):
            yield from _diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
    elif a != b:
        yield prefix.rstrip(".")


def train(
    cfg: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    callbacks: Sequence[Callback] = (),
    progress: bool = True,
    until: int | None = None,
) -> dict[str, Any]:
    """Train one run and return its summary (also written to ``out_dir/summary.json``);
    ``until``: pause after that step (:meth:`Trainer.run_all`)."""
    return Trainer(cfg, out_dir, resume=resume, callbacks=callbacks, progress=progress,
                   until=until).run()


def train_seeds(
    cfg: RunConfig,
    seeds: Sequence[int],
    out_dirs: str | Path | Sequence[str | Path],
    *,
    resume: bool = False,
    callbacks: Sequence[Callback] = (),
    progress: bool = True,
    until: int | None = None,
) -> list[dict[str, Any]]:
    """Train the init ``seeds`` of ``cfg`` stacked in one process, on the same batches, into
    one run folder each (``out_dirs``: a list, or a parent folder that gets ``s<seed>/``);
    returns their summaries. The method must be stackable (``Plan.stackable``)."""
    return Trainer(cfg, out_dirs, seeds=seeds, resume=resume, callbacks=callbacks,
                   progress=progress, until=until).run_all()


__all__ = ["Callback", "Member", "Trainer", "init_checkpoint", "load_initial_weights",
           "stop_stalled_at", "train", "train_seeds"]
