"""The trainer's contract: resume equality, iso-data batches, divergence, run folders."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from modbench.config import RECIPES, resolve
from modbench.errors import ModbenchError
from modbench.train.optim import param_groups
from modbench.train.schedule import lr_at
from modbench.train.trainer import Callback, Trainer, train
from tests.helpers import read_metrics, tiny, train_losses


class BatchHashes(Callback):
    def __init__(self) -> None:
        self.hashes: list[str] = []

    def on_batch(self, trainer: Trainer, step: int, batch: torch.Tensor) -> None:
        self.hashes.append(hashlib.sha256(batch.numpy().tobytes()).hexdigest())


def test_batches_identical_across_methods_and_init_seeds(tmp_path: Path) -> None:
    runs = [("baseline", 0), ("baseline", 1), ("post_ln+qknorm", 0), ("layerscale", 7)]
    seen = []
    for i, (method, seed) in enumerate(runs):
        cb = BatchHashes()
        train(tiny(method, seed, 8), tmp_path / str(i), callbacks=[cb], progress=False)
        seen.append(cb.hashes)
    assert all(h == seen[0] for h in seen)
    assert len(set(seen[0])) == 8  # and the batches are not all the same
    # the init seed does change the weights, hence the losses
    assert train_losses(tmp_path / "0") != train_losses(tmp_path / "1")


def test_data_seed_changes_the_order(tmp_path: Path) -> None:
    a, b = BatchHashes(), BatchHashes()
    train(tiny("baseline", 0, 3), tmp_path / "a", callbacks=[a], progress=False)
    train(tiny("baseline", 0, 3, "data.data_seed=99"), tmp_path / "b", callbacks=[b],
          progress=False)
    assert a.hashes != b.hashes


class Kill(Callback):
    """Simulates a crash right after a given step (the process dies, nothing is saved)."""

    def __init__(self, after_step: int) -> None:
        self.after = after_step

    def on_step_end(self, trainer: Trainer, step: int, record: dict[str, Any]) -> None:
        if step + 1 == self.after:
            raise RuntimeError("killed")


def test_resume_reaches_exactly_the_uninterrupted_losses(tmp_path: Path) -> None:
    cfg = lambda: tiny("post_ln+qknorm", 3, 20, "train.checkpoint_every=5",  # noqa: E731
                       "train.eval_every=4")
    full = train(cfg(), tmp_path / "full", progress=False)
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg(), tmp_path / "cut", callbacks=[Kill(13)], progress=False)
    assert not (tmp_path / "cut" / "summary.json").exists()
    resumed = train(cfg(), tmp_path / "cut", resume=True, progress=False)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "tokens_per_s"}  # noqa: E731
                          for r in rows]
    assert strip(read_metrics(tmp_path / "cut")) == strip(read_metrics(tmp_path / "full"))
    assert resumed["final_val_loss"] == full["final_val_loss"]
    a = torch.load(tmp_path / "full/checkpoints/last.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "cut/checkpoints/last.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_different_config(tmp_path: Path) -> None:
    train(tiny("baseline", 0, 4), tmp_path / "r", progress=False)
    with pytest.raises(ModbenchError, match=r"differs .* in recipe\.lr"):
        train(tiny("baseline", 0, 4, "recipe.lr=0.01"), tmp_path / "r", resume=True,
              progress=False)


class Poison(Callback):
    """Puts a NaN into one weight after a given optimizer step."""

    def __init__(self, at: int) -> None:
        self.at = at

    def after_optimizer_step(self, trainer: Trainer, step: int) -> None:
        if step + 1 == self.at:
            with torch.no_grad():
                trainer.model.blocks[0].ffn.core.up_proj.weight[0, 0] = float("nan")


def test_divergence_ends_the_run_with_status_diverged(tmp_path: Path) -> None:
    s = train(tiny("baseline", 0, 20, "train.eval_every=0"), tmp_path / "d",
              callbacks=[Poison(6)], progress=False)
    assert s["status"] == "diverged"
    assert s["diverged_at_step"] == 7 and s["steps"] == 6
    assert s["final_val_loss"] is None
    norms = s["last_grad_norms"]
    assert [n["step"] for n in norms] == list(range(1, 8)) and norms[-1]["grad_norm"] is None
    assert all(math.isfinite(n["grad_norm"]) for n in norms[:-1])
    rows = read_metrics(tmp_path / "d")
    assert rows[-1]["nonfinite"] is True and rows[-1]["step"] == 7
    on_disk = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert on_disk == s


def test_huge_learning_rate_diverges_without_crashing(tmp_path: Path) -> None:
    s = train(tiny("baseline", 0, 30, "recipe.lr=1e30", "recipe.grad_clip=0",
                   "recipe.warmup_frac=0"), tmp_path / "d", progress=False)
    assert s["status"] == "diverged" and s["diverged_at_step"] is not None


def test_run_folder_contents(tmp_path: Path) -> None:
    s = train(tiny("layerscale", 2, 12), tmp_path / "r", progress=False)
    for key in ("status", "method", "preset", "seed", "steps", "tokens", "params",
                "final_val_loss", "val_ppl", "tokens_per_s", "diverged_at_step"):
        assert key in s
    assert s["tokens"] == 12 * 8 * 64 and s["val_ppl"] == pytest.approx(
        math.exp(s["final_val_loss"]))
    cfg = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert cfg["model"]["method"] == "layerscale" and cfg["seed"] == 2
    assert cfg["meta"]["slots"]["merge"] == "layerscale"
    rows = read_metrics(tmp_path / "r")
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, 13))
    assert set(train_rows[0]) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s"}
    assert [r["step"] for r in rows if r["kind"] == "val"] == [0, 10, 12]


def test_existing_folder_is_refused(tmp_path: Path) -> None:
    train(tiny("baseline", 0, 2), tmp_path / "r", progress=False)
    with pytest.raises(ModbenchError, match="already exists"):
        train(tiny("baseline", 0, 2), tmp_path / "r", progress=False)


def test_gradient_accumulation_matches_full_batch(tmp_path: Path) -> None:
    a = train(tiny("baseline", 0, 5), tmp_path / "a", progress=False)
    b = train(tiny("baseline", 0, 5, "train.micro_batch_size=2"), tmp_path / "b",
              progress=False)
    assert a["final_val_loss"] == pytest.approx(b["final_val_loss"], rel=1e-4)


def test_schedule_matches_formula() -> None:
    r = RECIPES["seed002"]
    total = 44000
    assert lr_at(0, r, total) == pytest.approx(r.lr / 2000)
    assert lr_at(1999, r, total) == pytest.approx(r.lr)
    mid = 2000 + (total - 2000 - 1) / 2
    assert lr_at(int(mid), r, total) == pytest.approx(0.55 * r.lr, rel=1e-3)
    assert lr_at(total - 1, r, total) == pytest.approx(0.1 * r.lr)


def test_weight_decay_only_on_matrices() -> None:
    from modbench.methods.build import build_model

    model = build_model(tiny("layerscale").model)
    decay, no_decay = param_groups(model, 0.1)
    assert all(p.ndim >= 2 for p in decay["params"])  # type: ignore[union-attr]
    assert all(p.ndim < 2 for p in no_decay["params"])  # type: ignore[union-attr]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_recipes_as_specified() -> None:
    s = RECIPES["seed002"]
    assert (s.optimizer, s.betas, s.weight_decay, s.grad_clip, s.warmup_steps,
            s.schedule, s.min_lr_ratio) == ("adamw", (0.9, 0.95), 0.1, 1.0, 2000, "cosine", 0.1)
    c = RECIPES["c4-mixln"]
    assert (c.optimizer, c.lr, c.weight_decay, c.grad_clip) == ("adam", 1e-3, 0.0, 0.0)
    assert resolve("climb-1.2b").recipe.name == "seed002"
    assert resolve("llama-130m").recipe.name == "c4-mixln"


def test_the_callers_config_is_not_changed(tmp_path: Path) -> None:
    """Method recipe exceptions and the canonical method string go into the run's own copy."""
    cfg = tiny("ngpt", 0, 2)
    before = cfg.to_dict()
    trainer = Trainer(cfg, tmp_path / "r", progress=False)
    trainer.run()
    assert cfg.to_dict() == before and cfg.recipe.weight_decay == 0.1
    assert trainer.cfg.recipe.weight_decay == 0.0 and trainer.cfg.recipe_exceptions
    spelled = tiny("qknorm(scope=head)", 0, 2)
    assert Trainer(spelled, tmp_path / "q", progress=False).cfg.model.method == "qknorm"
    assert spelled.model.method == "qknorm(scope=head)"


def test_methods_are_planned_once_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          ) -> None:
    import modbench.methods.build as build

    calls: list[str] = []
    real = build.plan

    def counting(cfg: Any) -> Any:
        calls.append(cfg.method)
        return real(cfg)

    monkeypatch.setattr(build, "plan", counting)
    train(tiny("layerscale+qknorm", 0, 2), tmp_path / "r", progress=False)
    assert calls == ["layerscale+qknorm"]


class Recorder(Callback):
    """Logs each hook it sees and adds a key wherever the loop lets it."""

    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen = name, seen

    def on_train_start(self, trainer: Trainer) -> None:
        self.seen.append(f"{self.name}:start@{trainer.step}")

    def on_step_end(self, trainer: Trainer, step: int, record: dict[str, Any]) -> None:
        record[f"{self.name}_step"] = step

    def on_eval(self, trainer: Trainer, step: int, record: dict[str, Any]) -> None:
        record[f"{self.name}_eval"] = record["val_loss"]

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        summary[f"{self.name}_end"] = summary["steps"]
        self.seen.append(f"{self.name}:end")


def test_callbacks_run_in_order_and_their_keys_are_kept(tmp_path: Path) -> None:
    seen: list[str] = []
    s = train(tiny("baseline", 0, 4, "train.eval_every=2"), tmp_path / "r",
              callbacks=[Recorder("a", seen), Recorder("b", seen)], progress=False)
    assert seen == ["a:start@0", "b:start@0", "a:end", "b:end"]
    rows = read_metrics(tmp_path / "r")
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [(r["a_step"], r["b_step"]) for r in train_rows] == [(i, i) for i in range(4)]
    assert all(r["a_eval"] == r["val_loss"] for r in rows if r["kind"] == "val")
    on_disk = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert on_disk["a_end"] == on_disk["b_end"] == s["steps"] == 4


def test_a_resumed_run_starts_its_callbacks_at_the_checkpoint_step(tmp_path: Path) -> None:
    cfg = lambda: tiny("baseline", 0, 6, "train.checkpoint_every=3")  # noqa: E731
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg(), tmp_path / "r", callbacks=[Kill(4)], progress=False)
    seen: list[str] = []
    train(cfg(), tmp_path / "r", resume=True, callbacks=[Recorder("a", seen)], progress=False)
    assert seen[0] == "a:start@3"


def test_the_batch_hash_is_the_data_order(tmp_path: Path) -> None:
    """summary.batches_sha256 chains every batch a run saw: equal for every method and init
    seed on one data order, different on another, and a resumed run ends on the same hash."""
    a = train(tiny("baseline", 0, 6), tmp_path / "a", progress=False)
    b = train(tiny("post_ln+qknorm", 5, 6), tmp_path / "b", progress=False)
    c = train(tiny("baseline", 0, 6, "data.data_seed=7"), tmp_path / "c", progress=False)
    assert a["batches_sha256"] == b["batches_sha256"] != c["batches_sha256"]
    assert len(a["batches_sha256"]) == 64
    cfg = lambda: tiny("baseline", 0, 6, "train.checkpoint_every=3")  # noqa: E731
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg(), tmp_path / "r", callbacks=[Kill(5)], progress=False)
    resumed = train(cfg(), tmp_path / "r", resume=True, progress=False)
    assert resumed["batches_sha256"] == a["batches_sha256"]
    # probe rows and their loss mask are part of what a run saw
    d = train(tiny("baseline", 0, 6, "data.probe_mix=0.5", "data.probe_loss=answers"),
              tmp_path / "d", progress=False)
    assert d["batches_sha256"] not in (a["batches_sha256"], c["batches_sha256"])


def test_resume_refuses_data_that_changed(tmp_path: Path) -> None:
    from modbench.data import PrepareSettings, prepare_dataset

    def corpus(words: str) -> list[str]:
        return [f"Document {i}: " + " ".join([words] * (20 + i % 7)) for i in range(300)]

    data = tmp_path / "data"
    prepare_dataset(
        corpus("the model reads tokens"), "builtin", data,
        PrepareSettings(seq_len=64, vocab_size=512, val_fraction=0.2, progress=False),
    )
    cfg = lambda: tiny("baseline", 0, 6, f"data.source={data}",  # noqa: E731
                       "train.checkpoint_every=3")
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg(), tmp_path / "r", callbacks=[Kill(4)], progress=False)
    stored = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert len(stored["meta"]["data"]["fingerprint"]) == 64
    before = (tmp_path / "r" / "metrics.jsonl").read_bytes()
    shutil.rmtree(data)
    prepare_dataset(
        corpus("a different text entirely"), "builtin", data,
        PrepareSettings(seq_len=64, vocab_size=512, val_fraction=0.2, progress=False),
    )
    with pytest.raises(ModbenchError, match=r"the data at .* changed since the run started") as e:
        train(cfg(), tmp_path / "r", resume=True, progress=False)
    assert "\n" not in str(e.value)
    assert (tmp_path / "r" / "metrics.jsonl").read_bytes() == before  # nothing touched
