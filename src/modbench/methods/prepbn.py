"""PRepBN: progressive replacement of the norm by re-parameterised BatchNorm.

Equations (docs/sources.md#prepbn; SLAB ``LinearNorm`` and ``RepBN``)::

    RepBN(x)  = BN(x) + eta * x             BN over all B T tokens per channel, eta a scalar
    PRepBN(x) = lambda N(x) + (1 - lambda) RepBN(x)          (training mode)
    PRepBN(x) = RepBN(x)                                     (evaluation mode, as published)
    lambda    = 1 for step < W, then 1 - (step - W) / D, floored at 0

N is the baseline RMSNorm (with its gain). BN uses batch statistics in training mode and
its running statistics (momentum 0.1) in evaluation mode.

Citation: Guo et al. 2024, "SLAB: Efficient Transformers with Simplified Linear Attention and
Progressive Re-parameterized Batch Normalization" (ICML 2024); code xinghaochen/SLAB
(``llama/modeling/llama-350M/modeling_llama.py``).

Init (``init=llama``, the LLaMA code): eta = 0, BN gamma = 0, BN beta = 0, so RepBN(x) = 0 at
first; ``init=vit`` (the ViT code): eta = 1, gamma = 1, beta = 0. RMSNorm gain 1.

Schedule: the LLaMA-350M code uses W = 10,000 warm-up steps of pure RMSNorm and a decay over
D = 18,000 steps. Our runs are far shorter, so W and D default to fractions of the run's
``train.steps`` (``warm_frac`` 0.1, ``decay_frac`` 0.3; our choice) unless ``warm_steps`` /
``decay_steps`` are given. Steps are optimizer steps (the code advances its counters every
16th micro-batch, i.e. once per optimizer step at its 16-way accumulation). The step comes
from the trainer through a callback; outside the trainer a module stays at step 0
(lambda = 1) unless ``modbench_set_step`` is called.

Leak across positions (``leaks_across_positions``): in training mode BN's batch mean and
variance are taken over every token of the batch, so an output depends on later positions
(and other sequences). Evaluation mode uses running statistics only: causal. Evaluation
mode is RepBN alone, as published, so while lambda > 0 the evaluated model differs from the
trained one (with ``init=llama`` every PRepBN outputs 0 in evaluation during warm-up, so
validation loss is that of a model without its sublayers until the decay has progressed);
``eval_mix=true`` evaluates lambda N(x) + (1 - lambda) RepBN(x) with running statistics
instead (our option, not published).

Sites: the SLAB LLaMA code replaces only the two block norms (``input_layernorm``,
``post_attention_layernorm``) and keeps the model's final RMSNorm; so here the ``final`` site
stays RMSNorm and every other site the placement enables gets PRepBN. (A batch norm right
before the LM head made our tiny models train much worse.)

Choices of our own: while lambda = 1 RepBN is still computed (with batch statistics, without
updating the running ones, as the published code does not run it then), multiplied by 0, so
every parameter has a gradient; statistics are in float32; no pad masks (packed rows).

Slots: ``norm`` (any placement). Parameters over the baseline, counted for the baseline
placement (2 L block norms; the final norm is unchanged): + 2 d + 1 per block norm (BN gamma
and beta, eta).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modbench.config import ModelConfig
from modbench.methods._common import StepCallback, baseline_norm_count
from modbench.methods.base import Method, option_choice, register
from modbench.model.norms import RMSNorm
from modbench.model.spec import ModelSpec


def prepbn_lambda(step: int, warm: int, decay: int) -> float:
    if step < warm:
        return 1.0
    if decay <= 0:
        return 0.0
    return max(0.0, 1.0 - (step - warm) / decay)


class RepBN(nn.Module):
    """``BN(x) + eta x`` over the flattened tokens."""

    def __init__(self, dim: int, init: str, momentum: float = 0.1, eps: float = 1e-5) -> None:
        super().__init__()
        self.init, self.momentum, self.eps = init, momentum, eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eta = nn.Parameter(torch.zeros(1))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))
        self.modbench_init()

    def modbench_init(self) -> None:
        one = 1.0 if self.init == "vit" else 0.0
        nn.init.constant_(self.weight, one)
        nn.init.zeros_(self.bias)
        nn.init.constant_(self.eta, one)
        self.running_mean.zero_()
        self.running_var.fill_(1.0)

    def forward(self, x: torch.Tensor, update: bool = True) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        use_batch = self.training
        rm = self.running_mean if (update or not use_batch) else None
        rv = self.running_var if (update or not use_batch) else None
        y = F.batch_norm(flat, rm, rv, self.weight.to(flat.dtype), self.bias.to(flat.dtype),
                         use_batch, self.momentum, self.eps)
        return (y + self.eta.to(flat.dtype) * flat).reshape(x.shape)


class PRepBNLayer(nn.Module):
    def __init__(self, dim: int, eps: float, init: str, warm: tuple[float, int | None],
                 decay: tuple[float, int | None], eval_mix: bool = True) -> None:
        super().__init__()
        self.eval_mix = eval_mix
        self.norm = RMSNorm(dim, eps)
        self.repbn = RepBN(dim, init, eps=eps)  # the SLAB code passes rms_norm_eps to both
        self._warm, self._decay = warm, decay
        self.step, self.total = 0, 0
        # lambda and 1 - lambda (float64, computed in Python as the eager forward does) and
        # whether the BN statistics update, for a compiled forward: tensors and a bool that
        # change with the step do not make torch.compile recompile at every step, as the
        # Python float lambda would (modbench bench --compile-check)
        self.register_buffer("mix", torch.ones(2, dtype=torch.float64), persistent=False)
        self.update_bn = False
        self._sync()

    def modbench_set_step(self, step: int, total: int) -> None:
        self.step, self.total = step, total
        self._sync()

    def _sync(self) -> None:
        lam = self.lam
        with torch.no_grad():
            self.mix.copy_(torch.tensor([lam, 1.0 - lam], dtype=torch.float64))
        self.update_bn = lam < 1.0

    def schedule(self) -> tuple[int, int]:
        (wf, ws), (df, ds) = self._warm, self._decay
        warm = ws if ws is not None else round(wf * self.total)
        decay = ds if ds is not None else round(df * self.total)
        return warm, decay

    @property
    def lam(self) -> float:
        return prepbn_lambda(self.step, *self.schedule()) if self.total or self._warm[1] else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        if self.training and torch.compiler.is_compiling():  # the same products as below
            lam_t, rest = self.mix[0].to(xf.dtype), self.mix[1].to(xf.dtype)
            bn = self.repbn(xf, update=self.update_bn)
            return (lam_t * self.norm(xf) + rest * bn).to(x.dtype)
        lam = self.lam
        if not self.training:
            if not self.eval_mix or lam == 0.0:
                return self.repbn(xf).to(x.dtype)
            return (lam * self.norm(xf) + (1.0 - lam) * self.repbn(xf)).to(x.dtype)
        bn = self.repbn(xf, update=lam < 1.0)
        return (lam * self.norm(xf) + (1.0 - lam) * bn).to(x.dtype)

    def extra_repr(self) -> str:
        return f"warm={self._warm}, decay={self._decay}"


@register
class PRepBN(Method):
    name = "prepbn"
    category = "norm"
    stackable = False
    stack_note = "it updates running statistics (buffers) during the forward"
    citation = ("Guo et al. 2024, SLAB: Efficient Transformers with Simplified Linear Attention "
                "and Progressive Re-parameterized Batch Normalization (ICML)")
    summary = ("lambda RMSNorm + (1-lambda) (BN(x) + eta x), lambda 1 -> 0 over training; "
               "training mode leaks across positions.")
    leaks_across_positions = True

    @dataclass
    class Options:
        init: str = "llama"  # llama (eta = gamma = beta = 0) | vit (eta = gamma = 1)
        warm_frac: float = 0.1  # warm-up share of train.steps (pure RMSNorm)
        decay_frac: float = 0.3  # share of train.steps over which lambda decays to 0
        warm_steps: int | None = None  # absolute warm-up steps (overrides warm_frac)
        decay_steps: int | None = None  # absolute decay steps (overrides decay_frac)
        eval_mix: bool = False  # true: evaluate the lambda mixture (published: RepBN only)

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        o = self.opts
        init = option_choice(self.name, "init", o.init, ("llama", "vit"))
        warm, decay = (o.warm_frac, o.warm_steps), (o.decay_frac, o.decay_steps)

        def factory(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            if site == "final":  # the SLAB LLaMA code keeps the model's final RMSNorm
                return RMSNorm(dim, eps)
            return PRepBNLayer(dim, eps, init, warm, decay, o.eval_mix)

        spec.fill("norm", factory, by=self.name, key=("prepbn", init, warm, decay, o.eval_mix))

    def callbacks(self) -> list[Any]:
        return [StepCallback()]

    def extra_params(self, cfg: ModelConfig) -> int:
        return (baseline_norm_count(cfg) - 1) * (2 * cfg.d_model + 1)  # the final norm stays

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
