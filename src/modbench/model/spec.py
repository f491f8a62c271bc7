"""The slots of the shared decoder and the components that fill them.

The decoder never branches on a method name. It asks a :class:`ModelSpec` for each piece it
needs, and methods (``modbench.methods``) fill the spec's slots before the model is built.
Each slot holds a *factory*; the baseline fills every slot with a Llama-2 default.

Exclusive slots (one filler each; two methods filling one differently are refused):

=====================  ==================================================================
``norm``               norm type: ``factory(dim, eps, site, layer) -> Module``
``placement``          which norm sites exist: ``placement(site, layer, n_layers) -> bool``
``linear``             linear-layer factory: ``factory(role, d_in, d_out, layer) -> Module``
``attn.q_norm``        transform of per-head queries before RoPE: ``factory(cfg, layer)``
``attn.k_norm``        transform of per-head keys before RoPE: ``factory(cfg, layer)``
``attn.qk_post``       ``(q, k, ctx) -> (q, k)`` after RoPE: ``factory(cfg, layer)``
``attn.v_path``        ``(v, ctx) -> v``, the value path: ``factory(cfg, layer)``
``attn.kernel``        ``(q, k, v, ctx) -> y``, scores and mixing: ``factory(cfg, layer)``
``attn.out_gate``      ``(y, x) -> y`` before the output projection: ``factory(cfg, spec, layer)``
``attn``               the whole attention core: ``factory(cfg, spec, layer)``
``ffn.act``            activation of the gated FFN: ``factory(cfg, layer)``
``ffn``                the whole FFN core: ``factory(cfg, spec, layer)``
``merge``              residual merge ``(x, out, state) -> x'``: ``factory(cfg, layer, sublayer)``
``stream``             the residual stream object: ``factory(cfg)``
``logits``             transform of the final logits: ``factory(cfg)``
=====================  ==================================================================

Additive slots (every filler is applied, in method order):

``norm_wrappers``      ``wrap(module, site, layer, cfg) -> Module``, applied at every norm site
                       (present or Identity)
``linear_wrappers``    ``wrap(module, role, d_in, d_out, layer, cfg) -> Module``

Norm sites: ``embed``, ``attn.pre``, ``attn.post`` (branch output), ``attn.residual``
(after the merge), ``ffn.pre``, ``ffn.post``, ``ffn.residual``, ``final``.
Linear roles: ``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down``, ``head``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modbench.errors import ModbenchError

NORM_SITES = (
    "embed", "attn.pre", "attn.post", "attn.residual",
    "ffn.pre", "ffn.post", "ffn.residual", "final",
)
LINEAR_ROLES = ("q", "k", "v", "o", "gate", "up", "down", "head")
SUBLAYERS = ("attn", "ffn")

EXCLUSIVE_SLOTS = (
    "norm", "placement", "linear",
    "attn.q_norm", "attn.k_norm", "attn.qk_post", "attn.v_path", "attn.kernel",
    "attn.out_gate", "attn", "ffn.act", "ffn", "merge", "stream", "logits",
)
ADDITIVE_SLOTS = ("norm_wrappers", "linear_wrappers")


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

    def fill(self, slot: str, value: Any, *, by: str, key: Any = None) -> None:
        """Fill an exclusive slot. ``key`` identifies the filler for conflict checks
        (defaults to ``by``): two methods may fill a slot only with the same key."""
        if slot not in EXCLUSIVE_SLOTS:
            hint = " (use add() for additive slots)" if slot in ADDITIVE_SLOTS else ""
            raise ValueError(f"unknown slot {slot!r}{hint}")
        key = by if key is None else key
        cur = self.fills.get(slot)
        if cur is not None and cur.owner != "baseline" and cur.owner != by and cur.key != key:
            raise ModbenchError(
                f"methods '{cur.owner}' and '{by}' both set the {slot} slot differently; "
                "they cannot be combined, pick one"
            )
        self.fills[slot] = _Fill(value, by, key)

    def add(self, slot: str, value: Any, *, by: str) -> None:
        if slot not in ADDITIVE_SLOTS:
            raise ValueError(f"unknown additive slot {slot!r}")
        self.additive[slot].append((by, value))

    def get(self, slot: str) -> Any:
        return self.fills[slot].value

    def owner(self, slot: str) -> str:
        return self.fills[slot].owner

    def wrappers(self, slot: str) -> list[Callable[..., Any]]:
        return [v for _, v in self.additive[slot]]

    def describe(self) -> dict[str, str]:
        """Which method fills each slot (for config records and `modbench methods`)."""
        out = {s: f.owner for s, f in sorted(self.fills.items())}
        for s, items in self.additive.items():
            if items:
                out[s] = "+".join(o for o, _ in items)
        return out
