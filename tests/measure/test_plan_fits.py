"""Plans that pick what fits (issue 46): DDP's gradients as views of its buckets (one copy of
the gradients, where DDP's default kept a second), and ``train.parallel=auto``: DDP where the
plan fits the device with DDP, else FSDP where it fits with FSDP, else one line saying what
fits nothing and what to do."""

from __future__ import annotations

import math

import pytest

from modbench.config import resolve
from modbench.errors import ModbenchError
from modbench.measure.plan import (
    FIXED_ALLOWANCE,
    FP32,
    MARGIN,
    DoesNotFit,
    auto_parallel,
    layout,
    plan_memory,
)
from modbench.methods.build import count_params
from modbench.runtime.gpus import lookup
from modbench.study.spec import config_key, expand, load_spec
from tests.helpers import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def _cuda_bytes_between(low: int, high: int) -> int:
    """A GPU's bytes whose usable share (less 10 % and 2 GiB) lies halfway between peaks."""
    return math.ceil(((low + high) // 2 + FIXED_ALLOWANCE["cuda"]) / (1 - MARGIN))


def _peaks(cfg_overrides: tuple[str, ...] = ()) -> tuple[int, int]:
    """The DDP and FSDP peaks of the tiny run on two processes at micro-batch 1."""
    cfg = tiny("baseline", 0, 30, *cfg_overrides)
    ddp = plan_memory(cfg, device=lookup("h100"), micro_batch=1, nproc=2)
    fsdp = plan_memory(cfg, device=lookup("h100"), micro_batch=1, nproc=2, parallel="fsdp")
    return ddp.peak_bytes, fsdp.peak_bytes


def test_ddp_bucket_views_plan_one_gradient_copy_less() -> None:
    """With bucket views (how train.distributed wraps DDP) the gradients are the buckets:
    the plan is one fp32 copy of the gradients lower than DDP's default, and validation no
    longer borrows the gradients' room (the views stay between steps)."""
    cfg = resolve("tiny")
    n = count_params(cfg.model)
    views = plan_memory(cfg, device=lookup("h100"), micro_batch=4, nproc=2)
    copies = plan_memory(cfg, device=lookup("h100"), micro_batch=4, nproc=2,
                         bucket_view=False)
    assert views.terms["gradients"] == copies.terms["gradients"] == FP32 * n
    assert views.terms["parallel"] == 0 and copies.terms["parallel"] == FP32 * n
    assert views.terms["eval"] == copies.terms["eval"]  # validation fits a step's room here
    assert copies.peak_bytes - views.peak_bytes == FP32 * n  # one fp32 copy of the gradients
    # one process, and FSDP, have no buckets: the switch changes nothing there
    for kw in ({"nproc": 1}, {"nproc": 2, "parallel": "fsdp"}):
        a = plan_memory(cfg, device=lookup("h100"), micro_batch=4, **kw)
        b = plan_memory(cfg, device=lookup("h100"), micro_batch=4, bucket_view=False, **kw)
        assert a.peak_bytes == b.peak_bytes


def test_auto_picks_ddp_where_it_fits() -> None:
    ddp, fsdp = _peaks()
    assert fsdp < ddp  # two shards of the state
    cfg = tiny("baseline", 0, 30, "train.parallel=auto", "train.micro_batch_size=1")
    lay = layout(cfg, lookup("h100"), nproc=2, device_type="cuda")
    assert (lay.parallel, lay.chosen, lay.rejected) == ("ddp", True, [])
    assert lay.plan is not None and lay.plan.peak_bytes == ddp and lay.plan.parallel == "ddp"


def test_auto_picks_fsdp_where_only_fsdp_fits() -> None:
    ddp, fsdp = _peaks()
    cfg = tiny("baseline", 0, 30, "train.parallel=auto", "train.micro_batch_size=1")
    lay = layout(cfg, _cuda_bytes_between(fsdp, ddp), nproc=2, device_type="cuda")
    assert lay.parallel == "fsdp" and lay.chosen
    assert lay.plan is not None and lay.plan.peak_bytes == fsdp and lay.plan.fits
    assert [p.parallel for p in lay.rejected] == ["ddp"] and not lay.rejected[0].fits


def test_auto_with_an_auto_micro_batch_takes_ddp_at_a_smaller_micro_batch_first() -> None:
    """The rule is DDP where DDP fits at all (at the largest micro-batch that fits it), even
    where FSDP would take a larger one; FSDP only where DDP fits no micro-batch."""
    cfg = tiny("baseline", 0, 30, "train.parallel=auto", "train.micro_batch_size=auto")
    big = tiny("baseline", 0, 30)
    d1 = plan_memory(big, device=lookup("h100"), micro_batch=1, nproc=2)
    d4 = plan_memory(big, device=lookup("h100"), micro_batch=4, nproc=2)
    lay = layout(cfg, _cuda_bytes_between(d1.peak_bytes, d4.peak_bytes), nproc=2,
                 device_type="cuda")
    assert lay.parallel == "ddp" and lay.plan is not None and lay.plan.micro_batch < 4


def test_auto_refuses_in_one_line_where_nothing_fits() -> None:
    _, fsdp = _peaks()
    cfg = tiny("baseline", 0, 30, "train.parallel=auto", "train.micro_batch_size=1")
    with pytest.raises(DoesNotFit) as e:
        layout(cfg, _cuda_bytes_between(0, fsdp // 2), nproc=2, device_type="cuda")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("train.parallel=auto: tiny baseline fits neither")
    assert "DDP (peak" in msg and "FSDP (peak" in msg and "usable a process" in msg
    assert "more processes" in msg and "train.activation_checkpointing=true" in msg
    assert e.value.plan.peak_bytes == fsdp and e.value.plan.parallel == "fsdp"
    assert e.value.advice.startswith("use ")
    assert isinstance(e.value, ModbenchError)  # the CLI's one line, exit 2


def test_a_fixed_mode_with_an_auto_micro_batch_keeps_the_trainers_refusal() -> None:
    cfg = tiny("baseline", 0, 30, "train.parallel=ddp", "train.micro_batch_size=auto")
    with pytest.raises(DoesNotFit, match="even at micro-batch 1: peak"):
        layout(cfg, FIXED_ALLOWANCE["cuda"] + 10**6, nproc=2, device_type="cuda")


def test_auto_is_ddp_with_one_process_and_on_the_cpu_without_a_plan() -> None:
    cfg = tiny("baseline", 0, 30, "train.parallel=auto", "train.micro_batch_size=1")
    assert auto_parallel("auto", 1, "cuda") == "ddp"
    assert auto_parallel("auto", 8, "cpu") == "ddp"
    assert auto_parallel("auto", 8, "cuda") is None
    assert auto_parallel("fsdp", 1, "cuda") == "fsdp"
    one = layout(cfg, 10**6, nproc=1, device_type="cuda")  # 1 MB: would fit nothing
    gloo = layout(cfg, 10**6, nproc=2, device_type="cpu")
    assert (one.parallel, one.plan, one.chosen) == ("ddp", None, False)
    assert (gloo.parallel, gloo.plan, gloo.chosen) == ("ddp", None, False)


def test_auto_is_a_value_of_its_own_and_ddp_keeps_old_keys() -> None:
    """``auto`` is valid, hashed as itself (it may train as FSDP); the default ``ddp`` is
    left out of the key as before, so recorded runs keep their keys."""
    assert tiny("baseline", 0, 30, "train.parallel=auto").train.parallel == "auto"
    with pytest.raises(ModbenchError, match=r"train\.parallel must be ddp or fsdp, got 'zero'"):
        tiny("baseline", 0, 30, "train.parallel=zero")
    base = tiny("baseline")
    assert config_key(base) == config_key(tiny("baseline", 0, 30, "train.parallel=ddp"))
    assert config_key(base) != config_key(tiny("baseline", 0, 30, "train.parallel=auto"))
    assert resolve("climb-3b").train.parallel == "ddp"  # the default is unchanged
    three = expand(load_spec("seed002-3b"))
    assert {r.config.train.parallel for r in three} == {"auto"}
    assert {r.config.train.parallel for r in expand(load_spec("seed002-1.2b"))} == {"ddp"}


def test_auto_keeps_layers_that_share_weights_on_ddp() -> None:
    """FSDP2 cannot shard a model whose layers share weights (the engine refuses it), so
    auto never chooses FSDP for one; where DDP does not fit, the line says so."""
    cfg = tiny("widenet", 0, 30, "train.parallel=auto", "train.micro_batch_size=1")
    assert layout(cfg, lookup("h100"), nproc=2, device_type="cuda").parallel == "ddp"
    ddp = plan_memory(cfg, device=lookup("h100"), micro_batch=1, nproc=2).peak_bytes
    with pytest.raises(DoesNotFit) as e:
        layout(cfg, _cuda_bytes_between(ddp // 2, ddp), nproc=2, device_type="cuda")
    assert "share weights" in str(e.value) and "FSDP (peak" not in str(e.value)
    assert "processes" not in e.value.advice and e.value.plan.parallel == "ddp"
