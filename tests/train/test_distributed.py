"""Multi-process training (DDP and FSDP2 over gloo on the CPU, two processes) against the
single-process run with the same global batch: the same batches, the same losses and weights
to float32 rounding, only rank 0 writing, checkpoints that resume across a change in the
number of processes (2 -> 2, 2 -> 1, 1 -> 2, after a SIGKILL), nGPT's renormalisation and
PowerNorm's running statistics kept in step on every process, bad process counts refused in
one line; and activation checkpointing (same numbers, fewer saved activations).

Most multi-process runs share one group of two spawned processes (``group``, module
scoped: starting processes is the slow part); each process records what it saw and what it
wrote. The resume with two processes goes through :func:`modbench.train.distributed.launch`
(torchrun), so that path is exercised too. No network: the group meets through a file
store, torchrun through ``--standalone`` on localhost.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modbench.cli import run_cli
from modbench.config import RunConfig, from_dict
from modbench.errors import ModbenchError
from modbench.measure.memory import saved_activation_bytes
from modbench.methods.build import plan
from modbench.methods.ngpt import UnitNormLinear
from modbench.runtime.callback import Callback, TrainingRun
from modbench.runtime.checkpoint import load_checkpoint
from modbench.runtime.runfolder import CHECKPOINT
from modbench.train.distributed import _failure, launch
from modbench.train.recompute import apply_activation_checkpointing, stateful_buffers
from modbench.train.trainer import train
from tests.helpers import read_metrics, tiny

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available() and hasattr(signal, "SIGKILL")),
    reason="needs torch.distributed with gloo and POSIX signals")

# Two processes against one, same global batch. A 2-process loss is the mean of two
# per-process means and its gradient the average of two per-process gradients (DDP's
# all-reduce, FSDP's reduce-scatter): the same sums in another order, so they differ from
# one process's by float32 rounding. Measured on these runs: training losses differ by at
# most 3e-7, validation losses by 1.2e-7, weights by 7.5e-6 (DDP and FSDP alike); over every
# method (3 steps, no micro-batches, DDP and FSDP) losses by at most 9.5e-7. Weights can
# differ more than losses: Adam divides each step by the gradient's running RMS, so a weight
# whose gradient is rounding noise moves by up to ~lr either way (one ln_scaling weight:
# 1.4e-4). The tolerances leave a 30x and 13x margin on these runs.
LOSS_ATOL = 1e-5
PARAM_ATOL = 1e-4

STEPS, KILL_AT = 8, 4  # the kill comes after the checkpoint at step 3, before step 5
BASE = ("train.threads=1", "train.eval_every=4", "train.checkpoint_every=3",
        "train.micro_batch_size=2")  # batch 8: 4 rows per process, in 2 micro-batches


def cfg_of(method: str = "baseline", steps: int = STEPS, *extra: str) -> RunConfig:
    return tiny(method, 0, steps, *BASE, *extra)


# the group's runs: name -> (config, resume, kill at this 0-based step)
JOBS: dict[str, tuple[RunConfig, bool, int | None]] = {
    "ddp": (cfg_of(), False, None),
    "fsdp": (cfg_of("baseline", STEPS, "train.parallel=fsdp",
                    "train.activation_checkpointing=true"), False, None),
    "ngpt_ddp": (cfg_of("ngpt", 6), False, None),
    "ngpt_fsdp": (cfg_of("ngpt", 6, "train.parallel=fsdp"), False, None),
    "powernorm_ddp": (cfg_of("powernorm(warmup=3)", 6), False, None),
    "powernorm_fsdp": (cfg_of("powernorm(warmup=3)", 6, "train.parallel=fsdp"), False, None),
    # a 0-dim parameter (FSDP leaves it whole) and a loss mask over probe answers
    "scalars_mask_fsdp": (cfg_of("value_residual", 6, "train.parallel=fsdp",
                                 "data.probe_mix=0.5", "data.probe_loss=answers"), False, None),
    # recipe.precision=bf16: the forward under bf16 autocast, fp32 weights and reductions
    "bf16_ddp": (cfg_of("baseline", 6, "recipe.precision=bf16"), False, None),
    "bf16_fsdp": (cfg_of("baseline", 6, "recipe.precision=bf16", "train.parallel=fsdp",
                         "train.activation_checkpointing=true"), False, None),
    "resume_1_to_2": (cfg_of(), True, None),  # a killed single-process run, resumed with 2
    "killed": (cfg_of(), False, KILL_AT),  # last: the kill ends the group
}
# the single-process runs the group's are compared with
REFERENCE = {"ddp": "ddp", "fsdp": "ddp", "resume_1_to_2": "ddp", "ngpt_ddp": "ngpt_ddp",
             "ngpt_fsdp": "ngpt_ddp", "scalars_mask_fsdp": "scalars_mask_fsdp",
             "bf16_ddp": "bf16_ddp", "bf16_fsdp": "bf16_ddp"}

_WRITES = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.link", "os.symlink",
           "os.truncate", "os.chmod", "shutil.rmtree", "shutil.copyfile", "shutil.move",
           "tempfile.mkstemp", "tempfile.mkdtemp"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _audit_writes(under: str, seen: list[str]) -> None:
    """Record every file-system write this process makes under ``under`` (audit hooks see
    Python's opens for writing, renames, links, mkdir, removals, mkstemp)."""

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writing = ((isinstance(mode, str) and any(c in mode for c in "wax+"))
                       or (isinstance(flags, int) and bool(flags & _WRITE_FLAGS)))
            paths = [path] if writing else []
        elif event in _WRITES:
            paths = list(args[:2]) if event in ("os.rename", "os.link") else [args[0]]
        else:
            return
        for p in paths:
            if isinstance(p, str | bytes | os.PathLike) and os.fsdecode(p).startswith(under):
                seen.append(f"{event} {os.fsdecode(p)}")

    sys.addaudithook(hook)


class _Digest(Callback):
    """What one process ends a run with: the global losses it reported, and digests of its
    full weights and of its buffers (FSDP shards gathered; every process calls it)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.result: dict[str, Any] = {}

    def on_step_end(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None:
        self.losses.append(record["loss"])

    def on_train_end(self, run: TrainingRun, summary: dict[str, Any]) -> None:
        full = {n: getattr(p, "full_tensor", lambda p=p: p)().detach()
                for n, p in run.model.named_parameters()}
        self.result = {"losses": self.losses, "params": _digest(full),
                       "buffers": _digest(_buffers(run.model.state_dict(), full))}


def _buffers(state: dict[str, torch.Tensor], params: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k not in params}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class _KillAt(Callback):
    """Die at ``on_batch(step)``: SIGKILL (nothing runs after it; ``before`` runs first) or
    an exception."""

    def __init__(self, step: int, sigkill: bool, before: Any = None) -> None:
        self.step, self.sigkill, self.before = step, sigkill, before

    def on_batch(self, run: TrainingRun, step: int, batch: torch.Tensor) -> None:
        if step == self.step:
            if self.before is not None:
                self.before()
            if self.sigkill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise KeyboardInterrupt("killed by the test")


def _worker(rank: int, world: int, root: str, jobs: list[tuple[str, dict[str, Any], bool,
                                                               int | None]]) -> None:
    """One process of the group: train each job, record what it saw and wrote."""
    from datetime import timedelta

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    writes: list[str] = []
    _audit_writes(str(Path(root) / "runs"), writes)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    report = Path(root) / "ranks"

    def save_writes() -> None:
        (report / f"writes.{rank}.json").write_text(json.dumps(writes))

    for name, tree, resume, kill_at in jobs:
        digest = _Digest()
        callbacks: list[Callback] = [digest]
        if kill_at is not None:
            callbacks.append(_KillAt(kill_at, sigkill=True, before=save_writes))
        train(from_dict(tree), Path(root) / "runs" / name, resume=resume, callbacks=callbacks,
              progress=False)
        (report / f"{name}.{rank}.json").write_text(json.dumps(digest.result))
    save_writes()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run :data:`JOBS` in one group of two processes; the last is SIGKILLed after its first
    checkpoint. Also the single-process runs they are compared with (``root/single``)."""
    root = tmp_path_factory.mktemp("dist")
    (root / "ranks").mkdir()
    for name in set(REFERENCE.values()):
        train(JOBS[name][0], root / "single" / name, progress=False)
    # a single-process run killed after its checkpoint at step 3: the group resumes it
    with pytest.raises(KeyboardInterrupt):
        train(JOBS["resume_1_to_2"][0], root / "runs" / "resume_1_to_2",
              callbacks=[_KillAt(KILL_AT, sigkill=False)], progress=False)
    jobs = [(name, cfg.to_dict(), resume, kill) for name, (cfg, resume, kill) in JOBS.items()]
    with pytest.raises(mp.ProcessExitedException) as killed:
        mp.start_processes(_worker, args=(2, str(root), jobs), nprocs=2, join=True,
                           start_method="spawn")
    assert killed.value.signal_name == "SIGKILL"
    return root


def rank_result(root: Path, name: str, rank: int) -> dict[str, Any]:
    return json.loads((root / "ranks" / f"{name}.{rank}.json").read_text())


def values(run: Path) -> list[tuple[str, int, float]]:
    """(kind, step, loss) of every record: training losses and validation losses."""
    return [(r["kind"], r["step"], r["loss"] if r["kind"] == "train" else r["val_loss"])
            for r in read_metrics(run)]


def assert_close_runs(a: Path, b: Path) -> None:
    """Same records, losses within LOSS_ATOL, final weights within PARAM_ATOL, and
    checkpoints of the same format (keys, shapes, dtypes, optimizer layout)."""
    va, vb = values(a), values(b)
    assert [v[:2] for v in va] == [v[:2] for v in vb]
    for (kind, step, x), (_, _, y) in zip(va, vb, strict=True):
        assert abs(x - y) <= LOSS_ATOL, (kind, step, x, y)
    ca, cb = load_checkpoint(a / CHECKPOINT), load_checkpoint(b / CHECKPOINT)
    assert ca["model"].keys() == cb["model"].keys()
    for k, w in ca["model"].items():
        assert (w.shape, w.dtype) == (cb["model"][k].shape, cb["model"][k].dtype)
        torch.testing.assert_close(cb["model"][k], w, rtol=0, atol=PARAM_ATOL)
    oa, ob = ca["optimizer"], cb["optimizer"]
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i, s in oa["state"].items():
        assert {k: (v.shape, v.dtype) for k, v in s.items()} == {
            k: (v.shape, v.dtype) for k, v in ob["state"][i].items()}
        assert float(s["step"]) == float(ob["state"][i]["step"])


# ------------------------------------------------------------------------------ 2 vs 1


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_two_processes_train_like_one(group: Path, name: str) -> None:
    """DDP, and FSDP with activation checkpointing, with two micro-batches per process:
    the single-process run's batches, losses, validation losses and weights."""
    run, single = group / "runs" / name, group / "single" / REFERENCE[name]
    assert_close_runs(single, run)
    one = json.loads((single / "summary.json").read_text())
    two = json.loads((run / "summary.json").read_text())
    assert two["batches_sha256"] == one["batches_sha256"]
    assert (two["processes"], two["parallel"]) == (2, name)
    assert "processes" not in one
    assert two["params"] == one["params"] and two["tokens"] == one["tokens"]
    config = (run / "config.yaml").read_text()
    assert f"parallel: {name}" in config and "nproc" not in config
    if name == "fsdp":  # one FSDP2 unit per block, the root around them (tied head)
        assert two["fsdp_units"] == ["<root>", "blocks.0", "blocks.1"]
    else:
        assert "fsdp_units" not in two


@pytest.mark.parametrize("name", [n for n in JOBS if n != "killed"])
def test_every_process_reports_the_global_loss_and_holds_the_same_weights(
        group: Path, name: str) -> None:
    r0, r1 = rank_result(group, name, 0), rank_result(group, name, 1)
    assert r0["losses"] and r0["losses"] == r1["losses"]
    assert r0["params"] == r1["params"] and r0["buffers"] == r1["buffers"]
    logged = [loss for kind, _, loss in values(group / "runs" / name) if kind == "train"]
    assert r0["losses"] == logged[-len(r0["losses"]):]


def test_only_rank_zero_writes(group: Path) -> None:
    w0 = json.loads((group / "ranks" / "writes.0.json").read_text())
    w1 = json.loads((group / "ranks" / "writes.1.json").read_text())
    assert w1 == []
    # the audit does see the writes (rank 0's): the files of every run folder
    for name in JOBS:
        run = str(group / "runs" / name)
        mine = [w for w in w0 if w.split(" ", 1)[1].startswith(run + os.sep)]
        for f in ("config.yaml", "metrics.jsonl", "summary.json", "last.pt"):
            if (name, f) in (("resume_1_to_2", "config.yaml"), ("killed", "summary.json")):
                continue  # written by the single process it resumes / never reached
            assert any(f in w for w in mine), (name, f)


@pytest.mark.parametrize("name", ["bf16_ddp", "bf16_fsdp"])
def test_bf16_autocast_two_processes_train_like_one(group: Path, name: str) -> None:
    """recipe.precision=bf16 on the CPU (gloo), DDP and FSDP with activation checkpointing:
    the single-process bf16 run's batches and, within bf16 rounding (the matmuls see another
    batch split), its losses; weights, gradients' reductions and checkpoints stay fp32."""
    run, single = group / "runs" / name, group / "single" / REFERENCE[name]
    one = json.loads((single / "summary.json").read_text())
    two = json.loads((run / "summary.json").read_text())
    assert two["batches_sha256"] == one["batches_sha256"] and two["processes"] == 2
    va, vb = values(single), values(run)
    assert [v[:2] for v in va] == [v[:2] for v in vb]
    for (kind, step, x), (_, _, y) in zip(va, vb, strict=True):
        assert abs(x - y) <= 2e-2, (kind, step, x, y)
    weights = load_checkpoint(run / CHECKPOINT)["model"]
    assert {w.dtype for w in weights.values()} == {torch.float32}
    fp32 = values(group / "single" / "ddp")  # the same run in fp32: bf16 really ran
    assert va[0][2] != fp32[0][2]


def test_bf16_fsdp_checkpoint_trains_on_with_one_process(group: Path, tmp_path: Path) -> None:
    """The 2-process FSDP2 run with bf16 parameters (the mixed-precision policy) leaves a
    checkpoint of fp32 weights that one process trains on from (two more steps)."""
    more = tmp_path / "more"
    shutil.copytree(group / "runs" / "bf16_fsdp", more)
    (more / "summary.json").unlink()
    (more / "config.yaml").write_text((more / "config.yaml").read_text().replace(
        "steps: 6", "steps: 8"))
    cfg = cfg_of("baseline", 8, "recipe.precision=bf16", "train.parallel=fsdp",
                 "train.activation_checkpointing=true")
    summary = train(cfg, more, resume=True, progress=False)
    assert (summary["status"], summary["steps"]) == ("completed", 8)
    assert "processes" not in summary
    steps = [r["step"] for r in read_metrics(more) if r["kind"] == "train"]
    assert steps == list(range(1, 9))


def test_ngpt_renormalises_identically_under_ddp_and_fsdp(group: Path) -> None:
    for name in ("ngpt_ddp", "ngpt_fsdp"):
        run = group / "runs" / name
        assert_close_runs(group / "single" / "ngpt_ddp", run)
        weights = load_checkpoint(run / CHECKPOINT)["model"]
        model = plan(JOBS[name][0].model).build(0)
        units = {n + ".weight": m.unit_dim for n, m in model.named_modules()
                 if isinstance(m, UnitNormLinear)}
        units["embed.weight"] = 1
        assert len(units) > 2
        for key, dim in units.items():  # the last step's renormalisation, on the whole matrix
            norms = torch.linalg.vector_norm(weights[key], dim=dim)
            torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["powernorm_ddp", "powernorm_fsdp"])
def test_powernorm_statistics_stay_in_step(group: Path, name: str) -> None:
    """Each process's forward uses its own slice's statistics, but the running ones are
    rank 0's on every process (broadcast before each forward and before validation): every
    process ends with the same buffers, and the checkpoint holds them."""
    run = group / "runs" / name
    r0 = rank_result(group, name, 0)
    assert r0["buffers"] == rank_result(group, name, 1)["buffers"]
    state = load_checkpoint(run / CHECKPOINT)["model"]
    names = {n for n, _ in plan(JOBS[name][0].model).build(0).named_parameters()}
    buffers = _buffers(state, dict.fromkeys(names))
    assert any("running_phi" in k for k in buffers)
    assert _digest(buffers) == r0["buffers"]
    assert all(not torch.allclose(v.float(), torch.ones_like(v.float()))
               for k, v in buffers.items() if k.endswith("running_phi"))  # it trained them
    # one update per training forward: 6 steps of 2 micro-batches, counted once (rank 0's)
    assert {int(v) for k, v in buffers.items() if k.endswith("updates")} == {12}
    assert all(math.isfinite(loss) for _, _, loss in values(run))


def test_fsdp_scalar_parameters_and_loss_mask(group: Path) -> None:
    """Value-Residual's 0-dim lambda stays whole under FSDP (its gradient averaged, clipped
    with the sharded ones); a probe-answer loss mask shares the global denominator."""
    assert_close_runs(group / "single" / "scalars_mask_fsdp", group / "runs" / "scalars_mask_fsdp")


# ------------------------------------------------------------------------------ resume


def test_killed_run_resumes_with_two_and_with_one_process(group: Path,
                                                          tmp_path: Path) -> None:
    killed = group / "runs" / "killed"
    assert load_checkpoint(killed / CHECKPOINT)["step"] == 3
    assert not (killed / "summary.json").exists()
    assert [r["step"] for r in read_metrics(killed) if r["kind"] == "train"] == [1, 2, 3, 4]
    two, one = tmp_path / "two", tmp_path / "one"
    shutil.copytree(killed, two)
    shutil.copytree(killed, one)
    cfg = JOBS["killed"][0]
    summary = launch(cfg, two, 2, resume=True)
    assert summary == json.loads((two / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["processes"]) == ("completed", 8, 2)
    # 2 -> 2 continues exactly as the uninterrupted 2-process run
    assert values(two) == values(group / "runs" / "ddp")
    train(cfg, one, resume=True, progress=False)  # 2 -> 1
    assert_close_runs(group / "single" / "ddp", one)
    for run in (two, one):
        assert json.loads((run / "summary.json").read_text())["batches_sha256"] == json.loads(
            (group / "single" / "ddp" / "summary.json").read_text())["batches_sha256"]


def test_single_process_checkpoint_resumes_with_two(group: Path) -> None:
    run = group / "runs" / "resume_1_to_2"
    assert_close_runs(group / "single" / "ddp", run)
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == list(
        range(1, STEPS + 1))
    assert json.loads((run / "summary.json").read_text())["processes"] == 2


def test_launch_reports_a_process_error_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModbenchError) as e:
        launch(cfg_of(), tmp_path / "none", 1, resume=True)  # a torchrun group of one
    assert str(e.value).startswith("cannot resume") and "\n" not in str(e.value)
    assert not (tmp_path / "none").exists()


# ------------------------------------------------------------------------------ refused


def test_batch_not_divisible_by_processes_refused(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ModbenchError, match=r"train.batch_size=8 does not split evenly over "
                                            r"3 processes"):
        launch(cfg_of(), tmp_path / "a", 3)
    with pytest.raises(ModbenchError, match=r"micro_batch_size=3 does not divide the 4"):
        launch(tiny("baseline", 0, 4, "train.batch_size=24", "train.micro_batch_size=3"),
               tmp_path / "b", 6)
    code = run_cli(["train", "--preset", "tiny", "--steps", "2", "--nproc", "3", "--out",
                    str(tmp_path / "c"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: train.batch_size=8 does not split")
    assert len(err.splitlines()) == 1
    code = run_cli(["train", "--preset", "tiny", "--seeds", "0,1", "--nproc", "2", "--out",
                    str(tmp_path / "d"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "stacked seeds (--seeds) cannot train across 2 processes" in err
    assert not any(tmp_path.iterdir())


def test_failure_message_is_the_processes_error() -> None:
    out = Path("/runs/x")
    stderr = ("W1123 torch/distributed/run.py] *****\n"
              "[rank1]: Traceback (most recent call last):\n"
              '[rank1]:   File "x.py", line 3, in <module>\n'
              "[rank1]: RuntimeError: Connection closed by peer\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert _failure(stderr, 2, out, 1) == (
        "training with 2 processes failed: RuntimeError: Connection closed by peer; the run "
        "in /runs/x can be continued with resume=True (--resume)")
    assert _failure("error: cannot resume: nope\n" + stderr, 2, out, 1) == "cannot resume: nope"
    assert "exit code -9" in _failure("", 2, out, -9)


# ---------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("method", ["baseline", "value_residual", "hyper_connections"])
def test_activation_checkpointing_same_numbers_fewer_saved_activations(
        method: str, tmp_path: Path) -> None:
    """The stream state a block writes in place is copied for the recomputation: the losses
    and weights are bit for bit those without it, and the blocks keep no activations."""
    plain = tiny(method, 0, 3, "train.eval_every=0", "train.threads=1")
    ac = tiny(method, 0, 3, "train.eval_every=0", "train.threads=1",
              "train.activation_checkpointing=true")
    train(plain, tmp_path / "plain", progress=False)
    train(ac, tmp_path / "ac", progress=False)
    assert values(tmp_path / "plain") == values(tmp_path / "ac")
    wa = load_checkpoint(tmp_path / "plain" / CHECKPOINT)["model"]
    wb = load_checkpoint(tmp_path / "ac" / CHECKPOINT)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    model = plan(plain.model).build(0)
    idx = torch.randint(0, plain.model.vocab_size, (2, 32), generator=torch.Generator()
                        .manual_seed(0))
    before = saved_activation_bytes(model, idx)
    apply_activation_checkpointing(model, method)
    assert saved_activation_bytes(model, idx) < before / 2


def test_activation_checkpointing_refuses_running_statistics(tmp_path: Path) -> None:
    cfg = tiny("prepbn", 0, 2, "train.activation_checkpointing=true")
    assert stateful_buffers(plan(cfg.model).build(0))
    with pytest.raises(ModbenchError, match="its forward updates buffers"):
        train(cfg, tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()


def test_run_folders_from_before_the_new_keys_resume(tmp_path: Path) -> None:
    """A config.yaml written before train.parallel and train.activation_checkpointing
    existed resumes: the missing keys hold their defaults."""
    cfg = tiny("baseline", 0, 4, "train.threads=1", "train.eval_every=0",
               "train.checkpoint_every=2")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "r", callbacks=[_KillAt(3, sigkill=False)], progress=False)
    config = tmp_path / "r" / "config.yaml"
    text = config.read_text()
    old = "".join(line for line in text.splitlines(keepends=True)
                  if not line.lstrip().startswith(("parallel:", "activation_checkpointing:")))
    assert len(old) < len(text)
    config.write_text(old)
    assert train(cfg, tmp_path / "r", resume=True, progress=False)["steps"] == 4
    with pytest.raises(ModbenchError, match=r"differs from its config\.yaml in train\.parallel"):
        train(tiny("baseline", 0, 4, "train.threads=1", "train.eval_every=0",
                   "train.checkpoint_every=2", "train.parallel=fsdp"), tmp_path / "r",
              resume=True, progress=False)


# ---------------------------------------------------------------------------- CUDA only


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gpus_train_like_one(parallel: str,
                                 tmp_path: Path) -> None:  # pragma: no cover - GPUs only
    """nccl, one process per GPU, bf16 autocast (recipe.precision=auto on CUDA): the same
    batches as one GPU, losses within bf16 rounding, a checkpoint one GPU resumes."""
    extra = ("train.device=cuda", f"train.parallel={parallel}",
             "train.activation_checkpointing=true")
    cfg = tiny("baseline", 0, 6, "train.eval_every=3", *extra)
    one = train(cfg, tmp_path / "one", progress=False)
    two = launch(cfg, tmp_path / "two", 2)
    assert two["batches_sha256"] == one["batches_sha256"] and two["processes"] == 2
    for (kind, step, x), (_, _, y) in zip(values(tmp_path / "one"), values(tmp_path / "two"),
                                          strict=True):
        assert abs(x - y) <= 2e-2, (kind, step, x, y)  # bf16 matmuls in another order
    # the 2-GPU checkpoint trains on with one GPU (two more steps than planned)
    more = tmp_path / "more"
    shutil.copytree(tmp_path / "two", more)
    (more / "summary.json").unlink()
    (more / "config.yaml").write_text((more / "config.yaml").read_text().replace(
        "steps: 6", "steps: 8"))
    longer = tiny("baseline", 0, 8, "train.eval_every=3", *extra)
    assert train(longer, more, resume=True, progress=False)["steps"] == 8
