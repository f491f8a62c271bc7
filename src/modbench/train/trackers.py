"""Experiment trackers: ``train.trackers=[wandb, tensorboard]`` (docs/trackers.md).

Each tracker is a :class:`~modbench.runtime.callback.Callback` the trainer attaches to every
member of a run, after all other callbacks (so it sees the keys they add), on rank 0 only. It
sends what the run folder records, under the same step numbers:

- at the start, the resolved config (``config.yaml``, its ``meta`` section included);
- every training record that ``metrics.jsonl`` logs (``train.log_every``) as ``train/<key>``
  (nested keys joined with ``/``: per-layer values become ``train/layers/...``);
- every validation record as ``val/<key>`` (``val/loss``, ``val/ppl``, ``val/probes/mqar``);
- at the end, the summary (status, final validation loss and probes, throughput).

Runs are grouped so the tracker's own comparison views work: in a study (a run folder
``<study>/runs/<key>/`` next to the study's ``spec.yaml``) the group is the study's name,
otherwise the name of the run folder's parent; the method string is the W&B job type and a tag;
each run is named ``<method>-s<seed>``.

- **wandb** (extra ``[wandb]``): one W&B run per run folder, in project ``$WANDB_PROJECT``
  (default ``modbench``). W&B's own settings apply (``WANDB_MODE=offline`` writes a local run
  to upload later with ``wandb sync``; ``WANDB_DIR``, ``WANDB_ENTITY``, ``WANDB_API_KEY``).
  Without ``WANDB_DIR`` the W&B files go into the run folder (``<run>/wandb/``). The W&B run id
  is kept in ``<run>/trackers.json``, so ``--resume`` continues the same W&B run.
- **tensorboard** (extra ``[tensorboard]``): event files written with
  :class:`torch.utils.tensorboard.SummaryWriter`, one directory per run: ``<run>/tensorboard``
  for a single run, ``<study>/tensorboard/<preset>/<method>/s<seed>`` for a study run, so
  ``tensorboard --logdir <study>`` compares a study's runs by name. The config is a text entry
  and the run's hyperparameters, with its final numbers, appear in the HParams view. A resumed
  run purges the events past its checkpoint, so no step shows twice.

A tracker whose package is missing, or W&B online without credentials, is refused by
:func:`check_trackers` before any run folder is written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from modbench.config import TRACKERS, RunConfig
from modbench.errors import ModbenchError
from modbench.fsutil import atomic_write_text
from modbench.runtime.callback import Callback, TrainingRun
from modbench.runtime.runfolder import CONFIG

#: the package each tracker needs, and the modbench extra that installs it
PACKAGES = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard")}
TRACKERS_FILE = Path("trackers.json")  # in the run folder: where each tracker logs the run
DEFAULT_PROJECT = "modbench"
STUDY_SPEC = "spec.yaml"  # a study folder's spec (modbench.study.store)

# tracker runs opened in this process and not finished yet (a run whose training raised)
_OPEN: list[_Tracker] = []


def check_trackers(names: Iterable[str]) -> None:
    """Refuse, in one line, a tracker that cannot start: unknown, its package not installed,
    or W&B set to log online with no credentials. Writes nothing."""
    for name in names:
        if name not in PACKAGES:
            raise ModbenchError(f"unknown tracker {name!r} in train.trackers; the known ones are "
                                f"{', '.join(TRACKERS)}")
        package, extra = PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ModbenchError(
                f"train.trackers includes {name} but the {package} package is not installed; "
                f"install it with pip install 'modbench[{extra}]', or drop {name} from "
                "train.trackers")
        if name == "wandb":
            _check_wandb_login()


def _wandb_mode() -> str:
    """W&B's mode as ``wandb.init`` will take it: ``WANDB_MODE``, else W&B's settings files
    (``wandb offline`` writes ``mode = offline`` into ``./wandb/settings``), else online."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"].strip().lower()
    import wandb

    return str(wandb.setup().settings.mode or "online").strip().lower()


def _check_wandb_login() -> None:
    """W&B online needs credentials (``wandb login``, ``WANDB_API_KEY``, ...); without them
    ``wandb.init`` would prompt for a key or fail mid-run. Offline and disabled need none
    (set by ``WANDB_MODE`` or by ``wandb offline`` / ``wandb disabled``)."""
    import wandb

    if _wandb_mode() in ("offline", "disabled", "dryrun"):
        return

    if "prompt" not in inspect.signature(wandb.login).parameters:
        return  # an older wandb cannot ask without prompting: wandb.init reports it
    if not wandb.login(verify=False, prompt=False):
        raise ModbenchError(
            "train.trackers includes wandb but W&B has no credentials; run `wandb login` (or "
            "set WANDB_API_KEY), or set WANDB_MODE=offline to keep the runs on disk and upload "
            "them later with `wandb sync`")


def make_trackers(cfg: RunConfig, out: Path) -> list[Callback]:
    """The tracker callbacks ``cfg.train.trackers`` asks for, for the run folder ``out``
    (checked first by :func:`check_trackers`)."""
    names = list(cfg.train.trackers)
    if not names:
        return []
    check_trackers(names)
    _close_abandoned()
    kinds: dict[str, type[_Tracker]] = {"wandb": WandbTracker, "tensorboard": TensorBoardTracker}
    return [kinds[n](out) for n in names]


def _close_abandoned() -> None:
    """Close what trackers of an earlier run in this process left open (its training raised
    before the end): W&B marks such a run failed."""
    for t in list(_OPEN):
        t.close(failed=True)


# ----------------------------------------------------------------------------- grouping


def study_of(run_dir: Path) -> tuple[str, Path] | None:
    """``(study name, study folder)`` when ``run_dir`` is a study's run folder
    (``<study>/runs/<key>/`` with ``<study>/spec.yaml``), else None."""
    run_dir = Path(run_dir).resolve()
    root = run_dir.parent.parent
    spec = root / STUDY_SPEC
    if run_dir.parent.name != "runs" or not spec.is_file():
        return None
    try:
        name = (yaml.safe_load(spec.read_text()) or {}).get("name")
    except (OSError, yaml.YAMLError, AttributeError):
        name = None
    return str(name or root.name), root


def group_of(run_dir: Path) -> str:
    """The run's group: its study's name, else the name of the run folder's parent."""
    study = study_of(run_dir)
    return study[0] if study else Path(run_dir).resolve().parent.name


def run_name(cfg: RunConfig) -> str:
    return f"{cfg.model.method}-s{cfg.seed}"


def safe_part(text: str) -> str:
    """``text`` as one path component (a method string may hold ``/`` or spaces)."""
    return re.sub(r"[^A-Za-z0-9_.+=(),-]", "_", text) or "_"


def tensorboard_dir(cfg: RunConfig, run_dir: Path) -> Path:
    """Where a run's TensorBoard events go: ``<study>/tensorboard/<preset>/<method>/s<seed>``
    for a study's run, ``<run>/tensorboard`` otherwise."""
    study = study_of(run_dir)
    if study is None:
        return Path(run_dir) / "tensorboard"
    return (study[1] / "tensorboard" / safe_part(cfg.preset) / safe_part(cfg.model.method)
            / f"s{cfg.seed}")


# ------------------------------------------------------------------------------ values


def flatten(obj: Any, prefix: str = "", out: dict[str, float] | None = None) -> dict[str, float]:
    """The finite numbers in ``obj`` under ``/``-joined keys: mappings by key, lists of
    numbers (or ``None``) by index; strings, ``None``, non-finite numbers and other objects are
    left out. A 0-d tensor or numpy scalar counts as a number."""
    out = {} if out is None else out
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:
        obj = obj.item()
    if isinstance(obj, numbers.Real):
        f = float(obj)
        if math.isfinite(f) and prefix:
            out[prefix] = f
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            flatten(v, f"{prefix}/{k}" if prefix else str(k), out)
    elif isinstance(obj, list | tuple) and all(isinstance(v, numbers.Real) or v is None
                                               for v in obj):
        for i, v in enumerate(obj):
            flatten(v, f"{prefix}/{i}" if prefix else str(i), out)
    return out


def train_values(record: Mapping[str, Any]) -> dict[str, float]:
    """A training record's numbers as ``train/<key>``."""
    return flatten({k: v for k, v in record.items() if k not in ("kind", "step")}, "train")


def val_values(record: Mapping[str, Any]) -> dict[str, float]:
    """A validation record's numbers as ``val/<key>`` (``val_loss`` is ``val/loss``)."""
    return flatten({k.removeprefix("val_"): v for k, v in record.items()
                    if k not in ("kind", "step")}, "val")


def summary_values(summary: Mapping[str, Any]) -> dict[str, float]:
    """The summary's numbers (not the seeds, which are settings, nor the last grad norms)."""
    return flatten({k: v for k, v in summary.items()
                    if k not in ("last_grad_norms", "seed", "data_seed", "stacked_seeds")})


def resolved_config(run: TrainingRun) -> dict[str, Any]:
    """The run's ``config.yaml`` as written (with ``meta``), else its config."""
    with contextlib.suppress(OSError, yaml.YAMLError):
        tree = yaml.safe_load((Path(run.out) / CONFIG).read_text())
        if isinstance(tree, dict):
            return tree
    return run.cfg.to_dict()


def _read_record(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / TRACKERS_FILE
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            return data
    return {}


def _write_record(run_dir: Path, name: str, entry: dict[str, Any]) -> None:
    """Note in ``<run>/trackers.json`` where tracker ``name`` logs the run."""
    data = _read_record(run_dir)
    data[name] = entry
    atomic_write_text(Path(run_dir) / TRACKERS_FILE, json.dumps(data, indent=2) + "\n")


# ---------------------------------------------------------------------------- trackers


class _Tracker(Callback):
    def __init__(self, out: Path) -> None:
        self.out = Path(out)

    def close(self, failed: bool = False) -> None:
        if self in _OPEN:
            _OPEN.remove(self)


class WandbTracker(_Tracker):
    """One W&B run per run folder; ``step`` (optimizer steps done) is every metric's x-axis."""

    def __init__(self, out: Path) -> None:
        super().__init__(out)
        self.run: Any = None

    def on_train_start(self, run: TrainingRun) -> None:
        import wandb

        cfg = run.cfg
        old = _read_record(run.out).get("wandb", {})
        study = study_of(run.out)
        method = cfg.model.method
        kwargs: dict[str, Any] = {
            "project": os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            "group": group_of(run.out),
            "job_type": method[:64],
            "name": run_name(cfg),
            "tags": list(dict.fromkeys(t[:64] for t in (method, cfg.preset, cfg.recipe.name))),
            "config": {**resolved_config(run), "run_dir": str(Path(run.out).resolve()),
                       **({"study": study[0]} if study else {})},
            "resume": "allow",
            "reinit": "create_new",
            # the trainer's output is not copied to W&B; W&B says less unless asked otherwise
            "settings": (wandb.Settings(console="off")
                         if {"WANDB_QUIET", "WANDB_SILENT"} & set(os.environ)
                         else wandb.Settings(console="off", quiet=True)),
        }
        if os.environ.get("WANDB_MODE"):  # also when W&B read its settings before it changed
            kwargs["mode"] = _wandb_mode()
        if old.get("id"):  # a resumed run folder: the same W&B run
            kwargs["id"] = old["id"]
        kwargs["dir"] = os.environ.get("WANDB_DIR") or str(Path(run.out).resolve())
        try:
            self.run = wandb.init(**kwargs)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise ModbenchError(f"W&B could not start a run ({type(e).__name__}: {first}); "
                                "check `wandb login` and the network, or set "
                                "WANDB_MODE=offline to log to local files") from e
        _OPEN.append(self)
        self.run.define_metric("step")
        for section in ("train", "val"):
            self.run.define_metric(f"{section}/*", step_metric="step")
        _write_record(run.out, "wandb", {
            "id": self.run.id, "project": self.run.project, "entity": self.run.entity,
            "group": kwargs["group"], "name": kwargs["name"], "mode": self.run.settings.mode,
            "dir": self.run.dir})

    def on_step_end(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None:
        if self.run is not None and run.cfg.train.logs(int(record["step"])):
            self.run.log({"step": int(record["step"]), **train_values(record)})

    def on_eval(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log({"step": int(record["step"]), **val_values(record)})

    def on_train_end(self, run: TrainingRun, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        self.run.summary.update({
            **summary_values(summary),
            **{k: summary[k] for k in ("status", "method", "preset", "recipe", "device")
               if isinstance(summary.get(k), str)}})
        if summary.get("status") not in (None, "completed"):
            self.run.tags = (*self.run.tags, str(summary["status"]))
        self.close()

    def close(self, failed: bool = False) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None
        super().close(failed)


class TensorBoardTracker(_Tracker):
    """Event files for one run (:func:`tensorboard_dir`); the x-axis is optimizer steps done."""

    def __init__(self, out: Path) -> None:
        super().__init__(out)
        self.writer: Any = None

    def on_train_start(self, run: TrainingRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = tensorboard_dir(run.cfg, run.out)
        # events an earlier attempt logged past the step this one starts from are dropped (a
        # fresh start: all of them; a resume keeps those up to its checkpoint's step)
        purge = run.step + 1 if run.step > 0 else 0
        self.writer = SummaryWriter(str(log_dir), purge_step=purge, flush_secs=10)
        _OPEN.append(self)
        if run.step == 0:
            text = yaml.safe_dump(resolved_config(run), sort_keys=False)
            self.writer.add_text("config", "```yaml\n" + text + "```", 0)
        _write_record(run.out, "tensorboard", {"log_dir": str(log_dir.resolve())})

    def on_step_end(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None:
        if self.writer is not None and run.cfg.train.logs(int(record["step"])):
            for tag, v in train_values(record).items():
                self.writer.add_scalar(tag, v, int(record["step"]))

    def on_eval(self, run: TrainingRun, step: int, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for tag, v in val_values(record).items():
            self.writer.add_scalar(tag, v, int(record["step"]))
        self.writer.flush()

    def on_train_end(self, run: TrainingRun, summary: dict[str, Any]) -> None:
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        step = int(summary.get("steps") or run.cfg.train.steps)
        metrics = {f"summary/{k}": v for k, v in summary_values(summary).items()}
        for tag, v in metrics.items():
            self.writer.add_scalar(tag, v, step)
        params = {k: (v if isinstance(v, int | float | str | bool) else str(v))
                  for k, v in _dotted(run.cfg.to_dict()).items()}
        params["status"] = str(summary.get("status"))
        for item in hparams(params, metrics):  # in this run's own folder, not a subfolder
            self.writer.file_writer.add_summary(item)
        self.close()

    def close(self, failed: bool = False) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        super().close(failed)


def _dotted(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


__all__ = ["PACKAGES", "TRACKERS_FILE", "TensorBoardTracker", "WandbTracker", "check_trackers",
           "flatten", "group_of", "make_trackers", "study_of", "tensorboard_dir"]
