"""Build a model from a config and a method string."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from modbench.config import ModelConfig
from modbench.methods.base import Method, canonical, parse_methods
from modbench.model.spec import ModelSpec
from modbench.model.transformer import Transformer, baseline_spec


@dataclass
class Plan:
    """The resolved methods, the (possibly edited) model config and the filled spec."""

    cfg: ModelConfig
    methods: list[Method]
    spec: ModelSpec

    @property
    def method(self) -> str:
        return canonical(self.methods)


def plan(cfg: ModelConfig) -> Plan:
    """Parse ``cfg.method``, let each method edit the config and fill the spec.

    Raises :class:`~modbench.errors.ModbenchError` for unknown or conflicting methods,
    before anything is allocated.
    """
    methods = parse_methods(cfg.method)
    cfg = copy.deepcopy(cfg)
    for m in methods:
        m.edit_config(cfg)
    cfg.validate()
    spec = baseline_spec()
    for m in methods:
        m.configure(spec, cfg)
    return Plan(cfg, methods, spec)


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> Transformer:
    """Build and initialise the model; the weights depend on ``seed`` only.

    Initialisation runs on the CPU under a private RNG (the global RNG is left as it was),
    so the same seed gives bit-identical weights on every machine.
    """
    p = plan(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(p.cfg, p.spec)
        model.init_weights()
        for m in p.methods:
            m.post_init(model)
    model.methods = p.methods  # type: ignore[assignment]
    return model.to(device)


def count_params(cfg: ModelConfig) -> int:
    """Parameter count without allocating weights (built on the meta device).

    Tied embeddings count once.
    """
    p = plan(cfg)
    with torch.device("meta"):
        model = Transformer(p.cfg, p.spec)
    return sum(t.numel() for t in model.parameters())
