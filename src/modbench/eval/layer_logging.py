"""``train.log_layers``: each decoder layer's gradient norm and activation RMS, logged with the
training records of ``metrics.jsonl`` (docs/diagnostics.md, docs/runs.md).

At every logged training step (``train.log_every``, and the last step; with
``train.log_layers_every=N`` only at those whose step count N divides, and the last) the
record gains::

    "layers": {"grad_norm": [g_0, ..., g_{L-1}], "grad_norm_rest": g_rest,
               "act_rms": [r_0, ..., r_{L-1}], "act_rms_final": r_final}

``grad_norm[l]``: the L2 norm of the step's gradient over the parameters of block ``l``
(``model.blocks[l].parameters()``), before clipping, like the record's ``grad_norm``;
``grad_norm_rest``: over every other parameter (embedding, final norm, head, a stream's own
parameters), so ``sqrt(sum_l g_l^2 + g_rest^2)`` is the record's ``grad_norm``.
``act_rms[l]``: the RMS over every entry of the residual stream as block ``l`` reads it (the
input of its attention sublayer's pre-norm site), over the step's whole batch;
``act_rms_final``: of the stream's output (the final norm's input). These are the sites of
``modbench diagnose``'s ``layers[l].attn.rms`` and ``final.rms``.

How, and what it costs: only logged steps pay anything. The gradients are read at the
trainer's ``after_backward`` point (after clipping, before the update; one fused norm per
parameter group), and the clip factor is divided out again when the record comes (the
record's ``grad_norm`` gives it), so the values are the pre-clip ones. The activations come
from forward pre-hooks that :meth:`LayerLogging.on_batch` arms on a logged step, on the
training forward itself, and ``after_backward`` removes. Where the training forward does not
run the member's own modules (stacked seeds: a vmapped call on stacked weights; a compiled
forward: ``train.compile``, which hooks would break) the callback runs one extra forward
without gradients on the member's model at ``after_backward``, on the step's batch (its own
rows in a multi-process run), with the weights of the step's forward, under the run's
autocast, its buffers saved and restored: the same activations, to rounding. Nothing either
way touches the weights, the gradients, the buffers or a random generator, so the run's
numbers are those of a run without it (``train.log_layers`` is an execution key).

Several processes: each process reads its own part (the activations of its rows, the shards
of FSDP's gradients) and one all-reduce per logged step adds them up, so every process logs
the global values.

The values are kept on the device, by step, until the trainer hands the record to
``on_step_end`` (which may come later than the step, a window of steps at a time).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from modbench.errors import ModbenchError
from modbench.runtime.callback import Callback, TrainingRun
from modbench.runtime.device import autocast_for, compiles

RECORD_KEY = "layers"
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (total + 1e-6)


def logged_step(run: TrainingRun, step: int) -> bool:
    """Whether 0-based ``step``'s record gets the layers: the trainer logs it
    (``train.log_every``, and the last step) and, with ``train.log_layers_every=N``, N divides
    the steps done (or it is the last)."""
    tc = run.cfg.train
    done = step + 1
    every = tc.log_layers_every
    return tc.logs(done) and (done == tc.steps or every <= 0 or done % every == 0)


def compiled_forward(run: TrainingRun) -> bool:
    """Whether the training forward runs through ``torch.compile`` (``train.compile``: true,
    or ``auto`` where the trainer chose to compile: the run's ``compiled``), so hooks on the
    model's modules must not be used."""
    chosen = getattr(run, "compiled", None)
    return chosen if isinstance(chosen, bool) else compiles(run.cfg.train.compile, run.device)


def decoder_sites(model: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """The blocks of a modbench decoder and its final norm (whose input is the stream's
    output)."""
    blocks = getattr(model, "blocks", None)
    final = getattr(model, "final_norm", None)
    if not isinstance(blocks, nn.ModuleList) or not isinstance(final, nn.Module):
        raise ModbenchError("train.log_layers needs a modbench decoder (a model with .blocks "
                            "and .final_norm); set train.log_layers=false")
    return list(blocks), final


def _world() -> tuple[int, int]:
    """(rank, size) of the process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Acts:
    """Per site of ``model`` (each block's stream input, then the final norm's input): the
    sum of squares (on the device) and the count of the entries seen."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.blocks, self.final = decoder_sites(model)
        n = len(self.blocks) + 1
        self.sq = torch.zeros(n, dtype=torch.float64, device=device)
        self.count = [0] * n

    def add(self, i: int, x: torch.Tensor) -> None:
        x = x.detach()
        self.sq[i] += torch.linalg.vector_norm(x, dtype=torch.float32).double() ** 2
        self.count[i] += x.numel()

    def arm(self) -> list[Any]:
        """Hooks that add each block's stream input and the final norm's input: a recorder
        on the stream adds what each attention sublayer read (the input of its pre-norm
        site), by the record's layer; not a hook on the norm site, since under the tie slot
        one norm module serves several layers. The stream calls no recorder while a block is
        recomputed (activation checkpointing), so each input is added once."""
        final = self.final
        stream = getattr(self.model, "stream", None)
        if not callable(getattr(stream, "add_recorder", None)):
            raise ModbenchError("train.log_layers needs a modbench decoder (a model with a "
                                "stream); set train.log_layers=false")

        def attn_read(rec: Any) -> None:
            if rec.sublayer == "attn":
                self.add(rec.layer, rec.input)

        def final_read(module: nn.Module, args: tuple[Any, ...]) -> None:
            self.add(len(self.blocks), args[0])

        return [stream.add_recorder(attn_read),  # type: ignore[union-attr]
                final.register_forward_pre_hook(final_read)]

    @property
    def seen(self) -> bool:
        return all(c > 0 for c in self.count)


class LayerLogging(Callback):
    """``train.log_layers``: add :data:`RECORD_KEY` to every logged training record (see the
    module docstring). One instance per member (the trainer attaches it like probe scoring)."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
        self.acts: _Acts | None = None
        self.batch: torch.Tensor | None = None
        self.handles: list[Any] = []
        self.groups: list[tuple[nn.Parameter, int]] = []

    def on_train_start(self, run: TrainingRun) -> None:
        self.groups = param_groups(run.model)  # refuses a model it cannot read
        self.pending.clear()

    def on_batch(self, run: TrainingRun, step: int, batch: torch.Tensor) -> None:
        self._disarm()
        self.acts, self.batch = None, None
        if not logged_step(run, step):
            return
        self.acts, self.batch = _Acts(run.model, run.device), batch
        if not compiled_forward(run):
            self.handles = self.acts.arm()

    def after_backward(self, run: TrainingRun, step: int) -> None:
        self._disarm()
        acts, batch = self.acts, self.batch
        self.acts, self.batch = None, None
        if acts is None or batch is None:
            return
        if not acts.seen:  # the training forward did not run this model's modules
            acts = self._extra_forward(run, batch)
        sharded, whole = _grad_squares(self.groups, len(acts.count), run.device)
        _, size = _world()
        if size > 1:
            import torch.distributed as dist

            n = len(acts.count)
            buf = torch.cat([sharded, acts.sq,
                             torch.tensor(acts.count, dtype=torch.float64, device=run.device)])
            dist.all_reduce(buf)
            sharded, sq = buf[:len(sharded)], buf[len(sharded):len(sharded) + n]
            count = [int(c) for c in buf[len(sharded) + n:].tolist()]
        else:
            sq, count = acts.sq, acts.count
        self.pending[step] = (sharded + whole, sq, count)

    def on_step_end(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None:
        for old in [s for s in self.pending if s < step]:  # steps that never got a record
            del self.pending[old]
        got = self.pending.pop(step, None)
        if got is None:
            return
        grad_sq, act_sq, count = got
        g_all = grad_sq.sqrt().tolist()
        coef = _clip_coef(run.cfg.recipe.grad_clip, record.get("grad_norm"))
        g = [v / coef for v in g_all]
        a_sq = act_sq.tolist()
        rms = [math.sqrt(s / c) if c else None for s, c in zip(a_sq, count, strict=True)]
        record[RECORD_KEY] = {"grad_norm": _finite(g[:-1]), "grad_norm_rest": _finite(g[-1:])[0],
                              "act_rms": _finite(rms[:-1]), "act_rms_final": _finite(rms[-1:])[0]}

    def on_train_end(self, run: TrainingRun, summary: dict[str, Any]) -> None:
        self._disarm()
        self.pending.clear()

    # ---------------------------------------------------------------------------- parts

    def _disarm(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _extra_forward(self, run: TrainingRun, batch: torch.Tensor) -> _Acts:
        """The step's activations from a forward of the member's own model, without
        gradients, on this process's rows of ``batch`` (see the module docstring)."""
        model = run.model
        acts = _Acts(model, run.device)
        rank, size = _world()
        rows = batch.shape[0] // size
        local = batch[rank * rows:(rank + 1) * rows].to(run.device,
                                                        non_blocking=batch.is_pinned())
        mb = run.cfg.train.micro_batch_size
        micro = mb if isinstance(mb, int) else local.shape[0]
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        handles = acts.arm()
        try:
            with torch.no_grad(), autocast_for(run.cfg.recipe.precision, run.device)():
                for chunk in local.split(max(1, micro)):
                    model(chunk)
        finally:
            for h in handles:
                h.remove()
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)  # running statistics a forward updates stay as they were
        return acts


def param_groups(model: nn.Module) -> list[tuple[nn.Parameter, int]]:
    """Every parameter of ``model`` once, with its group: the index of the block holding it,
    or the number of blocks for the rest. (FSDP keeps its sharded parameters as the modules'
    parameters between steps, so the list stays valid for the run.)"""
    blocks, _ = decoder_sites(model)
    group: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            group.setdefault(id(p), i)
    return [(p, group.get(id(p), len(blocks))) for p in model.parameters()]


def _grad_squares(groups: list[tuple[nn.Parameter, int]], n: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared gradient norms of the ``n`` groups (the blocks, then the rest), in float64 on
    ``device``: of the sharded gradients' local parts (FSDP's DTensors: to be summed over the
    processes) and of the whole ones, separately."""
    parts: dict[tuple[bool, torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = {}
    for p, i in groups:
        if p.grad is None:
            continue
        g = p.grad.detach()
        to_local = getattr(g, "to_local", None)
        if callable(to_local):
            g, is_sharded = to_local(), True
        else:
            is_sharded = False
        grads, idx = parts.setdefault((is_sharded, g.device, g.dtype), ([], []))
        grads.append(g)
        idx.append(i)
    out = {True: torch.zeros(n, dtype=torch.float64, device=device),
           False: torch.zeros(n, dtype=torch.float64, device=device)}
    for (is_sharded, _, _), (grads, idx) in parts.items():
        norms = torch.stack(torch._foreach_norm(grads)).to(device, torch.float64)
        out[is_sharded].index_add_(0, _index(tuple(idx), device), norms * norms)
    return out[True], out[False]


_INDEX: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _index(idx: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``idx`` as a tensor on ``device``, made once: a copy from the host at every logged step
    would wait for the device's queued work (a read-back the trainer avoids between logs)."""
    key = (idx, device)
    if key not in _INDEX:
        if len(_INDEX) > 64:
            _INDEX.clear()
        _INDEX[key] = torch.tensor(idx, device=device)
    return _INDEX[key]


def _clip_coef(max_norm: float, grad_norm: Any) -> float:
    """The factor clipping multiplied the gradients by (1: none), from the step's pre-clip
    norm, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    if max_norm <= 0 or not isinstance(grad_norm, int | float) or not math.isfinite(grad_norm):
        return 1.0
    return min(1.0, max_norm / (float(grad_norm) + CLIP_EPS))


def _finite(values: list[float | None]) -> list[float | None]:
    return [v if v is not None and math.isfinite(v) else None for v in values]


__all__ = ["RECORD_KEY", "LayerLogging", "compiled_forward", "decoder_sites", "logged_step"]
