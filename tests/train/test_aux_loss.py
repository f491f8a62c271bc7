"""The generic auxiliary loss: a core adds a 0-d term to the forward's context
(``ForwardContext.add_aux``), ``Transformer.forward(with_aux=True)`` returns the sum, and the
engines train on ``lm_loss + aux`` with the same micro-batch scaling while reporting the LM
loss alone. Checked against a direct computation (the LM gradient of the whole batch plus the
analytic gradient of the auxiliary term) for one member, stacked members, a loss mask,
activation checkpointing and DDP; and the no-aux path is unchanged."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from modbench.config import ModelConfig
from modbench.methods import REGISTRY, Method, register
from modbench.methods.build import build_model
from modbench.model.ffn import GatedFFN
from modbench.model.spec import Builder, ModelSpec, parts_of
from modbench.model.stream import ForwardContext
from modbench.runtime.loss import lm_loss
from modbench.train.engine import LocalEngine, host_floats
from modbench.train.recompute import apply_activation_checkpointing
from modbench.train.trainer import train
from tests.helpers import read_metrics, tiny

COEF = 10.0  # large, so that a loss or gradient that wrongly includes or omits aux shows


class AuxFFN(nn.Module):
    """The baseline FFN plus the auxiliary term COEF * ||W_up||^2 (gradient 2 COEF W_up)."""

    def __init__(self, cfg: ModelConfig, build: Builder, layer: int) -> None:
        super().__init__()
        self.inner = GatedFFN(cfg, build, layer)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ctx.add_aux(COEF * self.inner.up_proj.weight.square().sum())
        return self.inner(x, ctx)


@pytest.fixture(scope="module")
def aux_method() -> Iterator[str]:
    class _Aux(Method):
        name = "zz_aux_ffn"
        category = "ffn"
        citation = summary = "test"

        def configure(self, spec: ModelSpec, cfg: ModelConfig) -> None:
            spec.fill("ffn", lambda c, b, layer: AuxFFN(c, b, layer), by=self.name)

        def extra_params(self, cfg: ModelConfig) -> int:
            return 0

        def extra_flops(self, cfg: ModelConfig, seq_len: int) -> float:
            return 0.0

    register(_Aux)
    yield "zz_aux_ffn"
    REGISTRY.pop("zz_aux_ffn", None)


def batch(rows: int = 4, seed: int = 0, t: int = 16) -> torch.Tensor:
    return torch.randint(0, 512, (rows, t), generator=torch.Generator().manual_seed(seed))


def ups(model: nn.Module) -> list[nn.Parameter]:
    return [parts_of(model).linear("up", i).weight for i in range(model.cfg.n_layers)]


def direct_grads(model: nn.Module, idx: torch.Tensor, mask: torch.Tensor | None = None
                 ) -> tuple[dict[str, torch.Tensor], float]:
    """The gradient of lm_loss(whole batch) + sum_l COEF ||W_up,l||^2, the LM part by autograd
    on the plain forward (no aux), the aux part written out; and the LM loss."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    loss = lm_loss(ref(idx), idx, mask)
    loss.backward()
    with torch.no_grad():
        for w in ups(ref):
            w.grad += 2 * COEF * w  # type: ignore[operator]
    return {n: p.grad.clone() for n, p in ref.named_parameters()}, loss.item()  # type: ignore


def engine_for(models: list[nn.Module], n_micro: int) -> LocalEngine:
    opts = [torch.optim.SGD(m.parameters(), lr=0.0) for m in models]
    return LocalEngine(models, opts, torch.device("cpu"), nullcontext, n_micro=n_micro)


def assert_grads(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)


# ------------------------------------------------------------------------------ the model


def test_without_aux_terms_the_forward_is_unchanged() -> None:
    model = build_model(tiny().model, seed=0)
    idx = batch()
    logits, aux = model(idx, with_aux=True)
    assert torch.equal(logits, model(idx))
    assert aux.ndim == 0 and aux.dtype == torch.float32 and aux.item() == 0.0
    loss = lm_loss(logits, idx)
    assert torch.equal(loss + aux / 4, loss)  # bit for bit: the engines add it anyway


def test_with_aux_sums_every_core_term(aux_method: str) -> None:
    model = build_model(tiny(aux_method).model, seed=0)
    _, aux = model(batch(), with_aux=True)
    want = sum(COEF * w.detach().square().sum() for w in ups(model))
    torch.testing.assert_close(aux.detach(), want)


def test_a_term_must_be_a_scalar() -> None:
    ctx = ForwardContext(cos=torch.zeros(4, 2), sin=torch.zeros(4, 2), seq_len=4)
    with pytest.raises(ValueError, match="0-d tensor"):
        ctx.add_aux(torch.ones(2))
    assert ctx.aux_total().item() == 0.0
    ctx.add_aux(torch.tensor(1.5))
    ctx.add_aux(torch.tensor(2.0))
    assert ctx.aux_total().item() == 3.5


# ----------------------------------------------------------------------------- the engines


@pytest.mark.parametrize("n_micro", [1, 2, 4])
def test_one_member_trains_on_lm_plus_aux_and_reports_lm(aux_method: str, n_micro: int
                                                          ) -> None:
    model = build_model(tiny(aux_method).model, seed=0)
    idx = batch()
    want, lm = direct_grads(model, idx)
    engine = engine_for([model], n_micro)
    (loss,) = host_floats(engine.backward(idx, None, [0]))
    assert loss == pytest.approx(lm, rel=1e-6)  # the LM loss alone (aux is ~90 here)
    assert_grads(model, want)


def test_loss_mask_shares_the_denominator_and_aux_is_a_mean(aux_method: str) -> None:
    model = build_model(tiny(aux_method).model, seed=0)
    idx = batch()
    mask = torch.rand(idx.shape[0], idx.shape[1] - 1,
                      generator=torch.Generator().manual_seed(1)) < 0.4
    want, lm = direct_grads(model, idx, mask)
    engine = engine_for([model], 2)
    (loss,) = host_floats(engine.backward(idx, mask, [0]))
    assert loss == pytest.approx(lm, rel=1e-6)
    assert_grads(model, want)


def test_stacked_members_each_get_their_own_aux_gradient(aux_method: str) -> None:
    cfg = tiny(aux_method).model
    models = [build_model(cfg, seed=s) for s in (0, 1)]
    idx = batch()
    wants = [direct_grads(m, idx) for m in models]
    engine = engine_for(models, 2)
    losses = host_floats(engine.backward(idx, None, [0, 1]))
    for model, (want, lm), loss in zip(models, wants, losses, strict=True):
        assert loss == pytest.approx(lm, rel=1e-6)
        assert_grads(model, want)


def test_activation_checkpointing_keeps_the_aux_gradient(aux_method: str) -> None:
    model = build_model(tiny(aux_method).model, seed=0)
    idx = batch()
    want, _ = direct_grads(model, idx)
    apply_activation_checkpointing(model, aux_method)
    engine = engine_for([model], 2)
    engine.backward(idx, None, [0])
    assert_grads(model, want)


def test_trainer_logs_and_validates_the_lm_loss(aux_method: str, tmp_path: Path) -> None:
    """The objective is ~90 nats above the LM loss here; the records show the LM loss."""
    summary = train(tiny(aux_method, 0, 3), tmp_path / "run", progress=False)
    train_losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert all(5.0 < x < 7.0 for x in train_losses), train_losses
    assert 5.0 < summary["initial_val_loss"] < 7.0 and 5.0 < summary["final_val_loss"] < 7.0


# --------------------------------------------------------------------------------- DDP


def _ddp_worker(rank: int, root: str, method: str) -> None:
    from datetime import timedelta

    from modbench.train.distributed import DistributedEngine, World

    torch.set_num_threads(1)
    if method not in REGISTRY:  # spawned: register the test method again
        register(type("_Aux", (Method,), {
            "name": method, "category": "ffn", "citation": "test", "summary": "test",
            "configure": lambda self, spec, cfg: spec.fill(
                "ffn", lambda c, b, layer: AuxFFN(c, b, layer), by=method)}))
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    model = build_model(tiny(method).model, seed=0)
    engine = DistributedEngine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.0),
                               torch.device("cpu"), nullcontext, World(rank, rank, 2),
                               parallel="ddp", n_micro=2)
    (loss,) = host_floats(engine.backward(batch(8), None, [0]))
    if rank == 0:
        torch.save({"loss": loss, "grads": {n: p.grad for n, p in model.named_parameters()}},
                   os.path.join(root, "grads.pt"))
    dist.destroy_process_group()


def test_ddp_trains_on_lm_plus_aux_and_reports_lm(aux_method: str, tmp_path: Path) -> None:
    """Two processes, two micro-batches each: the aux gradient once (DDP's average of the
    processes' means), the global LM loss reported."""
    mp.start_processes(_ddp_worker, args=(str(tmp_path), aux_method), nprocs=2, join=True,
                       start_method="spawn")
    got = torch.load(tmp_path / "grads.pt")
    model = build_model(tiny(aux_method).model, seed=0)
    want, lm = direct_grads(model, batch(8))
    assert got["loss"] == pytest.approx(lm, rel=1e-6)
    for n, g in got["grads"].items():
        torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-6, msg=n)
