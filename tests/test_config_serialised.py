"""A RunConfig's serialised form (to_dict, config.yaml) reads back through from_dict to an equal
config, with the checks resolve makes; a corrupt one is refused in one line."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from modbench.config import PRESETS, RunConfig, dump_yaml, from_dict, resolve
from modbench.errors import ModbenchError
from modbench.methods.build import plan_run


def _round_trips(cfg: RunConfig) -> None:
    back = from_dict(cfg.to_dict())
    assert back == cfg and back is not cfg
    assert back.model is not cfg.model and back.train.trackers is not cfg.train.trackers
    assert from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg  # config.yaml's form


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_round_trips(preset: str) -> None:
    _round_trips(resolve(preset))


@pytest.mark.parametrize("overrides", [
    ["train.micro_batch_size=auto", "train.compile=blocks", "train.trackers=[tensorboard]",
     "train.activation_checkpointing=every:2", "recipe.betas=[0.8, 0.99]",
     "recipe.warmup_steps=7", "train.stop_stalled_after=200", "train.device_memory_gb=1.5",
     "train.stop_stalled_margin=0.02", "train.stop_stalled_every=100",
     "train.init_from=runs/x", "data.probe_mix=0.25", "data.probe_loss=answers"],
    ["train.micro_batch_size=4", "train.compile=false", "train.activation_checkpointing=true",
     "train.seq_len=64", "model.attn_head_dim=32", "recipe.optimizer=muon",
     "recipe.muon_layerwise_lr=noise", "seed=3"],
])
def test_non_default_values_round_trip(overrides: list[str]) -> None:
    cfg = resolve("cpu-small", overrides=overrides)
    assert cfg != resolve("cpu-small")
    _round_trips(cfg)


@pytest.mark.parametrize("method", ["layerscale(init=1e-4)+qknorm", "osp", "sigmoid"])
def test_a_planned_run_config_round_trips(method: str) -> None:
    """What the trainer writes to config.yaml: the canonical method string, the recipe
    exceptions applied and recorded (osp: Muon), train_seq_len copied (cpu-deep)."""
    run, _ = plan_run(resolve("cpu-deep", method=method))
    _round_trips(run)


def _tree(**sections: dict[str, Any]) -> dict[str, Any]:
    tree = resolve("tiny").to_dict()
    for name, values in sections.items():
        tree[name].update(values)
    return tree


@pytest.mark.parametrize("tree,msg", [
    (["model", "recipe"], "must be a mapping of sections, got list"),
    ({"modle": {"d_model": 8}}, "unknown config key 'modle'"),
    ({"model": {"d_modle": 8}}, "unknown config key 'model.d_modle'"),
    ({"train": 5}, "'train' is a section"),
    (_tree(model={"d_model": "wide"}), "'model.d_model' takes an integer"),
    (_tree(recipe={"betas": [0.9]}), "takes a pair of numbers"),
    # what only validate() refuses: from_dict is resolve's check, not a lighter one
    (_tree(recipe={"lr": -1.0}), "recipe.lr must be positive"),
    (_tree(train={"seq_len": 4096}), "exceeds model.max_seq_len"),
    (_tree(train={"parallel": "zero"}), "train.parallel must be ddp or fsdp"),
    ({"preset": "tiny-ish"}, "unknown preset 'tiny-ish'"),
])
def test_a_corrupt_serialised_config_is_one_line(tree: Any, msg: str) -> None:
    with pytest.raises(ModbenchError, match=msg) as e:
        from_dict(tree)
    assert "\n" not in str(e.value)


def test_keys_added_since_take_their_defaults() -> None:
    tree = resolve("tiny").to_dict()
    del tree["train"]["stop_stalled_after"], tree["recipe"]["muon_momentum"]
    del tree["train"]["stop_stalled_margin"], tree["train"]["stop_stalled_every"]
    assert from_dict(tree) == resolve("tiny")
