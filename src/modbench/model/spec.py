"""The slots of the shared decoder, the factory type of each, and the builder that fills them.

The decoder never branches on a method name. It asks a :class:`ModelSpec` for each piece it
needs, and methods (``modbench.methods``) fill the spec's slots before the model is built.
Each slot holds a *factory*, typed by one :class:`~typing.Protocol` per slot kind
(:class:`NormFactory`, :class:`CoreFactory`, ...); the baseline fills the non-optional slots
with the Llama-2 defaults (``baseline_spec`` in :mod:`modbench.model.transformer`).

The slot table is :data:`SLOTS`: name, factory Protocol, exclusive or additive, meaning and
baseline of every slot. ``docs/architecture.md`` (section "Slots") writes it out, and
``tests/model/test_slots.py`` checks the two agree.

While a model is built, the :class:`Builder` records every linear layer and norm site it makes
in a :class:`Parts` index (``model.parts``), so that a method's ``post_init`` reaches a
projection by its role and layer, not by an attribute path.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, overload

from torch import nn

from modbench.config import ModelConfig
from modbench.errors import ModbenchError

NORM_SITES = (
    "embed", "attn.pre", "attn.post", "attn.residual",
    "ffn.pre", "ffn.post", "ffn.residual", "final",
)
LINEAR_ROLES = ("q", "k", "v", "o", "gate", "up", "down", "head")
SUBLAYERS = ("attn", "ffn")


# ------------------------------------------------------------------ factory types
# Positional-only parameters: an implementation may name its parameters as it likes.


class NormFactory(Protocol):
    """Slot ``norm``: the norm at one site that holds a norm."""

    def __call__(self, dim: int, eps: float, site: str, layer: int, /) -> nn.Module: ...


class Placement(Protocol):
    """Slot ``placement``: whether ``site`` of ``layer`` holds a norm (else Identity)."""

    def __call__(self, site: str, layer: int, n_layers: int, /) -> bool: ...


class LinearFactory(Protocol):
    """Slot ``linear``: the linear layer of one role (``q k v o gate up down head``)."""

    def __call__(self, role: str, d_in: int, d_out: int, layer: int, /) -> nn.Module: ...


class PartFactory(Protocol):
    """Per-layer parts of a core: ``attn.q_norm``, ``attn.k_norm``, ``attn.qk_post``,
    ``attn.v_path``, ``attn.kernel``, ``ffn.act``."""

    def __call__(self, cfg: ModelConfig, layer: int, /) -> nn.Module: ...


class CoreFactory(Protocol):
    """A core or a part that makes its own linear layers: ``attn``, ``ffn``,
    ``attn.out_gate``. ``build`` gives linear layers, norms and the other slots."""

    def __call__(self, cfg: ModelConfig, build: Builder, layer: int, /) -> nn.Module: ...


class MergeFactory(Protocol):
    """Slot ``merge``: the residual merge of one sublayer (``sublayer`` is attn or ffn)."""

    def __call__(self, cfg: ModelConfig, layer: int, sublayer: str, /) -> nn.Module: ...


class ModelPartFactory(Protocol):
    """Once-per-model parts: ``stream`` and ``logits``."""

    def __call__(self, cfg: ModelConfig, /) -> nn.Module: ...


class NormWrapper(Protocol):
    """Additive slot ``norm_wrappers``: wraps the module at a norm site (a norm or Identity)."""

    def __call__(self, module: nn.Module, site: str, layer: int, cfg: ModelConfig, /
                 ) -> nn.Module: ...


class LinearWrapper(Protocol):
    """Additive slot ``linear_wrappers``: wraps a linear layer."""

    def __call__(self, module: nn.Module, role: str, d_in: int, d_out: int, layer: int,
                 cfg: ModelConfig, /) -> nn.Module: ...


class TiePlan(Protocol):
    """Slot ``tie``: the layer whose module ``layer`` reuses. ``kind`` is ``core`` (``name`` a
    sublayer: the whole attention or FFN core), ``linear`` (``name`` a role: the linear layer
    the ``linear`` slot made, before the linear wrappers) or ``norm`` (``name`` a site: the
    norm the ``norm`` slot made, before the norm wrappers). ``layer`` itself means its own
    module; an earlier layer means that layer's module, shared (the same parameters)."""

    def __call__(self, kind: str, name: str, layer: int, /) -> int: ...


class ShapePlan(Protocol):
    """Slot ``shape``: the config layer ``layer`` (0 .. L-1) is built from, the model's config
    with that layer's own sizes (only :data:`LAYER_SHAPE_FIELDS` may differ). The builder hands
    it to the layer's cores, merges and wrappers, and the cores hand it on to their parts."""

    def __call__(self, cfg: ModelConfig, layer: int, /) -> ModelConfig: ...


# ------------------------------------------------------------------ the slot table


def _call_parameters(protocol: type) -> list[inspect.Parameter]:
    params = inspect.signature(protocol.__call__).parameters.values()
    return [p for p in params if p.name != "self"]


@dataclass(frozen=True)
class SlotInfo:
    """One slot: its factory type, kind, meaning and what the baseline puts there."""

    name: str
    protocol: type  # the Protocol every filler satisfies
    additive: bool  # additive (every filler applies, in method order) or exclusive
    meaning: str  # what the component does (one line, Markdown)
    baseline: str  # what the baseline puts there (Markdown)
    optional: bool = False  # the baseline leaves it unfilled; the builder uses a pass-through

    @property
    def arity(self) -> int:
        """Number of positional arguments the factory is called with."""
        return len(_call_parameters(self.protocol))

    @property
    def signature(self) -> str:
        """The factory's call, e.g. ``(cfg: ModelConfig, layer: int) -> nn.Module``."""
        ret = inspect.signature(self.protocol.__call__).return_annotation
        args = ", ".join(f"{p.name}: {p.annotation}" for p in _call_parameters(self.protocol))
        return f"({args}) -> {ret}"


def _slot(name: str, protocol: type, meaning: str, baseline: str, *, optional: bool = False,
          additive: bool = False) -> SlotInfo:
    return SlotInfo(name, protocol, additive, meaning, baseline, optional)


SLOTS: dict[str, SlotInfo] = {s.name: s for s in (
    _slot("norm", NormFactory, "the norm type, at every site that holds a norm", "RMSNorm"),
    _slot("placement", Placement, "which norm sites hold a norm (the others are Identity)",
          "Pre-LN: `attn.pre`, `ffn.pre`, `final`"),
    _slot("linear", LinearFactory, "every linear layer, by role", "`nn.Linear(bias=False)`"),
    _slot("attn.q_norm", PartFactory, "per-head queries before RoPE: `(q) -> q`",
          "unfilled: Identity", optional=True),
    _slot("attn.k_norm", PartFactory, "per-head keys before RoPE: `(k) -> k`",
          "unfilled: Identity", optional=True),
    _slot("attn.qk_post", PartFactory, "after RoPE: `(q, k, ctx) -> (q, k)`",
          "unfilled: pass-through", optional=True),
    _slot("attn.v_path", PartFactory, "the value path: `(v, ctx) -> v`",
          "unfilled: pass-through", optional=True),
    _slot("attn.kernel", PartFactory, "scores and mixing: `(q, k, v, ctx) -> y`",
          "causal softmax (SDPA)"),
    _slot("attn.out_gate", CoreFactory, "before the output projection: `(y, x) -> y`",
          "unfilled: pass-through", optional=True),
    _slot("attn", CoreFactory, "the whole attention core: `(x, ctx) -> out`",
          "Attention (GQA, RoPE)"),
    _slot("ffn.act", PartFactory, "activation of the gated FFN: `(x) -> x`", "unfilled: SiLU",
          optional=True),
    _slot("ffn", CoreFactory, "the whole FFN core: `(x, ctx) -> out`", "SwiGLU"),
    _slot("merge", MergeFactory, "residual merge: `(x, out, state) -> x'`", "`x + out`"),
    _slot("stream", ModelPartFactory, "the residual stream: `start`, `read`, `write`, `finish`",
          "one additive lane"),
    _slot("logits", ModelPartFactory, "transform of the final logits: `(logits) -> logits`",
          "unfilled: Identity", optional=True),
    _slot("tie", TiePlan,
          "weight sharing across layers: `(kind, name, layer) -> source layer` for cores, "
          "linear layers (before wrappers) and norms (before wrappers)",
          "unfilled: every layer its own", optional=True),
    _slot("shape", ShapePlan,
          "per-layer shapes: the layer's own config (`n_heads`, `n_kv_heads`, `d_ff`, "
          "`attn_head_dim`), seen by its cores, their parts, merges and wrappers",
          "unfilled: every layer the model's config", optional=True),
    _slot("norm_wrappers", NormWrapper,
          "wraps the module at every norm site (a norm or Identity)", "none", additive=True),
    _slot("linear_wrappers", LinearWrapper, "wraps every linear layer", "none", additive=True),
)}

EXCLUSIVE_SLOTS = tuple(s for s, info in SLOTS.items() if not info.additive)
ADDITIVE_SLOTS = tuple(s for s, info in SLOTS.items() if info.additive)

PartSlot = Literal["attn.q_norm", "attn.k_norm", "attn.qk_post", "attn.v_path", "attn.kernel",
                   "ffn.act"]
CoreSlot = Literal["attn", "ffn", "attn.out_gate"]
ModelPartSlot = Literal["stream", "logits"]
TIE_KINDS = ("core", "linear", "norm")
# the ModelConfig fields a layer's config (the shape slot) may change; RoPE needs the same
# head_dim in every layer, so a layer that changes n_heads sets attn_head_dim
LAYER_SHAPE_FIELDS = ("n_heads", "n_kv_heads", "d_ff", "attn_head_dim")
AnyFactory = Callable[..., Any]


def check_factory(slot: str, value: object, by: str) -> None:
    """Raise ``ValueError`` unless ``value`` can be called with ``slot``'s positional
    arguments (checked on placeholders, nothing is called)."""
    info = SLOTS[slot]
    what = f"the {slot} slot takes a factory called as {info.signature}"
    if not callable(value):
        raise ValueError(f"{what}; '{by}' filled it with {type(value).__name__} {value!r}, "
                         "which is not callable")
    try:
        sig = inspect.signature(value)
    except (TypeError, ValueError):  # no signature to check (a builtin): trust it
        return
    try:
        sig.bind(*([None] * info.arity))
    except TypeError as e:
        name = getattr(value, "__qualname__", type(value).__qualname__)
        raise ValueError(f"{what}; '{by}' filled it with {name}{sig}, which cannot be called "
                         f"with {info.arity} positional arguments ({e})") from None


# ------------------------------------------------------------------ the spec


@dataclass
class _Fill:
    value: Any
    owner: str  # the method that filled the slot ("baseline" for defaults)
    key: Any  # equality key: two fills with the same key do not conflict


@dataclass
class ModelSpec:
    """Slot table of one model. Built from the baseline defaults, then edited by methods."""

    fills: dict[str, _Fill] = field(default_factory=dict)
    additive: dict[str, list[tuple[str, Any]]] = field(
        default_factory=lambda: {s: [] for s in ADDITIVE_SLOTS}
    )

    @overload
    def fill(self, slot: Literal["norm"], value: NormFactory, *, by: str,
             key: Any = None) -> None: ...
    @overload
    def fill(self, slot: Literal["placement"], value: Placement, *, by: str,
             key: Any = None) -> None: ...
    @overload
    def fill(self, slot: Literal["linear"], value: LinearFactory, *, by: str,
             key: Any = None) -> None: ...
    @overload
    def fill(self, slot: PartSlot, value: PartFactory, *, by: str, key: Any = None) -> None: ...
    @overload
    def fill(self, slot: CoreSlot, value: CoreFactory, *, by: str, key: Any = None) -> None: ...
    @overload
    def fill(self, slot: Literal["merge"], value: MergeFactory, *, by: str,
             key: Any = None) -> None: ...
    @overload
    def fill(self, slot: ModelPartSlot, value: ModelPartFactory, *, by: str,
             key: Any = None) -> None: ...
    @overload
    def fill(self, slot: Literal["tie"], value: TiePlan, *, by: str, key: Any = None) -> None: ...
    @overload
    def fill(self, slot: Literal["shape"], value: ShapePlan, *, by: str,
             key: Any = None) -> None: ...
    def fill(self, slot: str, value: AnyFactory, *, by: str, key: Any = None) -> None:
        """Fill an exclusive slot. ``key`` identifies the filler for conflict checks
        (defaults to ``by``): two methods may fill a slot only with the same key.
        A factory that cannot be called with the slot's arguments is a ``ValueError``."""
        if slot not in EXCLUSIVE_SLOTS:
            hint = " (use add() for additive slots)" if slot in ADDITIVE_SLOTS else ""
            raise ValueError(f"unknown slot {slot!r}{hint}")
        check_factory(slot, value, by)
        key = by if key is None else key
        cur = self.fills.get(slot)
        if cur is not None and cur.owner != "baseline" and cur.owner != by and cur.key != key:
            raise ModbenchError(
                f"methods '{cur.owner}' and '{by}' both set the {slot} slot differently; "
                "they cannot be combined, pick one"
            )
        self.fills[slot] = _Fill(value, by, key)

    @overload
    def add(self, slot: Literal["norm_wrappers"], value: NormWrapper, *, by: str) -> None: ...
    @overload
    def add(self, slot: Literal["linear_wrappers"], value: LinearWrapper, *, by: str
            ) -> None: ...
    def add(self, slot: str, value: AnyFactory, *, by: str) -> None:
        """Add a filler to an additive slot (applied after the earlier ones)."""
        if slot not in ADDITIVE_SLOTS:
            raise ValueError(f"unknown additive slot {slot!r}")
        check_factory(slot, value, by)
        self.additive[slot].append((by, value))

    @overload
    def get(self, slot: Literal["norm"]) -> NormFactory: ...
    @overload
    def get(self, slot: Literal["placement"]) -> Placement: ...
    @overload
    def get(self, slot: Literal["linear"]) -> LinearFactory: ...
    @overload
    def get(self, slot: PartSlot) -> PartFactory: ...
    @overload
    def get(self, slot: CoreSlot) -> CoreFactory: ...
    @overload
    def get(self, slot: Literal["merge"]) -> MergeFactory: ...
    @overload
    def get(self, slot: ModelPartSlot) -> ModelPartFactory: ...
    @overload
    def get(self, slot: Literal["tie"]) -> TiePlan: ...
    @overload
    def get(self, slot: Literal["shape"]) -> ShapePlan: ...
    @overload
    def get(self, slot: str) -> AnyFactory: ...

    def get(self, slot: str) -> AnyFactory:
        """The factory filling an exclusive slot (``KeyError`` if none does)."""
        value: AnyFactory = self.fills[slot].value
        return value

    def owner(self, slot: str) -> str:
        return self.fills[slot].owner

    @overload
    def wrappers(self, slot: Literal["norm_wrappers"]) -> list[NormWrapper]: ...
    @overload
    def wrappers(self, slot: Literal["linear_wrappers"]) -> list[LinearWrapper]: ...
    @overload
    def wrappers(self, slot: str) -> list[AnyFactory]: ...

    def wrappers(self, slot: str) -> list[Any]:
        return [v for _, v in self.additive[slot]]

    def describe(self) -> dict[str, str]:
        """Which method fills each slot (for config records and `modbench methods`)."""
        out = {s: f.owner for s, f in sorted(self.fills.items())}
        for s, items in self.additive.items():
            if items:
                out[s] = "+".join(o for o, _ in items)
        return out


# ------------------------------------------------------------------ building


class Parts:
    """The linear layers and norm sites of one built model, under the spec's names.

    The :class:`Builder` records each as it makes it: linear layers by ``(role, layer)``
    (roles ``q k v o gate up down head``; ``head`` at layer ``n_layers``), norm sites by
    ``(site, layer)`` (every site of :data:`NORM_SITES`, an ``nn.Identity`` where the
    placement puts no norm; ``embed`` at layer -1, ``final`` at layer ``n_layers``). Each entry
    is the module exactly as built, wrappers included. A plain object, not an ``nn.Module``:
    the model's parameters, their order and its state-dict keys do not see it.
    """

    def __init__(self) -> None:
        self._linear: dict[tuple[str, int], nn.Module] = {}
        self._norm: dict[tuple[str, int], nn.Module] = {}
        self._core: dict[tuple[str, int], nn.Module] = {}

    @staticmethod
    def _record(table: dict[tuple[str, int], nn.Module], kind: str, name: str, layer: int,
                module: nn.Module) -> None:
        if (name, layer) in table:
            raise ValueError(f"the builder made a second {kind} {name!r} for layer {layer}; "
                             "a model has one per name and layer")
        table[(name, layer)] = module

    def add_linear(self, role: str, layer: int, module: nn.Module) -> None:
        self._record(self._linear, "linear layer", role, layer, module)

    def add_norm(self, site: str, layer: int, module: nn.Module) -> None:
        self._record(self._norm, "norm site", site, layer, module)

    def add_core(self, sublayer: str, layer: int, module: nn.Module) -> None:
        self._record(self._core, "core", sublayer, layer, module)

    def core(self, sublayer: str, layer: int) -> nn.Module:
        """The core (``attn`` or ``ffn``) of ``layer``, as built (shared under the ``tie``
        slot: the same module as the layer it reuses)."""
        key = (self._known(sublayer, SUBLAYERS, "sublayer"), layer)
        if key not in self._core:
            raise KeyError(f"the model has no {sublayer!r} core in layer {layer}")
        return self._core[key]

    @staticmethod
    def _known(name: str, names: tuple[str, ...], kind: str) -> str:
        if name not in names:
            raise ValueError(f"unknown {kind} {name!r}; the {kind}s are: {', '.join(names)}")
        return name

    def has_linear(self, role: str, layer: int) -> bool:
        """Whether the model has a linear layer of ``role`` in ``layer`` (a core may make no
        ``gate``, or none at all)."""
        return (self._known(role, LINEAR_ROLES, "linear role"), layer) in self._linear

    def linear(self, role: str, layer: int) -> nn.Module:
        """The linear layer of ``role`` in ``layer``, as built (``KeyError`` if none)."""
        if not self.has_linear(role, layer):
            raise KeyError(f"the model has no {role!r} linear layer in layer {layer}")
        return self._linear[(role, layer)]

    def linears(self, role: str) -> dict[int, nn.Module]:
        """Every linear layer of ``role``, by layer, in layer order."""
        self._known(role, LINEAR_ROLES, "linear role")
        return dict(sorted((i, m) for (r, i), m in self._linear.items() if r == role))

    def norm(self, site: str, layer: int) -> nn.Module:
        """The module at norm site ``site`` of ``layer``, as built (Identity where no norm)."""
        key = (self._known(site, NORM_SITES, "norm site"), layer)
        if key not in self._norm:
            raise KeyError(f"the model has no norm site {site!r} in layer {layer}")
        return self._norm[key]

    def norms(self, site: str) -> dict[int, nn.Module]:
        """The module at norm site ``site`` of every layer, by layer, in layer order."""
        self._known(site, NORM_SITES, "norm site")
        return dict(sorted((i, m) for (s, i), m in self._norm.items() if s == site))

    def __repr__(self) -> str:
        return f"Parts({len(self._linear)} linear layers, {len(self._norm)} norm sites)"


def shares_parameters(model: nn.Module) -> bool:
    """Whether one parameter sits under two names of ``model`` (layers tied by the ``tie``
    slot)."""
    every = sum(1 for _ in model.named_parameters(remove_duplicate=False))
    return every != sum(1 for _ in model.parameters())


def parts_of(model: nn.Module) -> Parts:
    """The :class:`Parts` index of a built decoder (``model.parts``)."""
    parts = getattr(model, "parts", None)
    if not isinstance(parts, Parts):
        raise TypeError(f"{type(model).__name__} has no parts index; expected a model built "
                        "by modbench.model.transformer.Transformer")
    return parts


class Builder:
    """What the cores see of the spec: ready-made parts for a given model config. Records
    every linear layer and norm site it makes in :attr:`parts`.

    Per-layer pieces (cores, merges, the linear and norm wrappers of a layer) get
    :meth:`layer_cfg`, the layer's own config under the ``shape`` slot; the model-level pieces
    (embedding, stream, final norm, head, logits, RoPE) keep :attr:`cfg`."""

    def __init__(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        self.spec, self.cfg = spec, cfg
        self.parts = Parts()
        self._layer_cfgs: dict[int, ModelConfig] = {}
        # every core, base linear and base norm made so far, by (kind, name, layer): what a
        # later layer reuses under the tie slot (per build, so two models never share)
        self._made: dict[tuple[str, str, int], nn.Module] = {}

    def layer_cfg(self, layer: int) -> ModelConfig:
        """The config of layer ``layer`` (0 .. L-1): the ``shape`` slot's plan for it, checked
        and cached; the model's config itself when the slot is unfilled or ``layer`` is not a
        block (``embed`` at -1, ``final`` and ``head`` at L)."""
        if "shape" not in self.spec.fills or not 0 <= layer < self.cfg.n_layers:
            return self.cfg
        if layer not in self._layer_cfgs:
            self._layer_cfgs[layer] = self._checked_layer_cfg(layer)
        return self._layer_cfgs[layer]

    def _checked_layer_cfg(self, layer: int) -> ModelConfig:
        owner = self.spec.owner("shape")
        c = self.spec.get("shape")(self.cfg, layer)
        what = f"the shape slot ({owner}) gives layer {layer}"
        if not isinstance(c, ModelConfig):
            raise ValueError(f"{what} a {type(c).__name__}; it must return a ModelConfig")
        kept = {f: getattr(self.cfg, f) for f in LAYER_SHAPE_FIELDS}
        if dataclasses.replace(c, **kept) != self.cfg:
            raise ValueError(f"{what} a config that differs from the model's outside "
                             f"{', '.join(LAYER_SHAPE_FIELDS)}; a layer may change only those")
        try:
            c.validate()
        except ModbenchError as e:
            raise ModbenchError(f"{what} an invalid config: {e}") from None
        if c.head_dim != self.cfg.head_dim:
            raise ModbenchError(f"{what} head_dim {c.head_dim}, the model's is "
                                f"{self.cfg.head_dim}; RoPE needs the same head_dim in every "
                                "layer (set attn_head_dim)")
        return c

    def _source(self, kind: str, name: str, layer: int) -> int:
        """The layer whose module ``layer`` uses under the ``tie`` slot: ``layer`` itself (its
        own module) or an earlier layer that built one, checked."""
        if "tie" not in self.spec.fills:
            return layer
        src = self.spec.get("tie")(kind, name, layer)
        if src == layer:
            return layer
        if not isinstance(src, int) or not src < layer or (kind, name, src) not in self._made:
            raise ValueError(
                f"the tie slot ({self.spec.owner('tie')}) maps {kind} {name!r} of layer {layer} "
                f"to layer {src!r}, which has built none; a layer can only reuse a module an "
                "earlier layer built")
        if kind != "norm" and self.layer_cfg(src) != self.layer_cfg(layer):
            raise ValueError(
                f"the tie slot ({self.spec.owner('tie')}) maps {kind} {name!r} of layer {layer} "
                f"to layer {src}, whose shape differs under the shape slot "
                f"({self.spec.owner('shape')}); only layers of the same shape can share")
        return src

    def _base(self, kind: str, name: str, layer: int, make: Callable[[], nn.Module]
              ) -> nn.Module:
        src = self._source(kind, name, layer)
        m = make() if src == layer else self._made[(kind, name, src)]
        self._made[(kind, name, layer)] = m
        return m

    def linear(self, role: str, d_in: int, d_out: int, layer: int) -> nn.Module:
        m = self._base("linear", role, layer,
                       lambda: self.spec.get("linear")(role, d_in, d_out, layer))
        for wrap in self.spec.wrappers("linear_wrappers"):
            m = wrap(m, role, d_in, d_out, layer, self.layer_cfg(layer))
        self.parts.add_linear(role, layer, m)
        return m

    def core(self, sublayer: str, layer: int) -> nn.Module:
        """The ``attn`` or ``ffn`` core of ``layer`` (its slot's factory, called with the
        layer's config :meth:`layer_cfg`, or the module of the layer it reuses under the ``tie``
        slot, whose linear layers it then lists)."""
        src = self._source("core", sublayer, layer)
        if src == layer:
            m = self.spec.get(sublayer)(  # type: ignore[call-overload]
                self.layer_cfg(layer), self, layer)
        else:
            m = self._made[("core", sublayer, src)]
            for role in LINEAR_ROLES:
                if self.parts.has_linear(role, src) and not self.parts.has_linear(role, layer):
                    self.parts.add_linear(role, layer, self.parts.linear(role, src))
        self._made[("core", sublayer, layer)] = m
        self.parts.add_core(sublayer, layer, m)
        return m

    def norm(self, site: str, layer: int, dim: int | None = None) -> nn.Module:
        dim = self.cfg.d_model if dim is None else dim
        present = self.spec.get("placement")(site, layer, self.cfg.n_layers)
        m = self._base("norm", site, layer, lambda: self.spec.get("norm")(
            dim, self.cfg.norm_eps, site, layer)) if present else nn.Identity()
        for wrap in self.spec.wrappers("norm_wrappers"):
            m = wrap(m, site, layer, self.layer_cfg(layer))
        self.parts.add_norm(site, layer, m)
        return m

    def slot(self, slot: str, *args: Any) -> Any:
        return self.spec.get(slot)(*args)

    def optional(self, slot: str, default: Callable[[], nn.Module], *args: Any) -> nn.Module:
        """The slot's component if a method filled it, else ``default()`` (a pass-through)."""
        return self.spec.get(slot)(*args) if slot in self.spec.fills else default()
