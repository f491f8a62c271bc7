"""``recipe.optimizer=muon``: the update against a direct Newton-Schulz implementation, the
parameter split, training, resume, stacked seeds and refusals."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from modbench.config import resolve
from modbench.errors import ModbenchError
from modbench.methods.build import plan_run
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


@pytest.mark.parametrize("layerwise", ["none", "noise"])
def test_trains_and_resumes_to_the_uninterrupted_losses(tmp_path: Path, layerwise: str) -> None:
    from tests.train.test_trainer import Kill

    cfg = lambda: tiny("baseline", 3, 16, MUON, "train.checkpoint_every=5",  # noqa: E731
                       "train.eval_every=8", f"recipe.muon_layerwise_lr={layerwise}")
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
    if layerwise == "noise":  # and the layerwise rates change the run
        train(tiny("baseline", 3, 16, MUON, "train.eval_every=8"), tmp_path / "plain",
              progress=False)
        plain = train_losses(tmp_path / "plain")
        assert plain[:2] == losses[:2]  # no noise sample before the second step
        assert plain[3:] != losses[3:]


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


# ----------------------------------------------------------------- noise-adaptive layerwise lr

NOISE = "recipe.muon_layerwise_lr=noise"


class ThreeMatrices(nn.Module):
    """Two 10 x 6 matrices (a quiet and a noisy one), an 8 x 4 one of a third noise level, and
    a bias for AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.quiet = nn.Linear(6, 10, bias=False)
        self.noisy = nn.Linear(6, 10, bias=False)
        self.other = nn.Linear(4, 8)


def nuclear(m: torch.Tensor) -> float:
    """Sum of the singular values, from the eigenvalues of m^T m (float64)."""
    return float(torch.linalg.eigvalsh(m.double().T @ m.double()).clamp(min=0).sqrt().sum())


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_noise_adaptive_rates_follow_the_formula(adjust: str) -> None:
    """Each matrix's lr scale against the rule computed here on plain tensors, step by step:
    N = (s ||G_t - B_{t-1}/(1 - mu^(t-1))||_*)^2, H = beta H + (1 - beta) N,
    r = min(c, sqrt(max_j Hhat_j / Hhat)), Hhat = H / (1 - beta^n); and the step taken is
    torch's Muon step at lr x r."""
    torch.manual_seed(0)
    model = ThreeMatrices()
    mu, beta, cap, lr, wd = 0.9, 0.8, 30.0, 0.01, 0.1
    recipe = tiny("baseline", 0, 2, MUON, NOISE, f"recipe.muon_momentum={mu}",
                  f"recipe.muon_noise_beta={beta}", f"recipe.muon_noise_max_ratio={cap}",
                  f"recipe.weight_decay={wd}", f"recipe.muon_adjust_lr={adjust}").recipe
    opt = build_optimizer(model, recipe)
    assert isinstance(opt, MuonAdamW)
    names = ["quiet", "noisy", "other"]
    ref = {n: model.get_submodule(n).weight.detach().clone().requires_grad_() for n in names}
    reference = {n: torch.optim.Muon([ref[n]], lr=lr, weight_decay=wd, momentum=mu,
                                     adjust_lr_fn=adjust) for n in names}
    sigma = {"quiet": 0.05, "noisy": 1.0, "other": 0.3}
    mean = {n: torch.randn_like(model.get_submodule(n).weight) for n in names}
    buf = {n: torch.zeros_like(mean[n], dtype=torch.float64) for n in names}
    ema = dict.fromkeys(names, 0.0)
    scales: list[dict[str, float]] = []
    for t in range(1, 7):
        grads = {n: mean[n] + sigma[n] * torch.randn_like(mean[n]) for n in names}
        for n in names:
            if t > 1:
                rows, cols = grads[n].shape
                s = (0.2 * math.sqrt(max(rows, cols)) if adjust == "match_rms_adamw"
                     else math.sqrt(max(1.0, rows / cols)))
                dev = grads[n].double() - buf[n] / (1 - mu ** (t - 1))
                ema[n] = beta * ema[n] + (1 - beta) * (s * nuclear(dev)) ** 2
            buf[n] = mu * buf[n] + (1 - mu) * grads[n].double()
        if t == 1:
            expected = dict.fromkeys(names, 1.0)
        else:
            hhat = {n: ema[n] / (1 - beta ** (t - 1)) for n in names}
            top = max(hhat.values())
            expected = {n: min(cap, math.sqrt(top / hhat[n])) for n in names}
        for group in opt.param_groups:
            group["lr"] = lr
        before = {n: model.get_submodule(n).weight.detach().clone() for n in names}
        for n in names:
            model.get_submodule(n).weight.grad = grads[n].clone()
        opt.step()
        got = dict(zip(names, opt.layer_lr_scales(), strict=True))
        assert got == pytest.approx(expected, rel=1e-5)
        scales.append(got)
        for n in names:  # the step itself: torch's Muon at lr x r (the first test checks it)
            ref_group = reference[n].param_groups[0]
            ref_group["lr"] = lr * expected[n]
            ref[n].grad = grads[n].clone()
            reference[n].step()
            torch.testing.assert_close(model.get_submodule(n).weight, ref[n], rtol=1e-6,
                                       atol=1e-7)
            assert (model.get_submodule(n).weight - before[n]).abs().max() > 1e-4
        assert opt.param_groups[0]["lr"] == lr  # the schedule's lr is left in place
    # the noisiest matrix keeps the lr, the quietest steps further, up to the cap
    assert all(sc["noisy"] == 1.0 for sc in scales)
    assert all(1.0 < sc["other"] < sc["quiet"] <= cap for sc in scales[1:])


def test_a_noisier_matrix_takes_a_smaller_step() -> None:
    torch.manual_seed(1)
    model = ThreeMatrices()
    recipe = tiny("baseline", 0, 2, MUON, NOISE, "recipe.weight_decay=0").recipe
    opt = build_optimizer(model, recipe)
    plain = build_optimizer(copy.deepcopy(model), tiny("baseline", 0, 2, MUON,
                                                       "recipe.weight_decay=0").recipe)
    assert plain.layer_lr_scales() == [1.0, 1.0, 1.0]
    mean = torch.randn(10, 6)
    moved: dict[str, list[float]] = {"quiet": [], "noisy": []}
    for _ in range(8):
        before = {n: model.get_submodule(n).weight.detach().clone() for n in moved}
        for n, sigma in (("quiet", 0.05), ("noisy", 1.0)):
            model.get_submodule(n).weight.grad = mean + sigma * torch.randn(10, 6)
        model.other.weight.grad = torch.randn(8, 4)
        opt.step()
        for n in moved:
            moved[n].append(float((model.get_submodule(n).weight.detach() - before[n]).norm()))
    # same shape, same mean gradient, the same lr at the first step (an orthogonalised step
    # of about the same size); after it the quiet matrix moves further
    assert moved["quiet"][0] == pytest.approx(moved["noisy"][0], rel=0.2)
    assert all(q > 1.5 * n for q, n in zip(moved["quiet"][1:], moved["noisy"][1:], strict=True))


def test_a_matrix_without_noise_steps_at_the_cap() -> None:
    model = ThreeMatrices()
    recipe = tiny("baseline", 0, 2, MUON, NOISE, "recipe.muon_noise_max_ratio=4").recipe
    opt = build_optimizer(model, recipe)
    constant = torch.randn(10, 6)
    for _ in range(4):
        model.quiet.weight.grad = constant.clone()  # the same gradient every step: no noise
        model.noisy.weight.grad = torch.randn(10, 6)
        model.other.weight.grad = torch.randn(8, 4)
        opt.step()
    quiet, noisy, _ = opt.layer_lr_scales()
    assert quiet == 4.0 and noisy == 1.0


def test_layerwise_state_must_match_on_load() -> None:
    noise = build_optimizer(TwoMatrices(), tiny("baseline", 0, 2, MUON, NOISE).recipe)
    none = build_optimizer(TwoMatrices(), tiny("baseline", 0, 2, MUON).recipe)
    for into, src, saved in ((noise, none, "none"), (none, noise, "noise")):
        with pytest.raises(ModbenchError, match=f"trained with recipe.muon_layerwise_lr={saved}"
                           ) as err:
            into.load_state_dict(src.state_dict())
        assert "\n" not in str(err.value)


def test_noise_needs_muon(tmp_path: Path) -> None:
    """Checked once the methods' recipe exceptions are applied: refused for the baseline
    (before anything is written), accepted for osp, which sets optimizer=muon itself."""
    with pytest.raises(ModbenchError, match=r"add recipe\.optimizer=muon") as err:
        plan_run(resolve("tiny", overrides=[NOISE]))
    assert "\n" not in str(err.value)
    with pytest.raises(ModbenchError, match=r"add recipe\.optimizer=muon"):
        train(tiny("baseline", 0, 2, NOISE), tmp_path / "refused", progress=False)
    assert not (tmp_path / "refused").exists()
    run, _ = plan_run(resolve("tiny", method="osp", overrides=[NOISE]))
    assert (run.recipe.optimizer, run.recipe.muon_layerwise_lr) == ("muon", "noise")
    assert run.recipe_exceptions == {"optimizer": "muon"}


@pytest.mark.parametrize("override, match", [
    ("recipe.optimizer=sgd", "recipe.optimizer must be"),
    ("recipe.muon_layerwise_lr=lanton", "recipe.muon_layerwise_lr must be"),
    ("recipe.muon_noise_beta=1.0", "recipe.muon_noise_beta must be in"),
    ("recipe.muon_noise_max_ratio=0.5", "recipe.muon_noise_max_ratio must be at least 1"),
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
