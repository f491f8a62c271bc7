"""``modbench methods new NAME --slot SLOT``: a commented template method for one slot, and a
test that runs the conformance kit on it.

:func:`write_method` writes two files into a folder: ``NAME.py``, a working method that fills
the slot (each template is an identity at initialisation, so it declares
``starts_as_baseline``, and documents its parameter and FLOP overheads), and
``test_NAME.py``, which loads the file as a plugin (:func:`modbench.methods.plugins.load_plugins`)
and asserts that every check of :func:`modbench.conformance.kit.check_method` passes. The
template as written passes the kit (tests/conformance/test_scaffold.py holds it); edit the
equation, keep the checks passing.

The slots offered (:data:`SCAFFOLD_SLOTS`) are the ones a new method usually changes: the
per-head query/key transform, the attention output gate, the FFN activation, the norm type
and the residual merge. Only the standard library is imported here; the registry (to refuse a
taken name) is imported when a file is written.
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path

from modbench.errors import ModbenchError

#: scaffold slot -> (the spec slots it fills, one line on what it is)
SCAFFOLD_SLOTS: dict[str, tuple[tuple[str, ...], str]] = {
    "attn.qk": (("attn.q_norm", "attn.k_norm"),
                "attention: per-head transform of the queries and keys before RoPE"),
    "attn.out_gate": (("attn.out_gate",),
                      "attention: a gate on each head's output before the output projection"),
    "ffn.act": (("ffn.act",), "FFN: the activation of the gated FFN (SiLU in the baseline)"),
    "norm": (("norm",), "norm type: the module at every norm site (RMSNorm in the baseline)"),
    "merge": (("merge",), "residual: how a sublayer's output joins the stream (x + out)"),
}

_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_") if part) or "Method"


def check_name(name: str) -> None:
    """Refuse, in one line, a name that is not lower_snake_case, is a Python keyword, or is
    already registered (a built-in method's, or a loaded plugin's)."""
    if not _NAME.fullmatch(name) or keyword.iskeyword(name):
        raise ModbenchError(f"method name {name!r} must be lower_snake_case (a letter, then "
                            "letters, digits or _), and not a Python keyword, e.g. my_gate")
    from modbench.methods.base import load_all

    registry = load_all()
    if name in registry:
        cls = registry[name]
        what = ("a built-in method" if cls.__module__.startswith("modbench.methods.")
                else f"already registered by {cls.__module__}")
        raise ModbenchError(f"'{name}' is {what}; choose another name for the new method")


def write_method(name: str, slot: str, out_dir: str | Path) -> list[Path]:
    """Write ``out_dir/NAME.py`` (a template method filling ``slot``) and
    ``out_dir/test_NAME.py`` (the kit on it); returns the two paths. ``out_dir`` is created if
    missing. Raises :class:`ModbenchError` (one line) for an unknown slot, a bad or taken name,
    or a file that exists (nothing is written then)."""
    if slot not in SCAFFOLD_SLOTS:
        known = "; ".join(f"{s} ({what})" for s, (_, what) in SCAFFOLD_SLOTS.items())
        raise ModbenchError(f"unknown slot {slot!r} for a new method; the slots are: {known}")
    check_name(name)
    folder = Path(out_dir)
    method_file, test_file = folder / f"{name}.py", folder / f"test_{name}.py"
    for path in (method_file, test_file):
        if path.exists():
            raise ModbenchError(f"{path} exists; choose another --out folder or name (nothing "
                                "was written)")
    if folder.exists() and not folder.is_dir():
        raise ModbenchError(f"--out {folder} is a file, not a folder")
    texts = {method_file: _fill(_TEMPLATES[slot], name),
             test_file: _fill(_TEST, name)}
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    try:
        for path, text in texts.items():
            with path.open("x", encoding="utf-8") as f:  # never over a file made meanwhile
                f.write(text)
            written.append(path)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return written


def _fill(template: str, name: str) -> str:
    return template.replace("__NAME__", name).replace("__CLASS__", _class_name(name))


# ------------------------------------------------------------------ the templates
# Each is an identity at initialisation (starts_as_baseline) and passes every check of the
# kit as written. __NAME__ and __CLASS__ are replaced by the method's name and class name.

_HEADER = '''"""__NAME__: {title}

Equation::

{equation}

Citation: (the paper, or "none: my own idea") -- write it here and in ``citation`` below.

Init: {init}

Slots: {slots}
(docs/architecture.md, "Slots").

Written by `modbench methods new`. The conformance kit checks it (docs/methods.md, "Checking a
method"), as a table::

    modbench methods check __NAME__ --methods-from __NAME__.py

or as a test: ``pytest test___NAME__.py``. It compares ``extra_params`` and ``extra_flops``
with the built model and torch's FLOP counter: keep them true when you change the equation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods.base import Method, register
'''

_QK = _HEADER.format(
    title="a learnable per-head scale on the queries and keys.",
    equation="    q_h <- g_h q_h,   k_h <- g'_h k_h   (per head, before RoPE; g = g' = init)",
    init="every scale at ``init`` (1.0): the model starts as the baseline.",
    slots="``attn.q_norm`` and ``attn.k_norm``",
) + '''from modbench.model.spec import ModelSpec


class HeadScale(nn.Module):
    """``x * g_h`` for a ``(B, H, T, d_h)`` tensor: one learnable scalar per head."""

    def __init__(self, n_heads: int, init: float) -> None:
        super().__init__()
        self.init = init
        self.scale = nn.Parameter(torch.full((n_heads, 1, 1), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(x.dtype)

    def modbench_init(self) -> None:
        # called by the model's init pass (Transformer.init_weights): a method's own init is
        # never overwritten by the generic N(0, std^2) draw of nn.Linear / nn.Embedding
        nn.init.constant_(self.scale, self.init)


@register
class __CLASS__(Method):
    name = "__NAME__"
    category = "attention"  # attention | ffn | norm | placement | residual | architecture
    citation = "none yet: write the paper here"
    summary = "A learnable scale per head on the queries and keys (before RoPE)."
    # True while the model at init computes the baseline's logits (here: every scale 1);
    # the kit's "init" check holds it. Set False if your init is not an identity.
    starts_as_baseline = True

    @dataclass
    class Options:  # every option typed, with a default: __NAME__(init=0.5) sets it
        init: float = 1.0

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        # a factory gets the layer's config (c) and its index; `by=self.name` makes a second
        # method filling the same slot a conflict that names both
        def q_scale(c: ModelConfig, layer: int) -> nn.Module:
            return HeadScale(c.n_heads, self.opts.init)

        def k_scale(c: ModelConfig, layer: int) -> nn.Module:
            return HeadScale(c.n_kv_heads, self.opts.init)

        spec.fill("attn.q_norm", q_scale, by=self.name)
        spec.fill("attn.k_norm", k_scale, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        # H query scales and H_kv key scales per layer
        return (cfg.n_heads + cfg.n_kv_heads) * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        # forward FLOPs per token over the baseline, matrix multiplications only (2 per
        # multiply-add); element-wise products count 0
        return 0.0
'''

_OUT_GATE = _HEADER.format(
    title="a gate on each head's attention output, from the layer input.",
    equation="    y_h <- 2 sigmoid(x W)_h * y_h   (x: the normed layer input; W in R^{d x H})",
    init="W = 0, so every gate is 2 sigmoid(0) = 1: the model starts as the baseline.",
    slots="``attn.out_gate``",
) + '''from modbench.model.spec import Builder, ModelSpec


class HeadGate(nn.Module):
    """``y_h * 2 sigmoid(x W)_h``: ``y`` is the heads' output ``(B, H, T, d_h)``, ``x`` the
    sublayer's normed input ``(B, T, d)``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        # a plain parameter, not nn.Linear: the generic init would draw it (and shift the
        # random numbers of every later weight); this one starts at zero
        self.weight = nn.Parameter(torch.zeros(d_model, n_heads))

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = 2 * torch.sigmoid(x @ self.weight.to(x.dtype))  # (B, T, H)
        return y * gate.transpose(1, 2).unsqueeze(-1).to(y.dtype)

    def modbench_init(self) -> None:
        nn.init.zeros_(self.weight)


@register
class __CLASS__(Method):
    name = "__NAME__"
    category = "attention"  # attention | ffn | norm | placement | residual | architecture
    citation = "none yet: write the paper here"
    summary = "A gate 2 sigmoid(x W) on each head's output before the output projection."
    # True while the model at init computes the baseline's logits (here: W = 0, gates 1);
    # the kit's "init" check holds it. Set False if your init is not an identity.
    starts_as_baseline = True

    @dataclass
    class Options:  # every option typed, with a default: __NAME__(key=value) sets it
        pass

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        # the attn.out_gate factory gets the layer's config, the builder (for linear layers
        # made through the model's linear slot) and the layer index
        def gate(c: ModelConfig, build: Builder, layer: int) -> nn.Module:
            return HeadGate(c.d_model, c.n_heads)

        spec.fill("attn.out_gate", gate, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return cfg.d_model * cfg.n_heads * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        # x W per token and layer: 2 d H (a multiply-add is 2 FLOPs)
        return float(2 * cfg.d_model * cfg.n_heads * cfg.n_layers)
'''

_ACT = _HEADER.format(
    title="Swish with a learnable slope in the gated FFN.",
    equation="    FFN(x) = W_down( swish_b(W_gate x) * W_up x ),  swish_b(u) = u sigmoid(b u)",
    init="b = ``init`` (1.0): swish_1 is SiLU, so the model starts as the baseline.",
    slots="``ffn.act``",
) + '''from modbench.model.spec import ModelSpec


class Swish(nn.Module):
    """``u * sigmoid(b u)`` with one learnable ``b`` per layer."""

    def __init__(self, init: float) -> None:
        super().__init__()
        self.init = init
        self.slope = nn.Parameter(torch.tensor(float(init)))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return u * torch.sigmoid(self.slope.to(u.dtype) * u)

    def modbench_init(self) -> None:
        nn.init.constant_(self.slope, self.init)


@register
class __CLASS__(Method):
    name = "__NAME__"
    category = "ffn"  # attention | ffn | norm | placement | residual | architecture
    citation = "none yet: write the paper here"
    summary = "Swish u sigmoid(b u) with a learnable slope b in place of SiLU."
    # True while the model at init computes the baseline's logits (here: b = 1 is SiLU);
    # the kit's "init" check holds it. Set False if your init is not an identity.
    starts_as_baseline = True

    @dataclass
    class Options:  # every option typed, with a default: __NAME__(init=1.5) sets it
        init: float = 1.0

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        def act(c: ModelConfig, layer: int) -> nn.Module:
            return Swish(self.opts.init)

        spec.fill("ffn.act", act, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return cfg.n_layers  # one slope per layer

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0  # element-wise
'''

_NORM = _HEADER.format(
    title="RMSNorm with a learnable scalar on top of its gain.",
    equation="    N(x) = s * g * x / sqrt(mean(x^2) + eps)   (g per channel, s one scalar)",
    init="g = 1, s = ``init`` (1.0): the baseline's RMSNorm, so the model starts as the baseline.",
    slots="``norm`` (every norm site that the placement gives a norm)",
) + '''from modbench.model.spec import ModelSpec


class ScaledRMSNorm(nn.Module):
    """RMSNorm (computed in float32, cast back, as the baseline's) times a learnable scalar."""

    def __init__(self, dim: int, eps: float, init: float) -> None:
        super().__init__()
        self.eps, self.init = eps, init
        self.weight = nn.Parameter(torch.ones(dim))
        self.scale = nn.Parameter(torch.tensor(float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * inv * self.weight.float() * self.scale.float()).to(x.dtype)

    def modbench_init(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.constant_(self.scale, self.init)


@register
class __CLASS__(Method):
    name = "__NAME__"
    category = "norm"  # attention | ffn | norm | placement | residual | architecture
    citation = "none yet: write the paper here"
    summary = "RMSNorm times one learnable scalar per norm."
    # True while the model at init computes the baseline's logits (here: s = 1);
    # the kit's "init" check holds it. Set False if your init is not an identity.
    starts_as_baseline = True

    @dataclass
    class Options:  # every option typed, with a default: __NAME__(init=0.5) sets it
        init: float = 1.0

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        # called for every site that holds a norm: `site` (attn.pre, ffn.pre, final, ...) and
        # `layer` say which, if the norm should differ by site
        def norm(dim: int, eps: float, site: str, layer: int) -> nn.Module:
            return ScaledRMSNorm(dim, eps, self.opts.init)

        spec.fill("norm", norm, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        # one scalar per norm; the baseline placement (Pre-LN) has 2 norms a layer and a
        # final one (another placement has other sites: the overhead is stated for this one)
        return 2 * cfg.n_layers + 1

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0  # element-wise
'''

_MERGE = _HEADER.format(
    title="a learnable per-channel scale on each residual branch.",
    equation="    x' = x + a * F(x)   (a in R^d, one vector per sublayer)",
    init="a = ``init`` (1.0) everywhere: x + F(x), so the model starts as the baseline.",
    slots="``merge`` (the residual merge of every sublayer)",
) + '''from modbench.model.spec import ModelSpec
from modbench.model.stream import StreamState


class ScaledMerge(nn.Module):
    """``x + a * out`` with a per-channel ``a``."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.init = init
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
        # `state` holds what methods keep from earlier layers (docs/architecture.md, "The
        # block contract"); this merge reads only x and the sublayer's output
        return x + self.scale.to(out.dtype) * out

    def modbench_init(self) -> None:
        nn.init.constant_(self.scale, self.init)


@register
class __CLASS__(Method):
    name = "__NAME__"
    category = "residual"  # attention | ffn | norm | placement | residual | architecture
    citation = "none yet: write the paper here"
    summary = "A learnable per-channel scale on every residual branch: x + a * F(x)."
    # True while the model at init computes the baseline's logits (here: a = 1);
    # the kit's "init" check holds it. Set False if your init is not an identity.
    starts_as_baseline = True

    @dataclass
    class Options:  # every option typed, with a default: __NAME__(init=0.1) sets it
        init: float = 1.0

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        # one merge per sublayer: `sublayer` is "attn" or "ffn"
        def merge(c: ModelConfig, layer: int, sublayer: str) -> nn.Module:
            return ScaledMerge(c.d_model, self.opts.init)

        spec.fill("merge", merge, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 2 * cfg.d_model * cfg.n_layers  # one vector per sublayer

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0  # element-wise
'''

_TEMPLATES = {"attn.qk": _QK, "attn.out_gate": _OUT_GATE, "ffn.act": _ACT, "norm": _NORM,
              "merge": _MERGE}

_TEST = '''"""The conformance kit on __NAME__ (written by `modbench methods new`).

Run it with ``pytest test___NAME__.py``; the same checks as a table::

    modbench methods check __NAME__ --methods-from __NAME__.py
"""

from __future__ import annotations

from pathlib import Path

from modbench.conformance import check_method, format_table
from modbench.methods.plugins import load_plugins

METHOD_FILE = Path(__file__).resolve().with_name("__NAME__.py")


def test___NAME___conforms() -> None:
    """Every check of the kit passes (modbench.conformance.CHECKS; the slow ones, compile and
    export, too: skip them while you iterate with check_method(..., skip=["slow"]))."""
    load_plugins([str(METHOD_FILE)])
    results = check_method("__NAME__")
    assert not any(r.failed for r in results), format_table(results, "__NAME__")
'''
