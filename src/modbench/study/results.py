"""A study folder's results: its spec, its runs and their statistics
(:class:`modbench.analysis.results.StudyResults`). The report built from them is
:mod:`modbench.study.reporting`'s."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from modbench.analysis.results import (
    MethodFlops,
    RunRow,
    StudyResults,
    check_claim,
    compare_scales,
    default_metric,
)
from modbench.errors import ModbenchError
from modbench.measure.flops import flop_report
from modbench.study.spec import StudySpec, load_spec, run_spec
from modbench.study.store import Store


def check_study_folder(root: Path) -> None:
    """Refuse a folder that no study has run in (no results index)."""
    if not (root / "index.sqlite").is_file():
        raise ModbenchError(f"{root} is not a study folder (no index.sqlite); run "
                            "`modbench study run` first")


def load_rows(folder: str | Path) -> list[RunRow]:
    """One :class:`RunRow` per run in the study's index (by scale, method, seed)."""
    root = Path(folder)
    check_study_folder(root)
    store = Store(root)
    return [RunRow.from_record(r, store.run_dir(r["key"])) for r in store.rows()]


def load_study_plugins(folder: str | Path) -> list[str]:
    """Import the plugins a study folder's ``spec.yaml`` names (``methods_from``), without
    reading the rest of the spec; their refs (none: nothing imported)."""
    import yaml

    try:
        tree = yaml.safe_load((Path(folder) / "spec.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []
    refs = tree.get("methods_from") if isinstance(tree, dict) else None
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) for r in refs):
        return []
    from modbench.methods.plugins import load_plugins

    return [p.ref for p in load_plugins(refs, base=Path(folder).resolve())]


def code_changes(root: Path, runs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Of a study's ``runs`` (key, method string), those whose outside methods' recorded code
    differs from the code loaded now, or is not loaded: run key -> what changed. Only runs whose
    method string names a method that is not built in are read (a study of built-ins reads no
    run folder)."""
    from modbench.methods.base import split_top
    from modbench.methods.plugins import recorded_origins, stale_methods

    builtin: set[str] | None = None
    out: dict[str, str] = {}
    for key, method in runs:
        names = {t.split("(")[0].strip() for t in split_top(method, "+")}
        if builtin is None:
            builtin = _builtin_names() | {"baseline"}
        if names <= builtin:
            continue
        stale = stale_methods(recorded_origins(root / "runs" / key))
        if stale:
            out[key] = "; ".join(f"{name}: {why}" for name, why in sorted(stale.items()))
    return out


def _builtin_names() -> set[str]:
    """The built-in methods' names, from the method catalog (no method module imported)."""
    from modbench.methods.catalog import method_rows

    return {r["name"] for r in method_rows()[0]}


def load_spec_of(folder: str | Path) -> StudySpec | None:
    """The spec a study folder was last run with (``DIR/spec.yaml``), None if it has none."""
    path = Path(folder) / "spec.yaml"
    return load_spec(path) if path.is_file() else None


def sensitivity_verdicts_of(folder: str | Path) -> dict[str, dict[str, str]] | None:
    """The learning-rate profile's sensitivity verdicts of a study (scale -> method ->
    verdict, ``lr_profile/profile.json``), None when it has no finished profile."""
    from modbench.report.profile import read_profile

    data = read_profile(folder)
    if data is None:
        return None
    return {scale: {v["method"]: v["verdict"] for v in per.get("sensitivity", [])}
            for scale, per in data.get("scales", {}).items()}


def rate_dependence_of(folder: str | Path) -> dict[str, dict[str, str]]:
    """The methods the learning-rate profile flags rate-dependent (scale -> method -> where
    it improves and where it degrades, in words); none without a finished profile."""
    from modbench.report.profile import read_profile

    data = read_profile(folder)
    out: dict[str, dict[str, str]] = {}
    for scale, per in (data or {}).get("scales", {}).items():
        for method, flagged in per.get("rate_dependent", {}).items():
            if not flagged:
                continue
            verdicts = [next((r["verdict"] for r in point if r["method"] == method), None)
                        for point in per["by_point"]]
            where = {v: [p for p, x in zip(data["points"], verdicts, strict=True) if x == v]
                     for v in ("improver", "degrader")}
            out.setdefault(scale, {})[method] = (f"improver at {', '.join(where['improver'])}; "
                                                 f"degrader at {', '.join(where['degrader'])}")
    return out


def method_flops(spec: StudySpec, scale: str, method: str, seed: int = 0) -> MethodFlops:
    """Training FLOPs per token and the FLOPs ratio of ``method`` at ``scale``, from the run
    config the spec gives it."""
    cfg = run_spec(spec, scale, method, seed).config
    r = flop_report(cfg.model, cfg.train.seq_len)
    return MethodFlops(float(r.train_flops_per_token), float(r.flops_ratio))


def load_results(folder: str | Path, metric: str | None = None) -> StudyResults:
    """The study's runs, their per-scale comparison with the baseline on ``metric`` (default:
    the spec's decision metric) and each method's FLOPs per scale."""
    root = Path(folder)
    found = load_spec_of(root)  # its plugins (methods_from) first
    rows = load_rows(root)
    changed = code_changes(root, ((r.key, r.method) for r in rows))
    current = {(r.scale, r.method, r.seed) for r in rows if r.key not in changed}
    left_out = {f"{r.scale}/{r.method}/s{r.seed}": changed[r.key] + (
        "; a run with the loaded code replaces it" if (r.scale, r.method, r.seed) in current
        else "; `modbench study run` trains it again with the loaded code")
        for r in rows if r.key in changed}
    # trained with other code than what is loaded: not judged with it
    rows = [r for r in rows if r.key not in changed]
    spec = found or StudySpec()
    metric = metric or default_metric(spec.evaluation.primary, spec.evaluation.tasks)
    anchors = list(spec.seeds.anchors)
    flops: dict[str, dict[str, MethodFlops]] = {}
    for r in rows:  # by scale, method, seed: the first seed of each method
        per_scale = flops.setdefault(r.scale, {})
        if r.method not in per_scale:
            per_scale[r.method] = method_flops(spec, r.scale, r.method, r.seed)
    comparisons = compare_scales(rows, spec.baseline, metric, anchors)
    claim = (check_claim(comparisons, spec.claim.expect, spec.claim.source, spec.claim.text,
                         sensitivity=sensitivity_verdicts_of(root)) if spec.claim else None)
    return StudyResults(
        name=found.name if found else root.name, folder=root, baseline=spec.baseline,
        metric=metric, anchors=anchors, rows=rows, comparisons=comparisons, flops=flops,
        claim=claim, data_order=spec.data.order, code_changed=left_out,
        rate_dependent=rate_dependence_of(root))
