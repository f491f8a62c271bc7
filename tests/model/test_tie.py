"""The ``tie`` slot: layers that reuse an earlier layer's core, linear layer or norm share
its parameters (one object, counted and optimised once), per-layer wrappers stay per layer,
and a tied model computes what an untied model with copied weights computes."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from modbench.config import ModelConfig
from modbench.methods import REGISTRY, Method, register
from modbench.methods.build import Plan, plan
from modbench.model.spec import ModelSpec, parts_of, shares_parameters
from modbench.runtime.loss import lm_loss
from modbench.train.trainer import train, train_seeds
from tests.helpers import tiny


def tied_plan(tie: object, cfg: ModelConfig | None = None) -> Plan:
    p = plan(cfg or tiny().model)
    spec = copy.copy(p.spec)
    spec.fills = dict(p.spec.fills)
    spec.fill("tie", tie, by="test")  # type: ignore[arg-type]
    return Plan(p.cfg, p.methods, spec)


def all_cores_to_0(kind: str, name: str, layer: int) -> int:
    return 0 if kind == "core" and layer < 99 else layer


def test_core_tie_shares_one_module_and_counts_it_once() -> None:
    base = plan(tiny().model)
    p = tied_plan(all_cores_to_0)
    model = p.build(seed=0)
    L = p.cfg.n_layers
    parts = parts_of(model)
    for sub in ("attn", "ffn"):
        for layer in range(1, L):
            assert parts.core(sub, layer) is parts.core(sub, 0)
    for role in ("q", "k", "v", "o", "gate", "up", "down"):
        assert all(parts.linear(role, i) is parts.linear(role, 0) for i in range(L))
    per_core = sum(t.numel() for sub in ("attn", "ffn") for t in parts.core(sub, 0).parameters())
    own = sum(t.numel() for t in model.parameters())
    assert own == base.count_params() - (L - 1) * per_core
    assert p.count_params() == own  # the meta-device count sees the sharing too
    assert shares_parameters(model) and not shares_parameters(base.build(seed=0))
    # norms stay per layer
    assert parts.norm("attn.pre", 1) is not parts.norm("attn.pre", 0)


def test_tied_model_computes_the_untied_model_with_copied_weights() -> None:
    """Reference: the baseline model with layer 0's core weights copied into every layer."""
    p = tied_plan(all_cores_to_0)
    tied = p.build(seed=3).double()
    ref = plan(tiny().model).build(seed=0).double()
    state = tied.state_dict()  # every layer's names, the shared tensors under each
    ref.load_state_dict(state)
    again = p.build(seed=4).double()
    again.load_state_dict(state)  # every layer's name loads, into the one shared tensor
    assert torch.equal(parts_of(again).linear("q", 0).weight, parts_of(tied).linear("q", 0).weight)
    ref_parts = parts_of(ref)
    assert ref_parts.linear("q", 1) is not ref_parts.linear("q", 0)
    torch.testing.assert_close(ref_parts.linear("q", 1).weight, ref_parts.linear("q", 0).weight)
    idx = torch.randint(0, p.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(tied(idx), ref(idx), rtol=0, atol=1e-12)
    # the shared weight's gradient is the sum of every layer's gradient in the untied model
    lm_loss(tied(idx), idx).backward()
    lm_loss(ref(idx), idx).backward()
    L = p.cfg.n_layers
    want = sum(parts_of(ref).linear("q", i).weight.grad for i in range(L))  # type: ignore[misc]
    torch.testing.assert_close(parts_of(tied).linear("q", 0).weight.grad, want)


class Scaled(nn.Module):
    """A per-layer wrapper: multiplies the wrapped linear's output by a fixed layer factor."""

    def __init__(self, inner: nn.Module, factor: float) -> None:
        super().__init__()
        self.inner, self.factor = inner, factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.factor * self.inner(x)


def test_linear_and_norm_ties_share_the_base_and_keep_wrappers_per_layer() -> None:
    def every_other(kind: str, name: str, layer: int) -> int:
        if kind in ("linear", "norm") and 0 <= layer < 4:  # the blocks, not head or final
            return layer % 2
        return layer

    p = tied_plan(every_other, tiny("", 0, 30, "model.n_layers=4").model)
    p.spec.add("linear_wrappers", lambda m, role, i, o, layer, cfg: Scaled(m, 1.0 + layer),
               by="test")
    model = p.build(seed=0)
    parts = parts_of(model)
    q = parts.linears("q")
    assert q[2] is not q[0] and q[2].inner is q[0].inner and q[3].inner is q[1].inner
    assert q[1].inner is not q[0].inner
    assert (q[2].factor, q[0].factor) == (3.0, 1.0)
    assert parts.norm("ffn.pre", 2) is parts.norm("ffn.pre", 0)
    assert parts.norm("final", 4) is not parts.norm("ffn.pre", 0)  # another site: its own
    assert parts.core("attn", 2) is not parts.core("attn", 0)  # the cores are not tied


def test_a_tie_to_a_layer_that_built_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match=r"tie slot .* maps core 'attn' of layer 0 to layer 1"):
        tied_plan(lambda kind, name, layer: 1 if kind == "core" else layer).build()
    # the embedding norm site has no norm under Pre-LN: nothing to reuse there
    with pytest.raises(ValueError, match=r"norm 'attn\.pre' of layer 1 to layer -1"):
        tied_plan(lambda kind, name, layer: -1 if kind == "norm" and layer == 1
                  else layer).build()


@pytest.fixture
def tie_method() -> Iterator[str]:
    class _TieAll(Method):
        name = "zz_tie_cores"
        category = "architecture"
        citation = summary = "test"

        def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
            spec.fill("tie", all_cores_to_0, by=self.name)

    register(_TieAll)
    yield "zz_tie_cores"
    REGISTRY.pop("zz_tie_cores", None)


def test_stacked_seeds_and_resume_train_a_tied_model_like_separate_runs(
        tie_method: str, tmp_path: Path) -> None:
    """Stacked seeds hand each member the gradient of its shared weights once."""
    train_seeds(tiny(tie_method, 0, 6), [0, 1], [tmp_path / "s0", tmp_path / "s1"],
                progress=False)
    alone = train(tiny(tie_method, 1, 6), tmp_path / "alone", progress=False)
    got = json.loads((tmp_path / "s1" / "summary.json").read_text())
    assert got["status"] == "completed"
    assert abs(got["final_val_loss"] - alone["final_val_loss"]) < 1e-4
    assert got["final_val_loss"] < got["initial_val_loss"]
