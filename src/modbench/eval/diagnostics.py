"""``modbench diagnose``: what a trained run's layers do, measured with hooks only.

Every figure is computed on the run's own validation batches by forward/backward hooks on the
modules of the built decoder (found through ``model.blocks`` and ``model.parts``); no method or
model code is touched. docs/diagnostics.md describes each figure, how it is computed and its
source; the JSON written by :func:`modbench.report.diagnostics.diagnose` is :func:`diagnose_run`'s
result::

    {"run", "method", "preset", "seed", "step", "batches", "sequences", "tokens",
     "validation_loss", "stream_is_single_lane",
     "layers": [{"layer": 0, "angular_distance", "skip_delta_loss", "skip_mode", "grad_norm",
                 "attn": {SUBLAYER figures, "attn_entropy", "attn_sink"},
                 "ffn":  {SUBLAYER figures, "hidden_max_abs", "hidden_excess_kurtosis"}}, ...],
     "final": {"rms", "variance", "max_abs", "excess_kurtosis"},
     "weights": [{"name", "shape", "layer", "spectral_norm", "condition_number", "alpha",
                  "alpha_tail"}, ...],
     "quantization": {"reference_loss", "w4_per_channel": {"loss", "delta"},
                      "w4_group": {"loss", "delta", "group_size"}, "a8_per_token": {...}},
     "null_reasons": {"layers.1.attn.attn_entropy": "why it is null", ...},
     "notes": ["...", ...]}

SUBLAYER figures: ``rms``, ``variance``, ``max_abs``, ``excess_kurtosis`` (of the sublayer's
input, the residual stream as it reads it), ``angular_distance`` (input to the next sublayer's
input), ``update_norm``, ``relative_update``, ``update_share``. A figure that cannot be
computed faithfully for a method is ``null`` and ``null_reasons`` says why, under its dotted
path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from modbench.errors import ModbenchError
from modbench.model.attention import ExplicitKernel, repeat_kv
from modbench.model.spec import LINEAR_ROLES, parts_of
from modbench.runtime.loss import lm_loss

DEFAULT_BATCHES = 8  # cpu-small: 128 validation sequences, its eval_sequences
WEIGHT_BITS = 4
ACT_BITS = 8
GROUP_SIZE = 128
ALPHA_TAIL = 0.5  # the power-law fit uses the top half of the eigenvalues
ALPHA_MIN_EIGS = 8  # fewer eigenvalues than this: no fit
ATTN_CHUNK = 1 << 26  # at most this many attention weights materialised at once
BLOCK_ROLES = tuple(r for r in LINEAR_ROLES if r != "head")


# ----------------------------------------------------------------------- missing values


@dataclass(frozen=True)
class Missing:
    """A figure that cannot be computed faithfully: written as ``null`` with ``reason``."""

    reason: str


class Unavailable(Exception):
    """Raised where a figure cannot be computed; the message is the reason."""


def finalise(obj: Any, path: str = "", reasons: dict[str, str] | None = None
             ) -> tuple[Any, dict[str, str]]:
    """``obj`` with every :class:`Missing` and every non-finite float replaced by ``None``,
    and the reasons by dotted path (list items by index)."""
    reasons = {} if reasons is None else reasons

    def walk(o: Any, p: str) -> Any:
        if isinstance(o, Missing):
            reasons[p] = o.reason
            return None
        if isinstance(o, float) and not math.isfinite(o):
            reasons[p] = f"the value is not finite ({o}): the model's numbers overflowed"
            return None
        if isinstance(o, dict):
            return {k: walk(v, f"{p}.{k}" if p else str(k)) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v, f"{p}.{i}" if p else str(i)) for i, v in enumerate(o)]
        return o

    return walk(obj, path), reasons


# ------------------------------------------------------------------- numerical pieces


@dataclass
class Moments:
    """Count, mean, central moment sums M2..M4 and max |x| of every entry of the tensors
    added, pooled, in float64; chunks are merged with the pairwise update of Chan et al. and
    Pébay (2008), so no sum of raw powers is ever formed."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    m3: float = 0.0
    m4: float = 0.0
    max_abs: float = 0.0

    def add(self, x: torch.Tensor) -> None:
        xd = x.detach().reshape(-1).double()
        nb = xd.numel()
        if nb == 0:
            return
        mb = float(xd.mean())
        c = xd - mb
        c2 = c * c
        m2b, m3b, m4b = float(c2.sum()), float((c2 * c).sum()), float((c2 * c2).sum())
        self.max_abs = max(self.max_abs, float(xd.abs().max()))
        na, n = self.n, self.n + nb
        d = mb - self.mean
        m2a, m3a = self.m2, self.m3
        self.m4 += (m4b + d ** 4 * na * nb * (na * na - na * nb + nb * nb) / n ** 3
                    + 6 * d * d * (na * na * m2b + nb * nb * m2a) / n ** 2
                    + 4 * d * (na * m3b - nb * m3a) / n)
        self.m3 += m3b + d ** 3 * na * nb * (na - nb) / n ** 2 + 3 * d * (na * m2b - nb * m2a) / n
        self.m2 += m2b + d * d * na * nb / n
        self.mean += d * nb / n
        self.n = n

    @property
    def variance(self) -> float:
        """Population variance of all entries."""
        return self.m2 / self.n

    @property
    def rms(self) -> float:
        return math.sqrt(self.mean * self.mean + self.variance)

    def excess_kurtosis(self) -> float | Missing:
        """``n M4 / M2^2 - 3`` (Fisher's, biased; ``scipy.stats.kurtosis``'s default)."""
        if self.m2 <= 0.0:
            return Missing("every value is the same (zero variance): kurtosis is undefined")
        return self.n * self.m4 / (self.m2 * self.m2) - 3.0

    def figures(self) -> dict[str, Any]:
        if self.n == 0:
            gone = Missing("no values were seen")
            return {"rms": gone, "variance": gone, "max_abs": gone, "excess_kurtosis": gone}
        return {"rms": self.rms, "variance": self.variance, "max_abs": self.max_abs,
                "excess_kurtosis": self.excess_kurtosis()}


def angular_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token (last dimension the features): the angle between ``a`` and ``b`` over pi,
    in [0, 1]; ``arccos(cos_sim) / pi`` computed as ``2 atan2(|u - v|, |u + v|) / pi`` on the
    unit vectors u, v (exact 0 for equal vectors, accurate near 0 and 1), in float64. NaN
    where either vector is zero."""
    ad, bd = a.detach().double(), b.detach().double()
    u = ad / ad.norm(dim=-1, keepdim=True)
    v = bd / bd.norm(dim=-1, keepdim=True)
    return 2.0 * torch.atan2((u - v).norm(dim=-1), (u + v).norm(dim=-1)) / math.pi


def rtn_quantize(w: torch.Tensor, bits: int = WEIGHT_BITS,
                 group_size: int | None = None) -> torch.Tensor:
    """Symmetric round-to-nearest fake quantization of a weight ``(out, in)``: for each output
    row (``group_size=None``) or each group of ``group_size`` consecutive input columns of a
    row (the last group of a row may be shorter), ``scale = max|w| / (2^(bits-1) - 1)`` and
    ``w_q = clamp(round(w / scale), -qmax, qmax) * scale`` (integers -7..7 at 4 bits); an
    all-zero group stays zero."""
    if w.dim() != 2:
        raise ValueError(f"rtn_quantize expects a matrix, got shape {tuple(w.shape)}")
    qmax = 2 ** (bits - 1) - 1
    g = w.shape[1] if group_size is None else min(group_size, w.shape[1])
    parts = []
    for chunk in torch.split(w, g, dim=1):
        scale = chunk.abs().amax(dim=1, keepdim=True) / qmax
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.clamp(torch.round(chunk / safe), -qmax, qmax) * safe
        parts.append(torch.where(scale > 0, q, torch.zeros_like(q)))
    return torch.cat(parts, dim=1)


def quantize_per_token(x: torch.Tensor, bits: int = ACT_BITS) -> torch.Tensor:
    """Symmetric per-token fake quantization over the last dimension:
    ``scale = max|x_token| / (2^(bits-1) - 1)``, ``x_q = round(x / scale) * scale``."""
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(dim=-1, keepdim=True) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(x / safe), -qmax, qmax) * safe
    return torch.where(scale > 0, q, torch.zeros_like(q))


def condition_number(sv: torch.Tensor, rank_eps: float = 0.0) -> float | Missing:
    """``sigma_max / sigma_min`` of the singular values ``sv``; a matrix with
    ``sigma_min <= rank_eps * sigma_max`` is (numerically) singular and has none
    (:func:`weight_figures` passes ``max(m, n) * eps``, numpy's ``matrix_rank`` rule, with eps
    that of float64, the precision the SVD is computed in: the weights themselves are exact)."""
    s_max, s_min = float(sv.max()), float(sv.min())
    if s_max == 0.0:
        return Missing("the matrix is all zeros: no condition number")
    if s_min <= rank_eps * s_max:
        return Missing("the matrix is singular (sigma_min is 0 to the SVD's precision): the "
                       "condition number is infinite")
    return s_max / s_min


def powerlaw_alpha(eigs: torch.Tensor, tail: float = ALPHA_TAIL,
                   min_eigs: int = ALPHA_MIN_EIGS) -> tuple[float | Missing, int]:
    """Power-law exponent alpha of the density ``p(lambda) ~ lambda^-alpha`` of the eigenvalues
    ``eigs`` (of W^T W), and the tail size k: the continuous maximum-likelihood (Hill)
    estimator of Clauset, Shalizi & Newman (2009, eq. 3.1) on the k = ceil(tail * n) largest
    eigenvalues, with x_min the smallest of them:
    ``alpha = 1 + k / sum_i ln(lambda_i / x_min)``."""
    lam = torch.sort(eigs.detach().double().reshape(-1), descending=True).values
    lam = lam[lam > 0]
    n = lam.numel()
    if n < min_eigs:
        return Missing(f"only {n} non-zero eigenvalues (fewer than {min_eigs}): too few for "
                       "a power-law fit"), 0
    k = max(2, math.ceil(tail * n))
    top = lam[:k]
    s = float(torch.log(top / top[-1]).sum())
    if s <= 0.0:
        return Missing("the top of the spectrum is flat (all equal eigenvalues): no power "
                       "law"), k
    return 1.0 + k / s, k


def attention_weights(kernel: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      ctx: Any, y: torch.Tensor) -> torch.Tensor:
    """The kernel's mixing weights ``A`` (B, H, T, T) with ``y = A v``: read off by running
    the kernel on one-hot values (value dimension T: ``A I = A``), then checked against the
    kernel's real output. A kernel that is not a weighted sum of the values (differential
    attention's per-head norm after the mixing) raises :class:`Unavailable`. An
    :class:`~modbench.model.attention.ExplicitKernel` runs its explicit score path (its own
    ``score`` and ``weights``), the path its fast variants must equal."""
    b, h, t, _ = q.shape
    h_kv = k.shape[1]
    name = type(kernel).__name__
    eye = torch.eye(t, dtype=v.dtype, device=v.device).expand(b, h_kv, t, t).contiguous()
    try:
        if isinstance(kernel, ExplicitKernel):
            w = ExplicitKernel.forward(kernel, q, k, eye, ctx)
        else:
            w = kernel.forward(q, k, eye, ctx)
    except (RuntimeError, ValueError, IndexError) as e:
        raise Unavailable(f"the attention kernel {name} cannot run on one-hot values "
                          f"({e.__class__.__name__}): it does not mix the values with one "
                          "weight per key, so no attention map can be read from q and k"
                          ) from e
    if tuple(w.shape) != (b, h, t, t):
        raise Unavailable(f"the attention kernel {name} does not return one weight per key "
                          "and head; no attention map can be read from q and k")
    ref = torch.matmul(w.float(), repeat_kv(v, h // h_kv).float())
    scale = float(y.detach().float().abs().max()) + 1e-6
    if not torch.allclose(ref, y.detach().float(), rtol=1e-3, atol=1e-4 * scale):
        raise Unavailable(f"the attention kernel {name} is not a weighted sum of the values "
                          "(its output differs from A v, e.g. a norm after the mixing), so "
                          "its attention map is not defined")
    return w.float()


def entropy_and_sink(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query (queries 1..T-1: query 0 sees only key 0 and has no choice), per head and
    row: the Shannon entropy (nats) of the weights over the keys, and the weight on key 0.
    ``w`` is (..., T, T) with rows that are probability distributions."""
    p = w[..., 1:, :].double()
    ent = -torch.special.xlogy(p, p).sum(dim=-1)
    return ent, p[..., 0]


# ----------------------------------------------------------------------- the collector


@dataclass
class _SubAcc:
    stream: Moments = field(default_factory=Moments)
    hidden: Moments = field(default_factory=Moments)  # the FFN's hidden activations
    ang_sum: float = 0.0
    ang_n: int = 0
    upd_sum: float = 0.0  # sum over tokens of |x_next - x|
    rel_sum: float = 0.0  # sum over tokens of |x_next - x| / |x|
    rel_n: int = 0
    tokens: int = 0


@dataclass
class _AttnAcc:
    ent_sum: float = 0.0
    sink_sum: float = 0.0
    n: int = 0
    entropy_missing: str | None = None
    sink_missing: str | None = None


@dataclass
class _LayerAcc:
    attn: _SubAcc = field(default_factory=_SubAcc)
    ffn: _SubAcc = field(default_factory=_SubAcc)
    heads: _AttnAcc = field(default_factory=_AttnAcc)
    ang_sum: float = 0.0
    ang_n: int = 0
    grad: list[float] = field(default_factory=list)
    skip: list[float] = field(default_factory=list)
    skip_mode: str | None = None
    skip_missing: str | None = None


def _sum_finite(x: torch.Tensor) -> tuple[float, int]:
    ok = torch.isfinite(x)
    return float(x[ok].sum()), int(ok.sum())


class _Hooks:
    """The forward hooks of one statistics pass: each sublayer's input (its pre-norm's input),
    the final norm's input, the FFN's hidden activations (the down projection's input), the
    attention kernels' inputs and outputs, and the stream's records (its recorder hook)."""

    def __init__(self, model: nn.Module, layers: list[_LayerAcc]) -> None:
        self.model, self.layers = model, layers
        self.reads: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self.records: list[Any] = []  # the stream's records of the forward
        self.hidden: dict[int, torch.Tensor] = {}
        self.handles: list[Any] = []
        # the block running now: a module shared by several layers (the tie slot) calls each
        # layer's hook, and a hook keeps only the calls made in its own layer
        self.current = -1

    @contextmanager
    def active(self) -> Iterator[None]:
        blocks = _blocks(self.model)
        parts = parts_of(self.model)
        for i, block in enumerate(blocks):
            for j, sub in enumerate((block.attn, block.ffn)):
                self.handles.append(sub.pre_norm.register_forward_pre_hook(
                    self._reader(2 * i + j)))
            self.handles.append(block.register_forward_pre_hook(self._block))
            if parts.has_linear("down", i):
                self.handles.append(parts.linear("down", i).register_forward_pre_hook(
                    self._hidden(i)))
            kernel = getattr(block.attn.core, "kernel", None)
            if isinstance(kernel, nn.Module):
                self.handles.append(kernel.register_forward_hook(self._attention(i)))
        self.handles.append(self.model.final_norm.register_forward_pre_hook(self._final))
        stream = getattr(self.model, "stream", None)
        if callable(getattr(stream, "add_recorder", None)):
            self.handles.append(stream.add_recorder(self.records.append))  # type: ignore
        try:
            yield
        finally:
            for h in self.handles:
                h.remove()
            self.handles.clear()

    def _reader(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self.current == k // 2:
                self.reads[k] = args[0].detach()
        return hook

    def _block(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.current = module.layer

    def _final(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.final = args[0].detach()

    def _hidden(self, layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self.current == layer:
                self.hidden[layer] = args[0].detach()
        return hook

    def _attention(self, layer: int) -> Callable[..., None]:
        acc = self.layers[layer].heads

        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            if self.current != layer or (acc.entropy_missing is not None
                                         and acc.sink_missing is not None):
                return
            q, k, v, ctx = args[:4]
            with torch.no_grad():
                _attention_batch(module, q.detach(), k.detach(), v.detach(), ctx,
                                 out.detach(), acc)
        return hook


def _attention_batch(kernel: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     ctx: Any, y: torch.Tensor, acc: _AttnAcc) -> None:
    b, h, t, _ = q.shape
    rows = max(1, ATTN_CHUNK // max(1, h * t * t))
    for s in range(0, b, rows):
        sl = slice(s, s + rows)
        try:
            w = attention_weights(kernel, q[sl], k[sl], v[sl], ctx, y[sl])
        except Unavailable as e:
            acc.entropy_missing = acc.sink_missing = str(e)
            return
        if t < 2:
            acc.entropy_missing = acc.sink_missing = (
                "sequences of one token: no query has a choice of keys")
            return
        rows_w = w[..., 1:, :]
        sums = rows_w.double().sum(dim=-1)
        negative = bool((rows_w < -1e-6).any())
        if negative:
            acc.entropy_missing = acc.sink_missing = (
                f"the attention kernel {type(kernel).__name__} gives negative weights (e.g. "
                "a difference of maps): the weights are not a distribution over the keys")
            return
        ent, sink = entropy_and_sink(w)
        if acc.entropy_missing is None:
            lo, hi = float(sums.min()), float(sums.max())
            if abs(lo - 1.0) > 1e-3 or abs(hi - 1.0) > 1e-3:
                acc.entropy_missing = (
                    f"the attention kernel {type(kernel).__name__} does not normalise its "
                    f"weights (rows sum to {lo:.3g} .. {hi:.3g}, not 1): they are not a "
                    "probability distribution, so their entropy is not defined")
            else:
                acc.ent_sum += float(ent.sum())
        acc.sink_sum += float(sink.sum())
        acc.n += sink.numel()


def _blocks(model: nn.Module) -> Sequence[nn.Module]:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ModbenchError(f"{type(model).__name__} has no `blocks`; diagnose works on models "
                            "built by modbench (load them with modbench.eval.run.load_run)")
    return list(blocks)


# ----------------------------------------------------------------------- skipping a block


@contextmanager
def skipped(block: nn.Module, mode: str) -> Iterator[None]:
    """Block ``block`` replaced by the identity for the forwards inside the context.

    ``restore``: a forward hook returns the block's input state in place of its output, so
    the stream leaving the block is the stream that entered it (the cores' kept tensors,
    ``state.shared``, and auxiliary terms are the block's).
    ``zero``: forward hooks on both sublayers' branch outputs (their post-norm sites) return
    zeros, so the block adds nothing and the stream runs its own mixing as usual."""
    handles: list[Any] = []
    if mode == "restore":
        def restore(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
            # the stream's part as it entered; what the cores keep for later layers
            # (Value-Residual's V_1) and the auxiliary terms as the block left them
            return args[0].replace(shared=out.shared, aux=out.aux)

        handles.append(block.register_forward_hook(restore))
    elif mode == "zero":
        def zero(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(out)

        handles += [block.attn.post_norm.register_forward_hook(zero),
                    block.ffn.post_norm.register_forward_hook(zero)]
    else:
        raise ValueError(f"unknown skip mode {mode!r}")
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------- quantization


def _weight_linears(model: nn.Module) -> list[nn.Linear] | Missing:
    """The ``nn.Linear`` layers inside the blocks (projections, FFN, gates; not the embedding
    or the head), or why W4 quantization is not defined for this method."""
    parts = parts_of(model)
    for role in BLOCK_ROLES:
        for layer, m in parts.linears(role).items():
            if not any(isinstance(x, nn.Linear) for x in m.modules()):
                return Missing(
                    f"the '{role}' projection of layer {layer} is a {type(m).__name__}, not a "
                    "linear layer: this method has no weight matrix to round there, and "
                    "quantizing only the remaining layers would not be comparable")
    return [m for b in _blocks(model) for m in b.modules() if isinstance(m, nn.Linear)]


def _act_targets(model: nn.Module) -> list[nn.Module] | Missing:
    """Where the 8-bit activation fake-quant pre-hooks go: each linear part of the blocks (its
    input is the linear layer's input, wrappers such as CoMT included) and every other
    ``nn.Linear`` in the blocks that no part contains (Gated Attention's gate)."""
    lins = _weight_linears(model)
    if isinstance(lins, Missing):
        return lins
    parts = parts_of(model)
    targets = [m for role in BLOCK_ROLES for m in parts.linears(role).values()]
    inside = {id(x) for t in targets for x in t.modules()}
    return targets + [m for m in lins if id(m) not in inside]


@contextmanager
def swapped_weights(weights: dict[nn.Parameter, torch.Tensor]) -> Iterator[None]:
    """Each parameter's data replaced by the given tensor inside the context."""
    old = {p: p.data for p in weights}
    try:
        for p, w in weights.items():
            p.data = w
        yield
    finally:
        for p, w in old.items():
            p.data = w


@contextmanager
def quantized_inputs(modules: Sequence[nn.Module], bits: int = ACT_BITS) -> Iterator[None]:
    """Forward pre-hooks that fake-quantize each module's first input per token."""
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (quantize_per_token(args[0], bits), *args[1:])

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------ the analysis


def _batch_loss(model: nn.Module, batch: torch.Tensor) -> float:
    with torch.no_grad():
        return float(lm_loss(model(batch), batch))


def _weighted(values: list[float], rows: list[int]) -> float:
    return sum(v * r for v, r in zip(values, rows, strict=True)) / max(sum(rows), 1)


def weight_figures(model: nn.Module) -> list[dict[str, Any]]:
    """Spectral figures of every 2-D parameter: spectral norm, condition number and the
    power-law alpha of the eigenvalues of W^T W (the squared singular values)."""
    rows = []
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        with torch.no_grad():
            sv = torch.linalg.svdvals(p.detach().double())
        alpha, k = powerlaw_alpha(sv * sv)
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else None
        eps = max(p.shape) * torch.finfo(torch.float64).eps  # the SVD's own accuracy
        rows.append({"name": name, "shape": list(p.shape), "layer": layer,
                     "spectral_norm": float(sv.max()),
                     "condition_number": condition_number(sv, eps),
                     "alpha": alpha, "alpha_tail": k})
    return rows


def compute_diagnostics(model: nn.Module, batches: Sequence[torch.Tensor], *,
                        progress: bool = False) -> dict[str, Any]:
    """Every figure of docs/diagnostics.md for ``model`` (a built modbench decoder, in
    evaluation mode, on the batches' device) on ``batches`` of token ids ``(B, T)``: the
    result before :func:`finalise` (figures that cannot be computed are :class:`Missing`).
    The model's weights and gradients are left as they were found (gradients cleared)."""
    if not batches:
        raise ModbenchError("no validation batches to diagnose; use --batches 1 or more")
    blocks = _blocks(model)
    n_layers = len(blocks)
    layers = [_LayerAcc() for _ in range(n_layers)]
    final = Moments()
    hooks = _Hooks(model, layers)
    single_lane = True
    rows: list[int] = []
    ref_losses: list[float] = []
    quant_losses: dict[str, list[float]] = {"w4_per_channel": [], "w4_group": [],
                                            "a8_per_token": []}
    lins = _weight_linears(model)
    act_targets = _act_targets(model)
    quant_weights: dict[str, dict[nn.Parameter, torch.Tensor]] = {}
    if not isinstance(lins, Missing):
        with torch.no_grad():
            quant_weights["w4_per_channel"] = {m.weight: rtn_quantize(m.weight.detach())
                                               for m in lins}
            quant_weights["w4_group"] = {
                m.weight: rtn_quantize(m.weight.detach(), group_size=GROUP_SIZE) for m in lins}
    seen: set[int] = set()  # a parameter shared by several blocks counts in the first
    params = [[p for p in b.parameters() if id(p) not in seen and not seen.add(id(p))]
              for b in blocks]
    was_grad = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(True)
    try:
        for batch in tqdm(batches, desc="diagnose", unit="batch", disable=not progress):
            rows.append(batch.shape[0])
            # 1. statistics forward (hooks), backward for the per-layer gradient norms
            model.zero_grad(set_to_none=True)
            hooks.reads.clear()
            hooks.hidden.clear()
            hooks.records.clear()
            hooks.final = None
            with hooks.active():
                loss = lm_loss(model(batch), batch)
            loss.backward()
            for i, ps in enumerate(params):
                sq = sum(float(p.grad.detach().double().pow(2).sum()) for p in ps
                         if p.grad is not None)
                layers[i].grad.append(math.sqrt(sq))
            model.zero_grad(set_to_none=True)
            single_lane &= _stream_figures(hooks, layers, final)
            # 2. the reference loss, every block skipped in turn, the quantized model
            ref = _batch_loss(model, batch)
            ref_losses.append(ref)
            for i, block in enumerate(blocks):
                _skip_batch(model, block, batch, layers[i], ref)
            for key, weights in quant_weights.items():
                with swapped_weights(weights):
                    quant_losses[key].append(_batch_loss(model, batch))
            if not isinstance(act_targets, Missing):
                with quantized_inputs(act_targets):
                    quant_losses["a8_per_token"].append(_batch_loss(model, batch))
    finally:
        model.zero_grad(set_to_none=True)
        for p, flag in was_grad.items():
            p.requires_grad_(flag)
    reference = _weighted(ref_losses, rows)
    result: dict[str, Any] = {
        "batches": len(batches), "sequences": sum(rows),
        "tokens": sum(int(b.numel()) for b in batches),
        "validation_loss": reference,
        "stream_is_single_lane": single_lane,
        "layers": [_layer_figures(i, acc) for i, acc in enumerate(layers)],
        "final": final.figures(),
        "weights": weight_figures(model),
        "quantization": _quant_figures(reference, quant_losses, rows, lins, act_targets),
        "notes": _notes(single_lane, layers),
    }
    return result


def _stream_figures(hooks: _Hooks, layers: list[_LayerAcc], final: Moments) -> bool:
    """Fold one batch's captured reads into the accumulators; whether each sublayer's
    recorded stream value after its write is what the next sublayer read (a single lane)."""
    n_sub = 2 * len(layers)
    if hooks.final is None or len(hooks.reads) != n_sub:
        raise ModbenchError("the decoder's sublayers were not all seen by the hooks; diagnose "
                            "works on models built by modbench")
    xs = [hooks.reads[k] for k in range(n_sub)] + [hooks.final]
    for k in range(n_sub):
        layer, sub = divmod(k, 2)
        acc = layers[layer].attn if sub == 0 else layers[layer].ffn
        x, nxt = xs[k], xs[k + 1]
        acc.stream.add(x)
        s, c = _sum_finite(angular_distance(x, nxt))
        acc.ang_sum += s
        acc.ang_n += c
        d = (nxt.double() - x.double()).norm(dim=-1)
        xn = x.double().norm(dim=-1)
        acc.upd_sum += float(d.sum())
        acc.tokens += d.numel()
        ok = xn > 0
        acc.rel_sum += float((d[ok] / xn[ok]).sum())
        acc.rel_n += int(ok.sum())
    for i, acc_l in enumerate(layers):
        s, c = _sum_finite(angular_distance(xs[2 * i], xs[2 * i + 2]))
        acc_l.ang_sum += s
        acc_l.ang_n += c
        if i in hooks.hidden:
            acc_l.ffn.hidden.add(hooks.hidden[i])
    final.add(hooks.final)
    single = True
    history = hooks.records
    if len(history) != n_sub:
        return False
    for k, rec in enumerate(history):
        nxt = xs[k + 1]
        if rec.after.shape != nxt.shape or not torch.equal(rec.after.detach(), nxt):
            single = False
    return single


def _skip_batch(model: nn.Module, block: nn.Module, batch: torch.Tensor, acc: _LayerAcc,
                ref: float) -> None:
    if acc.skip_missing is not None:
        return
    modes = [acc.skip_mode] if acc.skip_mode else ["restore", "zero"]
    failures = []
    for mode in modes:
        try:
            with skipped(block, mode):
                loss = _batch_loss(model, batch)
        except Exception as e:  # the stream cannot run without this block in this mode
            failures.append(f"{mode}: {e.__class__.__name__}")
            continue
        acc.skip_mode = mode
        acc.skip.append(loss - ref)
        return
    acc.skip_missing = ("the model cannot run with this block replaced by the identity ("
                        + "; ".join(failures) + ")")


def _sub_figures(acc: _SubAcc) -> dict[str, Any]:
    out = acc.stream.figures()
    out["angular_distance"] = (acc.ang_sum / acc.ang_n if acc.ang_n else
                               Missing("every token's stream vector was zero"))
    out["update_norm"] = acc.upd_sum / acc.tokens if acc.tokens else Missing("no tokens")
    out["relative_update"] = (acc.rel_sum / acc.rel_n if acc.rel_n else
                              Missing("every token's stream vector was zero"))
    return out


def _layer_figures(i: int, acc: _LayerAcc) -> dict[str, Any]:
    attn, ffn = _sub_figures(acc.attn), _sub_figures(acc.ffn)
    total = acc.attn.upd_sum + acc.ffn.upd_sum
    for sub, a in ((attn, acc.attn), (ffn, acc.ffn)):
        sub["update_share"] = (a.upd_sum / total if total > 0 else
                               Missing("the block changes nothing (both sublayers' updates "
                                       "are 0): no share to take"))
    h = acc.heads
    if h.n == 0 and h.entropy_missing is None:
        h.entropy_missing = h.sink_missing = ("the attention core has no kernel module to "
                                              "hook (its q/k are not exposed)")
    attn["attn_entropy"] = (Missing(h.entropy_missing) if h.entropy_missing is not None
                            else h.ent_sum / h.n)
    attn["attn_sink"] = Missing(h.sink_missing) if h.sink_missing is not None else h.sink_sum / h.n
    if acc.ffn.hidden.n:
        ffn["hidden_max_abs"] = acc.ffn.hidden.max_abs
        ffn["hidden_excess_kurtosis"] = acc.ffn.hidden.excess_kurtosis()
    else:
        gone = Missing("the FFN has no 'down' linear layer, so its hidden activations are "
                       "not exposed (e.g. tokenformer's Pattention FFN)")
        ffn["hidden_max_abs"] = ffn["hidden_excess_kurtosis"] = gone
    return {
        "layer": i,
        "angular_distance": (acc.ang_sum / acc.ang_n if acc.ang_n else
                             Missing("every token's stream vector was zero")),
        "skip_delta_loss": (Missing(acc.skip_missing) if acc.skip_missing is not None
                            else sum(acc.skip) / len(acc.skip)),
        "skip_mode": acc.skip_mode,
        "grad_norm": sum(acc.grad) / len(acc.grad) if acc.grad else Missing("no batches"),
        "attn": attn,
        "ffn": ffn,
    }


def _quant_figures(reference: float, losses: dict[str, list[float]], rows: list[int],
                   lins: list[nn.Linear] | Missing,
                   act_targets: list[nn.Module] | Missing) -> dict[str, Any]:
    out: dict[str, Any] = {"reference_loss": reference, "weight_bits": WEIGHT_BITS,
                           "activation_bits": ACT_BITS}
    for key in ("w4_per_channel", "w4_group", "a8_per_token"):
        why = act_targets if key == "a8_per_token" else lins
        if isinstance(why, Missing):
            out[key] = {"loss": why, "delta": why}
            continue
        loss = _weighted(losses[key], rows)
        out[key] = {"loss": loss, "delta": loss - reference}
    out["w4_group"]["group_size"] = GROUP_SIZE
    return out


def _notes(single_lane: bool, layers: list[_LayerAcc]) -> list[str]:
    notes = []
    if not single_lane:
        notes.append("the residual stream keeps more than one value (several lanes or depth "
                     "sources): the stream figures are taken on what each sublayer reads and "
                     "on the stream's final output, not on its internal state")
    if any(a.skip_mode == "zero" for a in layers):
        notes.append("where skip_mode is 'zero' the stream cannot run with a block's state "
                     "restored, so the block's branch outputs were zeroed instead (the stream "
                     "still runs its own mixing)")
    if any(a.heads.entropy_missing is not None and a.heads.sink_missing is None
           for a in layers):
        notes.append("attn_sink of a kernel that does not normalise its weights is the weight "
                     "on the first key itself, not a share of a row sum of 1")
    return notes


# --------------------------------------------------------------------------- a run


def diagnose_run(run_dir: str | Path, *, batches: int = DEFAULT_BATCHES, threads: int = 0,
                 progress: bool = True) -> dict[str, Any]:
    """Load a run folder's config and last checkpoint and diagnose the model on its first
    ``batches`` validation batches; JSON-ready (nulls with ``null_reasons``). ``threads``:
    torch's CPU threads for the analysis (0: the run's ``train.threads``, where that is 0
    torch's default); the previous setting is restored afterwards."""
    from modbench.eval.run import check_run_folder, load_run
    from modbench.runtime.data import open_data
    from modbench.runtime.device import resolve_device

    run = Path(run_dir)
    check_run_folder(run)
    if batches < 1:
        raise ModbenchError(f"--batches must be at least 1, got {batches}")
    if threads < 0:
        raise ModbenchError(f"--threads must be 0 (default) or more, got {threads}")
    cfg, model, step = load_run(run)
    device = resolve_device(cfg.train.device)
    model.to(device).eval()
    data = open_data(cfg, progress=progress)
    bs = cfg.train.forward_rows()
    val = [b.to(device) for b in data.val_batches(batches * bs, bs)]
    before = torch.get_num_threads()
    n_threads = threads or cfg.train.threads
    if n_threads:
        torch.set_num_threads(n_threads)
    try:
        figures = compute_diagnostics(model, val, progress=progress)
    finally:
        torch.set_num_threads(before)
    result = {"run": str(run), "method": cfg.model.method, "preset": cfg.preset,
              "seed": cfg.seed, "step": step, **figures}
    clean, reasons = finalise(result)
    clean["null_reasons"] = reasons
    return clean


__all__ = ["DEFAULT_BATCHES", "Missing", "Moments", "Unavailable", "angular_distance",
           "attention_weights", "compute_diagnostics", "condition_number", "diagnose_run",
           "entropy_and_sink", "finalise", "powerlaw_alpha", "quantize_per_token",
           "rtn_quantize", "skipped"]
