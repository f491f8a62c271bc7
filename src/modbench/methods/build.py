"""From a config to a model: resolve the method string, let each method edit the config and
fill the spec's slots (a :class:`Plan`), then build and initialise the decoder.

A plan is computed once per run and then built (:meth:`Plan.build`) or counted
(:meth:`Plan.count_params`); :func:`build_model` and :func:`count_params` plan and build in one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from modbench.config import ModelConfig, RunConfig
from modbench.errors import ModbenchError
from modbench.methods.base import Method, canonical, collect_recipe_exceptions, method_spec
from modbench.model.spec import ModelSpec
from modbench.model.transformer import Transformer, baseline_spec


@dataclass
class Plan:
    """The resolved methods, the (possibly edited) model config and the filled spec."""

    cfg: ModelConfig
    methods: list[Method]
    spec: ModelSpec

    @property
    def stackable(self) -> bool:
        """Whether seeds of this model can train stacked in one process
        (:class:`modbench.train.engine.LocalEngine`)."""
        return all(m.stackable for m in self.methods)

    @property
    def stack_note(self) -> str:
        """Why not, when not: the first non-stackable method's note."""
        return next((f"{m.name}: {m.stack_note}" for m in self.methods if not m.stackable), "")

    @property
    def method(self) -> str:
        """The canonical method string (names, and options that differ from the defaults)."""
        return canonical(self.methods)

    def build(self, seed: int = 0, device: str | torch.device = "cpu") -> Transformer:
        """Build and initialise the model; the weights depend on ``seed`` only.

        Initialisation runs on the CPU under a private RNG (the global RNG is left as it
        was), so the same seed gives bit-identical weights on every machine.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Transformer(self.cfg, self.spec)
            model.init_weights()
            for m in self.methods:
                m.post_init(model)
        model.methods = self.methods
        return model.to(device)

    def count_params(self) -> int:
        """Parameter count without allocating weights (built on the meta device); tied
        embeddings count once."""
        with torch.device("meta"):
            model = Transformer(self.cfg, self.spec)
        return sum(t.numel() for t in model.parameters())


def plan(cfg: ModelConfig, methods: list[Method] | None = None) -> Plan:
    """``cfg.method``'s methods (:func:`~modbench.methods.base.method_spec`: parsed once per
    process), each editing (a copy of) the config and filling the spec.

    ``methods``, when given, are the parsed methods to use instead (an exported model's
    remote code builds them from its config.json, without the registry).
    Raises :class:`~modbench.errors.ModbenchError` for unknown or conflicting methods,
    before anything is allocated.
    """
    methods = list(method_spec(cfg).methods) if methods is None else methods
    cfg = copy.deepcopy(cfg)
    for m in methods:
        m.edit_config(cfg)
    cfg.validate()
    spec = baseline_spec()
    for m in methods:
        m.configure(spec, cfg)
    return Plan(cfg, methods, spec)


def plan_run(cfg: RunConfig) -> tuple[RunConfig, Plan]:
    """A run config as it trains, and its plan. The config is a validated copy (``cfg`` is
    not touched) with the canonical method string and the methods' recipe exceptions applied
    to the recipe and recorded under ``recipe_exceptions``."""
    cfg.validate()
    run = copy.deepcopy(cfg)
    run.sync_seq_len()
    try:
        p = plan(run.model)
    except ModbenchError:
        raise
    except Exception as e:  # a method from outside modbench that raised: one line
        from modbench.methods.plugins import blame

        failed = blame(e, method_spec(run.model).methods, "to plan the model (its "
                       "edit_config or configure)")
        if failed is None:
            raise
        raise failed from e
    run.model.method = p.method
    run.recipe_exceptions = collect_recipe_exceptions(p.methods)
    for key, value in run.recipe_exceptions.items():
        if not hasattr(run.recipe, key):
            raise ModbenchError(f"a method declares recipe exception {key!r}, which is not a "
                                "recipe key; fix the method's recipe_exceptions")
        setattr(run.recipe, key, value)
    run.recipe.validate()
    run.recipe.check_combination()
    return run, p


def reads_train_seq_len(cfg: ModelConfig) -> bool:
    """Whether a method of ``cfg`` ties a constant to the training sequence length
    (``model.train_seq_len``; :meth:`Method.reads_train_seq_len`)."""
    return any(m.reads_train_seq_len() for m in method_spec(cfg).methods)


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> Transformer:
    """Plan ``cfg`` and build the model (:meth:`Plan.build`)."""
    return plan(cfg).build(seed, device)


def count_params(cfg: ModelConfig) -> int:
    """Plan ``cfg`` and count its parameters without allocating them."""
    return plan(cfg).count_params()
