"""scripts/ci_times.py, what .ci/run prints at its end: the phases' seconds, the machine's speed figures and the
slowest tests, read from the phase file and pytest's JUnit XML of each tier."""

from __future__ import annotations

from helpers import load_script

ct = load_script("ci_times")

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0"
skipped="1" tests="4" time="70.5">
<testcase classname="tests.test_a" name="test_quick" time="0.5"/>
<testcase classname="tests.test_a" name="test_slow[x]" time="60.0"/>
<testcase classname="tests.test_b" name="test_mid" time="10.0"/>
<testcase classname="tests.test_b" name="test_skipped" time="0.0"><skipped message="no"/></testcase>
</testsuite></testsuites>"""


def test_report_gives_phases_speed_and_the_slowest_tests_in_order(tmp_path):
    times = tmp_path / "times"
    times.write_text("setup 200\nspeed 3.25\ncpu AMD EPYC, AVX512\nfast-tier 480\nfull-tier 1800\nquickstart 4.18\n"
                     "check-docs 75\n")
    fast = tmp_path / "fast.xml"
    fast.write_text(JUNIT)
    out = ct.report(times, [fast, tmp_path / "full.xml"])  # a tier that never ran (no file) is left out
    assert "cnn_small step (ms, 1 thread): 3.25" in out and "quickstart round (s): 4.18" in out
    assert "CPU and torch's kernel set: AMD EPYC, AVX512" in out
    assert "| setup | 200 | 3.3 |" in out and "| full-tier | 1800 | 30.0 |" in out
    assert "| all | 2555 | 42.6 |" in out  # the phases only, not the speed figures
    assert "fast: 3 tests in 70 s" in out  # the skipped one is not counted
    slow = [line for line in out.splitlines() if line.startswith("| 60.0") or line.startswith("| 10.0")]
    assert slow == ["| 60.0 | fast | `tests/test_a.py::test_slow[x]` |", "| 10.0 | fast | `tests/test_b.py::test_mid` |"]


def test_report_without_any_file_says_so_rather_than_failing(tmp_path):
    out = ct.report(tmp_path / "none", [tmp_path / "none.xml"])
    assert "no speed figure was measured" in out and "| all | 0 |" in out


def test_speed_is_a_positive_time_per_step():
    ms = ct.speed()
    assert 0 < ms < 10_000
