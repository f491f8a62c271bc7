"""Study specs: which methods, seeds and scales to train, with one recipe and one data order.

A spec is a YAML file (or a built-in name, see ``modbench study list``)::

    name: my-study
    description: free text
    baseline: baseline                # the reference method string
    methods: [qknorm, post_ln, "layerscale(init=1e-4)"]
    seeds:
      default: [0]                    # every method
      noise_floor: [0, 1, 2]          # the baseline and the anchors below
      anchors: [qknorm]               # methods that also get the noise-floor seeds
    scales: [cpu-small]               # presets, or ladder(cpu, 4): a ladder's rungs
    recipe: null                      # null: each preset's own
    overrides: ["train.steps=300"]    # --set items applied to every run
    data: {source: builtin, data_seed: 1234, probe_mix: 0.0, probe_loss: all, order: fixed}
    evaluation: {probes: true, tasks: [], limit: null, primary: null,
                 diagnostics: {batches: 2, seeds: [0]}}   # optional: `modbench diagnose`
    claim:                            # optional: a published claim the verdicts test
      source: "CoMT preprint Table 3 (docs/sources.md#comt)"
      text: "Post-LN stalls on a deep, narrow model at a raised learning rate."
      expect: {post_ln: [stalled, diverged]}    # the verdicts that agree with it
    methods_from: [./mylab/methods.py]   # optional: your own methods (docs/methods.md)
    tuning:                           # optional: frozen versus tuned verdicts (study/tuning.py)
      key: recipe.lr                  # a run config key
      grid: [1e-3, 3e-3]              # its values tried for every scale and method
      seeds: [100]                    # tuning seeds, disjoint from every verdict seed
    lr_profile:                       # optional: every method at every rate of a grid
      grid: [0.25, 0.5, 1, 2, 4]      # multipliers of each run's recipe.lr (or rates: [...])
      seeds: [0, 1, 2]                # the profile's seeds (default: seeds.default)
      select_seeds: [100]             # optional: each method's best rate chosen on these
      tolerance: 0.02                 # the near-best basin: within this of the best loss
      halving: {at: [0.2, 0.4], margin: 0.1}   # optional: drop clearly worse points early

``data.order``: ``fixed`` (every run sees the batches of ``data_seed``: the protocol's one
data order) or ``per_seed`` (seed s sees the order of ``data_seed + s``, for every method, so
methods still meet the same batches seed for seed while the noise floor also spans data
orders; for capabilities whose emergence depends on the order, such as associative recall on
CPU, docs/eval.md). ``data.probe_mix`` and ``data.probe_loss`` are the run keys of the same
names (``modbench.data.mix``).

Expanding a spec gives one run per (scale, method, seed). Each run is keyed by a hash of its
fully resolved config, so re-running a study skips what is done and a changed spec reruns
only what changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from modbench.config import EXECUTION_KEYS, RunConfig, expand_scales, resolve, yaml_nodes
from modbench.errors import ModbenchError, suggest
from modbench.methods.base import MethodSpec
from modbench.methods.build import plan_run
from modbench.methods.plugins import code_hashes


@dataclass
class Seeds:
    default: list[int] = field(default_factory=lambda: [0])
    noise_floor: list[int] = field(default_factory=lambda: [0, 1, 2])
    anchors: list[str] = field(default_factory=list)


@dataclass
class DataSpec:
    source: str = "builtin"
    data_seed: int = 1234
    probe_mix: float = 0.0
    probe_loss: str = "all"  # all | answers (see modbench.data.mix)
    order: str = "fixed"  # fixed | per_seed (data_seed + init seed)


@dataclass
class DiagnosticsSpec:
    """``evaluation.diagnostics``: ``modbench diagnose`` on each finished run that did not
    diverge, its ``diagnostics.json`` kept in the run folder and summarised by the report
    (docs/diagnostics.md)."""

    batches: int = 2  # validation batches per run (the run's batch size each)
    seeds: list[int] | None = None  # the init seeds diagnosed; None: every seed


@dataclass
class EvalSpec:
    probes: bool = True
    tasks: list[str] = field(default_factory=list)
    limit: int | None = None
    primary: str | None = None  # val_loss | probe_avg | climb_avg | a task; None: climb_avg
    # when tasks are given, else val_loss
    diagnostics: DiagnosticsSpec | None = None  # None: no diagnostics
    # task YAML files may run Python (!function, included code): only when this is true
    # (modbench.eval.harness.check_task_files; docs/reliability.md, the trust boundary)
    trust_task_code: bool = False


# the verdicts a claim may expect (modbench.analysis.stats.Verdict): "diverged" and "stalled"
# are failures, a method with a seed that diverged or stalled (docs/statistics.md); besides
# them better, worse, not_worse(MARGIN) and equivalent(MARGIN) (analysis.results.CLAIM_FORMS,
# imported where a claim is read: analysis.results brings scipy, which a spec need not load)
VERDICTS = ("improver", "within_noise", "degrader", "diverged", "stalled")


@dataclass
class ClaimSpec:
    """A published claim the study tests: where it is made, what it says, and the verdict (or
    verdicts) against the baseline that agree with it, per method."""

    source: str = ""  # e.g. "CoMT preprint Table 3; arXiv 2605.20798 §5.3"
    text: str = ""  # the claim, in a sentence or two
    expect: dict[str, list[str]] = field(default_factory=dict)  # method -> agreeing verdicts


@dataclass
class TuningSpec:
    """``tuning``: each method (the baseline too) gets its best value of ``key`` from ``grid``
    on the ``seeds`` (never a verdict seed), and its tuned verdict on the study's own seeds
    (:mod:`modbench.study.stages.tuning`; docs/studies.md, "Tuned versus frozen")."""

    key: str = ""
    grid: list[Any] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [100])


@dataclass
class LrProfileSpec:
    """``lr_profile``: every method (the baseline too) at every rate of a grid, on ``seeds``
    (None: ``seeds.default``): ``grid`` multiplies each run's own ``recipe.lr``, or ``rates``
    gives the rates themselves. ``select_seeds`` (optional, disjoint from ``seeds``): each
    method's best rate is chosen on them, for the verdict at each method's own best rate.
    ``tolerance``: the near-best basin holds the rates whose mean loss is within it of the
    best (loss units). ``halving`` (optional; ``true`` for the defaults): at each fraction
    ``at`` of ``train.steps`` a grid point whose loss is above the method's best point's by
    more than ``margin`` on every seed stops there (:func:`modbench.analysis.profile.
    halving_drops`). :mod:`modbench.study.stages.profile`; docs/studies.md, "Learning-rate
    profiles"."""

    grid: list[float] | None = field(default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0])
    rates: list[float] | None = None
    seeds: list[int] | None = None
    select_seeds: list[int] = field(default_factory=list)
    tolerance: float = 0.02
    halving: dict[str, Any] | None = None


#: ``lr_profile.halving: true``: the rungs (fractions of train.steps) and the margin (nats),
#: calibrated on recorded profiles (benchmarks/halving_false_drops.py, BENCHMARKS.md)
HALVING_DEFAULTS: dict[str, Any] = {"at": [0.2, 0.4], "margin": 0.1}


#: keys a tuning block may not tune: what identifies a run, or what changes no result
UNTUNABLE = ("seed", "preset", "model.method")


@dataclass
class StudySpec:
    name: str = "study"
    description: str = ""
    baseline: str = "baseline"
    methods: list[str] = field(default_factory=list)
    seeds: Seeds = field(default_factory=Seeds)
    scales: list[str] = field(default_factory=lambda: ["cpu-small"])
    recipe: str | None = None
    overrides: list[str] = field(default_factory=list)
    data: DataSpec = field(default_factory=DataSpec)
    evaluation: EvalSpec = field(default_factory=EvalSpec)
    claim: ClaimSpec | None = None
    tuning: TuningSpec | None = None
    lr_profile: LrProfileSpec | None = None
    # plugins the study's methods come from (modbench.methods.plugins): .py files, package
    # folders (relative to the spec's file) or module names; recorded absolute in the study
    # folder's spec.yaml, so `study status`/`report` load them, and every worker imports them
    methods_from: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunSpec:
    """One run of a study."""

    key: str
    scale: str
    method: str
    seed: int
    config: RunConfig = field(compare=False, hash=False)

    @property
    def label(self) -> str:
        return f"{self.scale}/{self.method}/s{self.seed}"


SPEC_DIR = "specs"
DATA_ORDERS = ("fixed", "per_seed")


def builtin_specs() -> dict[str, Path]:
    """Named specs shipped with modbench (``src/modbench/study/specs/*.yaml``)."""
    folder = resources.files("modbench.study").joinpath(SPEC_DIR)
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir()
            if str(p).endswith(".yaml")}


def load_spec(ref: str | Path | None) -> StudySpec:
    """Load a spec from a YAML path or a built-in name (``None``: the built-in CPU study)."""
    ref = "builtin-cpu" if ref is None else ref
    path = Path(ref)
    if not path.is_file():
        named = builtin_specs()
        if str(ref) not in named:
            raise ModbenchError(
                f"no study spec file or built-in spec named '{ref}'"
                f"{suggest(str(ref), named)}; see `modbench study list`")
        path = named[str(ref)]
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModbenchError(f"cannot read study spec {path} ({e}); pass a readable YAML "
                            "file") from None
    tree = load_yaml_bounded(text, f"study spec {path}") or {}
    if not isinstance(tree, dict):
        raise ModbenchError(f"study spec {path} must be a mapping of keys")
    spec: StudySpec = _build(StudySpec, tree, "")
    check_spec(spec)
    if spec.methods_from:  # before any method string is read
        from modbench.methods.plugins import load_plugins

        base = path.resolve().parent
        spec.methods_from = [p.ref for p in load_plugins(spec.methods_from, base=base)]
    return spec


MAX_YAML_NODES = 100_000  # nodes of a spec with every alias expanded (an alias bomb: billions)


def load_yaml_bounded(text: str, what: str) -> Any:
    """Safe YAML whose document, with every alias use counted again, has at most
    :data:`MAX_YAML_NODES` nodes: a "billion laughs" alias bomb is refused in one line before
    it is expanded, instead of growing until memory runs out."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if yaml_nodes(node, MAX_YAML_NODES + 1) > MAX_YAML_NODES:
            raise ModbenchError(f"{what} expands to more than {MAX_YAML_NODES} YAML nodes "
                                "through its aliases (&anchor / *alias); write it out plainly")
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ModbenchError(f"{what} is not valid YAML{where} ({e.__class__.__name__}: "
                            f"{getattr(e, 'problem', None) or 'see the file'}); fix it") from None
    finally:
        loader.dispose()


NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
MAX_NAME = 100
MAX_SEED = 2**31 - 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _want(ok: bool, key: str, what: str, value: Any) -> None:
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ModbenchError(f"study key '{key}' must be {what}; got {shown} (see "
                            "docs/studies.md)")


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _seed_list(v: Any, empty: bool = True) -> bool:
    return isinstance(v, list) and (empty or bool(v)) and all(
        _is_int(x) and 0 <= x <= MAX_SEED for x in v)


def check_spec(spec: StudySpec) -> None:
    """Every field's type and range, in one line each, before a study writes anything.
    ``name`` becomes a folder (``studies/<name>``): a slug of letters, digits, ``.``, ``_``
    and ``-``, not starting with ``.``, at most :data:`MAX_NAME` characters."""
    n = spec.name
    _want(isinstance(n, str) and 0 < len(n) <= MAX_NAME and set(n) <= NAME_CHARS
          and not n.startswith("."), "name",
          f"a folder name of letters, digits, '.', '_' and '-' (not starting with '.', at most "
          f"{MAX_NAME} characters)", n)
    _want(isinstance(spec.description, str), "description", "a string", spec.description)
    _want(_str_list(spec.methods_from) and all(x.strip() for x in spec.methods_from),
          "methods_from", "a list of plugin files, package folders or module names",
          spec.methods_from)
    _want(isinstance(spec.baseline, str) and bool(spec.baseline), "baseline", "a method name",
          spec.baseline)
    _want(_str_list(spec.methods), "methods", "a list of method strings", spec.methods)
    _want(_str_list(spec.scales) and bool(spec.scales), "scales",
          "a non-empty list of preset names", spec.scales)
    _want(spec.recipe is None or isinstance(spec.recipe, str), "recipe", "a recipe name or null",
          spec.recipe)
    _want(_str_list(spec.overrides), "overrides", "a list of KEY=VALUE strings", spec.overrides)
    sd = spec.seeds
    _want(_seed_list(sd.default, empty=False), "seeds.default",
          f"a non-empty list of whole numbers from 0 to {MAX_SEED}", sd.default)
    _want(_seed_list(sd.noise_floor), "seeds.noise_floor",
          f"a list of whole numbers from 0 to {MAX_SEED}", sd.noise_floor)
    _want(_str_list(sd.anchors), "seeds.anchors", "a list of method strings", sd.anchors)
    d = spec.data
    _want(isinstance(d.source, str) and bool(d.source), "data.source",
          "'builtin' or a prepared data folder", d.source)
    _want(_is_int(d.data_seed) and 0 <= d.data_seed <= MAX_SEED, "data.data_seed",
          f"a whole number from 0 to {MAX_SEED}", d.data_seed)
    _want(isinstance(d.probe_mix, int | float) and not isinstance(d.probe_mix, bool)
          and 0.0 <= d.probe_mix <= 1.0, "data.probe_mix", "a number from 0 to 1", d.probe_mix)
    ev = spec.evaluation
    _want(isinstance(ev.probes, bool), "evaluation.probes", "true or false", ev.probes)
    _want(_str_list(ev.tasks), "evaluation.tasks", "a list of task names or YAML files",
          ev.tasks)
    _want(ev.limit is None or (_is_int(ev.limit) and ev.limit >= 1), "evaluation.limit",
          "a whole number of items, at least 1, or null", ev.limit)
    _want(ev.primary is None or isinstance(ev.primary, str), "evaluation.primary",
          "a metric name or null", ev.primary)
    _want(isinstance(ev.trust_task_code, bool), "evaluation.trust_task_code", "true or false",
          ev.trust_task_code)
    if spec.claim is not None:
        _want(isinstance(spec.claim.source, str), "claim.source", "a string", spec.claim.source)
        _want(isinstance(spec.claim.text, str), "claim.text", "a string", spec.claim.text)
    files = [t for t in ev.tasks if t.endswith((".yaml", ".yml"))]
    if files:  # code in task files is refused now, not after the runs have trained
        from modbench.eval.harness import check_task_files, expand_tasks

        check_task_files(expand_tasks(files)[1], ev.trust_task_code)
    if spec.tuning is not None:
        _check_tuning(spec.tuning, sd)
    if spec.lr_profile is not None:
        _check_lr_profile(spec.lr_profile, sd)
    wanted = sorted({e for es in (spec.claim.expect if spec.claim else {}).values() for e in es
                     if str(e).strip() in ("less_sensitive", "more_sensitive")})
    if wanted and spec.lr_profile is None:
        raise ModbenchError(f"claim.expect's {', '.join(wanted)} judges a learning-rate "
                            "profile: add an lr_profile block (docs/studies.md, Learning-rate "
                            "profiles), or expect a verdict")
    if wanted and spec.lr_profile is not None and spec.lr_profile.halving is not None:
        raise ModbenchError(f"claim.expect's {', '.join(wanted)} judges the sensitivity, which "
                            "lr_profile.halving makes approximate (a dropped point counts at "
                            "its loss when dropped; docs/statistics.md): remove halving, or "
                            "expect a verdict")


def _check_tuning(t: TuningSpec, sd: Seeds) -> None:
    """The tuning block: a tunable config key, a non-empty grid of values of its type, and
    tuning seeds that no verdict uses (docs/statistics.md, "Tuned versus frozen")."""
    from modbench.config import valid_keys

    _want(isinstance(t.key, str) and t.key in valid_keys() and t.key not in UNTUNABLE
          and t.key not in EXECUTION_KEYS, "tuning.key",
          "a run config key that changes the run (e.g. recipe.lr; see docs/config.md)", t.key)
    _want(isinstance(t.grid, list) and bool(t.grid), "tuning.grid",
          f"a non-empty list of values of {t.key}", t.grid)
    tuning_grid(t.key, t.grid)
    _want(_seed_list(t.seeds, empty=False), "tuning.seeds",
          f"a non-empty list of whole numbers from 0 to {MAX_SEED}", t.seeds)
    shared = sorted(set(t.seeds) & (set(sd.default) | set(sd.noise_floor)))
    if shared:
        raise ModbenchError(f"tuning.seeds shares seed(s) {shared} with the verdict seeds "
                            "(seeds.default, seeds.noise_floor); give the tuning seeds of "
                            "their own, e.g. [100]")


def _positive_numbers(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(x, int | float) and not isinstance(x, bool) and 0 < x < float("inf")
        for x in v) and len(set(v)) == len(v)


def _check_lr_profile(lp: LrProfileSpec, sd: Seeds) -> None:
    """The lr_profile block: a grid of distinct positive multipliers or of rates (one of
    them), profile seeds, selection seeds of their own, and a positive tolerance."""
    if (lp.grid is None) == (lp.rates is None):
        raise ModbenchError("lr_profile takes one of grid (multipliers of each run's "
                            "recipe.lr, e.g. [0.5, 1, 2]) or rates (e.g. [1e-3, 3e-3]); got "
                            + ("both" if lp.grid is not None else "neither"))
    which = "grid" if lp.grid is not None else "rates"
    _want(_positive_numbers(lp.grid if lp.grid is not None else lp.rates), f"lr_profile.{which}",
          "a list of at least two distinct positive numbers", getattr(lp, which))
    _want(len(getattr(lp, which)) >= 2, f"lr_profile.{which}",
          "a list of at least two distinct positive numbers", getattr(lp, which))
    _want(lp.seeds is None or _seed_list(lp.seeds, empty=False), "lr_profile.seeds",
          f"a non-empty list of whole numbers from 0 to {MAX_SEED}, or null", lp.seeds)
    _want(_seed_list(lp.select_seeds), "lr_profile.select_seeds",
          f"a list of whole numbers from 0 to {MAX_SEED}", lp.select_seeds)
    _want(isinstance(lp.tolerance, int | float) and not isinstance(lp.tolerance, bool)
          and 0 < lp.tolerance < float("inf"), "lr_profile.tolerance",
          "a positive loss difference, e.g. 0.02", lp.tolerance)
    if lp.halving is not None:
        lp.halving = halving_settings(lp.halving)
    shared = sorted(set(lp.select_seeds) & set(lp.seeds or sd.default))
    if shared:
        raise ModbenchError(f"lr_profile.select_seeds shares seed(s) {shared} with the "
                            "profile's seeds (lr_profile.seeds, else seeds.default); the best "
                            "rate is chosen on seeds the verdict does not use: give "
                            "select_seeds of their own, e.g. [100]")


def halving_settings(tree: Any) -> dict[str, Any] | None:
    """``lr_profile.halving``: ``true`` (the defaults), ``false`` (none), or a mapping of
    ``at`` (increasing fractions of train.steps, each between 0 and 1) and ``margin`` (a loss
    difference, at least 0); returned with every field, as spec.yaml records it."""
    if tree is False:
        return None
    if tree is True:
        return dict(HALVING_DEFAULTS)
    if not isinstance(tree, dict):
        raise ModbenchError(f"study key 'lr_profile.halving' must be true, or a mapping such as "
                            f"{{at: [0.2, 0.4], margin: 0.1}}; got {tree!r} (see docs/studies.md)")
    unknown = sorted(set(tree) - set(HALVING_DEFAULTS))
    if unknown:
        raise ModbenchError(f"unknown study key 'lr_profile.halving.{unknown[0]}'; it takes at "
                            "and margin (see docs/studies.md)")
    out = {**HALVING_DEFAULTS, **tree}
    at = out["at"]
    _want(isinstance(at, list) and bool(at) and all(
        isinstance(x, int | float) and not isinstance(x, bool) and 0 < x < 1 for x in at)
        and all(a < b for a, b in itertools.pairwise(at)), "lr_profile.halving.at",
        "a non-empty increasing list of fractions of train.steps between 0 and 1, e.g. "
        "[0.2, 0.4]", at)
    m = out["margin"]
    _want(isinstance(m, int | float) and not isinstance(m, bool) and 0 <= m < float("inf"),
          "lr_profile.halving.margin", "a loss difference of at least 0, e.g. 0.1", m)
    return {"at": [float(x) for x in at], "margin": float(m)}


def tuning_grid(key: str, grid: list[Any]) -> list[Any]:
    """The grid's values as the config key ``key`` holds them (``1e-3`` read as YAML text
    becomes the float 0.001), distinct and in order; one line for a value of the wrong type."""
    from modbench.config import RunConfig, apply_override

    out: list[Any] = []
    for v in grid:
        cfg = RunConfig()
        try:
            apply_override(cfg, f"{key}={json.dumps(v)}")
        except (ModbenchError, TypeError) as e:
            raise ModbenchError(f"tuning.grid value {v!r} is not a value of {key} "
                                f"({str(e).split(';')[0]}); see docs/studies.md") from None
        obj: Any = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        if obj in out:
            raise ModbenchError(f"tuning.grid lists {v!r} twice; list each value once")
        out.append(obj)
    return out


def _build(cls: Any, tree: dict[str, Any], prefix: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in tree.items():
        if k not in fields:
            key = prefix + str(k)
            raise ModbenchError(f"unknown study key '{key}'{suggest(str(k), fields)}; "
                                "see docs/studies.md")
        sub = {"seeds": Seeds, "data": DataSpec, "evaluation": EvalSpec,
               "claim": ClaimSpec, "tuning": TuningSpec, "lr_profile": LrProfileSpec}.get(k)
        if k in ("claim", "tuning", "lr_profile") and v is None and not prefix:
            kwargs[k] = None  # none (how spec.yaml records a spec without one)
        elif cls is EvalSpec and k == "diagnostics":
            kwargs[k] = _diagnostics_spec(v)
        elif sub is not None and not prefix:
            if not isinstance(v, dict):
                raise ModbenchError(f"study key '{k}' must be a mapping")
            kwargs[k] = _build(sub, v, f"{k}.")
        else:
            kwargs[k] = v
    if cls is StudySpec and "scales" in kwargs:  # ladder(NAME[, K]): its rungs' presets
        kwargs["scales"] = expand_scales(kwargs["scales"])
    for name in ("methods", "scales", "overrides"):
        if name in kwargs and not isinstance(kwargs[name], list):
            raise ModbenchError(f"study key '{name}' must be a list")
    if cls is ClaimSpec:
        kwargs["expect"] = _claim_expectations(kwargs.get("expect") or {})
    return cls(**kwargs)


def _diagnostics_spec(tree: Any) -> DiagnosticsSpec | None:
    """``evaluation.diagnostics``: a mapping (``{batches: N, seeds: [..]}``), ``true`` (the
    defaults), or ``false`` / ``null`` (none)."""
    if tree is None or tree is False:
        return None
    if tree is True:
        return DiagnosticsSpec()
    if not isinstance(tree, dict):
        raise ModbenchError("study key 'evaluation.diagnostics' must be a mapping such as "
                            "{batches: 2, seeds: [0]}, or true")
    spec: DiagnosticsSpec = _build(DiagnosticsSpec, tree, "evaluation.diagnostics.")
    if isinstance(spec.batches, bool) or not isinstance(spec.batches, int) or spec.batches < 1:
        raise ModbenchError(f"evaluation.diagnostics.batches must be a whole number of "
                            f"validation batches, at least 1; got {spec.batches!r}")
    seeds = spec.seeds
    if seeds is not None and (not isinstance(seeds, list) or not seeds or any(
            isinstance(s, bool) or not isinstance(s, int) for s in seeds)):
        raise ModbenchError(f"evaluation.diagnostics.seeds must be a list of init seeds such as "
                            f"[0], or left out for every seed; got {seeds!r}")
    return spec


def _claim_expectations(tree: Any) -> dict[str, list[str]]:
    """``claim.expect``: method -> a verdict or a list of verdicts that agree with the claim."""
    from modbench.analysis.results import CLAIM_FORMS, SENSITIVITY_FORMS, parse_expectation

    forms = f"{', '.join(VERDICTS)}, {', '.join(CLAIM_FORMS)} or {', '.join(SENSITIVITY_FORMS)}"
    if not isinstance(tree, dict):
        raise ModbenchError("study key 'claim.expect' must map methods to verdicts, e.g. "
                            "{post_ln: [stalled, diverged]}")
    out: dict[str, list[str]] = {}
    for method, verdicts in tree.items():
        vs = [verdicts] if isinstance(verdicts, str) else verdicts
        if not isinstance(vs, list) or not vs:
            raise ModbenchError(f"claim.expect.{method} must be a verdict or a list of them")
        for v in vs:
            if not isinstance(v, str):
                raise ModbenchError(f"claim.expect.{method}: {v!r} is not a verdict; use "
                                    f"{forms}")
            plain = (*VERDICTS, *CLAIM_FORMS[:2], *SENSITIVITY_FORMS)
            if v not in plain and "(" not in v:
                raise ModbenchError(f"claim.expect.{method}: unknown verdict {v!r}"
                                    f"{suggest(v, plain)}; use {forms}")
            parse_expectation(v, f"claim.expect.{method}")  # margins: one line if wrong
        out[str(method)] = [str(v) for v in vs]
    return out


_NEW_KEY_DEFAULTS: dict[tuple[str, str], object] = {
    # kept in the key only where a method reads it (config_key): sigmoid's and SSMax's
    # constants moved from model.max_seq_len to train.seq_len, so their runs where the two
    # lengths differ (cpu-deep) train again; every other run keeps its key
    ("model", "train_seq_len"): None,
    ("data", "probe_loss"): "all",
    ("train", "parallel"): "ddp",
    ("train", "fsdp_param_dtype"): "auto",
    ("train", "activation_checkpointing"): False,
    # the memory train.micro_batch_size=auto plans against (measure.plan)
    ("train", "device_memory_gb"): None,
    # the oneDNN switch (a replication factor): on, as every run before it trained
    ("train", "onednn"): True,
    # stall detection only labels a finished run; a store's runs from before it keep their
    # keys, and the report applies the rule to them (modbench.runtime.stall.judge_run_folder)
    ("train", "stall_margin"): 0.1,
    ("train", "stall_patience"): 0.5,
    ("train", "stall_min_steps"): 100,
    # the early stop of stalled runs: studies set it (run_spec), so a store's runs trained
    # to the end before it existed have other keys and are trained again, never mixed in
    ("train", "stop_stalled_after"): None,
    # the stop's own margin: before the key the stop used stall_margin's 0.1, so a store's
    # runs stopped at 0.1 keep their key only where 0.1 is asked (the default 0.05 trains
    # them again); a run without the stop never reads it (config_key drops it)
    ("train", "stop_stalled_margin"): 0.1,
    # the stop's looks (every validation before the key): where every validation is a look
    # anyway (validations at least that far apart, or none), or the run is no longer than the
    # patience, config_key hashes it as before
    ("train", "stop_stalled_every"): None,
    ("recipe", "muon_momentum"): 0.95,
    ("recipe", "muon_nesterov"): True,
    ("recipe", "muon_ns_steps"): 5,
    ("recipe", "muon_adjust_lr"): "match_rms_adamw",
    ("recipe", "muon_lr_ratio"): 1.0,
    ("recipe", "muon_layerwise_lr"): "none",
    ("recipe", "muon_noise_beta"): 0.99,
    ("recipe", "muon_noise_max_ratio"): 10.0,
}


def config_key(cfg: RunConfig) -> str:
    """Stable hash of a fully resolved run config (the study's skip key).

    Keys added to the config later are left out of the hash while they hold their default
    (``_NEW_KEY_DEFAULTS``), so runs a study store finished before they existed keep their
    key and are not trained again.

    The code of a method from outside the package is part of the key: the sha256 of each
    such method's source (:func:`modbench.methods.plugins.code_hashes`), so editing a plugin
    trains again exactly the runs that use it. Built-in methods add nothing (their code is
    modbench's version, and stores keep their keys).
    """
    d = cfg.to_dict()
    code = code_hashes(MethodSpec.parse(cfg.model.method).names)
    if code:
        d["model"]["method_code"] = code
    if d["model"].get("train_seq_len") is not None:
        from modbench.methods.build import reads_train_seq_len

        if not reads_train_seq_len(cfg.model):
            d["model"]["train_seq_len"] = None
    tr = d["train"]
    if tr.get("stop_stalled_after") is None:
        tr.pop("stop_stalled_margin", None)
        tr.pop("stop_stalled_every", None)
    elif tr.get("stop_stalled_every") and (
            not 0 < tr.get("eval_every", 0) < tr["stop_stalled_every"]
            or tr.get("steps", 0) <= tr["stop_stalled_after"]):
        # every validation is a look (validations that far apart, or none), or the run is too
        # short for the stop to fire: the same runs as before the key
        tr["stop_stalled_every"] = None
    for (section, key), default in _NEW_KEY_DEFAULTS.items():
        if key in d[section] and d[section][key] == default:
            del d[section][key]
    for dotted, hashed_as in EXECUTION_KEYS.items():
        section, key = dotted.split(".")
        if hashed_as is None:
            d[section].pop(key, None)
        else:
            d[section][key] = hashed_as
    blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def expand(spec: StudySpec) -> list[RunSpec]:
    """All runs of a spec, validated (unknown methods, presets or keys fail here)."""
    if not spec.scales:
        raise ModbenchError("the study has no scales; list at least one preset under 'scales'")
    methods = [spec.baseline, *[m for m in spec.methods if m != spec.baseline]]
    anchors = set(spec.seeds.anchors) | {spec.baseline}
    unknown = anchors - set(methods)
    if unknown:
        raise ModbenchError(f"seeds.anchors names {sorted(unknown)} which are not in 'methods'")
    claimed = set(spec.claim.expect) - set(methods) if spec.claim else set()
    if claimed:
        raise ModbenchError(f"claim.expect names {sorted(claimed)} which are not in 'methods'; "
                            "expect verdicts only for methods the study runs")
    diag = spec.evaluation.diagnostics
    if diag is not None and diag.seeds is not None:
        study_seeds = set(spec.seeds.default) | set(spec.seeds.noise_floor)
        missing = sorted(set(diag.seeds) - study_seeds)
        if missing:
            raise ModbenchError(f"evaluation.diagnostics.seeds names seed(s) {missing} that no "
                                f"run of the study has (its seeds: {sorted(study_seeds)}); "
                                "name seeds under 'seeds'")
    if spec.data.order not in DATA_ORDERS:
        raise ModbenchError(f"data.order must be one of {', '.join(DATA_ORDERS)}, got "
                            f"{spec.data.order!r}")
    return unique_runs(run_spec(spec, scale, method, seed) for scale in spec.scales
                       for method in methods for seed in verdict_seeds(spec, method))


def verdict_seeds(spec: StudySpec, method: str) -> list[int]:
    """The init seeds ``method`` runs on for the study's verdicts: the default seeds, and for
    the baseline and the anchors the noise-floor seeds besides."""
    seeds = [int(s) for s in spec.seeds.default]
    if method in set(spec.seeds.anchors) | {spec.baseline}:
        seeds += [int(s) for s in spec.seeds.noise_floor if int(s) not in seeds]
    return seeds


def unique_runs(runs: Iterable[RunSpec]) -> list[RunSpec]:
    """``runs`` in order, each key once (two spellings of one config are one run)."""
    out: list[RunSpec] = []
    seen: set[str] = set()
    for run in runs:
        if run.key not in seen:
            seen.add(run.key)
            out.append(run)
    return out


#: ``train.stop_stalled_after`` in every study run (a spec's overrides may change it, or
#: turn it off with ``train.stop_stalled_after=null``): the patience, in steps, whose
#: false-stop rate benchmarks/stall_rule.py measured (docs/runs.md, "Stopping stalled runs"):
#: longer than the longest stretch a run that went on to learn was measured to sit at the
#: unigram level (WideNet and SeedNorm at builtin-cpu's settings, 280 steps within the stop's
#: margin; 200, the patience before, cut both)
STUDY_STOP_STALLED_AFTER = 300

#: ``train.stop_stalled_every`` in every study run: the stop looks at validations at least
#: 100 steps apart, the cadence at which its false-stop rate was measured at 0
#: (benchmarks/stall_rule.py; looking every 20 steps cut a run that learned on)
STUDY_STOP_STALLED_EVERY = 100


def run_spec(spec: StudySpec, scale: str, method: str, seed: int) -> RunSpec:
    """The run of ``method`` at ``scale`` with init seed ``seed`` under the spec's settings
    (and :data:`STUDY_STOP_STALLED_AFTER`, unless the spec overrides it)."""
    data_seed = spec.data.data_seed + (seed if spec.data.order == "per_seed" else 0)
    overrides = [f"data.source={spec.data.source}", f"data.data_seed={data_seed}",
                 f"data.probe_mix={spec.data.probe_mix}",
                 f"data.probe_loss={spec.data.probe_loss}",
                 f"train.stop_stalled_after={STUDY_STOP_STALLED_AFTER}",
                 f"train.stop_stalled_every={STUDY_STOP_STALLED_EVERY}", *spec.overrides]
    cfg = resolve(scale, recipe=spec.recipe, method=method, seed=seed, overrides=overrides)
    plan_run(cfg)  # unknown or conflicting methods, and recipes that clash, fail now
    return RunSpec(config_key(cfg), scale, method, seed, cfg)
