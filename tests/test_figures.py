"""The current benchmark figures (benchmarks/figures.yaml, scripts/figures.py): the registry validates, the table at
the top of benchmarks/RESULTS.md is what it gives, every make target and section it names exists; and refresh takes a
planted JSON's figure, date, machine, load and verdict into a planted entry, leaving the others alone."""

from __future__ import annotations

import datetime
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
figures = importlib.util.module_from_spec(spec)
sys.modules["figures"] = figures  # pydantic resolves the models' annotations through it
spec.loader.exec_module(figures)


def test_the_registry_validates_and_the_results_table_is_generated_from_it():
    reg = figures.load()
    assert 8 <= len(reg.figures) <= figures.MAX_ROWS
    page = figures.PAGE.read_text()
    assert figures.generated(page, reg) == page, "benchmarks/RESULTS.md's table is out of date: make bench-table"
    assert not figures.problems(reg, page), figures.problems(reg, page)
    assert page.index(figures.END) < page.index("\n## "), "the table comes before the first section"


def test_every_make_target_and_section_it_names_exists():
    targets = figures.make_targets()
    assert {"bench", "bench-table", "check-results", "bench-hop"} <= targets
    assert "PY" not in targets and "GAS_AUTHORS" not in targets  # variables, not targets
    sections = figures.anchors(figures.PAGE.read_text())
    for f in figures.load().figures:
        assert f.make in targets, f.id
        assert f.section in sections, f.id


def test_every_benchmark_script_has_a_make_target():
    recipes = " ".join(line for line in figures.MAKEFILE.read_text().splitlines() if line.startswith("\t")) + " "
    helpers = {"common.py", "flower_side.py"}  # the library every script imports; run by flower.py
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        if script.name not in helpers:
            assert f"benchmarks/{script.name} " in recipes or f" {script.name} " in recipes, script.name


def test_check_names_a_table_that_differs_and_a_missing_target(tmp_path):
    reg = figures.load()
    page = figures.PAGE.read_text().replace("| measure | target |", "| what | target |", 1)
    assert any("not what" in p for p in figures.problems(reg, page))
    bad = reg.model_copy(update={"figures": [reg.figures[0].model_copy(update={"make": "bench-nowhere"})]})
    assert any("bench-nowhere" in p for p in figures.problems(bad, figures.PAGE.read_text()))


def test_a_target_needs_a_verdict_and_json_needs_a_key():
    entry = {"id": "x", "measure": "something measured", "target": "<= 1 ms", "figure": "1 ms", "met": None,
             "date": datetime.date(2026, 11, 29), "machine": "2-core CPU", "make": "bench-hop", "section": "s"}
    with pytest.raises(ValueError, match="needs met"):
        figures.Figure(**entry)
    with pytest.raises(ValueError, match="json and key"):
        figures.Figure(**{**entry, "met": "yes", "json": "hop.json"})
    with pytest.raises(ValueError, match="extra"):
        figures.Figure(**{**entry, "met": "yes", "colour": "red"})


def test_refresh_takes_a_planted_json_into_a_planted_entry(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    header = "# a header comment\n# kept\n\n"
    entries = [
        {"id": "planted", "measure": "a planted hop, 1 MB", "target": "<= 1 ms", "figure": "1.00 ms", "met": "yes",
         "date": datetime.date(2026, 11, 27), "machine": "2-core CPU", "load": "0.5", "make": "bench-hop",
         "section": "s", "json": "hop.json", "key": ["1 MB.compiled.median", "4 MB.compiled.median"],
         "scale": 1000.0, "digits": 2, "unit": " ms", "at_most": 1.0},
        {"id": "no-json-on-disk", "measure": "a figure whose JSON was not made", "target": None, "figure": "7 s",
         "met": None, "date": datetime.date(2026, 11, 27), "machine": "2-core CPU", "make": "bench-hop",
         "section": "s", "json": "absent.json", "key": "a.b"},
        {"id": "older-json", "measure": "a figure newer than its JSON", "target": None, "figure": "3 s", "met": None,
         "date": datetime.date(2026, 12, 1), "machine": "2-core CPU", "make": "bench-hop", "section": "s",
         "json": "hop.json", "key": "1 MB.compiled.median"},
        {"id": "hand", "measure": "a figure with no JSON", "target": None, "figure": "5 s", "met": None,
         "date": datetime.date(2026, 11, 20), "machine": "H100 (lent)", "make": "chaos", "section": "s"},
    ]
    registry = tmp_path / "figures.yaml"
    registry.write_text(header + yaml.safe_dump(entries, sort_keys=False))
    (out / "hop.json").write_text(json.dumps({
        "benchmark": "hop", "time": "2026-11-30T10:00:00Z", "command": "python hop.py",
        "machine": {"cpus": 16, "load_when_saved": "0.20 0.30 0.40"}, "args": {},
        "results": {"1 MB": {"compiled": {"median": 0.00081}}, "4 MB": {"compiled": {"median": 0.0047}}},
        "load_at_end": "0.25 0.30 0.40"}))
    monkeypatch.setattr(figures, "REGISTRY", registry)
    monkeypatch.setattr(figures, "OUT", out)
    notes = figures.refresh()
    text = registry.read_text()
    assert text.startswith(header)
    got = {f.id: f for f in figures.load(registry).figures}
    p = got["planted"]
    assert (p.figure, p.date, p.machine, p.load, p.met) == ("0.81-4.70 ms", datetime.date(2026, 11, 30),
                                                            "16-core CPU", "0.25", "partly")
    assert got["no-json-on-disk"].figure == "7 s" and got["older-json"].figure == "3 s"
    assert got["hand"] == figures.Figure(**entries[3])
    assert any(n.startswith("no-json-on-disk: no ") for n in notes)
    assert any(n.startswith("older-json:") and "older" in n for n in notes)
    # the table reads the refreshed entry
    assert "| a planted hop, 1 MB | <= 1 ms | 0.81-4.70 ms | **partly** | 2026-11-30 | 16-core CPU, load 0.25 |" in \
        figures.table(figures.load(registry))
