"""The core of LayerNorm removal by fine-tuning, whatever the model: the fake norm, the
published schedule, the fine-tuning loop, the checks and the report (the sources are
:mod:`modbench.remove_norm.modbench_source` and :mod:`modbench.remove_norm.gpt2`; the command,
:func:`modbench.remove_norm.remove_norm`).

Method (docs/sources.md#remove-norm): Heimersheim 2024, "You can remove GPT2's LayerNorm by
fine-tuning" (arXiv 2409.13710), and Baroni, Khara, Schaeffer, Subkhankulov, Heimersheim 2025,
"Transformers Don't Need LayerNorm at Inference Time" (arXiv 2507.02559).

Each normalization ``y = (x - mean x) / s(x) * g + b`` (LayerNorm, ``s`` the per-token std) or
``y = x / s(x) * g`` (RMSNorm, ``s`` the per-token RMS) becomes a :class:`FakeNorm`. While it is
*live* it computes the real statistic and keeps a moving average of it over the fine-tuning
batches (momentum :data:`EMA_MOMENTUM`), one average for ordinary tokens and one for the special
tokens (position 0 and end-of-text tokens). At its scheduled step it is *frozen*: ``s(x)`` is
replaced by the average, so the norm becomes a fixed linear map (centering, a constant scale,
the gain and bias). The norms are frozen one layer at a time on the published schedule
(:func:`schedule`): the FFN norms of every layer, then the query/key path of each attention
pre-norm, then its value path, then the final norm; then the special tokens lose their own
average (end-of-text first, position 0 ten published steps later), leaving one scalar per norm.

Choices of our own (docs/remove_norm.md lists them with the reasons):

* The published GPT-2-small timeline (300 steps; first freeze at step 20; 2, 2 and 3 steps
  between layers for ln_2, ln_1-QK and ln_1-V; ln_f; +2 steps EOT; +10 steps BOS) is scaled to
  ``--steps``: the event times for the model's depth are multiplied by
  ``steps / T`` where ``T`` keeps the published ratio of removal phase to whole run (116/300).
* The attention pre-norm is split into a query/key and a value path (one gain and bias, two
  frozen averages, as the 2025 code does) where the attention core reads its input only
  through its q/k/v projections (the baseline core without an output gate); elsewhere it is
  frozen whole at the query/key stage. Norms inside the attention core (QK-norm's q/k norms)
  freeze with the query/key path, the other attention-side norms (output, post-residual,
  value-head norms) with the value path, and norms outside the blocks (final, embedding) at
  the final stage.
* Special tokens keep their own average at every norm (the 2025 code does so at ln_1);
  LayerNorm keeps its centering when frozen (the papers' ``(x - mean(x)) / sigma``).
* The optimizer is AdamW (0.9, 0.999), lr 6e-4 cosine to 3e-4 after a warm-up of 25/300 of
  the steps, weight decay 0.01 on matrices, clipping 1.0, fp32 (arXiv 2507.02559); the optional
  auxiliary loss (``aux_weight``, the paper's 0.1) pulls each token's final-norm statistic
  towards the batch mean of the ordinary tokens.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from modbench.config import RecipeConfig
from modbench.errors import ModbenchError
from modbench.methods.basic_norms import LayerNorm as ModbenchLayerNorm
from modbench.methods.basic_norms import SingleScaleRMSNorm
from modbench.model.norms import RMSNorm
from modbench.runtime.loss import lm_loss
from modbench.train.optim import param_groups
from modbench.train.schedule import lr_at

REPORT = "remove_norm.json"
DIAGNOSTICS_DIR = "diagnostics"
EMA_MOMENTUM = 0.9  # arXiv 2507.02559: the live norm's moving average of its statistic

# The published GPT-2-small schedule (submarat/removing-layer-norm, config.py gpt2_standard):
# 300 steps, first freeze at step 20, then per layer 2 (ln_2), 2 (ln_1 QK), 3 (ln_1 V) steps,
# ln_f, EOT special-casing dropped 2 steps later, BOS special-casing 10 steps after that.
PUB_STEPS = 300
PUB_LAYERS = 12
PUB_START = 20
PUB_GAPS = {"ffn": 2, "attn_qk": 2, "attn_v": 3}
PUB_EOT_AFTER = 2
PUB_BOS_AFTER = 10
PUB_WARMUP = 25
STAGES = ("ffn", "attn_qk", "attn_v", "final", "eot", "bos")
STAGE_NAMES = {"ffn": "FFN norms (ln_2)", "attn_qk": "attention query/key path (ln_1 QK)",
               "attn_v": "attention value path (ln_1 V) and other attention norms",
               "final": "final and embedding norms (ln_f)",
               "eot": "end-of-text tokens use the ordinary average",
               "bos": "position 0 uses the ordinary average"}

DEFAULT_LR = 6e-4
DEFAULT_MIN_LR_RATIO = 0.5  # cosine from 6e-4 to 3e-4
DEFAULT_WEIGHT_DECAY = 0.01
DEFAULT_GRAD_CLIP = 1.0
BETAS = (0.9, 0.999)

# ------------------------------------------------------------------------ the fake norm


class TokenContext:
    """The special tokens of the batch the model is running on (position 0 and end-of-text
    tokens), set by a forward pre-hook on the model (:func:`track_tokens`) and read by every
    :class:`FakeNorm` of that model."""

    def __init__(self, eot_id: int | None) -> None:
        self.eot_id = eot_id
        self.first: torch.Tensor | None = None
        self.eot: torch.Tensor | None = None

    def set(self, idx: torch.Tensor) -> None:
        first = torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
        first[:, 0] = True
        self.first = first
        self.eot = (idx == self.eot_id) if self.eot_id is not None else torch.zeros_like(first)


def track_tokens(model: nn.Module, tokens: TokenContext) -> Any:
    """Register the pre-hook that records ``model(idx)``'s special tokens; returns the handle."""
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        tokens.set(args[0])

    return model.register_forward_pre_hook(hook)


def _align(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """``mask`` (B, T) shaped to broadcast against the per-token statistic of ``x``: (B, T, 1)
    for ``(B, T, d)`` inputs, (B, 1, T, 1) for per-head ``(B, H, T, d)`` ones; None otherwise."""
    if x.dim() == 3 and tuple(x.shape[:2]) == tuple(mask.shape):
        return mask[..., None]
    if x.dim() == 4 and (x.shape[0], x.shape[2]) == tuple(mask.shape):
        return mask[:, None, :, None]
    return None


class FakeNorm(nn.Module):
    """A LayerNorm or RMSNorm whose per-token statistic can be frozen to a moving average.

    ``kind``: ``layernorm`` (``s = sqrt(var(x) + eps)``, the input centred) or ``rmsnorm``
    (``s = sqrt(mean(x^2) + eps)``). ``weight``/``bias`` are the original norm's parameters
    (the same objects; ``weight`` may be a scalar or None). ``paths``: how many independent
    statistics it keeps (2 for an attention pre-norm split into query/key and value paths).

    Live path: ``y = c / s(x) * g + b`` exactly as the original norm, and in training mode the
    averages are updated (``record``). Frozen path: ``y = c / sigma * g + b`` with ``sigma``
    the ordinary tokens' average, or the special tokens' one at position 0 and end-of-text
    tokens while :attr:`special_first` / :attr:`special_eot` hold: a fixed linear map.
    """

    def __init__(self, kind: str, dim: int, weight: nn.Parameter | None,
                 bias: nn.Parameter | None, eps: float, tokens: TokenContext,
                 paths: int = 1) -> None:
        super().__init__()
        if kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"unknown norm kind {kind!r}")
        self.kind, self.dim, self.eps, self.paths = kind, dim, float(eps), paths
        self.weight = weight
        self.bias = bias
        object.__setattr__(self, "tokens", tokens)  # shared, not a submodule
        self.live = [True] * paths
        self.sigma = [1.0] * paths  # frozen average for ordinary tokens
        self.sigma_special = [1.0] * paths  # frozen average for position 0 / end-of-text
        self.frozen_at: list[int | None] = [None] * paths
        self.special_first = True
        self.special_eot = True
        self._ema: list[torch.Tensor | None] = [None] * paths
        self._ema_special: list[torch.Tensor | None] = [None] * paths

    # -- the statistic
    def _centred(self, xf: torch.Tensor) -> torch.Tensor:
        return xf - xf.mean(-1, keepdim=True) if self.kind == "layernorm" else xf

    def statistic(self, x: torch.Tensor) -> torch.Tensor:
        """The real per-token statistic of ``x`` (float32 or wider), keepdim."""
        c = self._centred(x.to(torch.promote_types(x.dtype, torch.float32)))
        return torch.sqrt(c.pow(2).mean(-1, keepdim=True) + self.eps)

    def _mask(self, x: torch.Tensor, first: bool, eot: bool) -> torch.Tensor | None:
        t = self.tokens
        if t.first is None or not (first or eot):
            return None
        m = t.first if first else torch.zeros_like(t.first)
        if eot and t.eot is not None:
            m = m | t.eot
        return _align(m, x)

    @torch.no_grad()
    def _record(self, path: int, x: torch.Tensor, s: torch.Tensor) -> None:
        m = self._mask(x, True, True)
        s = s.detach()
        if m is None:
            rest, special = s.mean(), None
        else:
            m = m.expand_as(s)
            rest = s[~m].mean() if bool((~m).any()) else None
            special = s[m].mean() if bool(m.any()) else None
        for store, value in ((self._ema, rest), (self._ema_special, special)):
            if value is None:
                continue
            old = store[path]
            store[path] = value if old is None else EMA_MOMENTUM * old + (1 - EMA_MOMENTUM) * value

    def forward(self, x: torch.Tensor, path: int = 0, record: bool = True) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        c = self._centred(xf)
        if self.live[path]:
            s = torch.sqrt(c.pow(2).mean(-1, keepdim=True) + self.eps)
            if record and self.training:
                self._record(path, x, s)
            y = c / s
        else:
            m = self._mask(x, self.special_first, self.special_eot)
            if m is None:
                y = c / self.sigma[path]
            else:
                sp = torch.tensor(self.sigma_special[path], dtype=c.dtype, device=c.device)
                rest = torch.tensor(self.sigma[path], dtype=c.dtype, device=c.device)
                y = c / torch.where(m, sp, rest)
        if self.weight is not None:
            y = y * self.weight.to(y.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype)

    # -- freezing
    def averages(self, path: int) -> tuple[float, float]:
        """The current moving averages (ordinary, special) of ``path``."""
        rest, special = self._ema[path], self._ema_special[path]
        if rest is None:
            raise RuntimeError("the norm has seen no batch in training mode; calibrate first")
        r = float(rest)
        return r, float(special) if special is not None else r

    def freeze(self, path: int, step: int) -> None:
        self.sigma[path], self.sigma_special[path] = self.averages(path)
        self.live[path] = False
        self.frozen_at[path] = step

    @torch.no_grad()
    def fold(self) -> bool:
        """Fold ``1/sigma`` into the gain of a frozen norm without special tokens (a single
        path with a per-channel or scalar gain): afterwards ``sigma = 1``. Whether it did."""
        if (self.paths != 1 or self.live[0] or self.special_first or self.special_eot
                or self.weight is None):
            return False
        self.weight.div_(self.sigma[0])
        self.sigma[0] = self.sigma_special[0] = 1.0
        return True

    def state(self) -> dict[str, Any]:
        """Plain-data state (for ``model.pt`` and the report)."""
        return {"kind": self.kind, "dim": self.dim, "eps": self.eps, "paths": self.paths,
                "live": list(self.live), "sigma": list(self.sigma),
                "sigma_special": list(self.sigma_special), "frozen_at": list(self.frozen_at),
                "special_first": self.special_first, "special_eot": self.special_eot}

    def load_state(self, state: dict[str, Any]) -> None:
        if state["paths"] != self.paths or state["kind"] != self.kind:
            raise ModbenchError("the saved norm state does not match the model; the output "
                                "folder was written by another version of remove-norm")
        self.live = [bool(v) for v in state["live"]]
        self.sigma = [float(v) for v in state["sigma"]]
        self.sigma_special = [float(v) for v in state["sigma_special"]]
        self.frozen_at = list(state["frozen_at"])
        self.special_first = bool(state["special_first"])
        self.special_eot = bool(state["special_eot"])

    def extra_repr(self) -> str:
        mode = ", ".join("live" if v else f"sigma={s:.4g}" for v, s in zip(self.live, self.sigma,
                                                                             strict=True))
        return f"{self.kind}, {self.dim}, {mode}"


class NormHolder(nn.Module):
    """Stands where a split norm was: passes its input through unchanged and owns the norm,
    which the consumers (:class:`NormedInput`, GPT-2's split ``c_attn``) apply per path."""

    def __init__(self, norm: FakeNorm) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class NormedInput(nn.Module):
    """``inner(norm(x, path))``: one consumer of a split norm (the q, k or v projection).
    ``record``: whether this consumer updates the norm's averages (the q projection does for
    the query/key path, the k projection reads the same input and does not)."""

    def __init__(self, inner: nn.Module, norm: FakeNorm, path: int, record: bool) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "norm_ref", norm)  # owned by the NormHolder
        self.path, self.record = path, record

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.inner(self.norm_ref(x, path=self.path, record=self.record), *args, **kwargs)


SUPPORTED_NORMS: tuple[type[nn.Module], ...] = (RMSNorm, ModbenchLayerNorm, SingleScaleRMSNorm,
                                                nn.LayerNorm, nn.RMSNorm)


def fake_from(module: nn.Module, tokens: TokenContext, paths: int = 1) -> FakeNorm:
    """A live :class:`FakeNorm` computing what ``module`` (a supported norm) computes, with
    the same parameter objects."""
    if isinstance(module, ModbenchLayerNorm):
        return FakeNorm("layernorm", module.dim, module.weight, module.bias, module.eps, tokens,
                        paths)
    if isinstance(module, nn.LayerNorm):
        (dim,) = module.normalized_shape
        return FakeNorm("layernorm", dim, module.weight, module.bias, module.eps, tokens, paths)
    if isinstance(module, RMSNorm):
        return FakeNorm("rmsnorm", module.weight.shape[0], module.weight, None, module.eps,
                        tokens, paths)
    if isinstance(module, SingleScaleRMSNorm):
        return FakeNorm("rmsnorm", 0, module.scale, None, module.eps, tokens, paths)
    if isinstance(module, nn.RMSNorm):
        (dim,) = module.normalized_shape
        eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
        return FakeNorm("rmsnorm", dim, module.weight, None, eps, tokens, paths)
    raise TypeError(f"{type(module).__name__} is not a supported norm")


@dataclass
class Site:
    """One path of one fake norm, where it sits and the stage that freezes it."""

    name: str
    norm: FakeNorm
    path: int
    stage: str
    layer: int

    def record(self) -> dict[str, Any]:
        n = self.norm
        return {"name": self.name, "path": self.path, "stage": self.stage, "layer": self.layer,
                "kind": n.kind, "sigma": n.sigma[self.path],
                "sigma_special": n.sigma_special[self.path],
                "frozen_at": n.frozen_at[self.path]}


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def final_fake_norm(sites: Sequence[Site]) -> FakeNorm | None:
    """The fake norm at the model's final norm site (the auxiliary loss's), also inside a
    wrapper (embproj's P_out around it); not an embedding norm, whose stage is also
    ``final``."""
    return next((s.norm for s in sites if s.name.split(".")[0] == "final_norm"), None)


def fake_norms(sites: Sequence[Site]) -> list[FakeNorm]:
    """The distinct fake norms of ``sites``, in order."""
    seen: dict[int, FakeNorm] = {}
    for s in sites:
        seen.setdefault(id(s.norm), s.norm)
    return list(seen.values())


# ---------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Event:
    """At the start of ``step``: freeze the sites of ``stage`` in ``layer`` (-1: every layer),
    or drop a special-token average (stages ``eot``, ``bos``)."""

    step: int
    stage: str
    layer: int

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "stage": self.stage, "layer": self.layer}


def published_timeline(n_layers: int) -> list[tuple[int, str, int]]:
    """The published event times (in published steps) for an ``n_layers``-layer model."""
    t, out = PUB_START, []
    for stage in ("ffn", "attn_qk", "attn_v"):
        for i in range(n_layers):
            out.append((t, stage, i))
            t += PUB_GAPS[stage]
    out.append((t, "final", -1))
    t += PUB_EOT_AFTER
    out.append((t, "eot", -1))
    t += PUB_BOS_AFTER
    out.append((t, "bos", -1))
    return out


def published_length(n_layers: int) -> float:
    """The published run length for ``n_layers`` layers: the removal phase takes the same
    share of it as on GPT-2 small (116 of 300 steps)."""
    removal = published_timeline(n_layers)[-1][0]
    return removal * PUB_STEPS / published_timeline(PUB_LAYERS)[-1][0]


def schedule(n_layers: int, steps: int) -> list[Event]:
    """The published schedule scaled to ``steps`` fine-tuning steps (events may share a step
    when ``steps`` is short; every event happens before the last step)."""
    scale = steps / published_length(n_layers)
    return [Event(min(steps - 1, int(t * scale)), stage, layer)
            for t, stage, layer in published_timeline(n_layers)]


def warmup_steps(steps: int) -> int:
    return round(PUB_WARMUP * steps / PUB_STEPS)


def apply_event(event: Event, sites: Sequence[Site]) -> None:
    if event.stage in ("eot", "bos"):
        for n in fake_norms(sites):
            if event.stage == "eot":
                n.special_eot = False
            else:
                n.special_first = False
        return
    for s in sites:
        if (s.stage == event.stage and (event.layer < 0 or s.layer == event.layer)
                and s.norm.live[s.path]):
            s.norm.freeze(s.path, event.step)


# --------------------------------------------------------------------------- fine-tuning


@dataclass
class FineTuneSettings:
    """The fine-tuning run (defaults: arXiv 2507.02559's, scaled to ``steps``)."""

    steps: int = 300
    batch_size: int = 8
    lr: float = DEFAULT_LR
    min_lr_ratio: float = DEFAULT_MIN_LR_RATIO
    weight_decay: float = DEFAULT_WEIGHT_DECAY
    grad_clip: float = DEFAULT_GRAD_CLIP
    aux_weight: float = 0.0

    def validate(self) -> None:
        if self.steps < 1:
            raise ModbenchError(f"--steps must be at least 1, got {self.steps}")
        if self.batch_size < 1:
            raise ModbenchError(f"--batch-size must be at least 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ModbenchError(f"--lr must be positive, got {self.lr}")
        if self.aux_weight < 0:
            raise ModbenchError(f"--aux-weight must be 0 or more, got {self.aux_weight}")

    def recipe(self) -> RecipeConfig:
        return RecipeConfig(name="remove-norm", optimizer="adamw", lr=self.lr, betas=BETAS,
                            weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                            warmup_steps=warmup_steps(self.steps), schedule="cosine",
                            min_lr_ratio=self.min_lr_ratio)


@dataclass
class Task:
    """What the fine-tuning loop needs: the model (token ids -> logits), its fake-norm sites,
    its token context, training batches by step, the validation loss, and the final norm for
    the auxiliary loss."""

    model: nn.Module
    sites: list[Site]
    tokens: TokenContext
    train_batch: Callable[[int], torch.Tensor]
    val_loss: Callable[[nn.Module], float]
    device: torch.device
    final_norm: FakeNorm | None = None


@dataclass
class FineTuneResult:
    stages: list[dict[str, Any]] = field(default_factory=list)
    curve: list[dict[str, Any]] = field(default_factory=list)
    after: float = math.nan


def _aux_capture(norm: FakeNorm) -> tuple[dict[str, torch.Tensor], Any]:
    held: dict[str, torch.Tensor] = {}

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        held["x"] = args[0]

    return held, norm.register_forward_pre_hook(hook)


def _aux_loss(norm: FakeNorm, x: torch.Tensor) -> torch.Tensor:
    """Mean squared distance of each token's statistic from the ordinary tokens' mean."""
    s = norm.statistic(x)
    m = norm._mask(x, True, True)
    with torch.no_grad():
        target = s[~m.expand_as(s)].mean() if m is not None else s.mean()
    return ((s - target) ** 2).mean()


def _stage_boundaries(events: Sequence[Event], steps: int) -> dict[int, list[str]]:
    """Step -> the stages whose validation comes before it: each stage of ``events`` is
    evaluated when the first event of a later stage is due, the last one after ``steps``."""
    boundaries: dict[int, list[str]] = {}
    present = [s for s in STAGES if any(e.stage == s for e in events)]
    for k, stage in enumerate(present):
        nxt = next((e.step for e in events if e.stage in present[k + 1:]), steps)
        boundaries.setdefault(nxt, []).append(stage)
    return boundaries


def _final_norm_input(task: Task, ft: FineTuneSettings) -> tuple[dict[str, torch.Tensor], Any]:
    """With an auxiliary loss, the final norm's input as each forward pass leaves it (and the
    hook's handle); refused for a model without a final norm. Else nothing is hooked."""
    if ft.aux_weight > 0:
        if task.final_norm is None:
            raise ModbenchError("--aux-weight needs a final norm, and this model has none; "
                                "drop --aux-weight")
        return _aux_capture(task.final_norm)
    return {}, None


def _train_step(task: Task, ft: FineTuneSettings, opt: torch.optim.Optimizer,
                recipe: RecipeConfig, step: int, held: dict[str, torch.Tensor]) -> float:
    """One optimizer step at ``step`` (the recipe's learning rate for it, plus the auxiliary
    loss when weighted); returns the language-model loss. Raises when a loss is not finite."""
    model = task.model
    for g in opt.param_groups:
        g["lr"] = lr_at(step, recipe, ft.steps)
    batch = task.train_batch(step).to(task.device)
    loss = lm_loss(model(batch), batch)
    total = loss
    if ft.aux_weight > 0 and task.final_norm is not None:
        total = loss + ft.aux_weight * _aux_loss(task.final_norm, held["x"])
    value = float(loss.detach())
    if not math.isfinite(value) or not math.isfinite(float(total.detach())):
        live = [s.name for s in task.sites if s.norm.live[s.path]]
        raise ModbenchError(
            f"fine-tuning diverged at step {step} (loss {value}) with {len(live)} norm "
            "paths still live; lower --lr or raise --steps")
    opt.zero_grad(set_to_none=True)
    total.backward()
    if ft.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), ft.grad_clip)
    opt.step()
    return value


def finetune(task: Task, ft: FineTuneSettings, events: Sequence[Event], *,
             progress: bool = True, desc: str = "remove-norm") -> FineTuneResult:
    """Fine-tune ``task.model`` for ``ft.steps`` steps, applying ``events`` at their steps and
    measuring the validation loss after each stage (when the next stage starts) and at the end.
    With no sites and no events this is the control run: the same fine-tuning with the norms.
    Raises :class:`ModbenchError` when the loss stops being finite."""
    model, res = task.model, FineTuneResult()
    recipe = ft.recipe()
    opt = torch.optim.AdamW(param_groups(model, ft.weight_decay), lr=ft.lr, betas=BETAS,
                            eps=1e-8)
    boundaries = _stage_boundaries(events, ft.steps)
    by_step: dict[int, list[Event]] = {}
    for e in events:
        by_step.setdefault(e.step, []).append(e)
    held, handle = _final_norm_input(task, ft)
    done: set[str] = set()

    def evaluate(stages: list[str], step: int) -> None:
        """Record the validation loss before ``step`` as that of ``stages``; back to training."""
        loss = task.val_loss(model)
        for stage in stages:
            res.stages.append({"stage": stage, "step": step, "val_loss": loss})
        done.update(stages)
        model.train()

    model.train()
    if task.sites:  # seed every average from the model as it is
        with torch.no_grad():
            model(task.train_batch(0).to(task.device))
    bar = tqdm(range(ft.steps), desc=desc, unit="step", disable=not progress)
    try:
        for step in bar:
            for e in by_step.get(step, []):
                waiting = [s for s in boundaries.get(step, []) if s not in done
                           and STAGES.index(s) < STAGES.index(e.stage)]
                if waiting:
                    evaluate(waiting, step)
                apply_event(e, task.sites)
            rest = [s for s in boundaries.get(step, []) if s not in done]
            if rest:
                evaluate(rest, step)
            value = _train_step(task, ft, opt, recipe, step, held)
            res.curve.append({"step": step, "loss": value,
                              "live": sum(s.norm.live[s.path] for s in task.sites)})
            bar.set_postfix(loss=f"{value:.3f}",
                            live=sum(s.norm.live[s.path] for s in task.sites))
    finally:
        if handle is not None:
            handle.remove()
        bar.close()
    rest = [s for s in boundaries.get(ft.steps, []) if s not in done]
    res.after = task.val_loss(model)
    for stage in rest:
        res.stages.append({"stage": stage, "step": ft.steps, "val_loss": res.after})
    model.eval()
    return res


# ----------------------------------------------------------------------------- checks


@torch.no_grad()
def linearity_error(norm: FakeNorm, path: int, seed: int = 0) -> float:
    """How far a norm path is from an affine map: with ``g(v) = f(v) - f(0)``, the largest of
    ``|g(2x) - 2 g(x)|`` and ``|g(x + y) - g(x) - g(y)|`` relative to ``|g(x)|``, on random
    inputs of the norm's width (a live LayerNorm/RMSNorm gives about 1, a fixed map rounding)."""
    gen = torch.Generator().manual_seed(seed)
    p = norm.weight if norm.weight is not None else norm.bias
    dev = p.device if p is not None else torch.device("cpu")
    dim = norm.dim or 8
    x = (torch.randn(2, 5, dim, generator=gen) * 3 + 1).to(dev)
    y = (torch.randn(2, 5, dim, generator=gen) * 0.5 - 2).to(dev)
    was = norm.training
    norm.eval()
    try:
        zero = norm(torch.zeros_like(x), path=path, record=False).double()

        def g(v: torch.Tensor) -> torch.Tensor:
            return norm(v, path=path, record=False).double() - zero

        gx = g(x)
        scale = float(gx.abs().max()) or 1.0
        err = max(float((g(2 * x) - 2 * gx).abs().max()),
                  float((g(x + y) - gx - g(y)).abs().max()))
    finally:
        norm.train(was)
    return err / scale


def norm_free_check(model: nn.Module, sites: Sequence[Site]) -> dict[str, Any]:
    """Whether ``model`` has no normalization nonlinearity left: no original norm module,
    no live fake-norm path, no special-token average in use, and every fake-norm path affine
    to rounding (:func:`linearity_error`)."""
    originals = [n for n, m in model.named_modules() if isinstance(m, SUPPORTED_NORMS)]
    live = [f"{s.name}[{s.path}]" for s in sites if s.norm.live[s.path]]
    special = [s.name for s in sites if s.norm.special_first or s.norm.special_eot]
    errors = [linearity_error(s.norm, s.path) for s in sites]
    worst = max(errors) if errors else 0.0
    return {"normalization_free": not originals and not live and not special and worst < 1e-4,
            "original_norm_modules": originals, "live_paths": live,
            "special_token_averages": sorted(set(special)),
            "max_linearity_error": worst, "paths_checked": len(errors)}


@dataclass
class Outcome:
    """What :func:`remove_norm` wrote."""

    out: Path
    report: dict[str, Any]
    kind: str  # modbench | gpt2


def _new_out(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModbenchError(f"{out} exists and is not empty; choose another --out folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))


def _publish(tmp: Path, out: Path) -> None:
    if out.is_dir():
        out.rmdir()
    os.replace(tmp, out)


@contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """A temporary folder next to ``out`` that becomes ``out`` on success and is removed on
    any error, so a failed run leaves nothing behind."""
    tmp = _new_out(out)
    try:
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def finite_before(loss: float) -> float:
    if not math.isfinite(loss):
        raise ModbenchError(f"the source model's validation loss is {loss} (a diverged run?); "
                            "remove-norm needs a model that trains")
    return loss


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, allow_nan=False) + "\n")


def run_report(kind: str, source: Path, ft: FineTuneSettings, events: Sequence[Event],
            before: float, res: FineTuneResult, exported: float, sites: Sequence[Site],
            check: dict[str, Any], control: FineTuneResult | None, extra: dict[str, Any],
            n_val: int, started: float) -> dict[str, Any]:
    validation: dict[str, Any] = {
        "sequences": n_val, "before": before, "stages": res.stages, "after": res.after,
        "change": res.after - before, "exported": exported}
    if control is not None:
        validation["control_after"] = control.after
        validation["control_change"] = control.after - before
        validation["removal_cost"] = res.after - control.after
    return {
        "source": str(source), "kind": kind, **extra,
        "settings": {"steps": ft.steps, "batch_size": ft.batch_size, "lr": ft.lr,
                     "min_lr_ratio": ft.min_lr_ratio, "warmup_steps": warmup_steps(ft.steps),
                     "weight_decay": ft.weight_decay, "grad_clip": ft.grad_clip,
                     "aux_weight": ft.aux_weight, "betas": list(BETAS),
                     "ema_momentum": EMA_MOMENTUM},
        "schedule": [e.as_dict() for e in events],
        "validation": validation,
        "check": check,
        "norms": [s.record() for s in sites],
        "train_curve": res.curve,
        "diagnostics": {"before": f"{DIAGNOSTICS_DIR}/before/diagnostics.json",
                        "after": f"{DIAGNOSTICS_DIR}/after/diagnostics.json"},
        "seconds": round(time.time() - started, 2),
    }
