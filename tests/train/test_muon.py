"""``recipe.optimizer=muon``: the update against a direct Newton-Schulz implementation, the
parameter split, training, resume, stacked seeds and refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from modbench.config import resolve
from modbench.errors import ModbenchError
from modbench.train.distributed import check_world
from modbench.train.optim import NO_MUON, MuonAdamW, build_optimizer, muon_split
from modbench.train.trainer import train, train_seeds
from tests.helpers import read_metrics, tiny, train_losses

MUON = "recipe.optimizer=muon"


def newton_schulz(m: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Jordan et al.'s quintic, in float64: ``X_0 = M/||M||_F`` (transposed when tall),
    ``X <- aX + (bA + cA^2)X`` with ``A = XX^T``, ``(a, b, c) = (3.4445, -4.7750, 2.0315)``."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = m.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(x.norm().item(), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class TwoMatrices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 24, bias=False)  # weight 24 x 8: tall
        self.down = nn.Linear(24, 8)  # weight 8 x 24: wide, and a bias for AdamW


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_update_is_the_newton_schulz_of_the_nesterov_momentum(adjust: str) -> None:
    torch.manual_seed(0)
    model = TwoMatrices()
    mu, wd, ratio, lr = 0.9, 0.1, 2.0, 0.01
    recipe = tiny("baseline", 0, 2, MUON, f"recipe.muon_momentum={mu}",
                  f"recipe.weight_decay={wd}", f"recipe.muon_lr_ratio={ratio}",
                  f"recipe.muon_adjust_lr={adjust}").recipe
    opt = build_optimizer(model, recipe)
    assert isinstance(opt, MuonAdamW)
    grads = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(2)]
    buf = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for g in grads:
        for group in opt.param_groups:  # as the trainer's engine.set_lr does
            group["lr"] = lr
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = g[n].clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for name in ("up.weight", "down.weight"):
            buf[name] = mu * buf[name] + (1 - mu) * g[name]  # the published EMA momentum
            nesterov = (1 - mu) * g[name] + mu * buf[name]
            rows, cols = nesterov.shape
            scale = (0.2 * math.sqrt(max(rows, cols)) if adjust == "match_rms_adamw"
                     else math.sqrt(max(1.0, rows / cols)))
            step_lr = lr * ratio
            decayed = before[name].double() * (1 - step_lr * wd)
            p = model.get_parameter(name).detach().double()
            applied = (decayed - p) / (step_lr * scale)
            # torch runs the iteration in bfloat16: ~1e-2 off, where a wrong coefficient or
            # one step fewer is ~0.15 off
            torch.testing.assert_close(applied, newton_schulz(nesterov), rtol=0, atol=0.04)
            assert (applied - newton_schulz(nesterov, steps=4)).abs().max() > 0.1
        assert opt.param_groups[0]["lr"] == lr  # the schedule's lr is left in place
    # the bias went to AdamW: it moved, by about lr per step (Adam's first steps)
    assert 0 < (model.down.bias - before["down.bias"]).abs().max() <= lr * 1.01


def test_split_on_the_baseline_model() -> None:
    from modbench.methods.build import build_model

    for tied in (True, False):
        model = build_model(tiny("baseline", 0, 2, f"model.tie_embeddings={tied}").model)
        muon, adamw = muon_split(model)
        names = {id(p): n for n, p in model.named_parameters()}
        muon_names = {names[id(p)] for p in muon}
        adamw_names = {names[id(p)] for p in adamw}
        expected_muon = {n for n, p in model.named_parameters() if n.startswith("blocks.")
                         and p.ndim == 2}
        assert muon_names == expected_muon
        assert len(muon_names) == 7 * model.cfg.n_layers  # q k v o, gate up down
        assert "embed.weight" in adamw_names
        assert ("head.weight" in adamw_names) is not tied
        assert all(model.get_parameter(n).ndim == 1 for n in adamw_names
                   if n not in ("embed.weight", "head.weight"))
        assert muon_names.isdisjoint(adamw_names)
        assert len(muon) + len(adamw) == sum(1 for _ in model.parameters())
    # a method's 2-D parameter that is not a hidden matrix opts out
    marked = next(p for n, p in model.named_parameters() if n.startswith("blocks.0.")
                  and p.ndim == 2)
    setattr(marked, NO_MUON, True)
    assert all(p is not marked for p in muon_split(model)[0])


def test_trains_and_resumes_to_the_uninterrupted_losses(tmp_path: Path) -> None:
    from tests.train.test_trainer import Kill

    cfg = lambda: tiny("baseline", 3, 16, MUON, "train.checkpoint_every=5",  # noqa: E731
                       "train.eval_every=8")
    full = train(cfg(), tmp_path / "full", progress=False)
    losses = train_losses(tmp_path / "full")
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-4:]) < sum(losses[:4]) - 0.5
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg(), tmp_path / "cut", callbacks=[Kill(12)], progress=False)
    resumed = train(cfg(), tmp_path / "cut", resume=True, progress=False)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "tokens_per_s"}  # noqa: E731
                          for r in rows]
    assert strip(read_metrics(tmp_path / "cut")) == strip(read_metrics(tmp_path / "full"))
    assert resumed["final_val_loss"] == full["final_val_loss"]
    # and it is not AdamW under another name
    train(tiny("baseline", 3, 16, "train.eval_every=8"), tmp_path / "adamw", progress=False)
    assert train_losses(tmp_path / "adamw") != losses


def test_stacked_seeds_match_their_separate_runs(tmp_path: Path) -> None:
    cfg = tiny("baseline", 0, 3, MUON, "train.eval_every=0")
    stacked = train_seeds(cfg, [0, 1], tmp_path / "k", progress=False)
    for seed in (0, 1):
        alone = train(tiny("baseline", seed, 3, MUON, "train.eval_every=0"),
                      tmp_path / f"a{seed}", progress=False)
        assert stacked[seed]["final_val_loss"] == pytest.approx(alone["final_val_loss"],
                                                                rel=1e-3)
        assert train_losses(tmp_path / "k" / f"s{seed}") == pytest.approx(
            train_losses(tmp_path / f"a{seed}"), rel=1e-3)


@pytest.mark.parametrize("override, match", [
    ("recipe.optimizer=sgd", "recipe.optimizer must be"),
    ("recipe.muon_momentum=1.0", "recipe.muon_momentum must be in"),
    ("recipe.muon_ns_steps=0", "recipe.muon_ns_steps must be in"),
    ("recipe.muon_adjust_lr=moonshot", "recipe.muon_adjust_lr must be"),
    ("recipe.muon_lr_ratio=0", "recipe.muon_lr_ratio must be positive"),
])
def test_bad_values_are_refused_in_one_line(override: str, match: str) -> None:
    with pytest.raises(ModbenchError, match=match) as err:
        resolve("tiny", overrides=[MUON, override])
    assert "\n" not in str(err.value)


def test_refusals() -> None:
    cfg = tiny("baseline", 0, 2, MUON)
    with pytest.raises(ModbenchError, match="one process only") as err:
        check_world(cfg.train, 2, 1, cfg.recipe.optimizer)
    assert "\n" not in str(err.value)
    check_world(cfg.train, 1, 1, cfg.recipe.optimizer)  # one process is fine
    with pytest.raises(ModbenchError, match="no hidden weight matrix"):
        build_optimizer(nn.Sequential(nn.Embedding(5, 4), nn.LayerNorm(4)), cfg.recipe)
    opt = build_optimizer(TwoMatrices(), cfg.recipe)
    with pytest.raises(ModbenchError, match="not a Muon one"):
        opt.load_state_dict(torch.optim.AdamW(TwoMatrices().parameters()).state_dict())
