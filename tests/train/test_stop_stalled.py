"""The early stop of stalled runs (``train.stop_stalled_after``, docs/runs.md "Stopping stalled
runs"): the rule on planted validation series (a late recovery is not cut at the studies'
patience, a stall is), the trainer's stop (status, steps, checkpoint), and the key in configs
and study run keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modbench.config import from_dict, resolve
from modbench.errors import ModbenchError
from modbench.study.spec import (
    STUDY_STOP_STALLED_AFTER,
    STUDY_STOP_STALLED_EVERY,
    config_key,
    expand,
    load_spec,
)
from modbench.train.trainer import stop_looks, stop_stalled_at, train
from tests.helpers import read_metrics, tiny

STALL_METHOD = "layerscale(init=-1e30)"  # saturated residual scales: every gradient is zero
LEVEL = 5.951  # the unigram level of cpu-deep's data (docs/runs.md)


def first_stop(series: list[tuple[int, float]], after: int | None, steps: int = 500,
               level: float = LEVEL, margin: float | None = None,
               every: int | None = None) -> tuple[int, int] | None:
    """Feed a builtin-cpu-like run (cpu-deep, lr 3e-3, ``steps`` steps) its validations one at
    a time, as the trainer does; (step it stops at, stalled_at_step) or None. ``margin``:
    ``train.stop_stalled_margin`` (None: its default); ``every``: ``train.stop_stalled_every``
    (None: every validation is a look, the key's default)."""
    patience = "null" if after is None else after
    cfg = resolve("cpu-deep", overrides=[
        "recipe.lr=3e-3", f"train.steps={steps}", f"train.stop_stalled_after={patience}",
        *([] if margin is None else [f"train.stop_stalled_margin={margin}"]),
        *([] if every is None else [f"train.stop_stalled_every={every}"])])
    for i, (done, _) in enumerate(series):
        if done >= steps:
            break
        at = stop_stalled_at(cfg, series[:i + 1], level, done)
        if at is not None:
            return done, at
    return None


# Pre-LN on cpu-deep at its own lr 1e-3, 500 steps, validated every 20 (benchmarks/stall_rule.py,
# 2026-11-26): at the unigram level (within 0.1) from step 60 to 200, then learning to 5.325
LATE_RECOVERY = [(0, 6.951), (20, 6.79), (40, 6.437), (60, 6.095), (80, 5.964), (100, 5.963),
                 (120, 5.959), (140, 5.976), (160, 5.936), (180, 5.902), (200, 5.901),
                 (220, 5.844), (240, 5.797), (260, 5.738), (280, 5.686), (300, 5.636),
                 (400, 5.437), (500, 5.325)]
# the Post-LN family at lr 3e-3: at the level from step 100 to the end
STALL = [(0, 6.95), (100, 5.96), (200, 5.947), (300, 5.946), (400, 5.946), (500, 5.946)]
# Sandwich-LN at builtin-cpu's settings, validated every 20 (benchmarks/stall_rule.py,
# 2026-11-27): 0.03-0.08 nats under the level from step 120 to 340, then learning on to 5.773,
# 0.18 under it: not stalled at the end. At the old margin of the stop (0.1) it was cut.
SLOW_SANDWICH = [(0, 6.942), (20, 6.525), (40, 6.046), (60, 6.013), (80, 5.96), (100, 5.986),
                 (120, 5.936), (140, 5.948), (160, 5.918), (180, 5.887), (200, 5.893),
                 (220, 5.876), (240, 5.881), (260, 5.875), (280, 5.889), (300, 5.895),
                 (320, 5.884), (340, 5.868), (360, 5.848), (380, 5.849), (400, 5.838),
                 (420, 5.818), (440, 5.808), (460, 5.785), (480, 5.776), (500, 5.773)]


def every_100(series: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(s, v) for s, v in series if s % 100 == 0]


def test_a_planted_late_recovery_is_not_cut_at_the_study_patience() -> None:
    for series in (LATE_RECOVERY, every_100(LATE_RECOVERY)):
        assert first_stop(series, STUDY_STOP_STALLED_AFTER) is None
    # a shorter patience at the old margin cuts it (the test can fail): at step 200,
    # "stalled" since 100
    assert first_stop(every_100(LATE_RECOVERY), 100, margin=0.1) == (200, 100)
    assert first_stop(LATE_RECOVERY, 100, margin=0.1) == (180, 80)


# SeedNorm at builtin-cpu's settings, validated every 20 (benchmarks/stall_rule.py,
# 2026-11-27): at the level (within 0.05, or above it) from step 60 to 280, then learning to
# 5.478 (the longest such stretch measured until the two runs of LONG_* below)
SLOW_SEEDNORM = [(0, 6.951), (20, 6.412), (40, 6.128), (60, 6.026), (80, 6.024), (100, 5.999),
                 (120, 5.954), (140, 5.985), (160, 5.961), (180, 5.956), (200, 5.98),
                 (220, 5.971), (240, 5.946), (260, 5.957), (280, 5.913), (300, 5.881),
                 (320, 5.823), (340, 5.741), (360, 5.679), (380, 5.639), (400, 5.592),
                 (420, 5.571), (440, 5.54), (460, 5.501), (480, 5.484), (500, 5.478)]


def test_slow_learners_at_the_level_are_not_cut() -> None:
    """Neither late learner of the catalogue is cut at the studies' patience and the stop's
    margin (``train.stop_stalled_margin``, 0.05); the stop before both (patience 200, margin
    0.1, the end-of-run rule's) cut both, and a patience of 150 cuts SeedNorm at 0.05."""
    for slow in (SLOW_SANDWICH, SLOW_SEEDNORM):
        for series in (slow, every_100(slow)):
            assert first_stop(series, STUDY_STOP_STALLED_AFTER) is None
            assert first_stop(series, STUDY_STOP_STALLED_AFTER, margin=0.1) is None
    assert first_stop(SLOW_SANDWICH, 200, margin=0.1) == (280, 80)
    assert first_stop(every_100(SLOW_SANDWICH), 200, margin=0.1) == (300, 100)
    assert first_stop(SLOW_SANDWICH, 200) is None  # the margin alone saves Sandwich-LN
    assert first_stop(SLOW_SEEDNORM, 200, margin=0.1) == (260, 60)
    assert first_stop(SLOW_SEEDNORM, 150) == (260, 100)
    # and the true stall still stops, at either margin
    assert first_stop(STALL, STUDY_STOP_STALLED_AFTER) == first_stop(
        STALL, STUDY_STOP_STALLED_AFTER, margin=0.1) == (400, 100)


# WideNet seed 0 and SeedNorm seed 2 at builtin-cpu's settings, validated every 20
# (benchmarks/stall_rule.py, 2026-11-27, stall_rule-2026-11-27b.json): at or above the level
# from step 60 to 320 and within the stop's margin to 340 (280 steps, the longest stretch of a
# run that learned on), then learning to 5.796 and 5.626: they sit where a true stall sits, so
# only the patience keeps them
LONG_WIDENET = [(0, 6.948), (20, 6.578), (40, 6.053), (60, 6.015), (80, 5.96), (100, 5.986),
                (120, 5.947), (140, 5.974), (160, 5.959), (180, 5.946), (200, 5.972),
                (220, 5.969), (240, 5.964), (260, 5.96), (280, 5.981), (300, 5.982),
                (320, 5.95), (340, 5.904), (360, 5.88), (380, 5.869), (400, 5.851),
                (420, 5.846), (440, 5.831), (460, 5.806), (480, 5.802), (500, 5.796)]
LONG_SEEDNORM = [(0, 6.936), (20, 6.245), (40, 6.145), (60, 6.027), (80, 6.016), (100, 5.998),
                 (120, 5.957), (140, 5.983), (160, 5.955), (180, 5.957), (200, 5.984),
                 (220, 5.97), (240, 5.963), (260, 5.968), (280, 5.983), (300, 5.967),
                 (320, 5.947), (340, 5.915), (360, 5.866), (380, 5.851), (400, 5.833),
                 (420, 5.787), (440, 5.747), (460, 5.669), (480, 5.625), (500, 5.626)]


def test_the_longest_measured_plateaus_are_not_cut_at_the_study_patience() -> None:
    """The two longest plateaus measured before a run learned (280 steps within the margin)
    are not cut at the studies' patience at either cadence; the patience before 2026-11-27
    (200) cuts both, at the study's cadence at step 300, as a stall from step 100."""
    for slow in (LONG_WIDENET, LONG_SEEDNORM):
        for series in (slow, every_100(slow)):
            assert first_stop(series, STUDY_STOP_STALLED_AFTER) is None
        assert first_stop(every_100(slow), 200) == (300, 100)
        assert first_stop(slow, 200) == (280, 60)


# SeedNorm seed 4 at builtin-cpu's settings, validated every 20 (stall_rule-2026-11-27b.json):
# at or near the level from step 60 to 420 (5.951 at 120, 5.909 at 420), then learning to
# 5.767, 0.18 under the level: not stalled at its end
LATEST_SEEDNORM = [(0, 6.934), (20, 6.274), (40, 6.129), (60, 6.022), (80, 6.009), (100, 6.008),
                   (120, 5.951), (140, 5.985), (160, 5.963), (180, 5.959), (200, 5.986),
                   (220, 5.97), (240, 5.963), (260, 5.968), (280, 5.986), (300, 5.986),
                   (320, 5.974), (340, 5.958), (360, 5.937), (380, 5.919), (400, 5.906),
                   (420, 5.909), (440, 5.88), (460, 5.839), (480, 5.801), (500, 5.767)]


def test_the_stop_looks_every_100_steps_in_studies() -> None:
    """Looking at every validation of a run validated every 20 steps, the stop cuts SeedNorm's
    seed 4 at step 420 (from 120, a low point of the noise); looking only at validations
    ``STUDY_STOP_STALLED_EVERY`` steps apart, as studies do, it does not, while a true stall
    validated every 20 still stops at the same step as one validated every 100."""
    assert first_stop(LATEST_SEEDNORM, STUDY_STOP_STALLED_AFTER) == (420, 120)
    assert first_stop(LATEST_SEEDNORM, STUDY_STOP_STALLED_AFTER,
                      every=STUDY_STOP_STALLED_EVERY) is None
    dense_stall = [(s, 6.95 if s == 0 else 5.946 + 0.002 * (s % 40 == 0))
                   for s in range(0, 501, 20)]
    assert first_stop(dense_stall, STUDY_STOP_STALLED_AFTER) == (360, 60)  # after warm-up
    assert first_stop(dense_stall, STUDY_STOP_STALLED_AFTER,
                      every=STUDY_STOP_STALLED_EVERY) == first_stop(
        STALL, STUDY_STOP_STALLED_AFTER) == (400, 100)


def test_the_looks_are_at_least_every_apart_whatever_the_cadence() -> None:
    def looked(cadence: int) -> list[int]:
        vals = [(s, 6.0) for s in range(0, 501, cadence)]
        return [s for s, _ in stop_looks(vals, STUDY_STOP_STALLED_EVERY)]

    assert looked(20) == looked(100) == [0, 100, 200, 300, 400, 500]
    assert looked(16) == [0, 112, 224, 336, 448]  # the first validation 100 steps on
    assert looked(250) == [0, 250, 500]  # sparser validations: each one is a look


def test_a_planted_stall_stops_with_its_step() -> None:
    stop = first_stop(STALL, STUDY_STOP_STALLED_AFTER)
    assert stop is not None and stop[1] == 100
    assert stop[0] - stop[1] >= STUDY_STOP_STALLED_AFTER and stop[0] < 500
    assert first_stop(STALL, None) is None  # off: never stops
    # still falling by the margin over the stretch: not a stall yet
    falling = [(0, 6.95), *((s, 6.3 - 0.0012 * s) for s in range(100, 501, 100))]
    assert first_stop(falling, STUDY_STOP_STALLED_AFTER, level=6.3) is None


def test_the_trainer_stops_a_stalled_run(tmp_path: Path) -> None:
    """tiny, 120 steps validated every 10, a model that cannot learn: at the level from step
    10 (the first validation after warm-up), stopped after 40 steps of it."""
    out = tmp_path / "run"
    s = train(tiny(STALL_METHOD, 0, 120, "train.stop_stalled_after=40"), out, progress=False)
    assert (s["status"], s["stalled_at_step"]) == ("stalled", 10)
    assert (s["steps"], s["steps_planned"]) == (50, 120)
    assert s["final_val_loss"] == pytest.approx(s["initial_val_loss"])  # finite, kept
    recs = read_metrics(out)
    assert max(r["step"] for r in recs if r["kind"] == "train") == 50
    assert [r["step"] for r in recs if r["kind"] == "val"] == [0, 10, 20, 30, 40, 50]
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"] == 50
    assert json.loads((out / "summary.json").read_text()) == s
    # looking every 30 steps: the stall counts from step 30, the first look after warm-up,
    # and the run stops at the first look 40 steps on (step 90), validated every 10 meanwhile
    out = tmp_path / "looks"
    s = train(tiny(STALL_METHOD, 0, 120, "train.stop_stalled_after=40",
                   "train.stop_stalled_every=30"), out, progress=False)
    assert (s["status"], s["stalled_at_step"], s["steps"]) == ("stalled", 30, 90)
    assert [r["step"] for r in read_metrics(out) if r["kind"] == "val"] == list(range(0, 91, 10))


# the tiny baseline of the test below, as it trained (unigram level 5.286): at the level
# (within 0.1) from step 10 to 60, then learning: a late recovery in miniature (within 0.05,
# the stop's margin, only from 30 to 50)
TINY_BASELINE = [(0, 6.234), (10, 5.581), (20, 5.33), (30, 5.289), (40, 5.259), (50, 5.261),
                 (60, 5.212), (70, 5.149), (80, 5.078), (90, 5.033), (100, 4.984)]


def test_a_healthy_run_is_not_stopped(tmp_path: Path) -> None:
    s = train(tiny("baseline", 0, 120, "train.stop_stalled_after=40"), tmp_path / "run",
              progress=False)
    assert s["status"] == "completed" and s["steps"] == 120 and s["stalled_at_step"] is None
    # its curve at a shorter patience and the old margin would have been cut at step 50
    cfg = tiny("baseline", 0, 120, "train.stop_stalled_after=30", "train.stop_stalled_margin=0.1")
    stops = [stop_stalled_at(cfg, TINY_BASELINE[:i + 1], 5.286, d)
             for i, (d, _) in enumerate(TINY_BASELINE)]
    assert stops[5] == 20 and not any(stops[:5])
    cfg = tiny("baseline", 0, 120, "train.stop_stalled_after=30")
    assert not any(stop_stalled_at(cfg, TINY_BASELINE[:i + 1], 5.286, d)
                   for i, (d, _) in enumerate(TINY_BASELINE))
    cfg = tiny("baseline", 0, 120, "train.stop_stalled_after=40")
    assert not any(stop_stalled_at(cfg, TINY_BASELINE[:i + 1], 5.286, d)
                   for i, (d, _) in enumerate(TINY_BASELINE))


def test_the_key_in_configs_and_study_keys(tmp_path: Path) -> None:
    assert resolve("tiny").train.stop_stalled_after is None  # modbench train: off
    for bad in ("0", "-5", "1.5", "true", "x"):
        with pytest.raises(ModbenchError, match=r"train\.stop_stalled_after") as e:
            resolve("tiny", overrides=[f"train.stop_stalled_after={bad}"])
        assert "\n" not in str(e.value)
    # a config.yaml written before the key loads, with the key off and its old run key
    old = resolve("tiny").to_dict()
    del old["train"]["stop_stalled_after"]
    cfg = from_dict(old)
    assert cfg.train.stop_stalled_after is None
    assert config_key(cfg) == config_key(resolve("tiny"))
    # studies set it: their runs' keys differ from the same runs trained to the end, so a
    # store's older runs are trained again rather than mixed with stopped ones
    runs = expand(load_spec("builtin-cpu"))
    assert {r.config.train.stop_stalled_after for r in runs} == {STUDY_STOP_STALLED_AFTER}
    for r in runs[:3]:
        full = from_dict(r.config.to_dict())
        full.train.stop_stalled_after = None
        assert config_key(full) != r.key
    # the stop's margin: a run without the stop never reads it, and a store's runs stopped
    # before the key (at the old 0.1) keep their key only at 0.1
    for r in runs[:2]:
        old_stop = from_dict(r.config.to_dict())
        old_stop.train.stop_stalled_margin = 0.1
        assert config_key(old_stop) != r.key
        off = from_dict(r.config.to_dict())
        off.train.stop_stalled_after = None
        off_other = from_dict(off.to_dict())
        off_other.train.stop_stalled_margin = 0.3
        assert config_key(off) == config_key(off_other)
    # the stop's looks: studies look every 100 steps; where every validation is a look anyway
    # (builtin-cpu validates every 100) the key is hashed as before it existed, so stores keep
    # their runs; validated every 20, the runs differ from those that looked at every one
    assert {r.config.train.stop_stalled_every for r in runs} == {STUDY_STOP_STALLED_EVERY}
    for r in runs[:2]:
        before = from_dict(r.config.to_dict())
        before.train.stop_stalled_every = None
        assert config_key(before) == r.key
        dense, dense_before = from_dict(r.config.to_dict()), from_dict(before.to_dict())
        dense.train.eval_every = dense_before.train.eval_every = 20
        assert config_key(dense) != config_key(dense_before)
        off, off_every = from_dict(before.to_dict()), from_dict(dense.to_dict())
        off.train.stop_stalled_after = off_every.train.stop_stalled_after = None
        off.train.eval_every = 20
        assert config_key(off) == config_key(off_every)
    with pytest.raises(ModbenchError, match=r"train\.stop_stalled_every"):
        resolve("tiny", overrides=["train.stop_stalled_every=0"])
    tree = runs[0].config.to_dict()
    del tree["train"]["stop_stalled_margin"]  # a config.yaml from before the key
    assert from_dict(tree).train.stop_stalled_margin == 0.05
    with pytest.raises(ModbenchError, match=r"train\.stop_stalled_margin"):
        resolve("tiny", overrides=["train.stop_stalled_margin=-0.1"])
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nmethods: []\nscales: [tiny]\nseeds: {default: [0], "
                    "noise_floor: []}\noverrides: ['train.stop_stalled_after=null']\n")
    (run,) = expand(load_spec(spec))
    assert run.config.train.stop_stalled_after is None
