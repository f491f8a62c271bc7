"""Planted broken methods for tests/conformance/test_kit.py: each is a working method with one
defect that the conformance kit must name. None is registered on import (the tests register
and remove them).

Citation: none (test doubles, not methods from a paper).

Init: as stated on each class; the defect is the only difference from a correct method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods.base import Method
from modbench.model.norms import pre_norm_placement
from modbench.model.spec import ModelSpec, _Fill
from modbench.model.stream import StreamState


class ScaledMerge(nn.Module):
    """``x + a * out`` with a per-channel ``a`` (LayerScale with its own init)."""

    def __init__(self, dim: int, init: float, poison: bool = False) -> None:
        super().__init__()
        self.init, self.poison = init, poison
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor, out: torch.Tensor, state: StreamState) -> torch.Tensor:
        y = x + self.scale.to(out.dtype) * out
        if self.poison:  # the planted defect: one NaN in every merge's output
            y = y.clone()
            y[..., 0, 0] = float("nan")
        return y

    def modbench_init(self) -> None:
        nn.init.constant_(self.scale, self.init)


class _Planted(Method):
    category = "residual"
    citation = "none: a planted defect"
    summary = "x + a * F(x), a per-channel scale (a test double)"
    init = 1.0
    poison = False

    @dataclass
    class Options:
        pass

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        init, poison = self.init, self.poison

        def merge(c: ModelConfig, layer: int, sublayer: str) -> nn.Module:
            return ScaledMerge(c.d_model, init, poison)

        spec.fill("merge", merge, by=self.name)

    def extra_params(self, cfg: ModelConfig) -> int:
        return 2 * cfg.d_model * cfg.n_layers

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0


class Correct(_Planted):
    """No defect: x + F(x) at init, declared (the control every planted one differs from)."""

    name = "zz_correct"
    starts_as_baseline = True


class LyingParams(_Planted):
    """extra_params says 2 d per layer; the model has 2 d per sublayer, 4 d per layer."""

    name = "zz_lying_params"

    def extra_params(self, cfg: ModelConfig) -> int:
        return cfg.d_model * cfg.n_layers


class NaNForward(_Planted):
    """A NaN in every merge's output."""

    name = "zz_nan_forward"
    poison = True


class FalseStart(_Planted):
    """Declares starts_as_baseline, but its scale starts at 0.5: x + F(x) / 2."""

    name = "zz_false_start"
    init = 0.5
    starts_as_baseline = True


def _post_ln_placement(site: str, layer: int, n_layers: int) -> bool:
    return site in ("attn.residual", "ffn.residual", "final")


class AsBaseline(Method):
    """Fills the placement slot (Post-LN) as 'baseline': post_ln+zz_as_baseline is not refused,
    the later filler silently wins."""

    name = "zz_as_baseline"
    category = "placement"
    citation = "none: a planted defect"
    summary = "Post-LN placement filled under the baseline's name (a test double)"

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        spec.fill("placement", _post_ln_placement, by="baseline")

    def extra_params(self, cfg: ModelConfig) -> int:
        return 0

    def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        return 0.0


class Overwrites(AsBaseline):
    """Writes the placement slot's record directly (under its own name, but past
    ModelSpec.fill): whatever filled the slot before is replaced without a conflict."""

    name = "zz_overwrites"

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        spec.fills["placement"] = _Fill(_post_ln_placement, self.name, self.name)


class Restores(AsBaseline):
    """Puts the baseline's Pre-LN placement back under the baseline's name (what a method that
    'resets' a slot might do): a placement listed before it is undone silently."""

    name = "zz_restores"

    def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
        spec.fill("placement", pre_norm_placement, by="baseline")


PLANTED: dict[str, tuple[type[Method], str]] = {
    # name: (class, the check the kit must fail first)
    "zz_lying_params": (LyingParams, "params"),
    "zz_nan_forward": (NaNForward, "forward"),
    "zz_false_start": (FalseStart, "init"),
    "zz_as_baseline": (AsBaseline, "conflicts"),
    "zz_overwrites": (Overwrites, "conflicts"),
    "zz_restores": (Restores, "conflicts"),
}

__all__ = ["PLANTED", "Correct"]
