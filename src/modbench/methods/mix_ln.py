"""Mix-LN: Post-LN in the first layers, Pre-LN in the rest.

Equation (docs/sources.md#mix-ln): with ``n_post = floor(fraction * L)``::

    layers l < n_post:   h = N(x + Attn(x));   y = N(h + FFN(h))        (Post-LN, C1)
    layers l >= n_post:  h = x + Attn(N(x));   y = h + FFN(N(h))        (Pre-LN)

The post-residual norm of the last Post-LN layer feeds the first Pre-LN layer directly; the
final norm is kept. ``fraction`` = 0.25 gives the code's ``POST_NUM`` = 3 for 12 layers and 6
for 24 layers.

Citation: Li, Yin, Liu 2024, "Mix-LN: Unleashing the Power of Deeper Layers by Combining
Pre-LN and Post-LN" (arXiv 2412.13795); code pixeli99/MixLN (``NORM_TYPE=post_pre``).

Init: gains 1, weights as the baseline (plain N(0, init_std^2), as the Mix-LN scripts).

Slots: ``placement`` only; any norm type composes (``mix_ln+layernorm``). With few layers
floor(0.25 L) can be 0 (e.g. the 2-layer ``tiny`` preset), which is plain Pre-LN; that is the
published rule and we keep it. Parameters and FLOPs: unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modbench.config import ModelConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, register
from modbench.model.spec import ModelSpec, Placement


def n_post_layers(n_layers: int, fraction: float) -> int:
    """Number of leading Post-LN layers: floor(fraction * L) (1e-9 guards float error)."""
    return math.floor(fraction * n_layers + 1e-9)


def mix_ln_placement(fraction: float) -> Placement:
    def placement(site: str, layer: int, n_layers: int) -> bool:
        if site == "final":
            return True
        if site == "embed":
            return False
        post = layer < n_post_layers(n_layers, fraction)
        return site.endswith(".residual") if post else site.endswith(".pre")

    return placement


@register
class MixLN(Method):
    name = "mix_ln"
    category = "placement"
    citation = ("Li, Yin, Liu 2024, Mix-LN: Unleashing the Power of Deeper Layers by "
                "Combining Pre-LN and Post-LN")
    summary = "Post-LN in the first floor(fraction * L) layers, Pre-LN after; final norm kept."

    @dataclass
    class Options:
        fraction: float = 0.25  # share of leading layers that use Post-LN

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        f = self.opts.fraction
        if not 0.0 <= f <= 1.0:
            raise ModbenchError(f"option fraction={f} of method 'mix_ln' must be in [0, 1]")
        spec.fill("placement", mix_ln_placement(f), by=self.name, key=("mix_ln", f))

    def extra_params(self, cfg: ModelConfig) -> int:
        return 0  # each layer has two norms, before or after its sublayers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0
