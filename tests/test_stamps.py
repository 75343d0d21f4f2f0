"""Stamps on result pages (scripts/stamps.py, make check-results): a page made with a method's golden fingerprint
fails the check, naming page and method, once that fingerprint changes; a page stamped stale on purpose is printed
and does not fail; the repository's own pages pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def stamps(tmp_path, monkeypatch):
    mod = load_script("stamps")
    golden = tmp_path / "tests" / "golden"
    golden.mkdir(parents=True)
    for name in ("gas", "fedbuff"):
        (golden / f"{name}.json").write_text(json.dumps({"algorithm": name, "rounds": [{"accuracy": 0.5}]}))
    (tmp_path / "docs" / "results").mkdir(parents=True)
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    monkeypatch.setattr(mod, "GOLDEN", golden)
    return mod


def test_a_page_fails_the_check_once_a_method_it_reports_changes(stamps, tmp_path, capsys):
    page = tmp_path / "docs" / "results" / "gas.md"
    page.write_text("# GAS\n\nintro\n\n## Accuracy\n\n| a | b |\n\n## Buffers\n\ntext\n")
    stamps.main(["stamp", str(page), "--methods", "gas,fedbuff", "--seeds", "0,1,2", "--rounds", "60",
                 "--command", "python docs/results/run_gas.py"])
    stamps.main(["stamp", str(page), "--section", "Buffers", "--methods", "gas", "--seeds", "0", "--rounds", "4",
                 "--command", "python docs/results/run_gas.py --buffers"])
    text = page.read_text()
    assert text.count("<!-- stamp: ") == 2 and text.rstrip().endswith("-->")  # the page's stamp closes the page
    assert "## Buffers\n\ntext\n\n*Stamp: stamped at" in text
    assert stamps.main(["check"]) == 0
    # restamping replaces the stamp rather than adding one
    stamps.main(["stamp", str(page), "--methods", "gas,fedbuff", "--seeds", "0,1,2", "--rounds", "60",
                 "--command", "python docs/results/run_gas.py"])
    assert page.read_text().count("<!-- stamp: ") == 2
    # also a section's, named by the beginning of its heading (the stamp keeps the full heading)
    stamps.main(["stamp", str(page), "--section", "Buff", "--methods", "gas", "--seeds", "0", "--rounds", "4",
                 "--command", "python docs/results/run_gas.py --buffers"])
    assert page.read_text().count("<!-- stamp: ") == 2 and '"section": "Buffers"' in page.read_text()
    capsys.readouterr()

    golden = tmp_path / "tests" / "golden" / "fedbuff.json"
    golden.write_text(golden.read_text().replace("0.5", "0.51"))  # make golden: FedBuff's behaviour changed
    assert stamps.main(["check"]) == 1
    out = capsys.readouterr().out
    changed = [ln for ln in out.splitlines() if ln.startswith("CHANGED")]
    assert len(changed) == 1 and "docs/results/gas.md: fedbuff changed" in changed[0], out
    assert "run_gas.py" in changed[0]


def test_a_stamp_names_the_commit_its_runs_were_made_at_where_given(stamps, tmp_path):
    page = tmp_path / "docs" / "results" / "gas.md"
    page.write_text("# GAS\n\n## Accuracy\n\ntext\n")
    stamps.main(["stamp", str(page), "--methods", "gas", "--seeds", "0", "--rounds", "4", "--command", "c",
                 "--commit", "3b7179e0a1b2"])  # a study run from a worktree at an earlier commit
    text = page.read_text()
    assert "stamped at commit 3b7179e on" in text and '"commit": "3b7179e"' in text
    with pytest.raises(SystemExit):  # not a hash: refused before the page is touched
        stamps.main(["stamp", str(page), "--methods", "gas", "--seeds", "0", "--rounds", "4", "--command", "c",
                     "--commit", "HEAD~1"])
    assert page.read_text() == text


def test_a_commit_the_text_names_beside_its_stamp_fails_until_the_stamp_names_it(stamps, tmp_path, monkeypatch):
    # issue 73: a section whose text says its runs were made at one commit while its stamp names another
    page = tmp_path / "docs" / "results" / "gas.md"
    page.write_text("# GAS\n\n## Accuracy\n\nSeeds 0-2, run at commit 2f7fbc2 (Capsule 0c37252).\n")
    args = ["stamp", str(page), "--methods", "gas", "--seeds", "0", "--rounds", "4", "--command", "c",
            "--commit", "3b7179e"]
    stamps.main(args)
    ours = {"2f7fbc2", "3b7179e"}  # commits of this repository; 0c37252 is another repository's
    found = stamps.named_commits(page.read_text(), is_commit=lambda toks: toks & ours)
    assert len(found) == 1 and "names commit 2f7fbc2, its stamp 3b7179e" in found[0]
    monkeypatch.setattr(stamps, "_commits", lambda toks: toks & ours)
    assert stamps.check() == 1  # the check catches it
    stamps.main(args + ["--made-at", "2f7fbc2"])
    text = page.read_text()
    assert "runs made at 2f7fbc2" in text and '"made_at": ["2f7fbc2"]' in text
    assert stamps.named_commits(text, is_commit=lambda toks: toks & ours) == [] and stamps.check() == 0
    with pytest.raises(SystemExit):
        stamps.main(args + ["--made-at", "HEAD"])


@pytest.mark.parametrize("where", ["benchmarks/RESULTS.md", "docs/reliability.md"])
def test_the_commit_check_holds_benchmark_and_docs_pages_too(stamps, tmp_path, monkeypatch, where):
    # issue 73: not only docs/results: a benchmark section or a docs page naming a commit its stamp does not
    page = tmp_path / where
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("# Results\n\n## Runtime III\n\nMeasured at commit 2f7fbc2 on the 2-core machine.\n")
    args = ["stamp", str(page), "--section", "Runtime III", "--methods", "gas", "--seeds", "0", "--rounds", "4",
            "--command", "make bench", "--commit", "3b7179e"]
    stamps.main(args)
    monkeypatch.setattr(stamps, "_commits", lambda toks: toks & {"2f7fbc2", "3b7179e"})
    assert stamps.check() == 1
    stamps.main(args + ["--made-at", "2f7fbc2"])
    assert stamps.check() == 0


def test_stale_on_purpose_is_printed_with_a_banner_at_the_top_and_does_not_fail(stamps, tmp_path, capsys):
    page = tmp_path / "docs" / "results" / "hydra.md"
    page.write_text("# Hydra\n\nintro\n\n## Table\n\nrows\n")
    stamps.main(["stamp", str(page), "--methods", "gas", "--seeds", "0", "--rounds", "60", "--command", "x",
                 "--stale", "made before the fork fix"])
    lines = page.read_text().splitlines()
    assert lines[2].startswith("> **Stale:** made before the fork fix")  # under the title
    (tmp_path / "tests" / "golden" / "gas.json").write_text("{}")
    capsys.readouterr()
    assert stamps.main(["check"]) == 0
    assert "stale on purpose: docs/results/hydra.md: made before the fork fix" in capsys.readouterr().out
    page.write_text(page.read_text().replace("> **Stale:**", "Note:"))  # the banner removed by hand
    assert stamps.main(["check"]) == 1


def test_a_page_made_before_metric_names_were_grouped_stays_current_until_a_value_changes(stamps, tmp_path, capsys):
    """Renaming metrics (accuracy -> eval/accuracy) rewrites every golden record without changing a method: a page
    stamped with the short-named record passes; once a value changes it fails like any other."""
    golden = tmp_path / "tests" / "golden" / "gas.json"

    def write(rounds):
        golden.write_text(json.dumps({"algorithm": "gas", "rounds": rounds}, indent=1, sort_keys=True) + "\n")

    write([{"round": 0, "accuracy": 0.5, "label_acc_3": 0.25, "bytes_up": 10.0, "ks": 4.0}])
    page = tmp_path / "docs" / "results" / "gas.md"
    page.write_text("# GAS\n\nrows\n")
    stamps.main(["stamp", str(page), "--methods", "gas", "--seeds", "0", "--rounds", "1", "--command", "x"])
    write([{"round": 0, "eval/accuracy": 0.5, "eval/label_acc/3": 0.25, "comm/bytes_up": 10.0, "method/ks": 4.0}])
    assert stamps.main(["check"]) == 0
    write([{"round": 0, "eval/accuracy": 0.5, "eval/label_acc/3": 0.25, "comm/bytes_up": 11.0, "method/ks": 4.0}])
    capsys.readouterr()
    assert stamps.main(["check"]) == 1
    assert "docs/results/gas.md: gas changed" in capsys.readouterr().out


def test_an_unknown_method_is_refused_naming_it(stamps, tmp_path):
    page = tmp_path / "docs" / "results" / "x.md"
    page.write_text("# X\n")
    with pytest.raises(SystemExit, match="no golden fingerprint for method 'gsa'"):
        stamps.main(["stamp", str(page), "--methods", "gsa", "--seeds", "0", "--rounds", "1", "--command", "x"])


def test_the_repository_pages_pass_the_check():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "stamps.py"), "check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_stamps_name_the_digest_golden_prints():
    """One fingerprint digest: what ``golden.py --fingerprints`` prints for a method is what a page's stamp names
    (they were once two digests, of the rounds and of the file, so no stamp matched the printed value)."""
    stamps, golden = load_script("stamps"), load_script("golden")
    for name in ("sflv2", "gas", "privacy_inversion"):
        assert stamps.fingerprint(name) == golden.fingerprint(name)
    page = (ROOT / "docs" / "results" / "privacy.md").read_text()
    assert f'"sflv2": "{golden.fingerprint("sflv2")}"' in page
