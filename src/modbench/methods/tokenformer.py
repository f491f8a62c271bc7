"""TokenFormer: Pattention layers (token-parameter attention) in place of the projections and
the FFN, and growth by appending parameter tokens.

Equation (docs/sources.md#tokenformer; ``Haiyang-W/TokenFormer``
``megatron/model/tokenformer.py``)::

    Pattention(X) = Theta(X K_P^T) V_P,   K_P in R^(n x d_in), V_P in R^(n x d_out)

    A = X K_P^T  (one row of n scores per token; no 1/sqrt(d), no bias)
    l2_norm_gelu (default):  Theta(A) = GeLU(sqrt(m) A / ||A||_2)
    gelu_l2_norm:            Theta(A) = sqrt(m) GeLU(A) / ||GeLU(A)||_2
    softmax:                 Theta(A) = m exp(A) / ||exp(A)||_1 = m softmax(A)

with the norms taken per token over the n parameter tokens and GeLU the exact (erf) form. In
the published code m = n; here m is the option ``norm_slots`` (default n), so that a grown
model keeps the scale of the model it grew from (see Growth).

Citation: Wang, Fan, Chen, et al. 2024, "TokenFormer: Rethinking Transformer Scaling with
Tokenized Model Parameters" (arXiv 2410.23168); code ``Haiyang-W/TokenFormer``
(``Pattention``, ``ParallelTokenformerLayer``, ``configs/tokenformer/150M_train_pile.yml``).

Where (``ParallelTokenformerLayer``): the q, k, v and o projections are Pattentions with
n = ``slots`` parameter tokens (``qkv_slot_num`` = ``proj_slot_num`` = d in the 150M
config), and the whole FFN is one Pattention d -> d with n = ``ffn_slots`` (4 d).
Token-token attention (RoPE, SDPA softmax) is unchanged. The block is Pre-LN with
*non-parametric* LayerNorm at the sublayer inputs (``layernorm_nonparam``) and a regular
LayerNorm (gain and bias) as the final norm (``final_norm: layernorm``). The LM head stays a
plain linear layer (or the tied embedding).

Slots: ``linear`` (roles q, k, v, o give Pattentions; every other role, i.e. the head, a
plain ``nn.Linear``), ``ffn`` (one Pattention) and ``norm`` (the factory looks at its
``site`` argument: ``final`` gives a LayerNorm with gain and bias, every other site the
non-parametric LayerNorm; which sites hold a norm stays the placement's business, so
``post_ln+tokenformer`` composes). Linear wrappers (CoMT) see the q, k, v, o Pattentions but
not the FFN, which has no gate/up/down roles.

Init: K_P ~ N(0, init_std^2) (``init_method: normal``); V_P ~ N(0, (2 / (L sqrt(d)))^2),
GPT-NeoX's ``wang_init`` (``output_layer_init_method: wang_init``: std = 2 / num_layers /
sqrt(hidden_size)), for every Pattention including k/v under GQA and the FFN. Both are drawn
in the component pass (``modbench_init``). The final LayerNorm starts at g = 1, b = 0; the
embedding and the head keep the lab's N(0, init_std^2).

Parameters over the baseline (n = slots, n_f = ffn_slots, H, H_kv heads of size d_h, L
layers, counted for the baseline placement)::

    L [ n (4 d + 2 H d_h + 2 H_kv d_h) - 2 d (H + H_kv) d_h      q, k, v, o
        + 2 n_f d - 3 d d_ff                                       FFN
        - 2 d ]                                                    input norms lose their gain
    + d                                                            final LN gains a bias

(each projection costs n (d_in + d_out): twice a linear layer when n = d; the FFN 8 d^2 at
n_f = 4 d, as SwiGLU at d_ff = 8 d / 3). FLOPs per token: every Pattention costs
2 n (d_in + d_out) (the two matmuls), so the extra forward FLOPs are twice the extra
matrix parameters: L [2 n (4 d + 2 H d_h + 2 H_kv d_h) - 4 d (H + H_kv) d_h + 4 n_f d
- 6 d d_ff]. The normalisation of Theta is element-wise and not counted.

Growth (paper section 3.4; code ``custom_load_fn_incremental``): a model with n' > n tokens
starts from a trained one by keeping the old tokens and appending new ones.
:func:`grow_tokenformer` does this for a state dict, and the trainer does it through
``train.init_from`` (:meth:`TokenFormer.grow_state_dict`). The grown model computes exactly
the same function when (i) the new K_P rows are zero: their scores are 0, which adds nothing
to ||A||_2 or ||GeLU(A)||_2, and Theta gives them weight GeLU(0) = 0 whatever their V_P
rows; and (ii) the scale m stays the old one: write ``tokenformer(slots=n',norm_slots=n)``
(the growth refuses a changed m with a message saying so). The published loader keeps the
new tokens' random initialisation and uses m = n', so its grown model starts close to, not
equal to, the small one; the paper describes zero-initialised new tokens.

Choices of our own (deviations): the new V_P rows take the grown model's own fresh
initialisation (wang init), not zero: with both K_P and V_P rows zero, dL/dV_new = Theta_new
dL/dY = 0 and dL/dK_new is proportional to V_new = 0, so the new tokens would never move
from zero under Adam(W) (a saddle; ``grow_tokenformer(..., target=None)`` gives that all-zero
form, and a test shows it is stuck). The ``softmax`` form cannot grow without changing the
function (a zero key gets weight exp(0) / Z, and m multiplies every weight), so its growth
is refused. The norm in Theta is clamped below at 1e-12 (the code has no epsilon). The lab's
RoPE rotates the whole head (the 150M config rotates 25%); GQA stays as configured (the
published model is MHA); dropout is 0 as in the configs. Options: ``slots`` (default d),
``ffn_slots`` (default 4 d), ``activation`` (``l2_norm_gelu``, ``gelu_l2_norm``, ``softmax``),
``norm_slots`` and ``ffn_norm_slots`` (the m of Theta, default the slot counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, method_spec, option_choice, register
from modbench.methods.basic_norms import LayerNorm
from modbench.model.spec import Builder, ModelSpec
from modbench.model.stream import ForwardContext

ACTIVATIONS = ("l2_norm_gelu", "gelu_l2_norm", "softmax")
PATTENTION_ROLES = ("q", "k", "v", "o")
KEY_SUFFIX, VALUE_SUFFIX = "key_param_tokens", "value_param_tokens"
_TINY = 1e-12


def theta(a: torch.Tensor, activation: str, m: int) -> torch.Tensor:
    """TokenFormer's modified softmax over the last dimension (the n parameter tokens), in at
    least float32; ``m`` is the normalisation's token count (sqrt(m) or m)."""
    af = a.to(torch.promote_types(a.dtype, torch.float32))
    if activation == "l2_norm_gelu":
        y = F.gelu(af * (math.sqrt(m) / af.norm(dim=-1, keepdim=True).clamp_min(_TINY)))
    elif activation == "gelu_l2_norm":
        g = F.gelu(af)
        y = g * (math.sqrt(m) / g.norm(dim=-1, keepdim=True).clamp_min(_TINY))
    elif activation == "softmax":
        y = torch.softmax(af, dim=-1) * m
    else:  # pragma: no cover - options are validated in configure
        raise ValueError(activation)
    return y.to(a.dtype)


class Pattention(nn.Module):
    """``Theta(x K_P^T) V_P`` with n parameter tokens (keys of width d_in, values d_out)."""

    def __init__(self, d_in: int, d_out: int, n: int, activation: str, norm_slots: int,
                 key_std: float, value_std: float) -> None:
        super().__init__()
        self.activation, self.norm_slots = activation, norm_slots
        self.key_std, self.value_std = key_std, value_std
        self.key_param_tokens = nn.Parameter(torch.empty(n, d_in))
        self.value_param_tokens = nn.Parameter(torch.empty(n, d_out))

    def modbench_init(self) -> None:
        nn.init.normal_(self.key_param_tokens, mean=0.0, std=self.key_std)
        nn.init.normal_(self.value_param_tokens, mean=0.0, std=self.value_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.linear(x, self.key_param_tokens.to(x.dtype))
        w = theta(a, self.activation, self.norm_slots)
        return torch.matmul(w, self.value_param_tokens.to(w.dtype))

    def extra_repr(self) -> str:
        n, d_in = self.key_param_tokens.shape
        return (f"{d_in} -> {self.value_param_tokens.shape[1]}, tokens={n}, "
                f"{self.activation}, norm_slots={self.norm_slots}")


class PattentionFFN(nn.Module):
    """The whole FFN as one Pattention d -> d."""

    def __init__(self, pattention: Pattention) -> None:
        super().__init__()
        self.pattention = pattention

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.pattention(x)


def wang_std(cfg: ModelConfig) -> float:
    """GPT-NeoX's ``wang_init`` standard deviation: 2 / L / sqrt(d)."""
    return 2.0 / cfg.n_layers / math.sqrt(cfg.d_model)


@dataclass
class Resolved:
    slots: int
    ffn_slots: int
    norm_slots: int
    ffn_norm_slots: int
    activation: str


@register
class TokenFormer(Method):
    name = "tokenformer"
    category = "architecture"
    citation = ("Wang et al. 2024, TokenFormer: Rethinking Transformer Scaling with Tokenized "
                "Model Parameters (arXiv 2410.23168)")
    summary = ("Pattention Theta(X K_P^T) V_P for q, k, v, o and the whole FFN; non-parametric "
               "LN; growable by appending parameter tokens.")

    @dataclass
    class Options:
        slots: int | None = None  # parameter tokens of q, k, v, o (None: d_model)
        ffn_slots: int | None = None  # parameter tokens of the FFN (None: 4 d_model)
        activation: str = "l2_norm_gelu"  # l2_norm_gelu | gelu_l2_norm | softmax
        norm_slots: int | None = None  # m in Theta for q, k, v, o (None: slots)
        ffn_norm_slots: int | None = None  # m in Theta for the FFN (None: ffn_slots)

    def resolve(self, cfg: ModelConfig) -> Resolved:
        o = self.opts
        act = option_choice(self.name, "activation", o.activation, ACTIVATIONS)
        slots = cfg.d_model if o.slots is None else o.slots
        ffn_slots = 4 * cfg.d_model if o.ffn_slots is None else o.ffn_slots
        r = Resolved(slots, ffn_slots, slots if o.norm_slots is None else o.norm_slots,
                     ffn_slots if o.ffn_norm_slots is None else o.ffn_norm_slots, act)
        for key in ("slots", "ffn_slots", "norm_slots", "ffn_norm_slots"):
            if getattr(r, key) < 1:
                raise ModbenchError(
                    f"option {key}={getattr(r, key)} of method 'tokenformer' must be a "
                    "positive number of parameter tokens"
                )
        return r

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        r = self.resolve(cfg)
        key_std, value_std = cfg.init_std, wang_std(cfg)

        def linear(role: str, d_in: int, d_out: int, layer: int) -> nn.Module:
            if role in PATTENTION_ROLES:
                return Pattention(d_in, d_out, r.slots, r.activation, r.norm_slots,
                                  key_std, value_std)
            return nn.Linear(d_in, d_out, bias=False)

        def ffn(c: ModelConfig, build: Builder, layer: int) -> nn.Module:
            return PattentionFFN(Pattention(c.d_model, c.d_model, r.ffn_slots, r.activation,
                                            r.ffn_norm_slots, key_std, value_std))

        def norm(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            return LayerNorm(dim, eps, affine=site == "final")

        spec.fill("linear", linear, by=self.name)
        spec.fill("ffn", ffn, by=self.name)
        spec.fill("norm", norm, by=self.name)

    def _matrix_delta(self, cfg: ModelConfig) -> int:
        r = self.resolve(cfg)
        d, dh, h, h_kv = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        attn = r.slots * (4 * d + 2 * h * dh + 2 * h_kv * dh) - 2 * d * (h + h_kv) * dh
        ffn = 2 * r.ffn_slots * d - 3 * d * cfg.d_ff
        return cfg.n_layers * (attn + ffn)

    def extra_params(self, cfg: ModelConfig) -> int:
        return self._matrix_delta(cfg) - 2 * cfg.d_model * cfg.n_layers + cfg.d_model

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return float(2 * self._matrix_delta(cfg))

    def grow_state_dict(self, state: dict[str, torch.Tensor], old_cfg: ModelConfig,
                        new_cfg: ModelConfig,
                        target: dict[str, torch.Tensor] | None = None,
                        ) -> dict[str, torch.Tensor]:
        return grow_tokenformer(state, old_cfg, new_cfg, target=target)


# --------------------------------------------------------------------------------- growth


def _tokenformer_of(cfg: ModelConfig, which: str) -> TokenFormer:
    found = [m for m in method_spec(cfg).methods if isinstance(m, TokenFormer)]
    if not found:
        raise ModbenchError(
            f"tokenformer growth needs a tokenformer model on both sides, but the {which} "
            f"model's method is {cfg.method!r}; initialise from a tokenformer run"
        )
    return found[0]


def grow_tokenformer(state: dict[str, torch.Tensor], old_cfg: ModelConfig,
                     new_cfg: ModelConfig, *,
                     target: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The state dict of a TokenFormer with more parameter tokens, computing exactly the same
    function as ``state`` (trained under ``old_cfg``) does.

    Every Pattention's old tokens are kept in front; the new K_P rows are zero; the new V_P
    rows are taken from ``target`` (the grown model's own initialised state dict, which gives
    trainable new tokens) or are zero when ``target`` is None (both zero: a saddle the new
    tokens never leave under gradient descent). Other entries are passed through unchanged
    (the caller checks that their shapes fit). The new model must keep the old
    normalisation count m (``norm_slots``/``ffn_norm_slots``) and activation; ``softmax``
    cannot grow.
    """
    old = _tokenformer_of(old_cfg, "initial").resolve(old_cfg)
    new = _tokenformer_of(new_cfg, "new").resolve(new_cfg)
    if old.activation != new.activation:
        raise ModbenchError(
            f"tokenformer growth cannot change the activation ({old.activation} -> "
            f"{new.activation}); use activation={old.activation} in the new model"
        )
    for part, n_key, m_key in (("q/k/v/o", "slots", "norm_slots"),
                               ("FFN", "ffn_slots", "ffn_norm_slots")):
        n_old, n_new = getattr(old, n_key), getattr(new, n_key)
        m_old, m_new = getattr(old, m_key), getattr(new, m_key)
        if n_new < n_old:
            raise ModbenchError(
                f"tokenformer growth cannot remove {part} parameter tokens ({n_key} {n_old} -> "
                f"{n_new}); give the new model {n_key} >= {n_old}"
            )
        if n_new > n_old and new.activation == "softmax":
            raise ModbenchError(
                "tokenformer(activation=softmax) cannot grow without changing its function "
                "(a zero key still gets weight exp(0)/Z); grow an l2_norm_gelu or "
                "gelu_l2_norm model instead"
            )
        if m_new != m_old:
            raise ModbenchError(
                f"growing tokenformer keeps the function only if Theta's scale stays at "
                f"{m_key}={m_old} (the new model has {m_new}); add {m_key}={m_old} to the new "
                f"model's tokenformer options, e.g. tokenformer({n_key}={n_new},"
                f"{m_key}={m_old})"
            )
    out = dict(state)
    for name, t in state.items():
        is_key, is_value = name.endswith(KEY_SUFFIX), name.endswith(VALUE_SUFFIX)
        if not (is_key or is_value):
            continue
        ffn = ".ffn." in name
        n_old_exp = old.ffn_slots if ffn else old.slots
        n_new = new.ffn_slots if ffn else new.slots
        if t.shape[0] != n_old_exp:
            raise ModbenchError(
                f"parameter {name} has {t.shape[0]} tokens but the initial model's config "
                f"says {n_old_exp}; the checkpoint and its config do not match"
            )
        if n_new == t.shape[0]:
            continue
        if is_value and target is not None:
            if name not in target or tuple(target[name].shape) != (n_new, t.shape[1]):
                raise ModbenchError(
                    f"the grown model has no parameter {name} of shape ({n_new}, "
                    f"{t.shape[1]}); build the target from the new config"
                )
            grown = target[name].detach().to(device=t.device, dtype=t.dtype).clone()
        else:
            grown = t.new_zeros((n_new, t.shape[1]))
        grown[: t.shape[0]] = t
        out[name] = grown
    return out
