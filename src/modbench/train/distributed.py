"""Multi-process training on one node: torchrun, DDP or FSDP2, one trainer loop.

Launch ``modbench train --nproc N ...``, :func:`launch` (the Python API), or torchrun
directly (``torchrun --nproc_per_node N -m modbench.train ...``). Every process runs the
same :class:`~modbench.train.trainer.Trainer` loop; when ``WORLD_SIZE > 1`` the trainer
initialises the process group (gloo on the CPU, nccl on CUDA with each process on its
``LOCAL_RANK`` device) and trains through a :class:`DistributedEngine`:

- ``train.parallel=ddp`` (default): ``DistributedDataParallel``; every process holds the
  whole model and optimizer, gradients are averaged by DDP's all-reduce. The gradients are
  views of DDP's all-reduce buckets (``gradient_as_bucket_view``): one copy of them, where
  DDP's default keeps a second in the buckets (4.9 GB a process at climb-1.2b, 11.9 GB at
  climb-3b); they are zeroed in place between steps, not freed.
- ``train.parallel=auto``: DDP where the memory plan fits the device with DDP, else FSDP
  (:func:`modbench.measure.plan.layout`; the trainer resolves it before the data is opened).
- ``train.parallel=fsdp``: FSDP2 (``fully_shard``), one unit per decoder block, the
  embedding where the head is untied, and the root (head, norms, the stream's parameters);
  parameters, gradients and optimizer state are sharded (DTensors), each unit gathered for
  its forward and backward in ``train.fsdp_param_dtype`` (bf16 with a bf16 forward), its
  gradients reduce-scattered in fp32 after every micro-batch (:func:`_fully_shard`).

Both keep the single-process recipe: the forward runs under the run's autocast
(``recipe.precision``; bf16 on CUDA by default) with fp32 master parameters (FSDP gathers them
in bf16 for a bf16 forward, where autocast would cast them anyway), gradients are reduced
in fp32, and ``train.activation_checkpointing`` recomputes each block
(:mod:`modbench.train.recompute`).

**Iso-data.** ``train.batch_size`` is the global batch. Every process trains on its
contiguous slice of the batch the single-process run reads at that step (rank ``r`` of ``W``
takes rows ``[r B/W, (r+1) B/W)``) and reads only those rows (rank 0 reads the whole batch:
it writes the batch hash), straight into pinned memory on CUDA, copied to its device without
blocking; so the data order and the batch hash (``batches_sha256``) equal the single-process
run's. The reported loss is the global mean
(an all-reduce of the per-process losses), the gradient is the global batch's (DDP and FSDP
average over processes), clipping acts on the global gradient norm (DDP's gradients are
already the global ones; FSDP's norm is computed over the shards), and validation splits the
fixed validation batches over the processes and all-reduces the sums: the single-process
value. What differs is the order of float32 sums (a loss is a mean of per-process means, a
gradient an average of per-process gradients), so losses agree with the single process to
float32 rounding, not bit for bit.

**Surviving a cluster** (docs/cluster.md). The group's timeout is ``train.dist_timeout``; a
collective that times out or loses a process fails in one line (:func:`collective_failure`).
The data's checksums are hashed once per node (``modbench.runtime.data``). SIGUSR1, SIGUSR2
and SIGTERM make every process save the step they agree on and exit 75
(``modbench.runtime.checkpoint``); :func:`launch` passes them to its processes as a stop
file.

**Files.** Only rank 0 writes the run folder (config.yaml, metrics.jsonl, summary.json,
checkpoints) and prepares the built-in data; the others write nothing. A checkpoint is
gathered with torch.distributed.checkpoint's state-dict helpers (full state dict, on the
CPU) and saved in the single-process format (optimizer state keyed by parameter index), so
a run resumes with any number of processes, one included, and a single-process checkpoint
resumes under DDP or FSDP.

**What is synchronised for methods.** Every process runs the same callbacks at the same
points on its own copy of the model: nGPT's renormalisation after each step acts on
identical weights (DDP) or on each process's shards (FSDP: norms across shards are DTensor
reductions), so the weights stay identical. Buffers a forward updates (PowerNorm's and
PRepBN's running statistics) follow DDP's rule under both engines: rank 0's buffers are
broadcast to every process before each training forward (DDP ``broadcast_buffers``; the FSDP
engine broadcasts them itself), and again before validation and at the end, so every
process validates with, and the checkpoint holds, rank 0's statistics. The batch statistics
inside a forward are each process's own slice's (as BatchNorm without SyncBatchNorm), so
these methods do not reproduce the single-process numbers; the others do, to rounding.
Stacked seeds (``--seeds``) are not supported with several processes.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modbench.config import RunConfig, TrainConfig, dump_yaml, resolve
from modbench.errors import ModbenchError
from modbench.model.spec import shares_parameters
from modbench.runtime.checkpoint import (
    EXIT_PREEMPTED,
    STOP_FILE_ENV,
    Preempted,
    signal_name,
    stop_on_signals,
    stop_requested,
)
from modbench.runtime.device import bf16_forward, compiled, fsdp_gathers_bf16, usable_cpus
from modbench.runtime.loss import micro_loss
from modbench.runtime.runfolder import SUMMARY
from modbench.train.engine import StepValue
from modbench.train.recompute import stateful_buffers

# ------------------------------------------------------------------------------ the group


@dataclass
class World:
    """This process's place in the group: ``rank`` of ``size``, on local device
    ``local_rank``. ``owned``: this process's trainer initialised the group (and ends it).

    ``waits``: the config key and seconds a collective waits now (``train.dist_timeout`` from
    :meth:`init`, ``train.dist_step_timeout`` once :meth:`settle` ran); None: a group this
    process did not initialise, left as its owner set it."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1
    owned: bool = False
    waits: tuple[str, float] | None = None
    startup: float | None = None  # train.dist_timeout, for start-up and checkpoints
    steady: tuple[str, float] | None = None  # what settle set, for patient() to restore

    @property
    def main(self) -> bool:
        """Rank 0: the process that writes files."""
        return self.rank == 0

    def init(self, device: torch.device, timeout: float | None = None) -> None:
        """Initialise the default process group (env://, as torchrun sets it up) unless one
        exists: gloo on the CPU, nccl on CUDA; ``timeout``: seconds a collective may wait
        (``train.dist_timeout``; None: torch's default)."""
        if self.size == 1 or dist.is_initialized():
            return
        extra: dict[str, Any] = {} if timeout is None else {
            "timeout": datetime.timedelta(seconds=timeout)}
        extra.update(self._attempt_store(timeout))
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, **extra)
        else:
            dist.init_process_group("gloo", **extra)
        self.owned = True
        if timeout is not None:
            self.startup, self.waits = timeout, ("train.dist_timeout", timeout)

    def _attempt_store(self, timeout: float | None) -> dict[str, Any]:
        """In a group torchrun started again (``train.max_restarts``): the group's store, the
        torchrun agent's, under a prefix of this attempt. The agent keeps one store for every
        attempt and torch's env:// adds no prefix, so a restarted process could read a key a
        process of the failed attempt wrote (its old address: gloo then fails to connect to a
        dead port). Empty (env:// as it is) on a first start."""
        attempt = restart_count()
        if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
            return {}
        wait = datetime.timedelta(seconds=timeout if timeout is not None else 1800)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              world_size=self.size, is_master=False, timeout=wait)
        return {"store": dist.PrefixStore(f"modbench/attempt_{attempt}", store),
                "rank": self.rank, "world_size": self.size}

    def settle(self, step_timeout: float) -> None:
        """Training has started: from now on a collective of every group of this process
        waits ``step_timeout`` seconds (``train.dist_step_timeout``; no longer than
        ``train.dist_timeout``), so a stuck or lost process ends the run in minutes, not the
        half hour that start-up (data preparation, hashing, compiling) may need. Only a group
        this process's trainer initialised; once."""
        if not self.owned or self.startup is None or self.steady is not None:
            return
        if step_timeout < self.startup:
            self.steady = ("train.dist_step_timeout", step_timeout)
        else:
            self.steady = ("train.dist_timeout", self.startup)
        _set_group_timeouts(self.steady[1])
        self.waits = self.steady

    @contextlib.contextmanager
    def patient(self) -> Iterator[None]:
        """Inside, collectives wait ``train.dist_timeout`` again (a large checkpoint's write on
        rank 0 may outlast the step timeout the other processes wait under)."""
        if self.steady is None or self.startup is None or not dist.is_initialized():
            yield
            return
        _set_group_timeouts(self.startup)
        self.waits = ("train.dist_timeout", self.startup)
        try:
            yield
        finally:
            if dist.is_initialized():
                _set_group_timeouts(self.steady[1])
                self.waits = self.steady

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def end(self) -> None:
        """End the group if this process's trainer began it."""
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
            self.owned = False


def _set_group_timeouts(seconds: float) -> None:
    """Set the timeout of every process group of this process (the default group, and those
    made since: the host-side gloo group of an nccl run) for the collectives issued from now
    on (torch's ``_set_pg_timeout``; NCCL's watchdog reads each collective's own)."""
    c10d = dist.distributed_c10d
    groups = list(getattr(getattr(c10d, "_world", None), "pg_map", None) or {}) or [None]
    with warnings.catch_warnings():  # a backend other than gloo and nccl: left as it is
        warnings.simplefilter("ignore")
        for group in groups:
            c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


_TIMED_OUT = re.compile(r"time[ds]? ?out|timeout|deadline", re.IGNORECASE)
_PEER_LOST = re.compile(r"connection (closed|reset|refused)|broken pipe|by peer|remote "
                        r"process|socket|NCCL", re.IGNORECASE)


def collective_failure(error: BaseException, world: World,
                       timeout: float) -> ModbenchError | None:
    """A one-line error for a collective that failed in a group of processes: waited past
    its timeout (``world.waits``, else ``train.dist_timeout``: another process is slow or
    stuck), or lost a process that died (its own error is the one to read); None for an error
    that is not the group's."""
    if world.size < 2 or isinstance(error, ModbenchError) or not isinstance(
            error, RuntimeError | ConnectionError | TimeoutError):
        return None
    text = str(error)
    where = f"process {world.rank} of {world.size}"
    key, seconds = world.waits or ("train.dist_timeout", timeout)
    if _TIMED_OUT.search(text):
        return ModbenchError(
            f"{where} waited more than {key}={seconds:g}s at a collective (the "
            "data check, a step or a checkpoint) for another process, which is stuck or much "
            f"slower; raise {key} if that wait is expected, else look at the "
            "other processes' errors, then continue the run with --resume")
    if (isinstance(error, ConnectionError | dist.DistBackendError)
            or _PEER_LOST.search(text)):
        return ModbenchError(
            f"{where} lost another process of its group at a collective ("
            f"{text.strip().splitlines()[-1][:160] if text.strip() else type(error).__name__}"
            "); it failed or was killed: see its error, then continue the run with --resume")
    return None


def current_world() -> World:
    """The running group (an initialised default group, else torchrun's ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``); one process when there is none."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        return World(rank, _env_int("LOCAL_RANK", rank), dist.get_world_size())
    size = _env_int("WORLD_SIZE", 1)
    if size > 1 and not dist.is_available():
        raise ModbenchError(f"WORLD_SIZE={size} but this torch build has no torch.distributed; "
                            "train with one process")
    rank = _env_int("RANK", 0)
    return World(rank, _env_int("LOCAL_RANK", rank), max(size, 1))


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ModbenchError(f"environment variable {name}={raw!r} is not an integer; launch "
                            "with torchrun or `modbench train --nproc N`") from None


def rank_device(device: torch.device, world: World) -> torch.device:
    """The device of this process: ``cuda:LOCAL_RANK`` for a CUDA run, else ``device``."""
    if device.type != "cuda" or world.size == 1:
        return device
    n = torch.cuda.device_count()
    if world.local_rank >= n:
        raise ModbenchError(f"process LOCAL_RANK={world.local_rank} has no CUDA device ({n} "
                            "visible); use at most one process per GPU")
    torch.cuda.set_device(world.local_rank)
    return torch.device("cuda", world.local_rank)


def local_batch(tc: TrainConfig, world: int,
                micro_batch: int | None = None) -> tuple[int, int]:
    """Sequences each of ``world`` processes trains on per step, and in how many
    micro-batches (``train.micro_batch_size`` bounds a process's micro-batch; ``micro_batch``,
    what the trainer resolved ``auto`` to, in its place; ``auto`` unresolved bounds nothing
    yet)."""
    if world < 1:
        raise ModbenchError(f"the number of processes must be at least 1, got {world}")
    if tc.batch_size % world:
        raise ModbenchError(
            f"train.batch_size={tc.batch_size} does not split evenly over {world} processes; "
            f"use a batch size divisible by {world} or another number of processes"
        )
    local = tc.batch_size // world
    mb = tc.micro_batch_size if micro_batch is None else micro_batch
    if not isinstance(mb, int) or mb >= local:
        return local, 1
    if local % mb:
        raise ModbenchError(
            f"train.micro_batch_size={mb} does not divide the {local} sequences each of "
            f"{world} processes trains on (train.batch_size={tc.batch_size}); choose a "
            f"micro-batch size that divides {local}"
        )
    return local, local // mb


def check_world(tc: TrainConfig, world: int, members: int = 1,
                optimizer: str = "adamw") -> None:
    """Refuse what a run of ``world`` processes cannot do (one line each)."""
    if world > 1 and optimizer == "muon":
        raise ModbenchError(f"recipe.optimizer=muon trains in one process only, not across "
                            f"{world}; drop --nproc or use recipe.optimizer=adamw")
    if world > 1 and members > 1:
        raise ModbenchError(f"stacked seeds (--seeds) cannot train across {world} processes; "
                            "train the seeds one at a time with --seed, or drop --nproc")
    local_batch(tc, world)


# ----------------------------------------------------------------------------- the engine


class DistributedEngine:
    """One member's model and optimizer in a group of processes (the trainer's
    :class:`~modbench.train.engine.Engine`). See the module docstring for what it keeps
    equal to a single process and what it synchronises.

    ``make_optimizer`` is called on the model after it is wrapped (FSDP's parameters are
    the sharded ones)."""

    def __init__(self, model: nn.Module,
                 make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                 device: torch.device, autocast: Callable[[], AbstractContextManager[Any]],
                 world: World, *, parallel: str = "ddp", n_micro: int = 1,
                 compile: bool | str = False,
                 param_dtype: torch.dtype = torch.float32,
                 on_compiled: Callable[[], None] | None = None) -> None:
        if world.size < 2 or not dist.is_initialized():
            raise ValueError("DistributedEngine needs an initialised group of 2+ processes")
        self.device, self.autocast, self.world = device, autocast, world
        self.parallel, self.n_micro = parallel, n_micro
        self.checked = False  # the first backward's gradients were checked
        names = set(stateful_buffers(model))
        self.buffers = [b for n, b in model.named_buffers() if n in names]
        # FSDP2 shards no 0-dim parameter (DyT's alpha, a learnt scalar gate): those stay
        # whole on every process, their gradients averaged here (an all-reduce of scalars)
        self.replicated: list[nn.Parameter] = []
        wrapped: nn.Module
        if parallel == "fsdp" and shares_parameters(model):
            raise ModbenchError("train.parallel=fsdp cannot shard a model whose layers share "
                                "weights (a method fills the tie slot): FSDP2 gives each "
                                "parameter to one unit, one per block, and a shared weight "
                                "would be in two; use train.parallel=ddp")
        self.units: list[str] = []  # FSDP2's units, by module name
        if parallel == "fsdp":
            self.replicated = [p for p in model.parameters() if p.ndim == 0]
            self.units = _fully_shard(model, device, world.size, set(self.replicated),
                                      param_dtype)
            wrapped = model
        elif parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # rank 0's buffers to every process before each forward (newer torch names the
            # option forward_sync_buffers)
            sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
                DistributedDataParallel.__init__).parameters else "broadcast_buffers")
            _bucket_gradients(model)
            wrapped = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True, **{sync: bool(self.buffers)})
        else:
            raise ModbenchError(f"train.parallel must be ddp or fsdp, got {parallel!r}")
        self.wrapped = wrapped
        self.models: list[nn.Module] = [model]  # FSDP: the model itself, sharded in place
        self.optimizers: list[torch.optim.Optimizer] = [make_optimizer(model)]
        self.forward: Callable[..., Any] = compiled(wrapped, compile, device, on_compiled)

    # ------------------------------------------------------------------ the step

    def set_lr(self, lr: float) -> None:
        for group in self.optimizers[0].param_groups:
            group["lr"] = lr

    def backward(self, batch: torch.Tensor, mask: torch.Tensor | None,
                 members: Sequence[int]) -> list[StepValue]:
        """Accumulate this process's share of the gradient of the global batch's mean loss
        (DDP/FSDP average over processes) and return that global mean loss (on the device:
        the all-reduce is queued, the host does not wait for it). As on one process, the
        gradient includes the cores' auxiliary loss terms (each micro-batch's divided by the
        number of micro-batches, then averaged over the processes with the gradient) and
        the loss returned is the LM loss alone."""
        w, r = self.world.size, self.world.rank
        rows = batch.shape[0] // w
        # only this process's rows go to the device; from pinned memory (the prefetcher's,
        # on CUDA) without waiting, as on one process
        ahead = self.device.type == "cuda" and batch.is_pinned()
        local = batch[r * rows:(r + 1) * rows].to(self.device, non_blocking=ahead)
        micros = local.chunk(self.n_micro)
        # with a loss mask every prediction shares the global denominator; times W because
        # the gradient reduction averages over the processes
        count = int(mask.sum()) if mask is not None else 0
        masks = (mask[r * rows:(r + 1) * rows].to(self.device, non_blocking=ahead)
                 .chunk(self.n_micro)
                 if mask is not None else (None,) * len(micros))
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (micro, m) in enumerate(zip(micros, masks, strict=True)):
            with self._reduce_gradients(i == len(micros) - 1):
                if self.parallel == "fsdp":
                    self.sync_buffers()
                with self.autocast():
                    loss, aux = micro_loss(self.forward, micro, m, count, n_micro=self.n_micro)
                    if m is not None:
                        loss = loss * w
                (loss + aux / self.n_micro).backward()  # aux 0 when no core adds any
            total = total + loss.detach().double()  # in order, as the host would add them
        self._average_replicated()
        if not self.checked:
            self._check_gradients()
        dist.all_reduce(total)
        return [total / w]

    def _check_gradients(self) -> None:
        """After the first backward: every trained parameter has its (reduced) gradient. A
        parameter whose gradient FSDP never reduced would silently stay untrained."""
        missing = [n for n, p in self.models[0].named_parameters()
                   if p.requires_grad and p.grad is None]
        if missing:
            raise ModbenchError(
                f"train.parallel={self.parallel} left parameter '{missing[0]}' without a "
                f"gradient ({len(missing)} in all) with this method; train it with "
                "train.parallel=ddp or with one process"
            )
        self.checked = True

    def _average_replicated(self) -> None:
        """FSDP: average the gradients of the parameters it does not shard (scalars)."""
        have = [p for p in self.replicated if p.grad is not None]
        if not have:
            return
        grads = torch.stack([p.grad.detach() for p in have])  # type: ignore[union-attr]
        dist.all_reduce(grads)
        grads /= self.world.size
        for p, g in zip(have, grads, strict=True):
            p.grad.copy_(g)  # type: ignore[union-attr]

    def _reduce_gradients(self, last: bool) -> AbstractContextManager[Any]:
        """DDP: reduce gradients only on the last micro-batch of a step. FSDP: reduce-scatter
        after every micro-batch, so what accumulates is each process's fp32 gradient shard,
        never the whole model's unsharded gradients (more communication per step when there
        are micro-batches; the memory of one unit's unsharded gradient at a time)."""
        if last or self.parallel == "fsdp":
            return contextlib.nullcontext()
        return self.wrapped.no_sync()  # type: ignore[operator]

    def clip_grad_norm(self, max_norm: float, members: Sequence[int]) -> list[StepValue]:
        """The global gradient norm before clipping (``max_norm <= 0``: none). DDP's
        gradients are the averaged ones on every process; FSDP's norm is reduced over the
        shards (DTensor) before the clip coefficient is applied."""
        clip = max_norm if max_norm > 0 else float("inf")
        if not self.replicated:
            return [_whole(torch.nn.utils.clip_grad_norm_(self.models[0].parameters(), clip))]
        # FSDP with unsharded scalars: the norm of both parts, then torch's clip coefficient
        ids = {id(p) for p in self.replicated}
        sharded = [p for p in self.models[0].parameters()
                   if id(p) not in ids and p.grad is not None]
        whole = [p.grad.detach().float() for p in self.replicated if p.grad is not None]
        norm = _whole(torch.nn.utils.clip_grad_norm_(sharded, float("inf"))).float()
        if whole:
            norm = torch.linalg.vector_norm(torch.stack([norm.to(self.device), *whole]))
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0)  # 1.0 leaves a gradient as it is
        for p in [*sharded, *self.replicated]:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device))
        return [norm]

    def update(self, members: Sequence[int]) -> None:
        if 0 in members:
            self.optimizers[0].step()
        self.discard()

    def discard(self) -> None:
        # DDP's gradients are its buckets' views: zeroed in place, so they stay views (set to
        # None, the next step's would be new tensors beside the buckets until its reduction)
        self.optimizers[0].zero_grad(set_to_none=self.parallel != "ddp")

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sync_buffers(self) -> None:
        """Give every process rank 0's buffers (running statistics); none for most
        methods."""
        for b in self.buffers:
            dist.broadcast(b, src=0)

    def _sum(self, values: Sequence[float]) -> list[float]:
        """``values`` summed over the processes (float64)."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    # ------------------------------------------------------------ validation

    @torch.no_grad()
    def validation_loss(self, member: int, data: Any, n_sequences: int,
                        batch_size: int) -> float:
        """The single-process validation loss: the fixed validation batches are dealt out
        to the processes in turn and the sums all-reduced. With FSDP every process runs as
        many forwards as the busiest one (a surplus forward is discarded), since each
        forward gathers parameters from all of them."""
        self.sync_buffers()
        model = self.models[0]
        was_training = model.training
        model.eval()
        batches = list(data.val_batches(n_sequences, batch_size))
        w, r = self.world.size, self.world.rank
        slots = math.ceil(len(batches) / w) * w if self.parallel == "fsdp" else len(batches)
        total, rows = 0.0, 0
        for i in range(r, slots, w):
            batch = batches[min(i, len(batches) - 1)].to(self.device)
            with self.autocast():
                loss = model(batch, loss=True) / (batch.shape[1] - 1)  # summed over its rows
            if i < len(batches):
                total += loss.item()
                rows += batch.shape[0]
        model.train(was_training)
        total, n = self._sum([total, rows])
        return total / max(n, 1)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self, member: int) -> dict[str, Any]:
        """The full model and optimizer state on rank 0's CPU, in the single-process format
        (empty on the other ranks). Every process must call it (it gathers)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        self.sync_buffers()
        model, opt = self.models[0], self.optimizers[0]
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        # an optimizer that has not stepped has no state; the helper would make some
        optim = get_optimizer_state_dict(model, opt, options=options) if opt.state else None
        if not self.world.main:
            return {}
        names = _param_names(model, opt)
        indexed = opt.state_dict()  # the param groups by index; the state gathered below
        state = {} if optim is None else {
            i: optim["state"][name] for i, name in enumerate(names) if name in optim["state"]}
        return {"model": weights,
                "optimizer": {"state": state, "param_groups": indexed["param_groups"]}}

    def load_state_dict(self, member: int, state: dict[str, Any]) -> None:
        """Load a single-process-format checkpoint (every process has read the file)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        model, opt = self.models[0], self.optimizers[0]
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=options)
        names = _param_names(model, opt)
        saved = state["optimizer"]
        if len(names) != sum(len(g["params"]) for g in saved["param_groups"]):
            raise ModbenchError("the checkpoint's optimizer state does not match this model's "
                                "parameters; resume with the code and method that wrote it")
        by_name = {
            "state": {names[int(i)]: v for i, v in saved["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                             for g in saved["param_groups"]],
        }
        if by_name["state"]:
            # the helper makes the optimizer's state by a step of zero gradients only where no
            # parameter has a gradient; DDP's are its bucket views: set aside, then put back
            views = [(p, p.grad) for p in model.parameters()]
            for p, _ in views:
                p.grad = None
            try:
                set_optimizer_state_dict(model, opt, by_name, options=options)
            finally:
                for p, grad in views:
                    p.grad = grad
            # the hyperparameters exactly as saved (the helper turns tuples such as betas
            # into lists), so later checkpoints keep the single-process format
            for group, hyper in zip(opt.param_groups, saved["param_groups"], strict=True):
                group.update({k: v for k, v in hyper.items() if k != "params"})
        else:
            opt.load_state_dict(saved)


def _bucket_gradients(model: nn.Module) -> None:
    """Give every trained parameter a zero gradient before DDP wraps ``model``: DDP then
    makes each gradient a view of its all-reduce bucket at once (``gradient_as_bucket_view``
    turns only existing gradients into views before the first reduction), so that no step,
    the first one included, holds the gradients twice (the memory plan counts one copy;
    measure.plan). Zero gradients change no number: the first micro-batch adds to them."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a plain tensor as it is)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _param_names(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The parameter name of each optimizer index (the order of ``opt.state_dict()``)."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    return [name_of[id(p)] for group in opt.param_groups for p in group["params"]]


def fsdp_param_dtype(setting: str, precision: str, device: torch.device) -> torch.dtype:
    """The dtype FSDP2 gathers parameters in (``train.fsdp_param_dtype``): ``auto`` follows
    the forward's autocast (bf16 for ``recipe.precision=bf16`` and for ``auto`` on CUDA)."""
    if fsdp_gathers_bf16(setting, bf16_forward(precision, device.type)):
        return torch.bfloat16
    return torch.float32


def _fully_shard(model: nn.Module, device: torch.device, size: int,
                 ignored: set[nn.Parameter],
                 param_dtype: torch.dtype = torch.float32) -> list[str]:
    """FSDP2 on whole decoder blocks: one unit per block (its cores, norms, merges and
    wrappers: a block is a function of its state, ``Block.forward(state) -> state``), the
    embedding its own unit where the head is untied, and the root (the embedding where tied,
    the head, the final and embedding norms, the stream's own parameters) around them.

    - The head stays in the root: the loss in pieces calls it once per piece and again when
      it recomputes a piece in the backward, and the root's parameters stay gathered from the
      forward to the backward; a tied head is the embedding's weight, so both stay there.
    - Every unit reshards after its forward except the last block (the backward needs it
      first) and the root.
    - Mixed precision (``MixedPrecisionPolicy``): parameters gathered in ``param_dtype`` (bf16
      halves the all-gathers and the unsharded weights; master weights, optimizer state and
      gradients' reduction stay fp32); the units' inputs are not cast, so the residual stream
      keeps the dtype the run's autocast gives it, as on one process.
    - ``ignored``: parameters left unsharded (0-dim scalars FSDP2 cannot shard).

    Returns the units' module names (``<root>`` for the model)."""
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.5
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )
    from torch.distributed.device_mesh import init_device_mesh

    # A block passes some of its state through unchanged (the embedding, earlier inputs), and
    # FSDP2's backward hooks turn a unit's inputs into views, so it warns of view outputs at
    # every block of every step; the warning is about in-place ops on them, which the stream's
    # pure read/write never make.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view",
                            category=UserWarning)
    mesh = init_device_mesh(device.type, (size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    extra: dict[str, Any] = {"mesh": mesh, "mp_policy": policy}
    if ignored:
        extra["ignored_params"] = ignored

    def owns_sharded(m: nn.Module) -> bool:
        return any(p not in ignored for p in m.parameters())

    blocks = [b for b in getattr(model, "blocks", ()) if owns_sharded(b)]
    try:
        embed = getattr(model, "embed", None)
        if (isinstance(embed, nn.Module) and getattr(model, "head", None) is not None
                and owns_sharded(embed)):
            fully_shard(embed, reshard_after_forward=True, **extra)
        for i, block in enumerate(blocks):
            fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **extra)
        fully_shard(model, **extra)
    except TypeError as e:  # a torch whose fully_shard takes no ignored_params
        raise ModbenchError(f"this torch's FSDP cannot leave the model's scalar parameters "
                            f"unsharded ({e}); use train.parallel=ddp") from None
    return [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]


# ------------------------------------------------------------------------------ launching


def launch(cfg: RunConfig, out_dir: str | Path, nproc: int, *, resume: bool = False,
           progress: bool = False, max_restarts: int | None = None) -> dict[str, Any]:
    """Train ``cfg`` into ``out_dir`` as a torchrun group of ``nproc`` processes on this
    node (``python -m torch.distributed.run --standalone -m modbench.train``), wait, and
    return the run's summary (its ``summary.json``). ``resume`` continues the run in
    ``out_dir`` from its checkpoint, whatever number of processes wrote it.

    ``max_restarts`` (None: ``train.max_restarts``): times torchrun starts the group again
    after a process failed or was killed; a restarted group resumes from the last checkpoint
    (:func:`restart_count`). The processes' environment: :func:`group_environment`.

    ``progress``: pass the processes' progress bar and messages through to stderr. A
    failure raises :class:`ModbenchError` with one line: the processes' own error where
    one was reported."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ModbenchError(f"the number of processes must be a positive integer, got "
                            f"{nproc!r}")
    if max_restarts is not None:
        cfg = _with_restarts(cfg, max_restarts)
    cfg.validate()
    local_batch(cfg.train, nproc)
    out = Path(out_dir).absolute()
    with tempfile.TemporaryDirectory(prefix="modbench-launch-") as tmp:
        # a stop signal here (SLURM, submitit) reaches the processes as this file: they save
        # the step they are on and stop (runtime.checkpoint.stop_on_signals)
        stop_file = Path(tmp) / "stop"
        env = group_environment(cfg, out, nproc, stop_file)
        config = Path(tmp) / "config.yaml"
        config.write_text(dump_yaml(cfg))
        differ = sorted(_differing(resolve(yaml_file=config).to_dict(), cfg.to_dict()))
        if differ:  # the processes would train another config
            raise ModbenchError(f"this config does not survive its YAML form (keys "
                                f"{', '.join(differ)} change); build it with "
                                "modbench.config.resolve")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", f"--max-restarts={cfg.train.max_restarts}",
               "-m", "modbench.train", "--config", str(config),
               "--out", str(out), "--resume" if resume else "--no-resume",
               "--progress" if progress else "--no-progress"]
        with stop_on_signals(lambda signum: stop_file.touch()):
            rc, tail = _run(cmd, env, progress)
            signum = stop_requested()
            if rc != 0 and (signum is not None
                            or re.search(rf"exit ?code\s*:\s*{EXIT_PREEMPTED}\b", tail)):
                raise Preempted(f"training with {nproc} processes stopped by "
                                f"{signal_name(signum)}: its step saved in {out}; continue "
                                "with resume=True (--resume)", signum)
    if rc != 0:
        raise ModbenchError(_failure(tail, nproc, out, rc))
    try:
        summary: dict[str, Any] = json.loads((out / SUMMARY).read_text())
    except (OSError, ValueError) as e:
        raise ModbenchError(f"training with {nproc} processes ended without a readable "
                            f"{out / SUMMARY} ({e.__class__.__name__}); run it again with "
                            "resume=True") from None
    return summary


#: The prefix of the Flight Recorder's dump files in a run folder (torch appends the rank).
FLIGHT_RECORDER = "flight_recorder_rank_"
#: NCCL Flight Recorder entries a process keeps (torchtitan's default, a few MB a process).
FLIGHT_RECORDER_ENTRIES = 20000
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun in every process it starts


def group_environment(cfg: RunConfig, out: Path, nproc: int, stop_file: Path,
                      environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment :func:`launch` gives the group's processes: ``environ`` (this
    process's), the thread count, the stop file, and for an nccl group NCCL's Flight Recorder
    (:func:`flight_recorder_environment`)."""
    env = dict(os.environ if environ is None else environ)
    threads = cfg.train.threads or max(1, usable_cpus() // nproc)
    # set, not defaulted: a Ray worker's OMP_NUM_THREADS (its task's CPUs) would give each
    # of the nproc processes all of them (torchrun would set 1, and say so)
    env["OMP_NUM_THREADS"] = str(threads)
    env[STOP_FILE_ENV] = str(stop_file)
    if _nccl_group(cfg.train.device):
        env.update(flight_recorder_environment(out, env))
    return env


def flight_recorder_environment(out: Path, environ: dict[str, str],
                                version: str | None = None) -> dict[str, str]:
    """NCCL's Flight Recorder on, its dump written into the run folder ``out``: the last
    :data:`FLIGHT_RECORDER_ENTRIES` collectives of each process, dumped when a collective
    times out to ``out/flight_recorder_rank_<rank>`` (read with ``python -m
    torch.distributed.flight_recorder.fr_trace``: which process stopped at which
    collective). Only what ``environ`` does not set already (the user's choice wins, under
    either of torch's names); torch 2.7 on reads the ``TORCH_FR_`` names, earlier ones the
    ``TORCH_NCCL_`` names."""
    major, minor = (int(x) for x in re.findall(
        r"\d+", version or str(torch.__version__))[:2])
    new = (major, minor) >= (2, 7)
    names = {  # (the name this torch reads, the other one): the value
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): str(FLIGHT_RECORDER_ENTRIES),
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
            str(out / FLIGHT_RECORDER),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"): "1",
    }
    return {(current if new else legacy): value
            for (current, legacy), value in names.items()
            if current not in environ and legacy not in environ}


def _nccl_group(device: str) -> bool:
    """Whether a group on ``train.device`` runs on nccl (CUDA; ``auto`` where CUDA is)."""
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def restart_count() -> int:
    """How many times torchrun has started this process's group again after a failure
    (``TORCHELASTIC_RESTART_COUNT``; 0: the first start, or no torchrun)."""
    return max(_env_int(RESTART_ENV, 0), 0)


def _with_restarts(cfg: RunConfig, max_restarts: int) -> RunConfig:
    """``cfg`` with ``train.max_restarts`` set (a copy)."""
    import copy

    cfg = copy.deepcopy(cfg)
    cfg.train.max_restarts = max_restarts
    return cfg


def _differing(a: Any, b: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            yield from _differing(a.get(k), b.get(k), f"{prefix}{k}.")
    elif a != b:
        yield prefix.rstrip(".")


def _run(cmd: list[str], env: dict[str, str], echo: bool) -> tuple[int, str]:
    """Run ``cmd``; its stderr is passed through when ``echo`` and its last 64 KiB kept."""
    tail: collections.deque[bytes] = collections.deque()
    kept = 0
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=_ignore_user_signals)
    assert proc.stderr is not None
    try:
        for chunk in _chunks(proc.stderr):
            if echo:
                sys.stderr.buffer.write(chunk)
                sys.stderr.buffer.flush()
            tail.append(chunk)
            kept += len(chunk)
            while kept > 65536 and len(tail) > 1:
                kept -= len(tail.popleft())
        return proc.wait(), b"".join(tail).decode(errors="replace")
    finally:
        if proc.poll() is None:  # interrupted: end the group (torchrun stops its workers)
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ignore_user_signals() -> None:
    """In the torchrun child before it starts: SIGUSR1/SIGUSR2 ignored (their default ends
    torchrun at once, orphaning its processes, when a scheduler signals every process of the
    job); its training processes install their own handlers (stop_on_signals)."""
    import signal

    for name in ("SIGUSR1", "SIGUSR2"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)


def _chunks(stream: Any) -> Iterator[bytes]:
    while chunk := stream.read1(4096):
        yield chunk


_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt)): (.+)$")


def _failure(stderr: str, nproc: int, out: Path, rc: int) -> str:
    """One line for a failed group: a process's ``error:`` line, else the first exception
    a process raised, else torchrun's exit code."""
    lines = [re.sub(r"^\[\w+\]:\s*", "", ln.strip())
             for ln in stderr.replace("\r", "\n").splitlines()]
    for ln in lines:
        if ln.startswith("error: "):
            return ln.removeprefix("error: ")
    for ln in lines:
        m = _EXCEPTION.match(ln)
        if m and m.group(1) != "ChildFailedError":
            return (f"training with {nproc} processes failed: {m.group(1)}: {m.group(2)}; "
                    f"the run in {out} can be continued with resume=True (--resume)")
    return (f"training with {nproc} processes failed (torchrun exit code {rc}, a process "
            f"was killed or crashed); the run in {out} can be continued with resume=True "
            "(--resume)")


__all__ = ["DistributedEngine", "World", "check_world", "current_world", "group_environment",
           "launch", "local_batch", "rank_device", "restart_count"]
