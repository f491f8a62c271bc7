"""Stall detection: the unigram level of a dataset (checked against a plain-Python count), the
stall rule on recorded validation curves, and the trainer's ``stalled`` status on a planted
stall next to a healthy run."""

from __future__ import annotations

import collections
import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from modbench.config import resolve
from modbench.data import builtin_dataset, open_dataset
from modbench.data.unigram import SMOOTHING, sample_rows, unigram_level
from modbench.errors import ModbenchError
from modbench.runtime.checkpoint import save_checkpoint
from modbench.runtime.stall import judge_run_folder, stalled_at
from modbench.train.trainer import train
from tests.helpers import tiny

STALL_METHOD = "layerscale(init=-1e30)"  # saturated residual scales: every gradient is zero


def reference_level(ds: Any, rows: set[int] | None, n_val: int) -> tuple[float, float]:
    """Entropy of the predicted tokens of training ``rows`` (None: all), and the cross-entropy
    of the first ``n_val`` validation rows under their add-1/2 distribution, counted with a
    Counter and summed in plain Python."""
    train: collections.Counter[int] = collections.Counter()
    for shard, first in _shards(ds, "train"):
        keep = [i for i in range(shard.shape[0]) if rows is None or first + i in rows]
        train.update(np.asarray(shard[keep, 1:]).ravel().tolist())
    total = sum(train.values())
    h = -sum(c / total * math.log(c / total) for c in train.values())
    val = [t for shard, first in _shards(ds, "val")
           for t in np.asarray(shard[: max(0, n_val - first), 1:]).ravel().tolist()]
    denom = total + SMOOTHING * ds.vocab_size
    ce = -sum(math.log((train[t] + SMOOTHING) / denom) for t in val) / len(val)
    return h, ce


def _shards(ds: Any, split: str) -> list[tuple[Any, int]]:
    out, first = [], 0
    for shard in ds._shards[split]:
        out.append((shard, first))
        first += shard.shape[0]
    return out


def test_unigram_level_equals_a_plain_count() -> None:
    ds = open_dataset(builtin_dataset(512, 64, progress=False))
    level = unigram_level(ds, 16)
    h, ce = reference_level(ds, None, 16)
    assert level.entropy == pytest.approx(h, rel=1e-12)
    assert level.val_loss == pytest.approx(ce, rel=1e-12)
    assert not level.sampled and level.val_sequences == 16
    assert level.train_tokens == ds.num_sequences("train") * 63
    # a model that learned only the frequencies scores about the entropy: the two are close,
    # and far below the loss of a uniform guess, log(512)
    assert abs(level.val_loss - level.entropy) < 0.1 < math.log(512) - level.val_loss


def test_a_big_split_is_sampled_evenly_and_cached(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ds = open_dataset(builtin_dataset(512, 64, progress=False))
    monkeypatch.setenv("MODBENCH_CACHE", str(tmp_path))  # an empty cache for the level
    n = ds.num_sequences("train")
    rows = sample_rows(n, 64, max_tokens=63 * 100)
    assert rows is not None and len(rows) == 100
    assert list(rows) == [round(i * (n - 1) / 99) for i in range(100)]
    assert sample_rows(n, 64, max_tokens=63 * n) is None  # fits: every row
    level = unigram_level(ds, 8, max_tokens=63 * 100)
    h, ce = reference_level(ds, {int(r) for r in rows}, 8)
    assert level.sampled and level.train_tokens == 6300
    assert level.entropy == pytest.approx(h, rel=1e-12)
    assert level.val_loss == pytest.approx(ce, rel=1e-12)
    (cached,) = (tmp_path / "unigram").iterdir()
    assert json.loads(cached.read_text())["val_loss"] == level.val_loss

    def no_count(*_: object, **__: object) -> None:
        raise AssertionError("counted again instead of reading the cache")

    monkeypatch.setattr("modbench.data.unigram.token_counts", no_count)
    assert unigram_level(ds, 8, max_tokens=63 * 100) == level


# Validation curves recorded on the built-in corpus (LOG.md 2026-11-23 and docs/runs.md):
# (preset, steps, warm-up, unigram level, [(step, val loss), ...]).
U_DEEP, U_TINY = 5.9511, 5.2857
POST_LN_500 = [(0, 6.955), (100, 5.986), (200, 5.967), (300, 5.980), (400, 5.946),
               (500, 5.947)]  # cpu-deep, lr 3e-3: the Post-LN stall of builtin-cpu
BASELINE_500 = [(0, 6.951), (100, 5.979), (200, 5.583), (300, 5.260), (400, 4.991),
                (500, 4.882)]  # the Pre-LN baseline of the same study
DEEP_120 = [(0, 6.951), (20, 6.103), (40, 6.051), (60, 6.008), (80, 5.944), (100, 5.946),
            (120, 5.950)]  # a 120-step cpu-deep baseline at lr 3e-3: ends *at* the level
SMOKE_30 = [(0, 6.234), (10, 5.581), (20, 5.388), (30, 5.362)]  # smoke-tiny: ends above it
TINY_MIX_120 = [(0, 6.234), (10, 5.681), (20, 5.377), (30, 5.343), (40, 5.334), (50, 5.306),
                (60, 5.284), (70, 5.284), (80, 5.252), (90, 5.252), (100, 5.217),
                (110, 5.212), (120, 5.199)]  # tiny, 120 steps, 25 % probe rows: slow, healthy


def rule(vals: list[tuple[int, float | None]], level: float, steps: int, warmup: int,
         **kw: Any) -> int | None:
    args = {"margin": 0.1, "patience": 0.5, "min_steps": 100, **kw}
    return stalled_at(vals, level, steps=steps, warmup=warmup, **args)


def test_the_post_ln_stall_is_flagged_from_its_first_point_after_warm_up() -> None:
    assert rule(POST_LN_500, U_DEEP, 500, 50) == 100


@pytest.mark.parametrize(("vals", "level", "steps", "warmup"), [
    (BASELINE_500, U_DEEP, 500, 50),  # learns: ends 1.07 below the level
    (DEEP_120, U_DEEP, 120, 12),  # at the level for its last 40-60 steps only
    (SMOKE_30, U_TINY, 30, 2),  # above the level, still falling
    (TINY_MIX_120, U_TINY, 120, 6),  # ends 0.09 below the level, falling
])
def test_healthy_short_runs_are_not_flagged(vals: list[tuple[int, float]], level: float,
                                            steps: int, warmup: int) -> None:
    assert rule(vals, level, steps, warmup) is None


def test_each_condition_of_the_rule() -> None:
    # the span: from step 60 the 120-step run sat at the level for 60 steps (fell 0.058)
    assert rule(DEEP_120, U_DEEP, 120, 12, min_steps=60) == 60
    assert rule(DEEP_120, U_DEEP, 120, 12, min_steps=61) is None
    # flatness: 0.058 nats is flat for a margin of 0.1, not of 0.05; from step 80 it is
    assert rule(DEEP_120, U_DEEP, 120, 12, min_steps=60, margin=0.05) is None
    assert rule(DEEP_120, U_DEEP, 120, 12, min_steps=40, patience=0.3, margin=0.05) == 80
    # the fraction of the steps after warm-up: 400 of 450 steps, not 90 %
    assert rule(POST_LN_500, U_DEEP, 500, 50, patience=0.9) is None
    # a run that leaves the level before the end is not stalled, however long it sat there
    recovered = [*POST_LN_500[:-1], (500, U_DEEP - 0.2)]
    assert rule(recovered, U_DEEP, 500, 50) is None
    # above the level counts: a run that learned nothing at all
    flat: list[tuple[int, float | None]] = [(s, 6.24) for s in range(0, 151, 10)]
    assert rule(flat, U_TINY, 150, 6) == 10
    # points inside warm-up do not count; a non-finite point ends the stretch
    assert rule(flat, U_TINY, 150, 20) == 30
    assert rule([*flat[:3], (30, None), *flat[4:]], U_TINY, 150, 6) == 40
    # off, and nothing to judge
    assert rule(POST_LN_500, U_DEEP, 500, 50, margin=0.0) is None
    assert rule([(0, 6.9), (500, 5.95)], U_DEEP, 500, 50) is None  # only the final point
    assert rule(POST_LN_500, math.nan, 500, 50) is None


def test_bad_stall_settings_are_refused_in_one_line() -> None:
    for item, words in (("train.stall_margin=-0.1", "at least 0"),
                        ("train.stall_patience=1.5", "in [0, 1]"),
                        ("train.stall_min_steps=-1", "at least 0")):
        with pytest.raises(ModbenchError, match=r"train\.stall_") as e:
            resolve("tiny", overrides=[item])
        assert words in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ the trainer


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run that cannot learn (every gradient zero), 120 steps, validated every 10."""
    out = tmp_path_factory.mktemp("stall") / "run"
    train(tiny(STALL_METHOD, 0, 120), out, progress=False)
    return out


def test_a_planted_stall_ends_stalled_with_its_step(planted: Path) -> None:
    s = json.loads((planted / "summary.json").read_text())
    assert s["status"] == "stalled" and s["steps"] == 120
    # warm-up is round(0.05 * 120) = 6 steps; the first validation after it is step 10, and
    # the loss never moved from there
    assert s["stalled_at_step"] == 10 and s["diverged_at_step"] is None
    ds = open_dataset(builtin_dataset(512, 64, progress=False))
    h, ce = reference_level(ds, None, 16)
    assert s["unigram_entropy"] == pytest.approx(h, rel=1e-12)
    assert s["unigram_loss"] == pytest.approx(ce, rel=1e-12)
    assert s["final_val_loss"] == pytest.approx(s["initial_val_loss"])  # kept: a finite loss
    assert s["final_val_loss"] > s["unigram_loss"]
    # the same rule applied afterwards to the folder agrees (how old summaries are judged)
    check = judge_run_folder(planted)
    assert check is not None and check.stalled_at == 10
    assert check.level is not None and check.level.val_loss == s["unigram_loss"]


def test_a_healthy_tiny_run_is_not_flagged(tmp_path: Path) -> None:
    s = train(tiny("baseline", 0, 120), tmp_path / "run", progress=False)
    assert s["status"] == "completed" and s["stalled_at_step"] is None
    assert s["final_val_loss"] < s["unigram_loss"] - 0.1


def test_stall_detection_off(tmp_path: Path) -> None:
    # 30 steps, a stretch of 20 allowed: stalled at step 10 with the rule on (as in
    # tests/reliability/test_numerical_faults.py), completed with it off
    s = train(tiny(STALL_METHOD, 0, 30, "train.stall_min_steps=20", "train.stall_margin=0"),
              tmp_path / "run", progress=False)
    assert s["status"] == "completed" and s["stalled_at_step"] is None
    assert s["unigram_loss"] is not None  # still reported


def test_a_resumed_stall_keeps_its_history(planted: Path, tmp_path: Path) -> None:
    """Resuming the finished run re-judges it from the history its checkpoint carries; a
    checkpoint from before the history was saved falls back to the metrics log."""
    ref = json.loads((planted / "summary.json").read_text())
    for old in (False, True):
        out = tmp_path / f"old{old}"
        shutil.copytree(planted, out)
        if old:
            ckpt = out / "checkpoints" / "last.pt"
            state = torch.load(ckpt, weights_only=True)
            assert [tuple(v) for v in state.pop("val_history")][:2] == [
                (0, ref["initial_val_loss"]), (10, pytest.approx(ref["initial_val_loss"]))]
            save_checkpoint(ckpt, state)
        s = train(tiny(STALL_METHOD, 0, 120), out, resume=True, progress=False)
        assert (s["status"], s["stalled_at_step"]) == ("stalled", 10)
        assert np.isclose(s["unigram_loss"], ref["unigram_loss"])
