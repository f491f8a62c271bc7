"""Hyper-Connections: n residual lanes with input-side mixing and output-side re-mixing;
and the seed study's output-side two-lane variant.

``hyper_connections`` (docs/sources.md#hyper-connections; Zhu et al., Alg. 1 and 2 of App. J).
The stream is H in R^{n x d} per token, H^0 = (x_0, ..., x_0) (n copies of the embedding). Each
sublayer T_k (k = 0 .. 2L-1 counts attention and FFN sublayers separately) keeps its own
pre-norm and::

    width connection:  h_in = A_m(H)^T H                    (A_m in R^{n x 1})
                       H_r  = A_r(H)^T H                    (A_r in R^{n x n})
    sublayer:          y    = post_norm(T_k(pre_norm(h_in)))
    depth connection:  H'   = B(H)^T y + H_r                (B in R^{1 x n}; lane j gets B_j y)

    static (SHC):   A_m = a_m,  A_r = a_r,  B = b           (learnable)
    dynamic (DHC):  Hbar = RMSNorm(H)   (per lane, no gain)
                    A_m(H) = s_a tanh(Hbar W_m) + a_m,   A_r(H) = s_a tanh(Hbar W_r) + a_r
                    B(H)   = s_b tanh(Hbar W_b)^T + b       (per token and lane)

    output:         h = (1/n) sum_j H^{2L}_j,   then the final norm and the head

Citation: Zhu, Huang, Huang, Zeng, Mao, Wu, Min, Zhou 2025, "Hyper-Connections" (ICLR 2025,
arXiv 2409.19606); Alg. 2 as implemented in lucidrains/hyper-connections
``hyper_connections.py`` (tanh, s_a = s_b = 0.01, zero W, static alpha = [e_k | I]).

Init: a_m = e_{k mod n} (sublayer k reads lane k mod n), a_r = I, b = 1 (the paper's
Pre-Norm-equivalent init); W_m = W_r = W_b = 0; s_a = s_b = 0.01. Then every lane holds the
baseline's stream, each sublayer reads exactly the baseline's input, and the mean of the
lanes is the baseline's stream: at initialisation SHC and DHC are exactly the baseline.

Parameters per sublayer: n (n + 1) + n static (a_m, a_r, b); dynamic adds d (n + 1) + d
(W_m, W_r, W_b, stored as one d x (n + 2) matrix) + 2 (s_a, s_b). In total
2L [n (n + 2) + dynamic (d (n + 2) + 2)].

FLOPs per token and sublayer (matrix products, 2 per multiply-add): the width connection
(n + 1) x n by n x d: 2 n (n + 1) d; dynamic adds Hbar W: 2 n d (n + 2). The depth
connection B^T y is an outer product (no additions) and the lane mean is a reduction: not
counted. In total 2L [2 n (n + 1) d + dynamic 2 n (n + 2) d].

Options: ``n`` (expansion rate, default 4, the paper's best "DHC x4"), ``dynamic``
(default true).

Choices of our own:

- Output reduce: the lanes are *averaged*, not summed as in the paper. Before a
  scale-invariant final norm the two differ only in the norm's eps (sum = n x mean), but
  with a sum the final RMSNorm sees n x the baseline's stream and N(n h) != N(h) because of
  eps, so the Pre-Norm-equivalent init would not be exactly the baseline. The mean is.
- The norm inside DHC is RMSNorm without a gain (the paper: LayerNorm; lucidrains: RMSNorm
  with a gain). A gain before Hbar W is a reparametrisation of W's rows; without it the
  parameter count is the paper's n(n+1)+n + d(n+1)+d (+ the two scales).
- The static mixing weights are stored as 1-D tensors (reshaped in the forward), so the
  recipe's matrix-only weight decay does not pull the identity init towards zero; the
  dynamic W matrix is decayed like every other matrix.
- HC replaces the additive merge: it claims the ``merge`` slot, so methods that fill it
  (layerscale, deepnorm, laurel_*, ngpt) are refused. A post-residual norm (``post_ln``,
  ``mix_ln``, ``hybrid_norm``) applies to every lane after the depth connection (with
  the static init every lane is then the Post-LN stream, so ``post_ln+hyper_connections``
  starts as ``post_ln``).
- The lane mixing runs in the stream's dtype (no bf16 autocast), as the residual add does.

Memory: every sublayer keeps its n-lane input H for the backward pass (n x the residual
activations) and its branch output (for the gradient of B); DHC computes Hbar W as
(H W) / rms(H), the same numbers, so it does not keep Hbar as well. See
``benchmarks/stream_memory.py``.

``hyper_connections_2lane`` (arXiv 2605.20798 Appendix B.11; the seed study's variant, kept so the
study can be reproduced). A fast lane x is the standard residual (any merge, any placement);
a slow lane s is an exponential moving average of the sublayer outputs; the slow lane is
added to the stream with a learnable weight w_k that starts at 0::

    s_k      = (1 - r_k) s_{k-1} + r_k out_k,   s_{-1} = 0,   r_k = sigmoid(rho_k)
    x_{k+1}  = residual_norm( merge(x_k, out_k) + w_k s_k )

Init: w_k = 0 (so the stream is exactly the baseline at step 0) and rho_k = logit(rate),
``rate`` = 0.1 by default. The appendix's number for the rate was lost in the text we have;
0.1 is our choice (a slow lane that averages about the last 10 sublayer outputs). Parameters:
2 scalars per sublayer, 4 L. FLOPs: none (element-wise). Choice of our own: rho and w are
scalars per sublayer ("a learnable rate", "a weight"); the slow lane's contribution is added
before the post-residual norm, so Post-LN normalises the whole stream.
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
from modbench.model.spec import ModelSpec
from modbench.model.stream import (
    Stream,
    StreamState,
    claim_merge,
    is_identity,
    stream_precision,
    sublayer_index,
)

KEY = "hyper_connections.pending"
SLOW = "hyper_connections_2lane.slow"


class HyperConnection(nn.Module):
    """The connection weights of one sublayer (Alg. 2): static a_m, a_r, b and, for DHC,
    W = [W_m W_r W_b] in R^{d x (n + 2)} and the scales s_a, s_b."""

    def __init__(self, dim: int, n: int, k: int, dynamic: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.n, self.k, self.dynamic, self.eps = dim, n, k, dynamic, eps
        # alpha = [a_m | a_r] in R^{n x (n + 1)}, stored flat (no weight decay)
        self.static_alpha = nn.Parameter(self._alpha0().flatten())
        self.static_beta = nn.Parameter(torch.ones(n))
        if dynamic:
            self.dynamic_fn = nn.Parameter(torch.zeros(dim, n + 2))
            self.alpha_scale = nn.Parameter(torch.tensor(0.01))
            self.beta_scale = nn.Parameter(torch.tensor(0.01))

    def _alpha0(self) -> torch.Tensor:
        a = torch.zeros(self.n, self.n + 1)
        a[self.k % self.n, 0] = 1.0
        a[:, 1:] = torch.eye(self.n)
        return a

    @torch.no_grad()
    def modbench_init(self) -> None:
        self.static_alpha.copy_(self._alpha0().flatten())
        self.static_beta.fill_(1.0)
        if self.dynamic:
            self.dynamic_fn.zero_()
            self.alpha_scale.fill_(0.01)
            self.beta_scale.fill_(0.01)

    def weights(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """alpha (..., n, n + 1) and beta (..., n) for lanes ``h`` (..., n, d); static ones
        broadcast (n, n + 1) and (n,)."""
        alpha = self.static_alpha.view(self.n, self.n + 1).to(h.dtype)
        beta = self.static_beta.to(h.dtype)
        if not self.dynamic:
            return alpha, beta
        # Hbar W computed as (H W) / rms(H): the same numbers, without storing Hbar
        hf, inv = inv_rms(h, self.eps)
        dyn = torch.tanh((h @ self.dynamic_fn.to(h.dtype)).to(hf.dtype) * inv).to(h.dtype)
        alpha = self.alpha_scale.to(h.dtype) * dyn[..., : self.n + 1] + alpha
        beta = self.beta_scale.to(h.dtype) * dyn[..., self.n + 1] + beta
        return alpha, beta

    def extra_repr(self) -> str:
        return f"n={self.n}, k={self.k}, dynamic={self.dynamic}"


class HyperConnectionsStream(Stream):
    """n lanes ``state.x`` of shape (..., n, d); one :class:`HyperConnection` per sublayer."""

    def __init__(self, dim: int, n_layers: int, n: int, dynamic: bool, eps: float) -> None:
        super().__init__()
        self.n = n
        self.conns = nn.ModuleList(
            HyperConnection(dim, n, k, dynamic, eps) for k in range(2 * n_layers))

    def start(self, x0: torch.Tensor) -> StreamState:
        lanes = x0.unsqueeze(-2).expand(*x0.shape[:-1], self.n, x0.shape[-1])
        return StreamState(x=lanes, embedding=x0)

    def read(self, state: StreamState, layer: int, sublayer: str
             ) -> tuple[torch.Tensor, StreamState]:
        h = state.x
        with stream_precision(h):
            alpha, beta = self.conns[sublayer_index(layer, sublayer)].weights(h)
            # (..., n + 1, n), static weights broadcast to every token so that both products
            # run as batched matrix products on H in place (no transposed copy of H)
            a = alpha.transpose(-1, -2).expand(*h.shape[:-2], self.n + 1, self.n)
            # two products, not one (n + 1)-row product sliced: the sublayer input is then
            # its own tensor, and the pre-norm that keeps it does not keep the re-mixed lanes
            x_in = (a[..., :1, :] @ h).squeeze(-2)  # A_m^T H
            remixed = a[..., 1:, :] @ h  # A_r^T H
        return x_in, state.keep(KEY, (remixed, beta))

    def write(self, state: StreamState, layer: int, sublayer: str, x: torch.Tensor,
              out: torch.Tensor, merge: nn.Module, residual_norm: nn.Module) -> StreamState:
        remixed, beta = state.kept[KEY]
        with stream_precision(remixed):
            lanes = beta.unsqueeze(-1) * out.unsqueeze(-2) + remixed
        if not is_identity(residual_norm):
            lanes = per_lane(residual_norm, lanes)
        self.record(layer, sublayer, x, out, lanes)
        kept = {k: v for k, v in state.kept.items() if k != KEY}
        return state.replace(x=lanes, kept=kept)

    def finish(self, state: StreamState) -> torch.Tensor:
        return state.x.mean(dim=-2)

    def extra_repr(self) -> str:
        return f"n={self.n}"


def per_lane(norm: nn.Module, lanes: torch.Tensor) -> torch.Tensor:
    """Apply a norm-site module to each lane of (B, T, n, d) as a (B n, T, d) batch, so modules
    that look along the sequence (dim -2) see positions, not lanes."""
    b, t, n, d = lanes.shape
    y = norm(lanes.transpose(1, 2).reshape(b * n, t, d))
    return y.reshape(b, n, t, d).transpose(1, 2)


def _check_n(n: int) -> None:
    if n < 1:
        raise ModbenchError(f"option n={n} of method 'hyper_connections' must be >= 1 "
                            "(the number of residual lanes, e.g. 4)")


@register
class HyperConnections(Method):
    name = "hyper_connections"
    category = "residual"
    citation = ("Zhu, Huang, Huang, Zeng, Mao, Wu, Min, Zhou 2025, Hyper-Connections "
                "(ICLR 2025)")
    summary = ("n residual lanes with input-side mixing A_m, output-side re-mixing A_r and "
               "output weights B; static or dynamic (DHC).")
    starts_as_baseline = True

    @dataclass
    class Options:
        n: int = 4  # expansion rate (lanes)
        dynamic: bool = True  # DHC: token-dependent A_m, A_r, B

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        n, dynamic = self.opts.n, self.opts.dynamic
        _check_n(n)

        def factory(c: ModelConfig) -> nn.Module:
            return HyperConnectionsStream(c.d_model, c.n_layers, n, dynamic, c.norm_eps)

        spec.fill("stream", factory, by=self.name)
        claim_merge(spec, self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        n, d = self.opts.n, cfg.d_model
        per = n * (n + 2) + (d * (n + 2) + 2 if self.opts.dynamic else 0)
        return 2 * cfg.n_layers * per

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        n, d = self.opts.n, cfg.d_model
        per = 2 * n * (n + 1) * d + (2 * n * (n + 2) * d if self.opts.dynamic else 0)
        return float(2 * cfg.n_layers * per)


# --------------------------------------------------------------------- two-lane variant


class TwoLaneStream(Stream):
    """Fast lane = the standard residual; slow lane = EMA of sublayer outputs, added to the
    stream with a weight that starts at zero (arXiv 2605.20798 B.11)."""

    def __init__(self, n_layers: int, rate: float) -> None:
        super().__init__()
        self.rate = rate
        self.slow_rate_logit = nn.Parameter(torch.full((2 * n_layers,), _logit(rate)))
        self.slow_weight = nn.Parameter(torch.zeros(2 * n_layers))

    @torch.no_grad()
    def modbench_init(self) -> None:
        self.slow_rate_logit.fill_(_logit(self.rate))
        self.slow_weight.zero_()

    def start(self, x0: torch.Tensor) -> StreamState:
        return StreamState(x=x0, embedding=x0)

    def read(self, state: StreamState, layer: int, sublayer: str
             ) -> tuple[torch.Tensor, StreamState]:
        return state.x, state

    def write(self, state: StreamState, layer: int, sublayer: str, x: torch.Tensor,
              out: torch.Tensor, merge: nn.Module, residual_norm: nn.Module) -> StreamState:
        k = sublayer_index(layer, sublayer)
        o = out.to(x.dtype)  # the slow lane lives in the stream's dtype (not autocast's)
        r = torch.sigmoid(self.slow_rate_logit[k]).to(x.dtype)
        slow = state.kept.get(SLOW)
        slow = r * o if slow is None else (1 - r) * slow + r * o
        after = residual_norm(merge(x, out, state) + self.slow_weight[k].to(x.dtype) * slow)
        self.record(layer, sublayer, x, out, after)
        return state.replace(x=after, kept={**state.kept, SLOW: slow})

    def finish(self, state: StreamState) -> torch.Tensor:
        return state.x

    def extra_repr(self) -> str:
        return f"sublayers={self.slow_weight.numel()}, rate={self.rate:g}"


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


@register
class HyperConnections2Lane(Method):
    name = "hyper_connections_2lane"
    category = "residual"
    citation = ("Zhu et al. 2025, Hyper-Connections (ICLR 2025); the output-side two-lane "
                "variant of arXiv 2605.20798 Appendix B.11")
    summary = ("Standard residual plus a slow EMA lane of sublayer outputs, added with a "
               "learnable weight that starts at 0.")
    starts_as_baseline = True

    @dataclass
    class Options:
        rate: float = 0.1  # initial EMA rate r = sigmoid(rho), in (0, 1)

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        rate = float(self.opts.rate)
        if not 0.0 < rate < 1.0:
            raise ModbenchError(f"option rate={rate:g} of method 'hyper_connections_2lane' "
                                "must lie strictly between 0 and 1 (e.g. 0.1)")

        def factory(c: ModelConfig) -> nn.Module:
            return TwoLaneStream(c.n_layers, rate)

        spec.fill("stream", factory, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 4 * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
