"""Three-Phase Transformer (3PT): a residual stream partitioned into N cyclic channels.

The hidden vector x in R^d is split into N equal channels x_0 .. x_{N-1} (each c = d / N
wide; channel i is the contiguous block of dims [i c, (i + 1) c)). Four phase-respecting
operations (docs/sources.md#three-phase; arXiv 2604.14430's abstract)::

    (1) per-channel RMSNorm, at every norm site the placement enables:
            y_i = x_i / sqrt(mean(x_i^2) + eps) * g_i          (RMS over each channel's c dims;
                                                               g in R^d, one gain per dim)
    (2) a Givens rotation of the stream between attention and FFN of every block l:
            for channel i and pair k = 0 .. c/2 - 1, with a = x[i c + k], b = x[i c + c/2 + k]:
            phi_{l,i,k} = theta_{l,k} + i * 2 pi / N
            a' = a cos(phi) - b sin(phi),     b' = a sin(phi) + b cos(phi)
    (3) GQA heads aligned with the partition: n_heads and n_kv_heads divisible by N, so each
        channel holds whole query and KV heads (refused otherwise);
    (4) Gabriel's horn in the one-dimensional DC subspace, added once to the stream's start:
            x_0[p] <- x_0[p] + s * r(p) * u,    r(p) = 1 / (p + 1),    u = 1_d / sqrt(d)
        (p = 0-based absolute position in the sequence, s = option ``horn_scale``, default 1).

so a block reads  h = x + Attn(N(x));  h <- R_l h;  x' = h + FFN(N(h))  (Pre-LN).

Citation: Abu Ayyash 2026, "Three-Phase Transformer" (arXiv 2604.14430). No public code was
reachable; everything beyond the abstract (and the few details below) is our own reading.

Init: theta = 0 in every block (the source gives no init), so at initialisation channel i is
rotated by the fixed offset i 2 pi / N (with N = 1 the rotation is the identity); norm gains
1 as the baseline; the horn is a fixed profile, not a parameter.

Parameters: one learnable angle per rotation pair of a channel per block, shared by the N
channels (channel i adds the fixed offset i 2 pi / N)::

    extra params = L * d / (2 N)        (12 * 768 / 6 = 1,536 at the paper's 123M, as reported)

The per-channel norm has the baseline's d gains per site, so it adds nothing.
FLOPs: 0 extra (the rotation and the horn are element-wise; no matrix products).

Options: ``phases`` N (default 2, see below; the paper's canonical N is 3, its N-sweep used
1, 2, 3, 4, 6, 8, 12); ``horn_scale`` s (default 1.0; 0 turns the horn off, for ablations).
N must divide n_heads and n_kv_heads, and d / N must be even (the rotation works on pairs).

Choices of our own (where the abstract is silent):

- Default N = 2, not the canonical 3: every preset of this lab has n_heads = 4 or 32 and
  n_kv_heads = 2, 4 or 8, which 3 does not divide, so ``three_phase`` at N = 3 would be
  refused everywhere. Use ``three_phase(phases=3)`` on a shape with heads divisible by 3
  (the paper's 123M: d = 768, 12 heads).
- Channels are contiguous blocks of d / N dims (so the head alignment is literal: channel
  i's dims are those of whole heads in the attention output before W_o); rotation pairs in a
  channel follow this lab's RoPE layout, rotate-half: (k, k + c/2) for k < c/2.
- Parameter sharing: theta_l has c/2 = d / (2N) entries per block, shared by the channels,
  which reproduces the reported +1,536 at d = 768, L = 12, N = 3 (one theta per block, or
  one per channel and pair, would give 12 or 4,608). The 1-D thetas get no weight decay.
- Where: the rotation is applied to the stream value after the attention sublayer's write,
  i.e. after its merge and post-residual norm, x <- R_l(residual_norm(merge(x, out))), so
  it composes with every merge (LayerScale, DeepNorm, LAUREL) and placement as the additive
  stream does; the attention sublayer's record holds the rotated value.
- The DC direction is the unit all-ones vector u = 1_d / sqrt(d) (the mean of all
  coordinates, orthogonal to every zero-sum, "balanced", pattern across the channels), and
  the horn's component along it is r(p) (each coordinate gets r(p) / sqrt(d)). The paper's
  figure reports the "zero-sum residual" pinned at N H_T / T (T = 1024: the mean of r(p)
  over positions, times N), consistent with a DC profile r(p) common to the N channels. The
  horn is added once, to the stream's start value (after the embedding norm site, before
  block 0); ``state.embedding`` is that value. It is not protected afterwards: a planar
  rotation cannot keep the all-ones direction fixed, so the rotations mix it like any
  other direction.
- The DC component is not excluded from the channels' RMS (each channel normalises all its
  c coordinates, horn included).
- Not implemented: the figure of the paper also names a "channel-structure embedding",
  which the abstract does not describe; the embedding is the baseline's.
- With N = 1 and ``horn_scale=0`` the model equals the baseline at initialisation (one
  channel, the per-channel norm is RMSNorm, theta = 0 is the identity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, register
from modbench.model.norms import inv_rms
from modbench.model.spec import ModelSpec, parts_of
from modbench.model.stream import AdditiveStream, StreamState


def valid_phases(cfg: ModelConfig) -> list[int]:
    """Channel counts N the shape allows: N divides n_heads and n_kv_heads and d / N is even."""
    return [n for n in range(1, cfg.n_kv_heads + 1)
            if cfg.n_heads % n == 0 and cfg.n_kv_heads % n == 0
            and cfg.d_model % n == 0 and (cfg.d_model // n) % 2 == 0]


def check_phases(cfg: ModelConfig, n: int) -> None:
    """Refuse a channel count the shape cannot hold (head-count alignment, pairs)."""
    if n in valid_phases(cfg):
        return
    choices = ", ".join(str(k) for k in valid_phases(cfg)) or "none"
    raise ModbenchError(
        f"method 'three_phase' with phases={n} needs model.n_heads ({cfg.n_heads}) and "
        f"model.n_kv_heads ({cfg.n_kv_heads}) divisible by {n} and model.d_model "
        f"({cfg.d_model}) divisible by {2 * n}; use phases in {{{choices}}} or head counts "
        f"that are multiples of {n}"
    )


class PhaseRMSNorm(nn.Module):
    """RMSNorm computed separately over each of N equal channels of the last dimension, one
    gain per dim (3PT's PhaseAwareRMSNorm). Computed in (at least) float32, as RMSNorm."""

    def __init__(self, dim: int, phases: int, eps: float = 1e-5) -> None:
        super().__init__()
        if phases < 1 or dim % phases:
            raise ModbenchError(f"three_phase: a norm of width {dim} cannot be split into "
                                f"{phases} equal channels; choose phases dividing {dim}")
        self.dim, self.phases, self.eps = dim, phases, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc, inv = inv_rms(x.unflatten(-1, (self.phases, self.dim // self.phases)), self.eps)
        return ((xc * inv).flatten(-2) * self.weight.to(xc.dtype)).to(x.dtype)

    def modbench_init(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, phases={self.phases}, eps={self.eps}"


def horn(seq_len: int, dim: int, like: torch.Tensor) -> torch.Tensor:
    """Gabriel's horn along the unit DC direction: ``(T, d)``, row p = r(p) 1_d / sqrt(d)."""
    r = 1.0 / torch.arange(1, seq_len + 1, device=like.device, dtype=like.dtype)
    return (r / math.sqrt(dim)).unsqueeze(-1).expand(seq_len, dim)


class ThreePhaseStream(AdditiveStream):
    """Additive stream with the horn injected at ``start`` and the per-channel Givens
    rotation applied after every attention sublayer's write."""

    def __init__(self, dim: int, n_layers: int, phases: int, horn_scale: float) -> None:
        super().__init__()
        self.dim, self.n_layers, self.phases, self.horn_scale = dim, n_layers, phases, horn_scale
        self.half = dim // phases // 2  # rotation pairs per channel
        self.theta = nn.ParameterList(nn.Parameter(torch.zeros(self.half))
                                      for _ in range(n_layers))

    @torch.no_grad()
    def modbench_init(self) -> None:
        for t in self.theta:
            t.zero_()

    def angles(self, layer: int) -> torch.Tensor:
        """``(N, c/2)``: phi_{i,k} = theta_{layer,k} + i 2 pi / N."""
        theta = self.theta[layer]
        offset = torch.arange(self.phases, device=theta.device, dtype=theta.dtype)
        return theta.unsqueeze(0) + (offset * (2 * math.pi / self.phases)).unsqueeze(-1)

    def rotate(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        phi = self.angles(layer).to(x.dtype)
        cos, sin = phi.cos(), phi.sin()
        xc = x.unflatten(-1, (self.phases, 2, self.half))
        a, b = xc[..., 0, :], xc[..., 1, :]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-2).flatten(-3)

    def start(self, x0: torch.Tensor) -> StreamState:
        if self.horn_scale:
            x0 = x0 + self.horn_scale * horn(x0.shape[-2], self.dim, x0)
        return StreamState(x=x0, embedding=x0)

    def after_merge(self, state: StreamState, layer: int, sublayer: str,
                    x: torch.Tensor) -> StreamState:
        return state.replace(x=self.rotate(x, layer) if sublayer == "attn" else x)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, n_layers={self.n_layers}, phases={self.phases}, "
                f"horn_scale={self.horn_scale}")


@register
class ThreePhase(Method):
    name = "three_phase"
    category = "residual"
    citation = "Abu Ayyash 2026, Three-Phase Transformer (arXiv 2604.14430)"
    summary = ("Stream split into N cyclic channels: per-channel RMSNorm, a Givens rotation by "
               "theta + i 2pi/N between attention and FFN, heads aligned, 1/(p+1) horn in the "
               "DC direction.")

    @dataclass
    class Options:
        phases: int = 2  # N channels (the paper's canonical 3 needs heads divisible by 3)
        horn_scale: float = 1.0  # s: the horn's component along the unit DC direction

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        n, s = self.opts.phases, self.opts.horn_scale
        check_phases(cfg, n)
        if not math.isfinite(s):
            raise ModbenchError(f"option horn_scale={s} of method 'three_phase' must be finite")

        def norm_factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            return PhaseRMSNorm(dim, n, eps)

        def stream_factory(c: ModelConfig) -> nn.Module:
            return ThreePhaseStream(c.d_model, c.n_layers, n, s)

        spec.fill("norm", norm_factory, by=self.name)
        spec.fill("stream", stream_factory, by=self.name)

    def post_init(self, model: nn.Module) -> None:
        """The head alignment (3), per layer: under the shape slot (``layerwise_scaling``)
        each layer has its own head counts, which :func:`check_phases` on the model's config
        does not see. An attention core without ``n_heads`` / ``n_kv_heads`` is left alone."""
        n, parts = self.opts.phases, parts_of(model)
        for layer in range(model.cfg.n_layers):  # type: ignore[union-attr]
            core = parts.core("attn", layer)
            h, h_kv = getattr(core, "n_heads", None), getattr(core, "n_kv_heads", None)
            if isinstance(h, int) and isinstance(h_kv, int) and (h % n or h_kv % n):
                raise ModbenchError(
                    f"three_phase with phases={n} aligns whole heads with its channels, but "
                    f"layer {layer} has n_heads={h} and n_kv_heads={h_kv} under the shape "
                    f"slot; choose per-layer head counts divisible by {n}, or phases "
                    "dividing them")

    def extra_params(self, cfg: ModelConfig) -> int:
        check_phases(cfg, self.opts.phases)
        return cfg.n_layers * cfg.d_model // (2 * self.opts.phases)

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
