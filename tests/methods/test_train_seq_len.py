"""sigmoid's -log n and SSMax's 1/log n come from the training sequence length
(train.seq_len), not model.max_seq_len; only the runs whose methods read it change key, and a
run folder from before the key resumes as it trained."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from modbench.config import resolve
from modbench.errors import ModbenchError
from modbench.methods.build import plan_run
from modbench.study.spec import config_key
from modbench.train.trainer import train


def test_the_constants_follow_train_seq_len() -> None:
    cfg = resolve("tiny", method="sigmoid+ssmax", overrides=["train.seq_len=32"])
    assert cfg.model.max_seq_len == 64 and cfg.model.train_seq_len == 32
    _, p = plan_run(cfg)
    model = p.build()
    kernel = model.parts.core("attn", 0).kernel
    assert kernel.log_n == pytest.approx(math.log(32))
    s = model.parts.core("attn", 0).qk_post.s
    assert float(s[0].detach()) == pytest.approx(1 / math.log(32))
    # where they agree nothing is stored; an explicit option wins over the length
    assert resolve("tiny").model.train_seq_len is None
    p2 = plan_run(resolve("tiny", method="sigmoid(n=100)",
                          overrides=["train.seq_len=32"]))[1]
    assert p2.build().parts.core("attn", 0).kernel.log_n == pytest.approx(math.log(100))


def test_plan_run_syncs_a_config_built_by_hand() -> None:
    cfg = resolve("tiny", method="sigmoid")
    cfg.train.seq_len = 16  # set after resolve, in Python
    run, p = plan_run(cfg)
    assert run.model.train_seq_len == 16 and cfg.model.train_seq_len is None
    assert p.build().parts.core("attn", 1).kernel.log_n == pytest.approx(math.log(16))


def test_only_the_methods_that_read_it_change_key() -> None:
    for method, changes in [("baseline", False), ("post_ln+qknorm", False),
                            ("sigmoid", True), ("ssmax", True), ("sigmoid(n=64)", False),
                            ("ssmax(init=0.3)", False)]:
        cfg = resolve("cpu-deep", method=method)
        assert cfg.model.train_seq_len == 64 != cfg.model.max_seq_len
        before = resolve("cpu-deep", method=method)
        before.model.train_seq_len = None  # what the key hashed before the key existed
        assert (config_key(cfg) != config_key(before)) is changes, method


def test_set_by_hand_is_refused() -> None:
    with pytest.raises(ModbenchError, match=r"copied from train\.seq_len"):
        resolve("tiny", overrides=["model.train_seq_len=32"])


@pytest.mark.parametrize("method,resumes", [("baseline", True), ("sigmoid", False)])
def test_a_folder_from_before_the_key(method: str, resumes: bool, tmp_path: Path) -> None:
    cfg = resolve("tiny", method=method, steps=4, overrides=["train.seq_len=32",
                                                              "train.checkpoint_every=2"])
    out = tmp_path / "run"
    train(cfg, out, progress=False)
    stored = yaml.safe_load((out / "config.yaml").read_text())
    assert stored["model"]["train_seq_len"] == 32
    del stored["model"]["train_seq_len"]  # as written before the key existed
    (out / "config.yaml").write_text(yaml.safe_dump(stored))
    more = resolve("tiny", method=method, steps=4, overrides=["train.seq_len=32",
                                                              "train.checkpoint_every=2"])
    if resumes:
        assert train(more, out, resume=True, progress=False)["status"] == "completed"
    else:
        with pytest.raises(ModbenchError, match=r"model\.train_seq_len"):
            train(more, out, resume=True, progress=False)
