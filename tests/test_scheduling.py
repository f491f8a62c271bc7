"""tests/scheduling.py: ``-n 2 --dist loadfile`` hands out the longest test file first."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.scheduling import (
    UNKNOWN_TEST_S,
    durations_from_junit,
    expected_seconds,
    load_durations,
    longest_first,
)

ROOT = Path(__file__).resolve().parent.parent


def test_longest_first_reads_the_table_and_counts_tests_elsewhere() -> None:
    queue = {"/r/tests/a/test_many.py": dict.fromkeys(range(40), False),
             "/r/tests/test_slow.py": {"x": False},
             "/r/tests/test_other.py": dict.fromkeys(range(3), False)}
    table = {"tests/test_slow.py": 90.0, "tests/test_other.py": 1.0}
    assert longest_first(queue, table) == "/r/tests/test_slow.py"
    # without the table, the file with the most tests (xdist's own order)
    assert longest_first(queue, {}) == "/r/tests/a/test_many.py"
    assert expected_seconds("/r/tests/a/test_many.py", 40, table) == 40 * UNKNOWN_TEST_S
    # ties keep the queue's order
    assert longest_first({"tests/b.py": {1: False}, "tests/c.py": {1: False}}, {}) == "tests/b.py"


def test_durations_from_a_junit_report_and_a_bad_table(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text(textwrap.dedent("""\
        <testsuites><testsuite name="pytest">
        <testcase classname="tests.a" file="tests/a.py" name="t1" time="1.25"/>
        <testcase classname="tests.a" file="tests/a.py" name="t2" time="2.5"/>
        <testcase classname="tests.b" file="tests/sub/b.py" name="t" time="9"/>
        </testsuite></testsuites>"""))
    assert durations_from_junit(xml) == {"tests/sub/b.py": 9.0, "tests/a.py": 3.8}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    assert load_durations(bad) == {} and load_durations(tmp_path / "missing.json") == {}


def test_two_workers_start_with_the_longest_files(tmp_path: Path) -> None:
    """A real ``-n 2 --dist loadfile`` run of a made-up suite whose table names two files of
    one test each as the longest: the two workers start with them, though xdist alone would
    start with the files of most tests."""
    suite = tmp_path / "tests"
    suite.mkdir()
    log = tmp_path / "order.log"
    body = textwrap.dedent(f"""\
        import os
        def _note(name):
            with open({str(log)!r}, "a") as f:
                f.write(os.environ["PYTEST_XDIST_WORKER"] + " " + name + "\\n")
        """)
    for name, n in (("test_many1", 6), ("test_many2", 5), ("test_one1", 1), ("test_one2", 1)):
        tests = "".join(f"def test_{i}():\n    _note({name!r})\n" for i in range(n))
        (suite / f"{name}.py").write_text(body + tests)
    table = tmp_path / "durations.json"
    table.write_text(json.dumps({"tests/test_one1.py": 50, "tests/test_one2.py": 40}))
    (suite / "conftest.py").write_text(textwrap.dedent(f"""\
        import sys
        from pathlib import Path
        import pytest
        sys.path.insert(0, {str(ROOT)!r})
        from tests.scheduling import make_scheduler

        @pytest.hookimpl(optionalhook=True)
        def pytest_xdist_make_scheduler(config, log):
            return make_scheduler(config, log, Path({str(table)!r}))
        """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist",
                           "loadfile", "-p", "no:cacheprovider", str(suite)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first: dict[str, str] = {}
    for line in log.read_text().splitlines():
        worker, name = line.split()
        first.setdefault(worker, name)
    assert sorted(first.values()) == ["test_one1", "test_one2"], log.read_text()
