"""The training loop's only view of the weights: an engine holds the members' models and
optimizers and does the numerical part of a step (forward and backward over micro-batches,
clipping, the update) and of validation.

A *member* is one seed's run. The loop (:class:`modbench.train.trainer.Trainer`) owns
everything else, per member: the schedule, the batches (the same for every member), logging,
checkpoints, divergence and callbacks. So a single run (one member), a K-seed ensemble and a
multi-process run (:class:`modbench.train.distributed.DistributedEngine`: DDP or FSDP2, each
process training on its slice of the global batch, all-reduced losses) are one loop over
different engines.

:class:`LocalEngine` runs K members on one device. With one member it is a plain forward and
backward. With several it stacks the members' weights (``torch.func.stack_module_state`` on
every micro-batch; the members' own modules stay the source of truth) and runs one vmapped
forward and backward for all of them, so the members share each kernel launch; each member
keeps its own optimizer and is clipped on its own gradient norm, exactly as a separate run.
Only methods that declare ``stackable`` can be stacked (a method that updates buffers during
the forward, reads a tensor's value in Python, or has no vmap rule cannot).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from modbench.runtime.device import compiled
from modbench.runtime.loss import micro_loss, validation_loss

#: A step's loss or gradient norm as an engine returns it: a tensor still on the device (0-d,
#: or 1-d holding parts the host sums in order, in float64), so the loop reads a whole window
#: of steps back in one transfer (:func:`host_floats`), or a float already on the host.
StepValue = torch.Tensor | float


def host_floats(values: Sequence[StepValue]) -> list[float]:
    """Each value as a host float, with one device-to-host transfer for all the tensors. A
    1-d tensor's parts are added in order in float64, as ``total += part.item()`` would."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    flat: list[float] = (torch.cat([t.detach().reshape(-1).double() for t in tensors]).tolist()
                         if tensors else [])
    out, i = [], 0
    for v in values:
        if isinstance(v, torch.Tensor):
            n = v.numel()
            total = 0.0
            for part in flat[i:i + n]:
                total += part
            out.append(total)
            i += n
        else:
            out.append(float(v))
    return out


class Engine(Protocol):
    models: list[nn.Module]  # one per member: the weights, unwrapped
    optimizers: list[torch.optim.Optimizer]

    def set_lr(self, lr: float) -> None: ...
    def backward(self, batch: torch.Tensor, mask: torch.Tensor | None,
                 members: Sequence[int]) -> list[StepValue]: ...
    def clip_grad_norm(self, max_norm: float, members: Sequence[int]) -> list[StepValue]: ...
    def update(self, members: Sequence[int]) -> None: ...
    def discard(self) -> None: ...
    def synchronize(self) -> None: ...
    def validation_loss(self, member: int, data: Any, n_sequences: int,
                        batch_size: int) -> float: ...
    def state_dict(self, member: int) -> dict[str, Any]: ...
    def load_state_dict(self, member: int, state: dict[str, Any]) -> None: ...


class LocalEngine:
    """K members' models and optimizers on one device.

    ``n_micro`` micro-batches per step (gradient accumulation); ``compile`` (``train.compile``:
    :func:`~modbench.runtime.device.compiled`) runs the forward (the vmapped one for several
    members) through ``torch.compile`` while :attr:`models` stay the plain modules.
    """

    def __init__(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 device: torch.device, autocast: Callable[[], AbstractContextManager[Any]], *,
                 n_micro: int = 1, compile: bool | str = False,
                 on_compiled: Callable[[], None] | None = None) -> None:
        self.models, self.optimizers, self.device = models, optimizers, device
        self.autocast, self.n_micro = autocast, n_micro
        if len(models) == 1:
            self.forward: Callable[..., Any] = compiled(models[0], compile, device, on_compiled)
        else:
            base = copy.deepcopy(models[0]).to("meta")  # the structure; weights come stacked

            def member_loss(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                            micro: torch.Tensor, mask: torch.Tensor | None,
                            count: int) -> tuple[torch.Tensor, torch.Tensor]:
                """(the micro-batch's share of the objective, of the LM loss)"""
                def forward(micro: torch.Tensor, **kwargs: Any) -> Any:
                    return functional_call(base, (params, buffers), (micro,), kwargs)

                loss, aux = micro_loss(forward, micro, mask, count, n_micro=self.n_micro)
                return loss + aux / self.n_micro, loss

            stacked = vmap(member_loss, in_dims=(0, 0, None, None, None))
            self.forward = compiled(stacked, compile, device, on_compiled)
            self.base = base

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr

    def backward(self, batch: torch.Tensor, mask: torch.Tensor | None,
                 members: Sequence[int]) -> list[StepValue]:
        """Accumulate, for each of ``members``, the gradient of the batch's mean loss over its
        micro-batches; return those losses, left on the device (no host synchronisation).
        With ``mask`` (``data.probe_loss=answers``) only the kept predictions count, all
        micro-batches sharing the batch's denominator.

        The gradient is that of the objective: the LM loss plus the auxiliary loss terms the
        model's cores add (``Transformer.forward(with_aux=True)``), each micro-batch's
        auxiliary term divided by the number of micro-batches (their mean); the losses
        returned are the LM losses alone."""
        # a pinned batch (the prefetching loader's, on CUDA) is copied while the host goes on
        ahead = self.device.type == "cuda" and batch.is_pinned()
        micros = batch.to(self.device, non_blocking=ahead).chunk(self.n_micro)
        count = int(mask.sum()) if mask is not None else 0
        masks = (mask.to(self.device, non_blocking=ahead).chunk(self.n_micro)
                 if mask is not None else (None,) * len(micros))
        if len(self.models) == 1:
            parts = []
            for micro, m in zip(micros, masks, strict=True):
                with self.autocast():
                    loss, aux = micro_loss(self.forward, micro, m, count, n_micro=self.n_micro)
                (loss + aux / self.n_micro).backward()  # aux 0 when no core adds any
                parts.append(loss.detach())
            return [torch.stack(parts)]  # summed on the host, in order
        live = [self.models[k] for k in members]
        totals = torch.zeros(len(live), dtype=torch.float64, device=self.device)
        for micro, m in zip(micros, masks, strict=True):
            params, buffers = stack_module_state(live)  # type: ignore[arg-type]
            with self.autocast(), warnings.catch_warnings():
                # CPU SDPA has no vmap rule yet: torch loops over the members and says so on
                # every call (docs/architecture.md states what stacking gains where)
                warnings.filterwarnings("ignore", message="There is a performance drop")
                objectives, losses = self.forward(params, buffers, micro, m, count)
                objectives.sum().backward()
            totals += losses.detach().double()
            self._unstack_grads(live, params)
        return list(totals)

    @staticmethod
    def _unstack_grads(live: list[nn.Module], params: dict[str, torch.Tensor]) -> None:
        """Add each member's slice of the stacked gradients to its own parameters' grads."""
        for name, stacked in params.items():
            if stacked.grad is None:
                continue
            for k, model in enumerate(live):
                p = model.get_parameter(name)
                g = stacked.grad[k]
                p.grad = g.clone() if p.grad is None else p.grad.add_(g)

    def clip_grad_norm(self, max_norm: float, members: Sequence[int]) -> list[StepValue]:
        """Each member's global gradient norm before clipping (``max_norm <= 0``: none), left
        on the device."""
        clip = max_norm if max_norm > 0 else float("inf")
        return [torch.nn.utils.clip_grad_norm_(self.models[k].parameters(), clip)
                for k in members]

    def update(self, members: Sequence[int]) -> None:
        """Step the optimizers of ``members``; every member's gradients are cleared."""
        for k in members:
            self.optimizers[k].step()
        self.discard()

    def discard(self) -> None:
        """Drop the step's gradients without applying them."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def synchronize(self) -> None:
        """Wait for queued device work (honest step times on CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def validation_loss(self, member: int, data: Any, n_sequences: int,
                        batch_size: int) -> float:
        return validation_loss(self.models[member], data, n_sequences, batch_size,
                               self.device, self.autocast)

    def state_dict(self, member: int) -> dict[str, Any]:
        return {"model": self.models[member].state_dict(),
                "optimizer": self.optimizers[member].state_dict()}

    def load_state_dict(self, member: int, state: dict[str, Any]) -> None:
        self.models[member].load_state_dict(state["model"])
        self.optimizers[member].load_state_dict(state["optimizer"])
