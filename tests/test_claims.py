"""The claims registry (docs/results/claims.yaml, scripts/claims.py): it validates, every verdict on
docs/results/README.md is the rule's, the table is what the registry gives, no cell runs long; and the rule itself,
on planted claims, gives each of its five verdicts exactly where its text says."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("claims", ROOT / "scripts" / "claims.py")
claims = importlib.util.module_from_spec(spec)
sys.modules["claims"] = claims  # pydantic resolves the models' annotations through it
spec.loader.exec_module(claims)


def _claim(values, *, sign=1, kind="paper", low=None, high=None, checks=(), comparable=True, scale="difference"):
    setting = {"kind": kind, "here": "here"}
    if kind == "reduced":
        setting["reductions"] = ["fewer rounds"]
    if kind == "equivalent":
        setting["equivalent"] = "the same arithmetic"
    return claims.Claim(
        id="planted", paper="GAS", claim="X beats Y", comparable=comparable,
        why_not_comparable=None if comparable else "another quantity",
        paper_number={"text": "+10 pp", "place": "Table 1", "low": low, "high": low if high is None else high},
        setting=setting, checks=list(checks),
        measure={"what": "X minus Y", "short": "X - Y", "unit": "x" if scale == "ratio" else "pp", "sign": sign,
                 "scale": scale, "seeds": list(range(len(values))),
                 "values": values, "page": "gas.md#x", "command": "python docs/results/run_gas.py"})


@pytest.mark.parametrize("kw, want", [
    ({"values": [1.0, 2.0, 3.0]}, "reproduced"),
    ({"values": [1.0, 2.0, 3.0], "kind": "equivalent"}, "reproduced"),
    ({"values": [1.0, 2.0, 3.0], "kind": "reduced"}, "direction only"),
    ({"values": [1.0, 2.0, 3.0], "low": 5.0}, "direction only"),  # median 2 under half of 5
    ({"values": [2.0, 2.5, 3.0], "low": 5.0}, "reproduced"),  # median 2.5: half of 5
    ({"values": [4.0]}, "direction only"),  # one seed
    ({"values": [-1.0, -2.0, -3.0], "sign": -1}, "reproduced"),  # the paper claims a decrease
    ({"values": [1.0, -0.5, 3.0]}, "not reproduced, unexplained"),
    ({"values": [-1.0, -0.5, -3.0], "checks": [{"what": "E = 2", "link": "c.md#e", "explains": False}]},
     "not reproduced, unexplained"),
    ({"values": [-1.0, -0.5, -3.0], "checks": [{"what": "E = 2", "link": "c.md#e", "explains": True}]},
     "not reproduced, cause known"),
    ({"values": [1.0, 2.0, 3.0], "comparable": False}, "not tested"),
])
def test_the_rule_gives_each_verdict_where_its_text_says(kw, want):
    assert claims.verdict(_claim(**kw))[0] == want


@pytest.mark.parametrize("kw, want", [
    # Ampere's on-device compute (Fig. 9, ampere.txt:532): "6.87% to 96.2% of the on-device computation required by
    # baselines", a ratio under 1 for a claimed decrease. The paper's best case, and its worst, give "reproduced";
    # before the ratio scale, sign -1 made every ratio negative and both gave "not reproduced".
    ({"values": [0.0687, 0.07, 0.07], "low": 0.0687, "high": 0.962}, "reproduced"),
    ({"values": [0.962, 0.962, 0.962], "low": 0.0687, "high": 0.962}, "reproduced"),
    # CycleSL's gradient norms (Table 6): CyclePSL 2.773 over PSL 4.369 = 0.635 (0.573 to 0.635 over the table)
    ({"values": [0.635, 0.6, 0.573], "low": 0.573, "high": 0.635}, "reproduced"),
    # the paper's direction, but short of half the smallest effect on the log scale (sqrt(0.962) = 0.981)
    ({"values": [0.99, 0.99, 0.99], "low": 0.0687, "high": 0.962}, "direction only"),
    ({"values": [0.5, 0.6, 0.7]}, "reproduced"),  # no paper number: the direction against 1 decides
    ({"values": [3.5, 3.5, 3.5], "low": 0.0687, "high": 0.962}, "not reproduced, unexplained"),  # 3.5x more
    ({"values": [0.5, 1.0, 0.7]}, "not reproduced, unexplained"),  # a ratio of 1 is no effect
])
def test_a_ratio_is_judged_against_1_on_the_log_scale(kw, want):
    """Issue 73, item 2: a ratio's direction is judged against 1, and the paper's smallest effect in the measure's
    unit (the end of its range of ratios nearest 1) on the log scale; the paper's own numbers give "reproduced"."""
    assert claims.verdict(_claim(sign=-1, scale="ratio", **kw))[0] == want, kw
    # a claimed increase as a ratio: a speedup of 2x against a paper's 1.5x
    assert claims.verdict(_claim([2.0, 2.1, 1.9], sign=1, scale="ratio", low=1.5))[0] == "reproduced"
    assert claims.verdict(_claim([1.1, 1.1, 1.1], sign=1, scale="ratio", low=1.5))[0] == "direction only"


def test_a_ratio_measure_is_named_and_positive():
    with pytest.raises(ValueError, match="unit x"):
        claims.Measure(what="w", short="s", unit="x", sign=-1, seeds=[0], values=[0.5], page="gas.md",
                       command="python docs/results/run_gas.py")
    with pytest.raises(ValueError, match="positive"):
        claims.Measure(what="w", short="s", unit="x", sign=-1, scale="ratio", seeds=[0], values=[-0.5],
                       page="gas.md", command="python docs/results/run_gas.py")
    ratios = [c for c in claims.load().claims if c.measure and c.measure.unit == "x"]
    assert ratios and all(c.measure.scale == "ratio" for c in ratios)


def test_the_registry_validates_and_the_readme_table_is_generated_from_it():
    reg = claims.load()
    assert len(reg.claims) >= 18 and {claims.verdict(c)[0] for c in reg.claims} <= set(claims.VERDICTS)
    page = claims.TABLE_PAGE.read_text()
    assert claims.generated(page, reg) == page, "docs/results/README.md's table is out of date: make claims"
    assert not claims.long_cells(reg), claims.long_cells(reg)
    for path, text in claims.heads(reg).items():
        assert text == path.read_text(), f"{path.name}'s head is out of date: make claims"
    assert not claims.broken_links(reg), claims.broken_links(reg)


def test_each_papers_page_head_lists_its_claims_with_seeds_and_verdicts():
    reg = claims.load()
    for paper, name in claims.PAGES.items():
        head = claims.head(paper, reg)
        mine = [c for c in reg.claims if c.paper == paper]
        assert mine and all(c.claim in head and f"Verdict: **{claims.verdict(c)[0]}**" in head for c in mine), name
        for c in mine:
            if c.measure and not c.measure.median_only:
                assert all(f"seed {s} {v:+g}" in head for s, v in zip(c.measure.seeds, c.measure.values)), c.id


def test_a_link_to_a_missing_section_is_named(tmp_path, monkeypatch):
    (tmp_path / "p.md").write_text("# Title\n\n## Where we = disagree\n\n```\n# not a heading\n```\n## Where we = disagree\n")
    assert claims.anchors(tmp_path / "p.md") == {"title", "where-we--disagree", "where-we--disagree-1"}
    monkeypatch.setattr(claims, "TABLE_PAGE", tmp_path / "README.md")
    good = _claim([1.0, 2.0, 3.0], checks=[{"what": "w", "link": "p.md#where-we--disagree-1", "explains": True}])
    bad = _claim([1.0, 2.0, 3.0], checks=[{"what": "w", "link": "p.md#not-a-heading", "explains": True}])
    assert claims.broken_links(claims.Registry(claims=[good])) == ["planted: gas.md#x: no page gas.md"]
    assert "p.md has no section #not-a-heading" in claims.broken_links(claims.Registry(claims=[bad]))[1]


def test_every_claims_page_and_command_exist():
    """Each measure's page (and each check's) is a file of docs/results; each command names a script that exists."""
    import re

    for c in claims.load().claims:
        for link in [c.measure.page if c.measure else None, *(ch.link for ch in c.checks)]:
            if link:
                assert (ROOT / "docs" / "results" / link.split("#")[0]).is_file(), (c.id, link)
        if c.measure:
            scripts = re.findall(r"[\w/.-]+\.py", c.measure.command)
            assert scripts and all((ROOT / s).is_file() for s in scripts), (c.id, c.measure.command)


def test_result_page_lengths_are_printed_and_the_claims_table_page_is_short(capsys):
    """Each result page's length in lines (issue 54 asks for pages a reader takes in five minutes, about 200 lines;
    investigations live in notes/), and docs/results/README.md, the generated table and its rule, within 120
    lines."""
    pages = {p.name: len(p.read_text().splitlines()) for p in sorted((ROOT / "docs" / "results").glob("*.md"))}
    with capsys.disabled():
        print("\nresult pages (lines):", ", ".join(f"{k} {v}" for k, v in sorted(pages.items(), key=lambda x: -x[1])))
    assert pages["README.md"] <= 120, pages["README.md"]
    long = {k: v for k, v in pages.items() if v > 230}  # about 200; investigations go to notes/
    assert not long, f"result pages over 230 lines (move investigations to docs/results/notes/): {long}"


def test_every_link_on_the_result_pages_lands_and_a_dangling_one_is_named(tmp_path):
    assert not claims.page_links(), claims.page_links()
    (tmp_path / "notes").mkdir()
    (tmp_path / "a.md").write_text("# A\n\n## Kept\n")
    (tmp_path / "notes" / "b.md").write_text("# B\n[ok](../a.md#kept) [moved](../a.md#gone) [web](https://x.org/y.md)\n"
                                             "[none](c.md) [self](#b)\n```\n[in code](nowhere.md)\n```\n")
    assert [line.split(": ", 1)[1] for line in claims.page_links([tmp_path / "notes" / "b.md"])] == [
        "../a.md#gone: no section #gone", "c.md: no file c.md"]


def test_no_verdict_is_written_by_hand_outside_a_pages_generated_head(tmp_path):
    """Issue 54: rows used verdicts outside the rule's five terms ("direction reproduced", "consistent with the
    paper") and status cells contradicted the computed ones (ampere.md's time row said "reproduced" where the rule
    gives "direction only"). A verdict stands only in a page's generated head."""
    assert not claims.hand_verdicts(), claims.hand_verdicts()
    page = tmp_path / "p.md"
    page.write_text(f"# P\n\n{claims.HEAD_BEGIN}\n- Verdict: **reproduced** (three seeds).\n| a | reproduced |\n"
                    f"{claims.HEAD_END}\n\n| the paper | here | open |\n|---|---|---|\n| x | +1 | Not tested here |\n"
                    "| y | +2 | the size |\n\nThe effect is consistent with the paper.\n")
    assert [line.split(": ", 1)[0] for line in claims.hand_verdicts([page])] == [f"{page}:10", f"{page}:13"]


def test_paths_to_the_shared_papers_lead_there_from_the_page(tmp_path):
    """Issue 73: pages wrote ../shared/papers/x.txt, a path from the repository's root, where a reader standing on
    docs/results/ needs ../../../shared/papers/x.txt (and one ../ more from notes/)."""
    assert not claims.shared_paths(), claims.shared_paths()
    root = tmp_path / "repo"
    (root / "docs" / "results" / "notes").mkdir(parents=True)
    (root / "docs" / "results" / "a.md").write_text("the paper (../shared/papers/x.txt), ok ../../../shared/papers/x.txt\n")
    (root / "docs" / "results" / "notes" / "b.md").write_text("ok (../../../../shared/notes/seed-code.md §1)\n"
                                                              "not ../../../shared/papers/y.txt\n")
    out = claims.shared_paths(root=root)
    assert [o.split(": ")[0] for o in out] == ["docs/results/a.md:1", "docs/results/notes/b.md:2"], out


def _said_of(text, **kw):
    """prose_verdicts on a planted GAS page (``text`` after a generated head) for one planted claim."""
    c = _claim(**kw).model_copy(update={"mentions": [r"X (beats|against|over) Y", r"\bX - Y\b"]})
    return c, claims.Registry(claims=[c])


def test_a_page_sentence_whose_verdict_differs_from_the_computed_one_fails(tmp_path):
    """Issue 73, item 5: ampere.md said "the paper's claims hold" where the rule computes "direction only", and
    "does not hold" where the registry's measure was +0.46; the old check read table cells and four fixed phrases.
    The check reads the verdict words of every sentence that speaks of a claim, so paraphrases fail too."""
    assert not claims.prose_verdicts(claims.load()), claims.prose_verdicts(claims.load())
    page = tmp_path / "gas.md"
    c, reg = _said_of("", values=[1.0, 2.0, 3.0], kind="reduced")  # direction only
    assert claims.verdict(c)[0] == "direction only"
    page.write_text(f"# P\n\n{claims.HEAD_BEGIN}\n- X beats Y: Verdict: **reproduced**.\n{claims.HEAD_END}\n\n"
                    "- **X against Y: the paper's claim holds.** Fine print.\n"            # a paraphrase of reproduced
                    "- X beats Y here, confirming the paper's claim.\n"                  # another
                    "- X - Y is +2 [+1, +3]: it does not hold at this scale.\n"           # the other way
                    "- X beats Y on every seed, in the paper's direction (reduced setting).\n"  # agrees with the rule
                    "- Z beats W: the paper's claim holds.\n"                             # another claim's subject
                    "- X against Y at another scale: it does not hold ([the check](c.md#e)).\n")  # a check, linked
    reg = claims.Registry(claims=[c.model_copy(update={"checks": [claims.Check(what="e", link="c.md#e",
                                                                                explains=False)]})])
    out = claims.prose_verdicts(reg, {"GAS": page})
    assert [o.split(": ")[0].rsplit(":", 1)[1] for o in out] == ["7", "8", "9"], out
    assert "says holds of planted, whose verdict is 'direction only'" in out[0]
    assert "says against of planted" in out[2]
    # the same sentences are right for a claim the rule finds not reproduced only where they say so
    bad, _ = _said_of("", values=[-1.0, -2.0, -3.0])
    out = claims.prose_verdicts(claims.Registry(claims=[bad]), {"GAS": page})
    assert [o.split(": ")[0].rsplit(":", 1)[1] for o in out] == ["7", "8", "10"], out


def test_verdict_words_are_read_with_their_negation():
    assert claims.said("the claim does not hold here") == {"against"}
    assert claims.said("the claim holds here") == {"holds"}
    assert claims.said("not reproduced; the opposite of the paper") == {"against"}
    assert claims.said("the seeds disagree in sign") == set()
    assert claims.said("direction only, the head's verdict") == {"direction"}


def test_a_registry_value_its_page_does_not_print_fails(tmp_path, monkeypatch):
    """Issue 73: the registry gave Ampere's time as 92.46, 92.65, 92.65 where its page printed 92.5, 92.7, 92.7, and
    linked CycleSL's and GAS's values to a section that prints none of them. Each value must stand in the section its
    measure links to, with at least the registry's decimals."""
    assert not claims.traces(claims.load()), claims.traces(claims.load())
    monkeypatch.setattr(claims, "TABLE_PAGE", tmp_path / "README.md")
    (tmp_path / "gas.md").write_text("# G\n\n## X\n\n| X - Y | +1.25 [+0.5, +2.04] | +1.25 +0.50 +2.04 |\n\n"
                                     "## Other\n\n92.46 and 3.1\n")
    ok = _claim([1.25, 0.5, 2.04]).model_copy(update={"measure": _claim([1.25, 0.5, 2.04]).measure.model_copy(
        update={"page": "gas.md#x"})})
    assert claims.traces(claims.Registry(claims=[ok])) == []
    coarse = _claim([1.3, 0.5, 2.0]).measure.model_copy(update={"page": "gas.md#x"})  # the page has more digits
    assert claims.traces(claims.Registry(claims=[ok.model_copy(update={"measure": coarse})])) == []
    fine = _claim([1.254, 0.5, 3.1]).measure.model_copy(update={"page": "gas.md#x"})
    assert claims.traces(claims.Registry(claims=[ok.model_copy(update={"measure": fine})])) == [
        "planted: 1.254 is not printed in gas.md#x (the measure's page)",
        "planted: 3.1 is not printed in gas.md#x (the measure's page)"]  # 3.1 stands in another section only


def test_what_a_page_says_stays_checked_in_its_notes_and_a_checks_own_section_reports_the_check(tmp_path):
    pages = claims.prose_pages()
    names = {p.name for p in pages["GAS"]}
    assert {"gas.md", "gas-baselines.md"} <= names and "gas-claims.md" not in names, names
    notes = tmp_path / "notes"
    notes.mkdir()
    page = notes / "gas-x.md"
    page.write_text("# X\n\n## The measure\n\nX beats Y: the claim holds.\n\n## Another scale\n\n"
                    "X against Y here: it does not hold.\n\nA cache that holds every activation; X beats Y.\n\n"
                    "X beats Y, as \"Where we disagree with the paper\" says.\n")
    c, _ = _said_of("", values=[1.0, 2.0, 3.0], kind="reduced")
    c = c.model_copy(update={"checks": [claims.Check(what="e", link="notes/gas-x.md#another-scale", explains=False)]})
    out = claims.prose_verdicts(claims.Registry(claims=[c]), {"GAS": [page]})
    assert [o.split(": ")[0].rsplit(":", 1)[1] for o in out] == ["5"], out  # only the measure's section's "holds"


def _counts(path):
    """A paper's page in words: its head, its longest table cell (characters, links as their text), and the words
    before its "Investigations (notes/)" heading."""
    import re

    text = path.read_text()
    a, b = text.index(claims.HEAD_BEGIN) + len(claims.HEAD_BEGIN), text.index(claims.HEAD_END)
    words = lambda t: len(re.sub(r"\]\([^)]*\)", "]", t).split())  # noqa: E731
    cells = [c.strip() for line in text.splitlines() if line.startswith("|") for c in line.split("|")[1:-1]]
    longest = max([0] + [len(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", c)) for c in cells])
    notes = text.find("\n## Investigations (notes/)")
    return words(text[a:b]), longest, words(text[:notes] if notes >= 0 else text)


def test_each_papers_page_reads_in_five_minutes(capsys):
    """Issue 73, item 7: a paper's page is read in five minutes: its head about 400 words at most, no table cell
    over about 300 characters, about 1,200 words before the link to its notes (investigations live in notes/)."""
    counts = {name: _counts(claims.TABLE_PAGE.parent / name) for name in claims.PAGES.values()}
    with capsys.disabled():
        print("\npaper pages (head words, longest cell, words before notes/):",
              ", ".join(f"{k} {h}/{c}/{w}" for k, (h, c, w) in counts.items()))
    assert all(h <= 420 for h, _, _ in counts.values()), counts
    assert all(c <= 320 for _, c, _ in counts.values()), counts
    assert all(w <= 1400 for _, _, w in counts.values()), counts  # about 1,200


def _axes(data=(), model=(), labels=1000, schedule=(), rounds=100):
    return {"data": list(data), "model": list(model), "labels": labels, "schedule": list(schedule), "rounds": rounds}


def _selecting(measure_at, settings):
    """A hand-made row: the paper at 1,000 labels and 100 rounds, the measure at ``measure_at`` (values +1, +2, +3) and
    each of ``settings`` (name, at, values) as a setting check."""
    c = _claim([1.0, 2.0, 3.0], kind="reduced")
    checks = [{"what": name, "link": "gas.md#x", "explains": False, "at": at, "seeds": list(range(len(v))), "values": v}
              for name, at, v in settings]
    paper = {"data": "SVHN", "model": "a CNN", "labels": [1000], "schedule": "K_s adapted", "rounds": 100}
    return claims.Claim(**{**c.model_dump(), "paper_setting": paper, "checks": checks,
                           "measure": {**c.measure.model_dump(), "at": measure_at}})


def test_the_selection_rule_picks_the_setting_nearest_the_papers():
    # the order of precedence: a nearer dataset wins over nearer labels, nearer labels over a nearer schedule and
    # more rounds; a number is compared on the log scale, departures by their count
    near = _axes(data=["Fashion-MNIST"], labels=1000, schedule=["K_s fixed", "K_u 10"], rounds=60)
    c = _selecting(_axes(data=["Fashion-MNIST"], labels=40, schedule=[], rounds=100),
                   [("1,000 labels", near, [-0.1, 0.2, -0.3]),
                    ("1,000 labels, Dirichlet", _axes(data=["Fashion-MNIST", "Dirichlet"], labels=1000, rounds=100),
                     [5.0, 5.0, 5.0]),
                    ("400 labels", _axes(data=["Fashion-MNIST"], labels=400), [4.0, 4.0, 4.0])])
    assert claims.candidates(c)[claims.nearest(c)][0] == "1,000 labels"
    assert claims.distance(near, c.paper_setting) == (1.0, 0.0, 0.0, 2.0, round(abs(math.log(60 / 100)), 9))
    # 250 is nearer 1,000 than 4,000 is (ln 4 each way: a tie on the axis), 100 farther (ln 10)
    paper = {**c.paper_setting, "labels": [1000]}
    assert claims.distance(_axes(labels=250), paper)[2] == claims.distance(_axes(labels=4000), paper)[2]
    assert claims.distance(_axes(labels=100), paper)[2] > claims.distance(_axes(labels=250), paper)[2]
    # a tie on every axis: more seeds, then the smaller median effect (a tie never flatters the claim)
    same = _axes(data=["Fashion-MNIST"])
    tie = _selecting(same, [("worse", same, [-1.0, 0.5, -2.0]), ("one seed", same, [-9.0])])
    assert claims.candidates(tie)[claims.nearest(tie)][0] == "worse"
    ok = _selecting(same, [("better", same, [4.0, 5.0, 6.0])])
    assert claims.nearest(ok) == 0 and claims.selection(claims.Registry(claims=[ok])) == []


def test_a_row_whose_measure_breaks_the_selection_rule_fails():
    # Semi-SFL's unlabelled-gain row as it stood: the measure at 40 labels where a setting at the paper's 1,000 was run
    bad = _selecting(_axes(data=["Fashion-MNIST"], labels=40, schedule=["K_s fixed"], rounds=60),
                     [("1,000 labels", _axes(data=["Fashion-MNIST"], labels=1000, schedule=["K_s fixed"], rounds=60),
                       [0.27, 0.24, -0.05])])
    problems = claims.selection(claims.Registry(claims=[bad]))
    assert len(problems) == 1 and "'1,000 labels' is nearer" in problems[0] and "labels" in problems[0], problems
    # a row with a measure and no axes fails too; a row the rule does not test is not judged
    bare = _claim([1.0, 2.0, 3.0])
    assert "needs paper_setting" in claims.selection(claims.Registry(claims=[bare]))[0]
    off = claims.Claim(**{**bad.model_dump(), "comparable": False, "why_not_comparable": "another quantity"})
    assert claims.selection(claims.Registry(claims=[off])) == []
    # a setting check names its values, and a number stands where the paper's is a number
    with pytest.raises(ValueError, match="seeds and one value"):
        claims.Check(what="w", link="gas.md#x", explains=False, at=_axes(), seeds=[0, 1], values=[1.0])
    with pytest.raises(ValueError, match="departures named"):
        _selecting(_axes(labels=["fewer labels"]), [])
    # a page that keeps only a mean gives one value for its seeds
    claims.Check(what="w", link="gas.md#x", explains=False, at=_axes(), seeds=[0, 1, 2], values=[2.1], mean_only=True)


def test_every_row_of_the_registry_keeps_the_selection_rule():
    reg = claims.load()
    assert claims.selection(reg) == []
    for c in reg.claims:
        if c.measure is not None:
            print(f"{c.id}: the measure and {len(claims.candidates(c)) - 1} other settings run")


def test_a_registry_value_made_from_run_records_is_what_they_give(tmp_path):
    import json

    for name, acc in (("a_s0", 0.8512), ("b_s0", 0.8201), ("a_s1", 0.8000), ("b_s1", 0.8100)):
        (tmp_path / "fake_runs").mkdir(exist_ok=True)
        (tmp_path / "fake_runs" / f"{name}.json").write_text(json.dumps({"result": {"eval/accuracy": acc}}))
    c = _claim([3.11, -1.0])
    pairs = [["fake_runs/a_s0.json", "fake_runs/b_s0.json"], ["fake_runs/a_s1.json", "fake_runs/b_s1.json"]]
    ok = claims.Claim(**{**c.model_dump(), "measure": {**c.measure.model_dump(), "records": pairs}})
    assert claims.record_traces(claims.Registry(claims=[ok]), tmp_path) == []
    off = claims.Claim(**{**c.model_dump(), "measure": {**c.measure.model_dump(), "values": [3.2, -1.0], "records": pairs}})
    assert "3.2 is not what its records give" in claims.record_traces(claims.Registry(claims=[off]), tmp_path)[0]
    gone = claims.Claim(**{**c.model_dump(), "measure": {**c.measure.model_dump(), "records": [pairs[0], ["x.json"]]}})
    assert "cannot be read" in claims.record_traces(claims.Registry(claims=[gone]), tmp_path)[0]
    with pytest.raises(ValueError, match="one \\[minuend"):
        claims.Claim(**{**c.model_dump(), "measure": {**c.measure.model_dump(), "records": pairs[:1]}})


def _run(curve, bytes_per_round=None):
    """A hand-made run result: its evaluated curve [(round, time/sim, accuracy)] and per-round traffic."""
    rounds = int(curve[-1][0])
    hist = [{"round": r, "comm/bytes_up": bytes_per_round or 0.0, "comm/bytes_down": 0.0} for r in range(1, rounds + 1)]
    return {"eval/accuracy": curve[-1][2], "curve": [list(p) for p in curve], "history": hist}


def test_time_and_traffic_to_a_common_target_on_hand_made_curves():
    # the method reaches 0.80 at its last point, 10 s; the baselines pass it early: equal outcomes, not equal rounds
    method = _run([(1, 4.0, 0.30), (2, 10.0, 0.80)], bytes_per_round=1.0)
    slow = _run([(1, 5.0, 0.60), (2, 10.0, 0.82), (3, 15.0, 0.90)], bytes_per_round=100.0)
    fast = _run([(1, 2.0, 0.70), (2, 4.0, 0.85), (3, 6.0, 0.88)], bytes_per_round=50.0)
    # the target is 0.80, the highest accuracy all three reach; the fastest baseline reaches it in 4 s
    assert claims.record_value("time to target", [method, slow, fast]) == pytest.approx(100 * (1 - 10 / 4))
    # traffic: the method 2 rounds x 1 byte; the least-traffic baseline (fast: 2 rounds x 50) to 0.80
    assert claims.record_value("traffic to target", [method, slow, fast]) == pytest.approx(100 * (1 - 2 / 100))
    # judged at the final point instead, the method would save 10 / 15 of the slow baseline's time: the target counts
    assert claims.record_value("accuracy", [method, slow]) == pytest.approx(-10.0)


def test_accuracy_at_early_stop_reads_the_validated_run_at_its_best_validation_round():
    # a method that stops itself (its final accuracy is its restored best) against a baseline validated each round
    method = {"eval/accuracy": 0.86, "curve": [[1, 0.0, 0.86]], "history": [{"round": 1}]}
    val = [0.70, 0.80, 0.79, 0.78, 0.77, 0.90]  # patience 3: stops at round 5 (0.80 at round 2 not bettered in 3)
    test = [0.71, 0.83, 0.84, 0.85, 0.86, 0.95]
    base = {"eval/accuracy": test[-1], "curve": [[r + 1, 0.0, a] for r, a in enumerate(test)],
            "history": [{"round": r + 1, "eval/validation_accuracy": v} for r, v in enumerate(val)]}
    assert claims.record_value("accuracy at early stop", [method, base], 3) == pytest.approx(100 * (0.86 - 0.83))
    # a longer patience reaches round 6's better model; its last round alone would be the plain difference
    assert claims.record_value("accuracy at early stop", [method, base], 4) == pytest.approx(100 * (0.86 - 0.95))
    assert claims.record_value("accuracy", [method, base]) == pytest.approx(100 * (0.86 - 0.95))
    c = next(c for c in claims.load().claims if c.measure is not None and c.measure.from_records == "accuracy")
    with pytest.raises(ValueError, match="measure.patience"):
        claims.Claim(**{**c.model_dump(), "measure": {**c.measure.model_dump(), "from_records": "accuracy at early stop"}})


def test_a_record_never_left_out_of_its_row(tmp_path):
    import json

    (tmp_path / "fake_runs").mkdir()
    for name, acc in (("a_s0", 0.85), ("b_s0", 0.82), ("a_long_s0", 0.90)):
        (tmp_path / "fake_runs" / f"{name}.json").write_text(json.dumps({"result": {"eval/accuracy": acc}}))
    c = _claim([3.0])
    pair = [["fake_runs/a_s0.json", "fake_runs/b_s0.json"]]
    paper = {"data": "SVHN", "model": "a CNN", "labels": [1000], "schedule": "K_s adapted", "rounds": 100}
    row = {**c.model_dump(), "runs": ["fake_runs/*.json"], "paper_setting": paper,
           "measure": {**c.measure.model_dump(), "records": pair}}
    found = claims.left_out(claims.Registry(claims=[claims.Claim(**row)]), tmp_path)
    assert len(found) == 1 and "fake_runs/a_long_s0.json" in found[0] and "never left out" in found[0]
    check = {"what": "longer run", "link": "gas.md#x", "explains": False, "at": _axes(), "seeds": [0],
             "values": [8.0], "records": [["fake_runs/a_long_s0.json", "fake_runs/b_s0.json"]]}
    listed = claims.Claim(**{**row, "checks": [check]})
    assert claims.left_out(claims.Registry(claims=[listed]), tmp_path) == []
    assert claims.record_traces(claims.Registry(claims=[listed]), tmp_path) == []  # 90 - 82 = 8: the check's value
    wrong = claims.Claim(**{**row, "checks": [{**check, "values": [7.0]}]})
    assert "7 is not what its records give" in claims.record_traces(claims.Registry(claims=[wrong]), tmp_path)[0]
    nothing = claims.Claim(**{**row, "runs": ["other_runs/*.json"]})
    assert "matches no record" in claims.left_out(claims.Registry(claims=[nothing]), tmp_path)[0]
