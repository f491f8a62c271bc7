"""Mixture-of-experts FFN: E SwiGLU experts, a linear router, top-k routing and a
load-balancing loss (the FFN of WideNet; ``methods/widenet.py`` shares it across layers).

Equations (Xue et al. 2022, Section "Mixture-of-Experts", after Shazeer et al. 2017, GShard
and Switch), for a token x (the FFN's input, after its pre-norm)::

    p(x)    = softmax(W_r x)                               router, W_r in R^{E x d}
    g(x)    = TopK(p(x), k)                                the k largest p_e kept, the rest 0
    MoE(x)  = sum_e g_e(x) FFN_e(x),  FFN_e(x) = W_down,e (act(W_gate,e x) * W_up,e x)

and, over the N tokens of a forward's batch (per call: per layer, per micro-batch)::

    f_e = (1 / (N k)) #{(token, slot) routed to e}          fraction of the assignments
    P_e = (1 / N) sum_tokens p_e(x)                         mean router probability
    l_balance = E sum_e f_e P_e                             1 when routing is uniform

Each call adds ``balance * l_balance`` to the forward's auxiliary loss
(``ForwardContext.add_aux``), so the objective is ``lm_loss + balance * sum over layers of
l_balance`` (WideNet: ``loss = l_main + lambda sum_t l_balance^t``, summed over the T
routing calls of its shared router). f_e counts the routing decisions and has no gradient;
the gradient reaches the router through P_e (Switch's differentiable approximation).

Citation: Xue, Shi, Wei, Lou, Liu, You 2022, "Go Wider Instead of Deeper" (AAAI 2022,
arXiv 2107.11817); the MoE layer and loss follow Shazeer et al. 2017, Lepikhin et al. 2021
(GShard) and Fedus et al. 2022 (Switch Transformers).

Init: every expert's three matrices and the router N(0, init_std^2) (the generic pass over
``nn.Linear``), so every expert starts as an independent baseline FFN.

Options: ``experts`` (E, default 4: WideNet's base models), ``top_k`` (k, default 2: the
top-2 routing of GShard / ViT-MoE that WideNet builds on), ``balance`` (the loss weight
lambda, default 0.01: Switch's and WideNet's value).

Parameters over the baseline, per layer: (E - 1) 3 d d_ff (the extra experts) + d E (the
router). Extra forward FLOPs per token per layer: (k - 1) 6 d d_ff + 2 d E: each token runs
k experts, not E (dispatch by index, below).

Choices of our own, where the sources are silent or we depart from them:

- Gates: the top-k of the softmax over all E logits, *not* renormalised over the k chosen
  (WideNet's g(x) = TopK(softmax(f(x) + eps)), as in the authors' code; GShard renormalises
  the top-2 gates, Mixtral takes the softmax over the k chosen logits).
- No router noise: WideNet adds Gaussian noise eps to the logits in training (std 1/E in its
  code) for exploration; here routing is deterministic, so runs are reproducible from the
  seed and the reference test is exact.
- No capacity limit and no token dropping: WideNet (on TPU) bounds each expert's buffer by a
  capacity factor and drops the overflow. Dropless routing computes what the equations say
  for every token and keeps a token's output independent of the other tokens of the batch
  (with a capacity a token could be dropped because of *later* positions, a leak across
  positions in a causal LM).
- f_e is the fraction of the N k routing assignments (so sum_e f_e = 1 for any k, as the
  authors' code divides the top-k mask by k); GShard's top-2 loss counts the first choice
  only. l_balance and the router run in float32 (Switch's "selective precision"), also under
  bf16 autocast; the experts run under the run's autocast.
- Dispatch: the N k (token, expert) assignments are sorted by expert, each expert runs once
  on its tokens (an expert with none runs on an empty batch, so every parameter has a
  gradient and DDP sees every parameter used), the outputs are scaled by their gates and
  summed back per token. The split sizes are read on the host (one synchronisation per
  call), so the forward cannot run vmapped (stacked seeds) and ``torch.compile`` breaks its
  graph there.
- The experts' projections come from the ``linear`` slot (plain bias-free ``nn.Linear`` at
  the baseline) but are not listed in ``model.parts`` (which names one linear layer per role
  and layer) and get no ``linear_wrappers``. The methods that adjust the FFN's ``gate``,
  ``up``, ``down`` through ``parts`` or wrap them refuse the combination rather than leave the
  experts alone (``deepnorm``; ``comt`` unless ``modules=self_attention``).
  The activation is the ``ffn.act`` slot (SiLU; GeGLU's GELU when combined).

Logged: the callback adds ``moe_balance`` (the mean of l_balance over the step's calls:
layers and micro-batches; 1 when routing is uniform, E/k when every token picks the same k
experts) and ``moe_balance_loss`` (the auxiliary term the step trained on: balance times
l_balance, summed over layers, averaged over micro-batches) to every training record. Under
several processes they are this process's.

Syntax: ``moe``, ``moe(experts=8,top_k=1,balance=0.01)``. Slot: ``ffn``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, register
from modbench.model.ffn import GatedFFN
from modbench.model.spec import Builder, ModelSpec, parts_of
from modbench.model.stream import ForwardContext
from modbench.runtime.callback import Callback, TrainingRun


def expert(cfg: ModelConfig, build: Builder, layer: int) -> GatedFFN:
    """One expert: the baseline's gated FFN (SwiGLU) of width ``d_ff``, its projections from
    the bare ``linear`` slot (not listed in ``model.parts``, not wrapped)."""
    return GatedFFN(cfg, build, layer, linear=lambda *a: build.slot("linear", *a))


class MoEFFN(nn.Module):
    """The mixture-of-experts FFN core (see the module docstring): ``(x, ctx) -> out``; adds
    ``balance * l_balance`` to ``ctx`` on every call."""

    def __init__(self, cfg: ModelConfig, build: Builder, layer: int, experts: int, top_k: int,
                 balance: float) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.balance = experts, top_k, balance
        self.router = nn.Linear(cfg.d_model, experts, bias=False)
        self.experts = nn.ModuleList(expert(cfg, build, layer) for _ in range(experts))
        # the l_balance of the training calls since the callback last read them (not saved:
        # a log, not state)
        self.register_buffer("balance_sum", torch.zeros(()), persistent=False)
        self.register_buffer("balance_calls", torch.zeros(()), persistent=False)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities ``(N, E)`` (float32, or the input's wider dtype), and the
        top-k gates and expert indices ``(N, k)``."""
        dtype = torch.promote_types(h.dtype, torch.float32)
        with torch.autocast(device_type=h.device.type, enabled=False):
            logits = F.linear(h.to(dtype), self.router.weight.to(dtype))
        probs = logits.softmax(dim=-1)
        gates, choice = probs.topk(self.top_k, dim=-1)
        return probs, gates, choice

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        n, k = h.shape[0], self.top_k
        probs, gates, choice = self.route(h)
        flat = choice.reshape(-1)  # assignment j of token t at t k + j
        counts = torch.bincount(flat, minlength=self.n_experts)
        order = flat.argsort(stable=True)  # the assignments grouped by expert
        token = order // k
        sizes = counts.tolist()  # the host reads the split sizes: one synchronisation
        parts = h[token].split(sizes)
        y = torch.cat([e(part) for e, part in zip(self.experts, parts, strict=True)])
        y = y.to(gates.dtype) * gates.reshape(-1)[order].unsqueeze(-1)
        out = h.new_zeros(h.shape).index_add_(0, token, y.to(h.dtype))
        frac = counts.to(probs.dtype) / (n * k)
        l_balance = self.n_experts * (frac * probs.mean(dim=0)).sum()
        ctx.add_aux(self.balance * l_balance)
        if self.training and torch.is_grad_enabled():
            self.balance_sum.add_(l_balance.detach())
            self.balance_calls.add_(1)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, top_k={self.top_k}, balance={self.balance}"


class BalanceLogging(Callback):
    """Adds ``moe_balance`` and ``moe_balance_loss`` to each training record (see the module
    docstring). It reads the MoE cores' sums after each step's backward (on the device, no
    synchronisation) and converts them when the record is logged."""

    def __init__(self) -> None:
        self.pending: dict[int, torch.Tensor] = {}

    def after_backward(self, run: TrainingRun, step: int) -> None:
        served = moe_cores(run.model)
        if not served:
            return
        with torch.no_grad():
            balance = loss = torch.zeros((), dtype=torch.float32, device=run.device)
            layers = 0
            for core, n in served:
                mean = core.balance_sum.float() / core.balance_calls.clamp_min(1).float()
                balance = balance + n * mean
                loss = loss + core.balance * n * mean
                layers += n
                core.balance_sum.zero_()
                core.balance_calls.zero_()
            self.pending[step] = torch.stack([balance / layers, loss])

    def on_step_end(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None:
        for old in [s for s in self.pending if s < step]:  # steps that were not logged
            del self.pending[old]
        value = self.pending.pop(step, None)
        if value is not None:
            record["moe_balance"], record["moe_balance_loss"] = value.tolist()


def moe_cores(model: nn.Module) -> list[tuple[MoEFFN, int]]:
    """Each distinct MoE core of ``model`` and the number of layers it serves (one each, or
    every layer for a core shared across layers)."""
    parts = parts_of(model)
    seen: dict[int, list[Any]] = {}
    for layer in range(model.cfg.n_layers):  # type: ignore[union-attr,arg-type]
        core = parts.core("ffn", layer)
        if isinstance(core, MoEFFN):
            seen.setdefault(id(core), [core, 0])[1] += 1
    return [(core, n) for core, n in seen.values()]


@dataclass
class MoEOptions:
    experts: int = 4  # E
    top_k: int = 2  # k experts per token
    balance: float = 0.01  # lambda, the load-balancing loss weight


def check_options(opts: MoEOptions, method: str) -> None:
    """Refuse options the MoE core cannot run (one line each)."""
    if isinstance(opts.experts, bool) or not isinstance(opts.experts, int) or opts.experts < 1:
        raise ModbenchError(f"option experts={opts.experts!r} of method '{method}' must be a "
                            "positive integer (the number of experts)")
    if (isinstance(opts.top_k, bool) or not isinstance(opts.top_k, int)
            or not 1 <= opts.top_k <= opts.experts):
        raise ModbenchError(f"option top_k={opts.top_k!r} of method '{method}' must be an "
                            f"integer from 1 to experts={opts.experts}")
    if not math.isfinite(opts.balance) or opts.balance < 0:
        raise ModbenchError(f"option balance={opts.balance!r} of method '{method}' must be a "
                            "finite number >= 0 (the load-balancing loss weight)")


def fill_moe(spec: ModelSpec, opts: MoEOptions, *, by: str) -> None:
    """Fill the ``ffn`` slot with the MoE core of ``opts`` (for ``moe`` and ``widenet``)."""
    check_options(opts, by)
    experts, top_k, balance = opts.experts, opts.top_k, float(opts.balance)

    def factory(cfg: ModelConfig, build: Builder, layer: int) -> nn.Module:
        return MoEFFN(cfg, build, layer, experts, top_k, balance)

    spec.fill("ffn", factory, by=by)  # moe + widenet: refused, widenet holds the MoE


def moe_extra_params(cfg: ModelConfig, opts: MoEOptions, cores: int) -> int:
    """Parameters of ``cores`` MoE cores over as many baseline FFNs."""
    return cores * ((opts.experts - 1) * 3 * cfg.d_model * cfg.d_ff + cfg.d_model * opts.experts)


def moe_extra_flops(cfg: ModelConfig, opts: MoEOptions) -> float:
    """Forward FLOPs per token over the baseline FFNs, all layers (2 per multiply-add)."""
    per_layer = (opts.top_k - 1) * 6 * cfg.d_model * cfg.d_ff + 2 * cfg.d_model * opts.experts
    return float(cfg.n_layers * per_layer)


@register
class MoE(Method):
    name = "moe"
    category = "ffn"
    citation = ("Xue et al. 2022, Go Wider Instead of Deeper (AAAI 2022); Shazeer et al. 2017; "
                "Fedus et al. 2022, Switch Transformers")
    summary = ("Mixture-of-experts FFN: E SwiGLU experts, top-k softmax router, "
               "load-balancing loss lambda E sum f_e P_e.")
    Options = MoEOptions
    stackable = False
    stack_note = ("its dispatch reads the number of tokens per expert on the host, which a "
                  "vmapped forward cannot")
    compile_graph_breaks = ("dropless dispatch: each expert's token count is read on the host "
                            "(data-dependent split sizes)")

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        fill_moe(spec, self.opts, by=self.name)

    def callbacks(self) -> list[Any]:
        return [BalanceLogging()]

    def extra_params(self, cfg: ModelConfig) -> int:
        check_options(self.opts, self.name)
        return moe_extra_params(cfg, self.opts, cfg.n_layers)

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        check_options(self.opts, self.name)
        return moe_extra_flops(cfg, self.opts)
