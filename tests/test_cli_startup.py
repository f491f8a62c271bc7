"""The command line answers fast: help, listings and argument errors without importing torch or
transformers; listings that fit the terminal; help that wraps on word boundaries; exit codes
(docs/cli.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from modbench.cli import (
    METHOD_COLUMNS,
    app,
    method_table,
    plain_table,
    render_table,
    run_cli,
)
from modbench.helptext import tidy_help
from modbench.methods.catalog import method_rows

HEAVY = ("torch", "transformers", "numpy", "tokenizers")  # docs/cli.md names all four

# (argv, exit code): none of these may import a HEAVY module
LIGHT = [
    (["--help"], 0),
    ([], 2),  # no command: the help, exit code 2
    (["methods"], 0),
    (["methods", "--json"], 0),
    (["presets"], 0),
    (["presets", "--json"], 0),
    (["recipes"], 0),
    (["train", "--help"], 0),
    (["data", "--help"], 0),
    (["data", "prepare", "--help"], 0),
    (["study", "run", "--help"], 0),
    (["eval", "--help"], 0),
    (["export", "--help"], 0),
    (["frobnicate"], 2),
    (["train", "--bogus"], 2),
    (["train", "--steps", "many"], 2),
    (["study", "show"], 2),
]

_CHILD = """
import contextlib, io, json, sys
from modbench.cli import run_cli
heavy, report = {heavy!r}, []
for argv, _ in {cases!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = run_cli(argv)
    report.append([argv, code, [m for m in heavy if m in sys.modules]])
print(json.dumps(report))
"""


def test_help_listings_and_argument_errors_import_no_torch() -> None:
    """In a fresh interpreter, one command after another: the first that imports torch or
    transformers is named."""
    res = subprocess.run([sys.executable, "-c", _CHILD.format(heavy=HEAVY, cases=LIGHT)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout)
    for (argv, want), (_, code, heavy) in zip(LIGHT, report, strict=True):
        assert heavy == [], f"`modbench {' '.join(argv)}` imported {heavy}"
        assert code == want, (argv, code)


def test_the_entry_point_answers_help_without_torch() -> None:
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "modbench", "--help"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0 and "Usage: modbench" in res.stdout
    imported = {line.split("|")[-1].strip() for line in res.stderr.splitlines()}
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    assert "modbench.cli" in imported  # the import log was read


def test_commands_that_train_nothing_leave_the_compiler_unloaded(tmp_path: Path) -> None:
    """Loading every method (a spec's validation, a dry run) does not import torch._dynamo,
    ~2 s of start-up (soft-cap's FlexAttention helpers load it on CUDA only). A training
    process loads it anyway (torch's optimizers do)."""
    child = (
        "import sys\n"
        "from modbench.methods import load_all\n"
        "from modbench.cli import run_cli\n"
        "load_all()\n"
        "assert 'torch._dynamo' not in sys.modules, 'load_all'\n"
        f"code = run_cli(['study', 'run', 'smoke-tiny', '--out', {str(tmp_path / 's')!r}, "
        "'--dry-run'])\n"
        "assert code == 0, code\n"
        "assert 'torch._dynamo' not in sys.modules, 'study run --dry-run'\n"
    )
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=120, check=False, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]


# ---------------------------------------------------------------------------- listings


def test_method_listing_fits_80_columns_and_long_names_stay_aligned() -> None:
    rows, _ = method_rows()
    table = method_table(rows)
    longest = max((r[0] for r in table), key=len)
    assert longest == "hyper_connections_2lane"  # the name that broke the columns (issue 20)
    text = render_table(METHOD_COLUMNS, table, width=80, wrap=(2,))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    starts = set()
    for name, category, _ in table:
        line = next(x for x in lines if x.startswith(name + " "))
        starts.add(line.index(f" {category} ", len(name)))
    assert len(starts) == 1, starts  # every category starts in the same column
    words = " ".join(r[2] for r in table).split()
    assert " ".join(text.split()).count(" ") >= len(words) - 1
    for w in words:  # wrapped on word boundaries: every word of a summary shows whole
        assert w in text, w


def test_plain_listing_aligns_columns_and_keeps_every_word() -> None:
    rows, _ = method_rows()
    table = method_table(rows)
    text = plain_table(METHOD_COLUMNS, table)
    lines = text.splitlines()
    assert lines[0].split() == METHOD_COLUMNS
    heads = [line for line in lines[1:] if not line.startswith(" ")]
    assert [h.split()[0] for h in heads] == [r[0] for r in table]  # one line per method
    col = {h.index(" " + r[1] + " ", len(r[0])) for h, r in zip(heads, table, strict=True)}
    assert len(col) == 1, col
    summary_col = lines[0].index("summary")
    for r, h in zip(table, heads, strict=True):
        first, *more = r[2].split("\n")
        assert h[summary_col:] == first
        for extra in more:  # options and notes: their own lines, under the summary
            assert " " * summary_col + extra in lines


@pytest.mark.parametrize("argv", [["presets"], ["recipes"], ["methods"]])
def test_piped_listings_are_plain_lines(argv: list[str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out and "─" not in out  # no colours, no box drawing
    assert out.splitlines()[0].split()[0] == argv[0].rstrip("s")


def test_presets_list_every_preset_with_its_parameter_count(
        capsys: pytest.CaptureFixture[str]) -> None:
    from modbench.config import PRESETS
    from modbench.methods.build import count_params

    assert run_cli(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [x.split()[0] for x in lines] == list(PRESETS)
    for line in lines:
        name, params = line.split()[:2]
        assert params == f"{count_params(PRESETS[name].model) / 1e6:.2f}M", name


# ---------------------------------------------------------------------------- help text


def _commands() -> list[list[str]]:
    import typer

    command = typer.main.get_command(app)
    out: list[list[str]] = []

    def walk(cmd: object, path: list[str]) -> None:
        out.append(path)
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*path, name])

    walk(command, [])
    return out


@pytest.mark.parametrize("path", _commands(), ids=lambda p: " ".join(p) or "modbench")
def test_help_wraps_on_word_boundaries(path: list[str], monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """At 80 columns every word of the command's help and its options' help shows whole (no
    word cut, no `…`, no `[default: x]` swallowed as markup, no space before a full stop),
    and it has an example."""
    import typer

    monkeypatch.setenv("COLUMNS", "80")
    assert run_cli([*path, "--help"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out and not re.search(r"\w \.(\s|$)", out), out
    assert "Example" in out
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    tidy_help(command, escape_markup=False)
    texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
    shown = set(out.replace("│", " ").split())
    for text in texts:
        for word in text.split():
            assert word in shown, (word, text)


def test_defaults_stated_in_help_are_shown(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert run_cli(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    for default in ("[default: cpu-small]", "[default: baseline]", "[default: 0]",
                    "[default: a new folder under runs/ named after the preset, method, seed "
                    "and time]"):
        assert default in text, default


def test_shard_sequences_default_matches_prepare() -> None:
    from modbench.data.cli import SHARD_SEQUENCES_DEFAULT
    from modbench.data.prepare import DEFAULT_SHARD_SEQUENCES

    assert SHARD_SEQUENCES_DEFAULT == DEFAULT_SHARD_SEQUENCES


# ---------------------------------------------------------------------------- exit codes


def test_no_command_prints_help_and_no_empty_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli([]) == 2
    captured = capsys.readouterr()
    assert "Usage: modbench" in captured.out + captured.err
    assert "error:" not in captured.err


def test_torchrun_entry_exits_3_for_a_diverged_run(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m modbench.train` (what torchrun runs) exits like `modbench train`: 3 for a
    diverged run alone, 0 inside a torchrun group (whose launcher reads the summary), 2 for
    bad input."""
    from modbench.train.cli import main

    argv = ["--preset", "tiny", "--steps", "6", "--no-progress", "--set", "recipe.lr=1e30",
            "--set", "recipe.grad_clip=0", "--set", "recipe.warmup_frac=0"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([*argv, "--out", str(tmp_path / "alone")]) == 3
    summary = json.loads((tmp_path / "alone" / "summary.json").read_text())
    assert summary["status"] == "diverged"
    assert "status:  diverged at step" in capsys.readouterr().out
    assert main(["--preset", "tiny", "--set", "recipe.lr=fast", "--out",
                 str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()
    assert main(["--help"]) == 0


def test_torchrun_entry_help_reads_like_modbench_train(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m modbench.train --help` wraps and keeps its defaults as `modbench train
    --help` does (the same tidied help: no `[default: x]` swallowed as markup)."""
    from modbench.train.cli import main

    monkeypatch.setenv("COLUMNS", "100")
    assert main(["--help"]) == 0
    torchrun = capsys.readouterr().out
    assert run_cli(["train", "--help"]) == 0
    modbench = capsys.readouterr().out
    assert "Usage: python -m modbench.train" in torchrun
    assert "[default: cpu-small]." in torchrun and not re.search(r"\w \.(\s|$)", torchrun)
    lines = [line.rstrip() for line in torchrun.splitlines()]
    assert [x.replace("python -m modbench.train", "modbench train") for x in lines] == [
        line.rstrip() for line in modbench.splitlines()]


@pytest.mark.parametrize("status,code", [("completed", 0), ("stalled", 3), ("diverged", 3)])
def test_train_exit_code_follows_the_run_status(status: str, code: int, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The status the trainer returns decides the code (the trainer itself is stubbed: how a
    run comes to stall is tests/train's business), with --seeds too."""
    import modbench.train.trainer as trainer

    def fake(status_of: dict[int, str]):  # type: ignore[no-untyped-def]
        def summary(seed: int) -> dict[str, object]:
            st = status_of[seed]
            return {"status": st, "final_val_loss": None, "steps": 4, "tokens": 10,
                    "params": 1, "tokens_per_s": None,
                    **({} if st == "completed" else {f"{st}_at_step": 5})}
        return summary

    one = fake({0: status})
    monkeypatch.setattr(trainer, "train", lambda cfg, out, **kw: one(cfg.seed))
    assert run_cli(["train", "--preset", "tiny", "--out", str(tmp_path / "r")]) == code
    lines = capsys.readouterr().out.splitlines()
    assert f"status:  {status}" + (" at step 5" if code else "") in lines
    both = fake({0: "completed", 1: status})
    monkeypatch.setattr(trainer, "train_seeds",
                        lambda cfg, seeds, out, **kw: [both(s) for s in seeds])
    assert run_cli(["train", "--preset", "tiny", "--seeds", "0,1", "--out",
                    str(tmp_path / "k")]) == code
