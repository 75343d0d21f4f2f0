"""The studies' committed run records (issue 73, item 6), on a tiny fake study: a run that finishes writes its record
beside the pages, a study run again where its cache is gone restores the run from its record instead of running it
(not when the record is of another config), and scripts/records.py holds a page's records table to its records."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "results"))
import _runs  # noqa: E402

spec = importlib.util.spec_from_file_location("records", ROOT / "scripts" / "records.py")
records = importlib.util.module_from_spec(spec)
spec.loader.exec_module(records)

RESULT = {"eval/accuracy": 0.8123, "time/sim": 12.5, "run_id": "abc", "curve": [[4, 2.5, 0.5], [8, 5.0, 0.8123]],
          "history": [{"round": 4, "eval/accuracy": 0.5}, {"round": 8, "eval/accuracy": 0.8123}]}


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake study: one base config, two runs cached under tmp_path/.fake_runs, records under tmp_path/records."""
    monkeypatch.setattr(_runs, "RECORDS", tmp_path / "records")
    monkeypatch.setattr(records, "RECORDS", tmp_path / "records")
    config = tmp_path / "fake.yaml"
    config.write_text("train:\n  rounds: 8\n")
    runs = [_runs.Run(config, {"seed": s}, f"fake seed {s}", tmp_path / ".fake_runs" / f"fake_s{s}.json")
            for s in (0, 1)]

    popen = subprocess.Popen

    def no_sweep(cmd, *a, **k):
        if "sweep" in cmd:
            raise AssertionError("the study ran a sweep")
        return popen(cmd, *a, **k)  # git, for the record's commit
    monkeypatch.setattr(_runs.subprocess, "Popen", no_sweep)
    return runs


def test_a_finished_run_writes_its_record_and_a_study_reuses_it(fake, monkeypatch):
    import raysplit.comparison

    found = {r.label: {**RESULT, "eval/accuracy": 0.8 + 0.01 * i} for i, r in enumerate(fake)}
    monkeypatch.setattr(raysplit.comparison, "arm_results", lambda *a, **k: {k2: dict(v) for k2, v in found.items()})
    _runs._cache("fake-study", "sqlite:///unused.db", "sweep", fake)
    for r in fake:
        rec = json.loads(_runs.record_path(r.out).read_text())
        assert rec["experiment"] == "fake-study" and rec["label"] == r.label and rec["overrides"] == r.overrides
        assert rec["config_digest"] == _runs.config_digest(r) and rec["commit"] and rec["machine"]
        assert rec["result"]["curve"] == RESULT["curve"] and records.invalid(_runs.record_path(r.out)) == []
        assert _runs.record_path(r.out).parent.name == "fake_runs"
        r.out.unlink()  # a fresh machine: the caches are gone, the committed records are there
    got = _runs.study("fake-study", fake)  # a sweep would fail the test
    assert [g["eval/accuracy"] for g in got] == [0.8, 0.81]
    assert all(r.out.is_file() for r in fake)


def test_a_record_of_another_config_is_run_again(fake):
    _runs.write_record("fake-study", fake[0], dict(RESULT))
    changed = _runs.Run(fake[0].config, {"seed": 0, "train.rounds": 16}, fake[0].label, fake[0].out)
    assert _runs.config_digest(changed) != _runs.config_digest(fake[0])
    assert not _runs.restore(changed.out, changed) and not changed.out.exists()
    with pytest.raises(AssertionError, match="ran a sweep"):
        _runs.study("fake-study", [changed])
    assert _runs.restore(fake[0].out, fake[0])  # the same config: restored
    assert _runs.restored(fake[1].out) == fake[1].out and not fake[1].out.exists()  # no record: nothing to restore


def test_a_pages_records_table_traces_to_its_records(fake, tmp_path):
    for i, r in enumerate(fake):
        _runs.write_record("fake-study", r, {**RESULT, "eval/accuracy": 0.8 + 0.01 * i})
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n<!-- records table: begin fake_runs -->\n<!-- records table: end -->\n\nText.\n")
    assert records.problems([page])  # the table is not written yet
    page.write_text(records.generated(page.read_text()))
    text = page.read_text()
    assert "| fake seed 0 | 80.00 | 8 |" in text and "| fake seed 1 | 81.00 | 8 |" in text, text
    assert records.problems([page]) == []
    page.write_text(text.replace("81.00", "81.50"))  # a number that no record gives
    assert "not what its records give" in records.problems([page])[0]
    bad = _runs.RECORDS / "fake_runs" / "broken.json"
    bad.write_text(json.dumps({"label": "x"}))
    assert any("no config_digest" in p for p in records.problems([]))


def test_the_committed_records_and_their_tables_check():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "records.py"), "check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_script_that_computes_its_runs_keeps_a_record_and_restores_from_it(fake, tmp_path):
    # semisfl_premise.py and semisfl_ladder.py run their arms themselves: keep() writes the cache and a record
    out = tmp_path / ".premise" / "fixmatch_l40_s0.json"
    spec = {"arm": "fixmatch", "labels": 40, "seed": 0, "steps": 30}
    res = {"accuracy": 0.66, "curve": [[10, 0.5, 0.5, 0.7], [30, 0.66, 0.64, 0.8]]}
    _runs.keep(out, "semisfl-premise", "fixmatch labels 40 seed 0", spec, res)
    rec = json.loads(_runs.record_path(out).read_text())
    assert rec["kind"] == "script" and rec["config_digest"] == _runs.spec_digest(spec) and rec["result"] == res
    assert records.invalid(_runs.record_path(out)) == []
    out.unlink()
    assert not _runs.restore(out, digest=_runs.spec_digest({**spec, "steps": 60}))  # another run: run it again
    assert _runs.restore(out, digest=_runs.spec_digest(spec)) and json.loads(out.read_text()) == res


def test_time_and_traffic_to_a_target_read_from_a_runs_curve_and_history():
    res = {"curve": [[2, 3.0, 0.5], [4, 7.5, 0.81], [6, 9.0, 0.79]],
           "history": [{"round": r, "comm/bytes_up": 10.0 * r, "comm/bytes_down": 1.0} for r in range(1, 7)]}
    # the first evaluation at or above the target, the traffic summed over its rounds (10+20+30+40 up, 4 down)
    assert _runs.to_target(res, 0.8, ("comm/bytes_up", "comm/bytes_down")) == (4, 7.5, 104.0)
    assert _runs.to_target(res, 0.5) == (2, 3.0, 0.0)
    assert _runs.common_target([res, {"curve": [[1, 1.0, 0.6]]}]) == 0.6  # the best both reach
    with pytest.raises(ValueError, match="never reaches"):
        _runs.to_target(res, 0.9)
    with pytest.raises(ValueError, match="misses rounds"):
        _runs.to_target({**res, "history": res["history"][1:]}, 0.8, ("comm/bytes_up",))
    with pytest.raises(ValueError, match="time/sim"):
        _runs.to_target({"curve": [[1, 0.9]]}, 0.8)


def test_a_language_models_time_to_target_falls_to_the_lowest_perplexity_both_reach():
    """A language model's run has no accuracy curve: its history's perplexity is the score (lower is better), the
    common target the lowest perplexity every run reaches, and the time to it that of the first evaluation at or
    below it; claims.record_value's percent saved reads it the same way (SplitLoRA's time row)."""
    cspec = importlib.util.spec_from_file_location("claims", ROOT / "scripts" / "claims.py")
    claims = importlib.util.module_from_spec(cspec)
    cspec.loader.exec_module(claims)

    def lm(points):  # (time/sim, perplexity) per round
        return {"curve": [], "history": [{"round": r, "time/sim": t, "eval/perplexity": p}
                                         for r, (t, p) in enumerate(points, 1)]}

    fast = lm([(1.0, 300.0), (2.0, 150.0), (3.0, 120.0), (4.0, 110.0)])
    slow = lm([(3.0, 250.0), (6.0, 140.0), (9.0, 125.0)])
    assert _runs.common_target([fast, slow]) == -125.0  # the lowest perplexity both reach: slow's best
    assert _runs.to_target(fast, -125.0) == (3, 3.0, 0.0) and _runs.to_target(slow, -125.0) == (3, 9.0, 0.0)
    assert claims.record_value("time to target", [fast, slow]) == pytest.approx(100 * (1 - 3.0 / 9.0))
    assert claims.record_value("time to target", [slow, fast]) == pytest.approx(100 * (1 - 9.0 / 3.0))
    with pytest.raises(ValueError, match="curve"):
        _runs.common_target([fast, {"curve": [], "history": [{"round": 1}]}])


def test_a_scripts_computation_and_a_run_read_from_elsewhere_keep_records(fake, tmp_path):
    # ampere_drift.py, ampere_aux_cost.py, hydra_head_share.py, ...: kept() computes once, then reads the record
    calls = []
    out = tmp_path / ".drift" / "drift_sflv1_r4_s0.json"
    spec = {"arm": "sflv1", "rounds": 4, "seed": 0}
    compute = lambda: calls.append(1) or {"drift": [0.5, 0.25], "accuracy": 0.7}  # noqa: E731
    assert _runs.kept(out, "ampere-drift", "SplitFed seed 0", spec, compute)["accuracy"] == 0.7
    out.unlink()  # a fresh machine: no cache, the committed record
    assert _runs.kept(out, "ampere-drift", "SplitFed seed 0", spec, compute)["drift"] == [0.5, 0.25]
    assert calls == [1] and records.invalid(_runs.record_path(out)) == []
    # run_peers.py: the authors' code's cached run, recorded under records/<folder>/ and restored from it
    theirs = tmp_path / "peers" / ".runs" / "psl_s0.json"
    theirs.parent.mkdir(parents=True)
    theirs.write_text(json.dumps({"final": 0.61, "curve": [[1, float("nan")]]}))
    _runs.recorded(theirs, "peers-cyclesl", "their PSL seed 0", "peers_cyclesl")
    rec = _runs.RECORDS / "peers_cyclesl" / "psl_s0.json"
    first = rec.read_text()
    assert json.loads(first)["result"]["final"] == 0.61 and records.invalid(rec) == []
    _runs.recorded(theirs, "peers-cyclesl", "their PSL seed 0", "peers_cyclesl")
    assert rec.read_text() == first  # the same result (a NaN in it too): the record is left as it is
    theirs.unlink()
    assert json.loads(_runs.recorded(theirs, "peers-cyclesl", "x", "peers_cyclesl").read_text())["final"] == 0.61
