"""The GPU memory plan: what one training process of a run holds at its peak, term by term,
and the largest micro-batch that fits a device (``modbench plan``; ``train.micro_batch_size
=auto``).

The resident state is counted from the parameters: fp32 master weights, fp32 gradients and
the optimizer's state (AdamW/Adam: two fp32 moments per parameter; ``recipe.optimizer=muon``:
one momentum buffer for the hidden matrices, :func:`modbench.train.optim.muon_split`'s rule,
and AdamW's two moments for the rest). Across ``nproc`` processes DDP keeps a full replica
whose gradients are views of its all-reduce buckets (``gradient_as_bucket_view``, as
:mod:`modbench.train.distributed` wraps the model: one copy of the gradients, kept between
steps; a second one, the buckets, where the views are off); FSDP2 shards weights, gradients and
optimizer state by ``nproc`` and holds its largest units unsharded while they are gathered,
in ``train.fsdp_param_dtype`` (the root: head and norms, kept through the forward; two block
units, the one running and the one prefetched; and one unit's unsharded gradient, in fp32,
before its reduce-scatter).

Activations are *measured*, not modelled: the planner builds the real model (every method
and its own activations included) under ``torch._subclasses.fake_tensor.FakeTensorMode``,
which allocates no memory, and runs one training forward and backward through the function
the engine trains with (:func:`modbench.runtime.loss.micro_loss`), under bf16 autocast where
the run would use it (``recipe.precision=auto`` on a GPU) and in fp32 on the CPU. A plan for a
GPU traces on the CPU under the CPU's autocast, whose bf16 list is CUDA's, plus
:class:`CudaAutocastPolicy`, which runs the operators CUDA's autocast runs in fp32 (``exp``,
``pow``, ``rsqrt``, ``softmax``, ``sum``, ``layer_norm``, ... : the CPU's autocast leaves them
in bf16) in fp32 as CUDA would. Without it, softpick's explicit scores were planned 1.27-1.33x
too small on an H200 (BENCHMARKS.md).
A dispatch mode (:class:`LiveBytes`) counts the bytes of every storage the step creates
while it is alive; the peak above the resident state is the step's transient memory. It is
split at the final norm's output: what the body saves for the backward (``activations``) and
what the loss head adds on top of it (``loss``: logits, chunked by the lead's
``modbench.model.head`` where that exists). Validation and probe scoring (no gradients, at
the same micro-batch) are traced the same way (``eval``, counted where it exceeds the
training step's transient: the two never coincide).

Activations are affine in the micro-batch ``B`` (every saved tensor has the batch as a
dimension; the constant part is autocast's bf16 copies of the weights and the chunked loss's
pieces), so each is traced at two small micro-batches and extrapolated; exactly, as
``tests/analysis/test_plan.py`` checks against a direct trace. The chunked loss changes regime
where one piece no longer holds a micro-batch's logits, so the two points are taken on the
same side of that boundary as the micro-batch planned. Planning a climb-3b method thus costs
a few traced steps of a fake model (seconds to a minute on two CPU cores), no real memory.

What the plan leaves out, and the margin covers: the CUDA context and the caching
allocator's fragmentation (:data:`FIXED_ALLOWANCE` plus :data:`MARGIN` of the device),
``torch.compile``'s fusion (it only lowers the peak) and NCCL's buffers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import json
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from modbench.config import RunConfig
from modbench.errors import ModbenchError
from modbench.methods.build import Plan, plan_run
from modbench.model.transformer import Transformer
from modbench.runtime import loss as loss_mod
from modbench.runtime.device import bf16_forward, fsdp_gathers_bf16
from modbench.runtime.gpus import Accelerator

#: The safety margin :func:`choose_micro_batch` leaves free: this fraction of the device's
#: memory (the caching allocator's fragmentation grows with the peak) ...
MARGIN = 0.10
#: ... plus this many bytes, by device type: on a GPU the CUDA context and the cuBLAS and
#: NCCL workspaces (about 1 GB on an H100), on the CPU the Python interpreter and torch's
#: libraries (about 0.4 GB of resident memory).
FIXED_ALLOWANCE = {"cuda": 2 * 2**30, "cpu": 2**29}
#: Host memory a training process needs besides the tensors it holds (interpreter, torch,
#: CUDA libraries, the data loader's buffers): :func:`host_memory_bytes`.
HOST_RUNTIME_BYTES = 4 * 2**30
FP32 = 4
#: The most layers a plan traces. Tracing costs time in the number of operators, not in the
#: tensors' sizes (they are fake): about 0.4 s a layer on a CPU core for the few micro-batches
#: a plan traces, so 1,024 layers take minutes and ``model.n_layers=100000`` would take half a
#: day (and gigabytes for the modules alone). Refused by :func:`check_plannable` before
#: anything is built.
MAX_PLANNED_LAYERS = 1024
#: The largest ``train.batch_size`` a plan looks for micro-batches in (its divisors are found
#: by trial division up to the square root: 2^20 divisions at most).
MAX_PLANNED_BATCH = 2**40

#: A function that makes a model recompute its blocks' activations in the backward
#: (``modbench.train.recompute.apply_activation_checkpointing``; the train layer passes it in,
#: this layer cannot import it).
Checkpointing = Callable[..., Any]  # (model, method, mode=...) -> ...


@dataclass
class MemoryPlan:
    """One process's peak memory for a run on a device, by term (bytes)."""

    preset: str
    method: str
    device: str  # the accelerator's key (runtime.gpus), or "<N>GB" for a given size
    device_bytes: int
    nproc: int
    parallel: str
    micro_batch: int
    batch_size: int  # the global batch (sequences per optimizer step)
    seq_len: int
    ensembles: int
    activation_checkpointing: bool | str
    peak_bytes: int
    fits: bool  # peak_bytes <= usable_bytes
    terms: dict[str, int] = field(default_factory=dict)
    usable_bytes: int = 0  # device_bytes less the margin (MARGIN, FIXED_ALLOWANCE)
    device_type: str = "cuda"  # cuda | cpu: what the precision and the allowance assume
    host_bytes: int = 0  # host memory of the run's processes on one node
    params: int = 0
    precision: str = "bf16"  # of the traced forward: bf16 (autocast) or fp32
    # empty where activations, loss and eval were traced at this shape; else why they are
    # the baseline's scaled by the method's ratio at the tiny preset (_Tracer._estimate)
    estimated: str = ""

    def largest_term(self) -> str:
        """The name of the biggest term."""
        return max(self.terms, key=lambda k: self.terms[k])

    def to_json(self) -> dict[str, Any]:
        """The plan as a JSON-ready dictionary (``modbench plan --json``)."""
        out = dataclasses.asdict(self)
        out["largest_term"] = self.largest_term()
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json())


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that operators create while they are alive (a weak
    reference to each storage; its finaliser subtracts it), and the peak of that count.

    Tensors that exist before the mode is entered are not counted unless :meth:`hold` is told
    of them; a sub-peak (:meth:`mark`, :meth:`sub_peak`) measures one stretch of the step."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._mark_peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def hold(self, tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
        """Count existing tensors (the resident state) as live; returns their bytes."""
        before = self.live
        for t in tensors:
            self._count(t)
        return self.live - before

    def mark(self) -> int:
        """Start a sub-peak here; returns the bytes live now."""
        self._mark_peak = self.live
        return self.live

    def sub_peak(self) -> int:
        return self._mark_peak

    def _free(self, n: int) -> None:
        self.live -= n

    def _count(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self._seen:
            return
        n = int(st.nbytes())
        self._seen[st] = n
        weakref.finalize(st, self._free, n)
        self.live += n
        self.peak = max(self.peak, self.live)
        self._mark_peak = max(self._mark_peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def _chunk_tokens(vocab: int) -> int | None:
    """Tokens one piece of the chunked loss holds (``modbench.model.head``), or None where
    the model computes the loss from full logits (linear in the micro-batch throughout)."""
    try:
        head = importlib.import_module("modbench.model.head")
    except ImportError:
        return None
    chunk = getattr(head, "LOGITS_CHUNK_BYTES", None)
    return None if chunk is None else max(1, int(chunk) // (FP32 * vocab))


@dataclass
class _Step:
    """One traced step's transient bytes above the resident state."""

    activations: int
    loss: int
    eval: int


# CUDA's autocast runs these in fp32 (torch's "Autocast Op Reference", CUDA ops that can
# autocast to float32; ``logsumexp`` and ``vector_norm`` from aten's autocast_mode.h); the
# CPU's autocast leaves most of them in the input's dtype.
CUDA_FP32_OPS = (
    "__pow__", "__rpow__", "__rdiv__", "__rtruediv__", "acos", "asin", "cosh", "sinh", "tan",
    "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2", "reciprocal", "rsqrt", "pow",
    "softplus", "softmax", "softmin", "log_softmax", "sum", "prod", "cumsum", "cumprod",
    "logsumexp", "norm", "vector_norm", "matrix_norm", "normalize", "renorm", "layer_norm",
    "group_norm", "cosine_similarity", "dist", "cdist", "pdist", "cross_entropy", "nll_loss",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    "binary_cross_entropy_with_logits", "poisson_nll_loss", "cosine_embedding_loss",
    "hinge_embedding_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "multi_margin_loss", "soft_margin_loss", "triplet_margin_loss")


@functools.cache
def _cuda_fp32_funcs() -> frozenset[Any]:
    spaces = (torch, torch.Tensor, torch.nn.functional, torch.linalg, torch.special)
    return frozenset(getattr(ns, name) for name in CUDA_FP32_OPS for ns in spaces
                     if hasattr(ns, name))


class CudaAutocastPolicy(TorchFunctionMode):
    """CUDA autocast's fp32 list on top of the CPU's autocast: the listed operators get their
    bf16/fp16 tensor arguments as fp32 copies (CUDA's autocast makes the same copies), unless
    called with an explicit ``dtype``, so a trace on the CPU keeps the fp32 tensors a CUDA step
    keeps. The matmul-like operators need nothing: both autocasts run them in bf16."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (func in _cuda_fp32_funcs() and kwargs.get("dtype") is None
                and torch.is_autocast_enabled("cpu")):
            def up(x: Any) -> Any:
                if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16):
                    return x.float()
                return x

            args, kwargs = pytree.tree_map(up, (args, kwargs))
        return func(*args, **kwargs)


class _Tracer:
    """Traces a run's model under FakeTensorMode at given micro-batches (memoised) and
    extrapolates affinely in the micro-batch between two points of the same loss regime."""

    def __init__(self, run: RunConfig, p: Plan, bf16: bool,
                 checkpointing: Checkpointing | None, cuda: bool = True) -> None:
        self.run, self.p, self.bf16, self.checkpointing = run, p, bf16, checkpointing
        self.cuda = cuda  # bf16 traces follow CUDA's autocast (CudaAutocastPolicy)
        self.seq_len = run.train.seq_len
        self.chunk = _chunk_tokens(p.cfg.vocab_size)
        self._cache: dict[int, _Step] = {}
        self.estimated = ""  # why the terms are estimated, not traced (see _estimate)

    def points(self, b: int) -> tuple[int, ...]:
        """The micro-batches whose traces give micro-batch ``b``'s: two on its side of the
        chunked loss's boundary (or ``b`` itself where it is one of them)."""
        start = 1
        if self.chunk is not None and b * self.seq_len > self.chunk:
            start = self.chunk // self.seq_len + 1
        return (b,) if b <= start + 1 else (start, start + 1)

    def at(self, b: int) -> _Step:
        pts = self.points(b)
        if len(pts) == 1:
            return self.trace(b)
        s1, s2 = self.trace(pts[0]), self.trace(pts[1])
        d = b - pts[0]

        def ext(a: int, c: int) -> int:
            return max(0, a + (c - a) * d)

        return _Step(ext(s1.activations, s2.activations), ext(s1.loss, s2.loss),
                     ext(s1.eval, s2.eval))

    def trace(self, b: int) -> _Step:
        if b not in self._cache:
            self._cache[b] = self._trace(b)
        return self._cache[b]

    def _trace(self, b: int) -> _Step:
        from torch._subclasses.fake_tensor import FakeTensorMode

        try:
            with FakeTensorMode(), torch.random.fork_rng(devices=[]):
                model = _fresh_model(self.p, fake=True)
                idx = torch.randint(0, self.p.cfg.vocab_size, (b, self.seq_len))
                return _measure(model, idx, self.p.method, self.bf16, self.checkpointing,
                                self.cuda)
        except ModbenchError:
            raise
        except Exception as e:  # a forward that reads tensor values cannot run on fakes
            first = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}" if str(e) else ""
            return self._estimate(b, first)

    def _estimate(self, b: int, why: str) -> _Step:
        """A method whose forward reads tensor values (``.item()``, data-dependent shapes:
        PowerNorm's update count, MoE's expert split) cannot run on fake tensors. Its terms
        are then the baseline's, traced at this shape, times the method's ratio to the
        baseline measured on real tensors at the ``tiny`` preset's shape (kilobytes)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from modbench.config import resolve
        from modbench.methods.build import plan as plan_model

        base_cfg = copy.deepcopy(self.p.cfg)
        base_cfg.method = "baseline"
        base_plan = plan_model(base_cfg)
        try:
            with FakeTensorMode(), torch.random.fork_rng(devices=[]):
                model = _fresh_model(base_plan, fake=True)
                idx = torch.randint(0, base_cfg.vocab_size, (b, self.seq_len))
                base = _measure(model, idx, "baseline", self.bf16, self.checkpointing,
                                self.cuda)
            small = []
            for method in (self.p.method, "baseline"):
                tiny = plan_model(resolve("tiny", method=method).model)
                gen = torch.Generator().manual_seed(0)
                idx = torch.randint(0, tiny.cfg.vocab_size, (2, tiny.cfg.max_seq_len),
                                    generator=gen)
                small.append(_measure(tiny.build(0, "cpu"), idx, method, self.bf16,
                                      self.checkpointing, self.cuda))
        except ModbenchError:
            raise
        except Exception as e:
            raise ModbenchError(
                f"cannot plan the memory of method '{self.p.method}': its forward could not be "
                f"traced without memory ({why}) nor estimated ({type(e).__name__}); give "
                "train.micro_batch_size as a number") from None
        self.estimated = why or "estimated"

        def scale(x: int, m: int, ref: int) -> int:
            return int(x * m / ref) if ref > 0 else x

        return _Step(scale(base.activations, small[0].activations, small[1].activations),
                     scale(base.loss, small[0].loss, small[1].loss),
                     scale(base.eval, small[0].eval, small[1].eval))


def _fresh_model(p: Plan, fake: bool) -> Transformer:
    """The plan's model, initialised as :meth:`Plan.build` does, without moving it (a fake
    model cannot be moved: FakeTensorMode refuses to swap a parameter)."""
    model = Transformer(p.cfg, p.spec)
    model.init_weights()
    for m in p.methods:
        m.post_init(model)
    model.methods = p.methods  # type: ignore[assignment]
    return model


def _measure(model: Transformer, idx: torch.Tensor, method: str, bf16: bool,
             checkpointing: Checkpointing | None, cuda: bool = True) -> _Step:
    """One training step's transient bytes above the resident state (the weights, buffers
    and, as from a run's second micro-batch, the gradients), split at the final norm into
    the body's and the loss head's; then validation's and probe scoring's, without
    gradients (a step's gradients are freed by then)."""
    if checkpointing is not None:
        checkpointing(model, method)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:  # a later micro-batch's state: gradients exist already
        q.grad = torch.zeros_like(q)
    autocast: Callable[[], Any] = contextlib.nullcontext
    if bf16:
        def autocast() -> Any:
            stack = contextlib.ExitStack()
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            if cuda:
                stack.enter_context(CudaAutocastPolicy())
            return stack
    meter = LiveBytes()
    base = meter.hold([*model.parameters(), *model.buffers(),
                       *(q.grad for q in params if q.grad is not None)])
    at_head: list[int] = []
    hook = model.final_norm.register_forward_hook(lambda *_: at_head.append(meter.mark()))
    with meter:
        with autocast():
            lm, aux = _train_loss(model, idx)
        head_peak = meter.sub_peak()
        (lm + aux).backward()
        del lm, aux
    hook.remove()
    step_peak = meter.peak - base
    loss = max(0, head_peak - at_head[-1]) if at_head else 0
    for q in params:
        q.grad = None
    model.eval()
    ev = LiveBytes()
    ev_base = ev.hold([*model.parameters(), *model.buffers()])
    with ev, torch.no_grad(), autocast():
        _eval_loss(model, idx)  # validation: the summed loss
        model(idx)  # probe scoring: logits
    return _Step(step_peak - loss, loss, ev.peak - ev_base)


def _train_loss(model: Transformer, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the engine trains on (``LocalEngine.backward``): ``micro_loss`` where the model
    sums its loss itself, else ``lm_loss`` of the full logits."""
    micro_loss = getattr(loss_mod, "micro_loss", None)
    if micro_loss is not None:
        lm, aux = micro_loss(model, idx, None, 0, n_micro=1)
        return lm, aux
    logits, aux = model(idx, with_aux=True)
    return loss_mod.lm_loss(logits, idx), aux


def _eval_loss(model: Transformer, idx: torch.Tensor) -> torch.Tensor:
    """What validation computes (``runtime.loss.validation_loss``)."""
    if getattr(loss_mod, "micro_loss", None) is not None:
        out: torch.Tensor = model(idx, loss=True)
        return out
    return loss_mod.lm_loss(model(idx), idx)


# ----------------------------------------------------------------- the resident state


def _resident(p: Plan, optimizer: str) -> tuple[int, int, int, dict[str, int]]:
    """(parameters, weight bytes, optimizer bytes, FSDP unit sizes in bytes) of a plan's
    model, counted on the meta device."""
    with torch.device("meta"):
        model = Transformer(p.cfg, p.spec)
    seen: set[int] = set()
    params = []
    for q in model.parameters():
        if id(q) not in seen:
            seen.add(id(q))
            params.append(q)
    n = sum(q.numel() for q in params if q.requires_grad)
    weights = sum(q.numel() for q in params) * FP32
    if optimizer == "muon":
        outer: set[int] = set()
        for name, m in model.named_modules():
            if isinstance(m, nn.Embedding) or name.split(".")[-1] == "head":
                outer.update(id(q) for q in m.parameters())
        muon = sum(q.numel() for q in params if q.requires_grad and q.ndim == 2
                   and min(q.shape) > 1 and id(q) not in outer)
        opt = (muon + 2 * (n - muon)) * FP32
    else:
        opt = 2 * n * FP32
    # FSDP2 units (train.distributed._fully_shard): each block, the embedding where the head
    # is untied, the root (the rest: head, norms, the stream's parameters)
    units: dict[str, int] = {}
    for i, block in enumerate(getattr(model, "blocks", [])):
        units[f"blocks.{i}"] = sum(q.numel() for q in block.parameters()) * FP32
    if getattr(model, "head", None) is not None:
        units["embed"] = sum(q.numel() for q in model.embed.parameters()) * FP32
    units["root"] = weights - sum(units.values())
    return n, weights, opt, units


# ----------------------------------------------------------------------- the planner


def _device(device: Accelerator | int) -> tuple[str, int]:
    if isinstance(device, Accelerator):
        return device.key, device.memory_bytes
    if isinstance(device, bool) or not isinstance(device, int) or device <= 0:
        raise ModbenchError(f"device memory must be a positive number of bytes, got {device!r}")
    return f"{device / 1e9:.0f}GB", int(device)


def usable_bytes(device_bytes: int, margin: float = MARGIN, device_type: str = "cuda") -> int:
    """What a plan may fill on a device of ``device_bytes``: less ``margin`` of it and
    :data:`FIXED_ALLOWANCE` for ``device_type``."""
    fixed = FIXED_ALLOWANCE.get(device_type, FIXED_ALLOWANCE["cuda"])
    return max(0, int(device_bytes * (1.0 - margin)) - fixed)


@dataclass
class _Context:
    """A run planned once (config, methods, resident state, traces) for many micro-batches."""

    run: RunConfig
    p: Plan
    tracer: _Tracer
    params: int
    weights: int
    optimizer: int
    units: dict[str, int]
    bf16: bool
    device_type: str
    # DDP's gradients are views of its buckets (train.distributed wraps it so): one copy
    bucket_view: bool = True


def check_plannable(cfg: RunConfig) -> None:
    """Refuse, by arithmetic on the config and before any model is built or traced, a run
    whose plan would take hours (more than :data:`MAX_PLANNED_LAYERS` layers to trace) or a
    batch whose micro-batches cannot be searched (more than :data:`MAX_PLANNED_BATCH`
    sequences)."""
    layers = cfg.model.n_layers
    if layers > MAX_PLANNED_LAYERS:
        raise ModbenchError(
            f"cannot plan the memory of model.n_layers={layers}: a plan traces every layer's "
            f"forward and backward (about 0.4 s a layer on a CPU core) and traces at most "
            f"{MAX_PLANNED_LAYERS}; plan a model of at most {MAX_PLANNED_LAYERS} layers (a "
            "run given train.micro_batch_size as a number trains without a plan)")
    batch = cfg.train.batch_size
    if batch > MAX_PLANNED_BATCH:
        raise ModbenchError(
            f"cannot plan train.batch_size={batch}: a plan searches the micro-batches of at "
            f"most {MAX_PLANNED_BATCH} sequences a step; use a smaller batch")


def _context(cfg: RunConfig, device_type: str,
             checkpointing: Checkpointing | None) -> _Context:
    check_plannable(cfg)
    run, p = plan_run(cfg)
    prec = run.recipe.precision
    bf16 = bf16_forward(prec, device_type)
    if run.train.activation_checkpointing and checkpointing is None:
        raise ModbenchError("planning train.activation_checkpointing=true needs the "
                            "trainer's checkpointing (modbench plan and the trainer pass it)")
    mode = run.train.activation_checkpointing
    ckpt: Checkpointing | None = None
    if mode and checkpointing is not None:
        ckpt = functools.partial(checkpointing, mode=mode)  # the run's mode (full, every:K, attn)
    n, weights, opt, units = _resident(p, run.recipe.optimizer)
    return _Context(run, p, _Tracer(run, p, bf16, ckpt, cuda=device_type == "cuda"), n,
                    weights, opt, units, bf16, device_type)


def _plan(ctx: _Context, key: str, device_bytes: int, micro_batch: int, nproc: int,
          parallel: str, ensembles: int, margin: float) -> MemoryPlan:
    if micro_batch < 1:
        raise ModbenchError(f"the micro-batch must be at least 1, got {micro_batch}")
    if nproc < 1:
        raise ModbenchError(f"the number of processes must be at least 1, got {nproc}")
    if ensembles < 1:
        raise ModbenchError(f"the number of stacked seeds must be at least 1, got {ensembles}")
    if parallel not in ("ddp", "fsdp"):
        raise ModbenchError(f"parallel must be ddp or fsdp, got {parallel!r}")
    run = ctx.run
    step = ctx.tracer.at(micro_batch)
    shard = nproc if parallel == "fsdp" and nproc > 1 else 1
    weights = math.ceil(ctx.weights / shard)
    grads = math.ceil(ctx.params * FP32 / shard)
    opt = math.ceil(ctx.optimizer / shard)
    gathered = 0
    # DDP's gradients: with bucket views they are its all-reduce buckets (one copy, never
    # freed between steps); without, the buckets are a second copy of them
    ddp = nproc > 1 and parallel == "ddp"
    views = ddp and ctx.bucket_view
    if ddp and not views:
        gathered = ctx.params * FP32
    elif shard > 1:
        cores = sorted((v for k, v in ctx.units.items() if k != "root"), reverse=True)
        biggest = cores[0] if cores else 0
        # unsharded, in the dtype FSDP gathers in (train.fsdp_param_dtype): the root through
        # the forward, two units (running, prefetched); and one unit's full gradient, in fp32
        # for its reduce-scatter; less their own fp32 shards
        scale = 0.5 if fsdp_gathers_bf16(run.train.fsdp_param_dtype, ctx.bf16) else 1.0
        full = (math.ceil(scale * (ctx.units["root"] + 2 * biggest))
                + max(biggest, ctx.units["root"]))
        gathered = max(0, full - math.ceil((ctx.units["root"] + 2 * biggest) / shard))
    transient = step.activations + step.loss
    stacked = 0
    if ensembles > 1:
        k = ensembles
        # K members' state, stack_module_state's stacked weights and their gradients each
        # micro-batch, and the vmapped step's activations K times over
        stacked = ((k - 1) * (weights + grads + opt) + 2 * k * weights
                   + (k - 1) * transient)
    # validation and probe scoring run between steps: no step transient, gradients freed
    # (but DDP's bucket views, which stay)
    ev = max(0, step.eval * ensembles - ((0 if views else grads) + transient * ensembles))
    terms = {"weights": weights, "gradients": grads, "optimizer": opt,
             "activations": step.activations, "loss": step.loss, "eval": ev,
             "ensembles": stacked, "parallel": gathered}
    peak = sum(terms.values())
    usable = usable_bytes(device_bytes, margin, ctx.device_type)
    return MemoryPlan(
        preset=run.preset, method=ctx.p.method, device=key, device_bytes=device_bytes,
        nproc=nproc, parallel=parallel, micro_batch=micro_batch,
        batch_size=run.train.batch_size, seq_len=run.train.seq_len, ensembles=ensembles,
        activation_checkpointing=run.train.activation_checkpointing, peak_bytes=peak,
        fits=peak <= usable, terms=terms, usable_bytes=usable,
        host_bytes=_host_bytes(ctx.weights, ctx.optimizer, nproc), params=ctx.params,
        precision="bf16" if ctx.bf16 else "fp32", device_type=ctx.device_type,
        estimated=ctx.tracer.estimated)


def _device_type(cfg: RunConfig, device: Accelerator | int, device_type: str | None) -> str:
    if device_type is not None:
        return device_type
    if isinstance(device, Accelerator):
        return "cpu" if device.key == "cpu" else "cuda"
    return "cpu" if cfg.train.device == "cpu" else "cuda"


def plan_memory(cfg: RunConfig, *, device: Accelerator | int, micro_batch: int,
                nproc: int = 1, parallel: str = "ddp", ensembles: int = 1,
                margin: float = MARGIN, device_type: str | None = None,
                checkpointing: Checkpointing | None = None,
                bucket_view: bool = True) -> MemoryPlan:
    """The peak memory of one process of run ``cfg`` at ``micro_batch`` sequences a
    forward, on ``device`` (an accelerator of :mod:`modbench.runtime.gpus`, or its memory in
    bytes), with ``nproc`` processes (``parallel`` ddp or fsdp) and ``ensembles`` seeds
    stacked. ``device_type`` (``cuda``/``cpu``: the precision ``recipe.precision=auto``
    takes) defaults to what ``device`` is. ``checkpointing``: the trainer's
    ``apply_activation_checkpointing``, needed where the run sets it. ``bucket_view``: DDP's
    gradients are views of its buckets, as the trainer wraps it (False: DDP's default, a
    second copy of the gradients in the buckets)."""
    key, nbytes = _device(device)
    ctx = _context(cfg, _device_type(cfg, device, device_type), checkpointing)
    ctx.bucket_view = bucket_view
    return _plan(ctx, key, nbytes, micro_batch, nproc, parallel, ensembles, margin)


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, largest first (trial division up to its square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def _some(numbers: list[int], most: int = 8) -> str:
    """``1, 2, 4 or 8``: a few numbers, smallest first, in words."""
    shown = sorted(numbers)[:most]
    words = [str(x) for x in shown] + (["…"] if len(numbers) > most else [])
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def check_split(cfg: RunConfig, nproc: int, *, flag: str = "the number of processes") -> int:
    """The sequences each of ``nproc`` processes trains on a step, or one line saying why
    ``nproc`` cannot split ``train.batch_size`` and the counts that can."""
    batch = cfg.train.batch_size
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ModbenchError(f"{flag} must be at least 1 (one process a GPU), got {nproc}")
    if batch % nproc:
        fits = [d for d in divisors(batch) if d <= 64]
        raise ModbenchError(
            f"train.batch_size={batch} does not split evenly over {nproc} processes; use "
            f"{_some(fits)} processes (the divisors of {batch} up to 64), or a batch size "
            f"divisible by {nproc} (--set train.batch_size=N)")
    return batch // nproc


def check_micro_batch(cfg: RunConfig, micro_batch: int, nproc: int = 1) -> None:
    """Refuse, in one line naming those that are, a micro-batch that is not a divisor of the
    sequences a process trains on a step (the trainer splits a process's share of the batch
    into equal micro-batches)."""
    local = check_split(cfg, nproc)
    if micro_batch < 1 or local % micro_batch:
        who = "the process" if nproc == 1 else f"each of the {nproc} processes"
        raise ModbenchError(
            f"a micro-batch of {micro_batch} sequences does not divide the {local} sequences "
            f"{who} trains on a step (train.batch_size={cfg.train.batch_size}); use "
            f"{_some(divisors(local))}, or leave the micro-batch out to plan the largest "
            "that fits")


def choose_micro_batch(cfg: RunConfig, device_bytes: Accelerator | int, *, nproc: int = 1,
                       parallel: str = "ddp", ensembles: int = 1, margin: float = MARGIN,
                       device_type: str | None = None,
                       checkpointing: Checkpointing | None = None) -> MemoryPlan:
    """The plan at the largest micro-batch that divides a process's share of the batch
    (``train.batch_size / nproc``) and fits ``device_bytes`` less the margin
    (:func:`usable_bytes`: ``margin`` of the device and :data:`FIXED_ALLOWANCE`).

    Raises :class:`ModbenchError` (one line: the biggest term and what to do) where even a
    micro-batch of one sequence does not fit."""
    key, nbytes = _device(device_bytes)
    check_split(cfg, nproc)
    ctx = _context(cfg, _device_type(cfg, device_bytes, device_type), checkpointing)
    best = _choose(ctx, key, nbytes, nproc, parallel, ensembles, margin)
    if best is not None:
        return best
    one = _plan(ctx, key, nbytes, 1, nproc, parallel, ensembles, margin)
    raise ModbenchError(refusal(one))


def _choose(ctx: _Context, key: str, nbytes: int, nproc: int, parallel: str, ensembles: int,
            margin: float) -> MemoryPlan | None:
    """The plan at the largest fitting divisor of the per-process batch, or None."""
    cands = divisors(ctx.run.train.batch_size // nproc)
    lo, hi = 0, len(cands) - 1  # the fitting ones are a suffix of cands (peak grows with B)
    best: MemoryPlan | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        mp = _plan(ctx, key, nbytes, cands[mid], nproc, parallel, ensembles, margin)
        if mp.fits:
            best, hi = mp, mid - 1
        else:
            lo = mid + 1
    return best


@dataclass
class Layout:
    """How a run's processes hold it on a device (:func:`layout`): the parallel mode they
    train with (``train.parallel``, ``auto`` resolved) and the memory plan at the micro-batch
    the run trains at (None where nothing needed planning)."""

    parallel: str  # ddp | fsdp (with one process: ddp, which the trainer then ignores)
    plan: MemoryPlan | None = None
    chosen: bool = False  # train.parallel=auto chose it by the plan
    rejected: list[MemoryPlan] = field(default_factory=list)  # what auto tried before it


class DoesNotFit(ModbenchError):
    """A run that no layout :func:`layout` may take fits: the message says why and what to
    do; :attr:`plan` is the smallest peak it tried (what the run needs at the least) and
    :attr:`advice` what to do, by itself (``use ...``)."""

    def __init__(self, message: str, plan: MemoryPlan, advice: str) -> None:
        super().__init__(message)
        self.plan = plan
        self.advice = advice


def auto_parallel(parallel: str, nproc: int, device_type: str) -> str | None:
    """``train.parallel`` for ``nproc`` processes on ``device_type``: ``ddp`` and ``fsdp``
    are themselves; ``auto`` is ``ddp`` with one process (nothing to spread: the value is not
    read) and on the CPU (gloo: the processes share the host's memory, no device memory to
    plan against), else None: the memory plan decides (:func:`layout`)."""
    if parallel != "auto":
        return parallel
    return "ddp" if nproc < 2 or device_type == "cpu" else None


def layout(cfg: RunConfig, device: Accelerator | int, *, nproc: int = 1, ensembles: int = 1,
           margin: float = MARGIN, device_type: str | None = None,
           checkpointing: Checkpointing | None = None, check: bool = False) -> Layout:
    """How ``nproc`` processes of run ``cfg`` hold it on ``device``, as the trainer lays
    them out: ``train.parallel`` (``auto``: DDP where its plan fits the device, else FSDP
    where its plan does; :func:`auto_parallel` for one process and the CPU) at
    ``train.micro_batch_size`` (``auto``: the largest that fits; a number: it; null: a
    process's whole share of the batch). Plans only what needs it (a micro-batch or a mode
    to choose), or everything with ``check`` (a study's check of its jobs).

    Raises :class:`DoesNotFit` (one line: the peaks against the usable memory, and what to
    do) where nothing it may take fits; with ``train.parallel`` fixed and the micro-batch
    ``auto``, the line :func:`choose_micro_batch` gives."""
    tc = cfg.train
    dt = _device_type(cfg, device, device_type)
    fixed = auto_parallel(tc.parallel, nproc, dt)
    if fixed is not None and tc.micro_batch_size != "auto" and not check:
        return Layout(fixed)
    key, nbytes = _device(device)
    check_split(cfg, nproc)
    ctx = _context(cfg, dt, checkpointing)
    tried: list[MemoryPlan] = []
    # FSDP2 gives each parameter to one unit: a model whose layers share weights stays DDP
    shares = fixed is None and _shares_layers(ctx.p)
    for mode in (fixed,) if fixed is not None else ("ddp",) if shares else ("ddp", "fsdp"):
        mp = _at_run_micro_batch(ctx, key, nbytes, nproc, mode, ensembles, margin)
        if mp.fits:
            return Layout(mode, mp, chosen=fixed is None, rejected=tried)
        tried.append(mp)
    least = min(tried, key=lambda t: t.peak_bytes)
    advice = _advice(least, shards=not shares)
    if fixed is not None and tc.micro_batch_size == "auto":
        raise DoesNotFit(refusal(least), least, advice)
    raise DoesNotFit(_misfit(tried, fixed is None, advice), least, advice)


def _shares_layers(p: Plan) -> bool:
    """Whether the plan's model has layers that share weights (the ``tie`` slot), which
    FSDP2 cannot shard (:mod:`modbench.train.distributed` refuses them); built on the meta
    device."""
    from modbench.model.spec import shares_parameters

    with torch.device("meta"):
        return shares_parameters(Transformer(p.cfg, p.spec))


def _at_run_micro_batch(ctx: _Context, key: str, nbytes: int, nproc: int, parallel: str,
                        ensembles: int, margin: float) -> MemoryPlan:
    """The plan at the micro-batch the run trains at: ``train.micro_batch_size`` (null: a
    process's whole share), or for ``auto`` the largest that fits (else micro-batch 1)."""
    mb = ctx.run.train.micro_batch_size
    if mb == "auto":
        best = _choose(ctx, key, nbytes, nproc, parallel, ensembles, margin)
        return best or _plan(ctx, key, nbytes, 1, nproc, parallel, ensembles, margin)
    size = mb if isinstance(mb, int) else ctx.run.train.batch_size // nproc
    return _plan(ctx, key, nbytes, size, nproc, parallel, ensembles, margin)


def _misfit(tried: list[MemoryPlan], auto: bool, advice: str) -> str:
    """The one line that says no plan :func:`layout` tried fits, and what to do."""
    mp = min(tried, key=lambda t: t.peak_bytes)
    where = f"{mp.nproc} x {mp.device}" if mp.nproc > 1 else f"one {mp.device}"
    at = (f"at micro-batch {mp.micro_batch}" if mp.micro_batch > 1
          else "even at micro-batch 1")
    if auto and len(tried) > 1:
        peaks = " nor ".join(f"{t.parallel.upper()} (peak {gb(t.peak_bytes)})" for t in tried)
        head = f"train.parallel=auto: {mp.preset} {mp.method} fits neither {peaks}"
    elif auto:  # DDP only: FSDP cannot shard layers that share weights
        head = (f"train.parallel=auto: {mp.preset} {mp.method} (its layers share weights, "
                f"which FSDP cannot shard) does not fit DDP (peak {gb(mp.peak_bytes)})")
    else:
        head = f"{mp.preset} {mp.method} does not fit (peak {gb(mp.peak_bytes)})"
    big = mp.largest_term()
    return (f"{head} on {where} {at}, against {gb(mp.usable_bytes)} usable a process "
            f"(largest term: {big} {gb(mp.terms[big])}); {advice}")


def _advice(mp: MemoryPlan, shards: bool = True) -> str:
    """What makes a run that does not fit fit (``use ... or ...``), from its plan;
    ``shards``: whether FSDP may shard it (not where its layers share weights)."""
    todo = []
    if mp.ensembles > 1:
        todo.append("fewer stacked seeds")
    if mp.micro_batch > 1:
        todo.append("a smaller train.micro_batch_size (auto: the largest that fits)")
    if shards:
        todo.append("more processes with train.parallel=fsdp or auto" if mp.nproc > 1
                    else "several processes (GPUs) with train.parallel=fsdp or auto")
    if not mp.activation_checkpointing:
        todo.append("train.activation_checkpointing=true")
    todo.append("a smaller model")
    return f"use {', '.join(todo[:-1])} or {todo[-1]}" if len(todo) > 1 else f"use {todo[0]}"


def plan_or_needs(cfg: RunConfig, device: Accelerator | int, *, micro_batch: int | None = None,
                  nproc: int = 1, parallel: str = "ddp", ensembles: int = 1,
                  margin: float = MARGIN, device_type: str | None = None,
                  checkpointing: Checkpointing | None = None) -> tuple[MemoryPlan, str]:
    """``modbench plan``'s answer for one run: the plan (at ``micro_batch``, else at the
    largest that fits, else at 1) and a note: empty where it fits, else what does fit (a
    smaller micro-batch on these processes; else the fewest FSDP processes of this device
    that hold it, at their largest micro-batch), or what else to change where nothing up to
    64 processes does. A ``micro_batch`` or ``nproc`` the trainer could not run (not a
    divisor of a process's share of the batch) is refused in one line."""
    key, nbytes = _device(device)
    check_split(cfg, nproc, flag="--nproc")
    if micro_batch is not None:
        check_micro_batch(cfg, micro_batch, nproc)
    ctx = _context(cfg, _device_type(cfg, device, device_type), checkpointing)
    if micro_batch is not None:
        mp = _plan(ctx, key, nbytes, micro_batch, nproc, parallel, ensembles, margin)
        if mp.fits:
            return mp, ""
        smaller = _choose(ctx, key, nbytes, nproc, parallel, ensembles, margin)
        if smaller is not None:
            return mp, (f"does not fit at micro-batch {micro_batch}; micro-batch "
                        f"{smaller.micro_batch} does (peak {gb(smaller.peak_bytes)} a "
                        "process): leave --micro-batch out to plan the largest that fits")
    else:
        mp = _choose(ctx, key, nbytes, nproc, parallel, ensembles, margin) or _plan(
            ctx, key, nbytes, 1, nproc, parallel, ensembles, margin)
        if mp.fits:
            return mp, ""
    for n in (2, 4, 8, 16, 32, 64):
        if (n <= nproc and parallel == "fsdp") or cfg.train.batch_size % n:
            continue
        other = _choose(ctx, key, nbytes, n, "fsdp", ensembles, margin)
        if other is not None:
            return mp, (f"needs --nproc {n} --parallel fsdp (micro-batch {other.micro_batch}, "
                        f"peak {gb(other.peak_bytes)} a process)")
    return mp, _beyond(ctx, key, nbytes, nproc if parallel == "fsdp" else 1, ensembles,
                       margin)


def _beyond(ctx: _Context, key: str, nbytes: int, nproc: int, ensembles: int,
            margin: float) -> str:
    """What to change for a run that no number of FSDP processes dividing its batch holds
    (up to 64, or ``nproc``): the fewest that would hold it at micro-batch 1 if the batch
    split over them; else, at the most, the largest term and the changes that shrink it."""
    batch = ctx.run.train.batch_size
    most = max(64, nproc)
    for n in (2, 4, 8, 16, 32, 64):
        if n > nproc and _plan(ctx, key, nbytes, 1, n, "fsdp", ensembles, margin).fits:
            return (f"needs {n} FSDP processes (at micro-batch 1), over which "
                    f"train.batch_size={batch} does not split; use a batch size divisible by "
                    f"{n} and --nproc {n} --parallel fsdp")
    mp = _plan(ctx, key, nbytes, 1, most, "fsdp", ensembles, margin)
    big = mp.largest_term()
    todo = []
    if ensembles > 1:
        todo.append("fewer stacked seeds")
    if big in ("activations", "loss", "eval") and not mp.activation_checkpointing:
        todo.append("train.activation_checkpointing=true")
    todo.append("a smaller model")
    return (f"does not fit {most} FSDP processes either, even at micro-batch 1 (peak "
            f"{gb(mp.peak_bytes)} > {gb(mp.usable_bytes)} usable a process, largest term: "
            f"{big} {gb(mp.terms[big])}); use {' or '.join(todo)}")


def max_ensembles(cfg: RunConfig, device: Accelerator | int, k: int, *,
                  device_type: str | None = None) -> int:
    """The most of ``k`` seeds of run ``cfg`` that one device holds stacked in one process
    (:class:`modbench.train.engine.LocalEngine`): ``k`` where the plan fits ``k`` members
    (their weights, gradients and optimizer state, the stacked copies, and ``k`` times the
    step's activations) at ``train.micro_batch_size`` (``auto``: at some micro-batch), else
    the largest fewer; 1 where none stack. ``train.device_memory_gb`` overrides ``device``."""
    if cfg.train.activation_checkpointing:
        return 1  # the trainer does not stack seeds that recompute their activations
    if cfg.train.device_memory_gb is not None:
        device = int(cfg.train.device_memory_gb * 1e9)
    key, nbytes = _device(device)
    ctx = _context(cfg, _device_type(cfg, device, device_type), None)
    mb = cfg.train.micro_batch_size
    for n in range(k, 1, -1):
        if isinstance(mb, int):
            if _plan(ctx, key, nbytes, mb, 1, "ddp", n, MARGIN).fits:
                return n
        elif mb == "auto":
            if _choose(ctx, key, nbytes, 1, "ddp", n, MARGIN) is not None:
                return n
        elif _plan(ctx, key, nbytes, cfg.train.batch_size, 1, "ddp", n, MARGIN).fits:
            return n
    return 1


def refusal(mp: MemoryPlan) -> str:
    """The one line that says a plan does not fit at micro-batch 1, and what to do."""
    big = mp.largest_term()
    where = f"{mp.nproc} x {mp.device}" if mp.nproc > 1 else f"one {mp.device}"
    todo = []
    if mp.ensembles > 1:
        todo.append("fewer stacked seeds")
    if mp.parallel != "fsdp" or mp.nproc == 1:
        todo.append("--nproc N with train.parallel=fsdp")
    else:
        todo.append("more processes (--nproc)")
    if not mp.activation_checkpointing:
        todo.append("train.activation_checkpointing=true")
    todo.append("a smaller model")
    return (f"{mp.preset} {mp.method} does not fit {where} even at micro-batch 1: peak "
            f"{gb(mp.peak_bytes)} > {gb(mp.usable_bytes)} usable (largest term: {big} "
            f"{gb(mp.terms[big])}); use {', '.join(todo[:-1])} or {todo[-1]}")


def gb(n: int | float) -> str:
    """Bytes in GB (10^9) to a tenth; below 0.1 GB in MB (10^6), so no peak reads 0.0 GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


# ------------------------------------------------------------------------- host memory


def _host_bytes(weights: int, optimizer: int, nproc: int) -> int:
    # rank 0 gathers the full state dict (fp32 weights and optimizer state) on its CPU to
    # write a checkpoint; every process builds the full model on the CPU before moving it
    return (weights + optimizer) + nproc * (weights + HOST_RUNTIME_BYTES)


def host_memory_bytes(cfg: RunConfig, nproc: int = 1) -> int:
    """Host memory (bytes) the ``nproc`` processes of run ``cfg`` need on one node together:
    rank 0's gathered checkpoint (fp32 weights and optimizer state) plus, per process, the
    model as built on the CPU and :data:`HOST_RUNTIME_BYTES` (the SLURM executor's
    ``mem_gb``). Counted without tracing."""
    run, p = plan_run(cfg)
    _, weights, opt, _ = _resident(p, run.recipe.optimizer)
    return _host_bytes(weights, opt, max(1, nproc))


def checkpoint_bytes(cfg: RunConfig) -> int:
    """Bytes a checkpoint of run ``cfg`` writes: its fp32 weights and optimizer state (what
    rank 0 gathers and saves; the SLURM executor's signal lead time). Counted without
    tracing."""
    run, p = plan_run(cfg)
    _, weights, opt, _ = _resident(p, run.recipe.optimizer)
    return weights + opt


def with_micro_batch(cfg: RunConfig, micro_batch: int | None) -> RunConfig:
    """A copy of ``cfg`` with ``train.micro_batch_size`` set."""
    out = copy.deepcopy(cfg)
    out.train.micro_batch_size = micro_batch
    return out


__all__ = ["FIXED_ALLOWANCE", "MARGIN", "MAX_PLANNED_BATCH", "MAX_PLANNED_LAYERS", "DoesNotFit",
           "Layout", "LiveBytes", "MemoryPlan", "auto_parallel", "check_micro_batch",
           "check_plannable", "check_split", "checkpoint_bytes", "choose_micro_batch", "divisors",
           "host_memory_bytes", "layout", "max_ensembles", "plan_memory", "plan_or_needs",
           "refusal", "usable_bytes"]
