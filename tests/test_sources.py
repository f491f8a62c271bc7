"""Sources a reader can follow (docs/sources.md).

No file of the repository cites a path that is not in it: the spec sheet and the seed
documents that were never committed (``METHODS.md``, ``seeds/00N``, ``../shared``), a
``docs/X.md`` or a markdown link to a file that does not exist, or a ``sources.md#ANCHOR`` that
docs/sources.md does not define. Every registered method has its entry there, and the README's
list of methods is the registry's, category by category.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from modbench.methods import load_all

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "docs" / "sources.md"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".json", ".txt", ".cfg", ".sh"}
#: Files this check leaves alone, each with the reason.
EXCLUDED = {
    "tests/test_sources.py": "it spells out the citations it looks for",
    "LOG.md": "the project's dated log: what was said then, kept as written",
}
#: The page that explains the old names: checked for its links and anchors only.
OLD_NAMES_EXPLAINED = {"docs/sources.md"}

NEVER_HERE = [
    (re.compile(r"METHODS\.md"), "the spec sheet METHODS.md is not in the repository"),
    (re.compile(r"\bseeds/\d{3}"), "the seed documents are not in the repository"),
    (re.compile(r"\.\./shared\b"), "../shared is outside the repository"),
]
DOCS_PATH = re.compile(r"(?<![\w./-])(docs/[\w./-]*?\.md)(?:#([\w-]+))?")
SOURCES_ANCHOR = re.compile(r"sources\.md#([\w-]+)")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
ANCHOR_ID = re.compile(r"<a id=\"([\w-]+)\"></a>")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading (tags and punctuation dropped, spaces to -)."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors a markdown page defines: explicit ``<a id>`` tags and its headings."""
    return set(ANCHOR_ID.findall(markdown)) | {_slug(h) for h in HEADING.findall(markdown)}


def repository_files(root: Path) -> list[str]:
    """The repository's text files (tracked, or new and not ignored), relative to ``root``."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, text=True, check=True).stdout
    return sorted(f for f in set(out.splitlines())  # (never an installed package's files)
                  if Path(f).suffix in TEXT_SUFFIXES and "site-packages" not in Path(f).parts
                  and (root / f).is_file())


def bad_citations(root: Path, files: list[str]) -> list[str]:
    """``path:line: what`` for each citation in ``files`` (relative to ``root``) of a path
    that is not in ``root``, or of an anchor ``root/docs/sources.md`` does not define."""
    sources = root / "docs" / "sources.md"
    defined = anchors(sources.read_text()) if sources.is_file() else set()
    found: list[str] = []
    for rel in files:
        path = root / rel
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            where = f"{rel}:{n}"
            for pattern, why in NEVER_HERE:
                if rel not in OLD_NAMES_EXPLAINED and pattern.search(line):
                    found.append(f"{where}: {why}")
            for target, _ in DOCS_PATH.findall(line):
                if not (root / target).is_file():
                    found.append(f"{where}: {target} does not exist")
            for anchor in SOURCES_ANCHOR.findall(line):
                if anchor not in defined:
                    found.append(f"{where}: docs/sources.md has no anchor #{anchor}")
            if path.suffix == ".md":
                found += [f"{where}: {msg}" for msg in _link_problems(root, path, line)]
    return found


def _link_problems(root: Path, page: Path, line: str) -> list[str]:
    """What is wrong with the relative links of one markdown line of ``page``: a file that is
    not there, or an anchor of the page itself it does not define (a ``sources.md#`` anchor is
    checked with every other file's)."""
    problems = []
    for target in MD_LINK.findall(line):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            problems.append(f"the link {target} leads to no file")
        elif anchor and not file_part and anchor not in anchors(page.read_text()):
            problems.append(f"the link {target}: this page has no anchor #{anchor}")
    return problems


def test_no_file_cites_a_path_that_is_not_in_the_repository() -> None:
    files = [f for f in repository_files(ROOT) if f not in EXCLUDED]
    assert len(files) > 200, "the repository's file list came back short: is git working?"
    assert all((ROOT / f).is_file() for f in EXCLUDED), "an excluded file is gone: drop it"
    bad = bad_citations(ROOT, files)
    assert not bad, "citations a reader cannot follow:\n" + "\n".join(bad)


def test_every_registered_method_has_its_entry_in_sources() -> None:
    defined = set(ANCHOR_ID.findall(SOURCES.read_text()))
    missing = [name for name in sorted(load_all()) if name.replace("_", "-") not in defined]
    assert not missing, f"docs/sources.md has no entry (anchor) for {missing}"


README_GROUPS = {"attention": "attention", "FFN": "ffn", "placement": "placement",
                 "norm types": "norm", "residual": "residual", "architecture": "architecture"}


def readme_methods(readme: str) -> tuple[int, dict[str, set[str]]]:
    """The README's methods row: the count it states and the names it lists per category."""
    row = next(line for line in readme.splitlines() if line.startswith("| methods |"))
    count = int(re.match(r"\| methods \| (\d+),", row).group(1))  # type: ignore[union-attr]
    groups: dict[str, set[str]] = {}
    for label, category in README_GROUPS.items():
        seg = re.search(rf"(?:: |; ){label} (.*?)(?:;|\|)", row)
        assert seg is not None, f"the README's methods row has no '{label}' group"
        groups[category] = set(re.findall(r"`([a-z0-9_]+)`", seg.group(1)))
    return count, groups


def test_the_readme_lists_the_registry() -> None:
    registry = load_all()
    count, groups = readme_methods((ROOT / "README.md").read_text())
    assert count == len(registry), f"README says {count} methods, the registry has {len(registry)}"
    for category, names in groups.items():
        want = {n for n, cls in registry.items() if cls.category == category}
        assert names == want, (f"README's {category} methods differ from the registry: "
                               f"missing {sorted(want - names)}, extra {sorted(names - want)}")


def _plant(root: Path, files: dict[str, str]) -> list[str]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return sorted(files)


def test_the_check_finds_each_kind_of_broken_citation(tmp_path: Path) -> None:
    files = _plant(tmp_path, {
        "docs/sources.md": '# Sources\n\n- <a id="mix-ln"></a>**`mix_ln`**\n\n## Seed documents\n',
        "docs/good.md": "[ok](sources.md#mix-ln) [heading](sources.md#seed-documents) "
                        "[web](https://arxiv.org/abs/2412.13795)\n",
        "src/ok.py": '"""Mix-LN (docs/sources.md#mix-ln; arXiv 2412.13795)."""\n',
        "src/a.py": '"""Equation (METHODS.md C4)."""\n',
        "src/b.py": "# see seeds/002_* Appendix B.11\n",
        "src/c.py": "# ../shared/seeds/000\n",
        "src/d.py": "# docs/missing.md explains\n",
        "src/e.py": "# docs/sources.md#no-such-anchor\n",
        "docs/f.md": "[gone](nothere.md) and [anchor](sources.md#nope)\n",
        "src/g.yaml": "description: 3 seeds/data orders\n",  # not a citation
    })
    bad = bad_citations(tmp_path, files)
    for planted in ("src/a.py:1", "src/b.py:1", "src/c.py:1", "src/d.py:1", "src/e.py:1"):
        assert any(b.startswith(planted) for b in bad), (planted, bad)
    assert sum(b.startswith("docs/f.md:1") for b in bad) == 2, bad
    assert not [b for b in bad if b.split(":")[0] in ("docs/good.md", "src/ok.py",
                                                       "src/g.yaml", "docs/sources.md")], bad


def test_readme_row_parsing() -> None:
    count, groups = readme_methods("| methods | 2, x: attention `qknorm`; FFN `geglu`, `moe` (see "
                                   "`train.init_from`); placement ; norm types ; residual ; "
                                   "architecture |")
    assert count == 2 and groups["attention"] == {"qknorm"} and groups["ffn"] == {"geglu", "moe"}
    assert groups["norm"] == set() and groups["architecture"] == set()
