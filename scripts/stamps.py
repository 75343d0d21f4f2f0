"""Stamps on result pages, and the check that names every page whose methods changed since it was made.

A stamp is two lines at the end of a page (or of one ``## `` section of it): a visible line and a machine-readable
comment holding the commit the numbers were made at, the date, the machine's CPU and torch's CPU kernel set (the
kind of machine on which the numbers repeat digit for digit: ``raysplit.runtime.devices.cpu_kind``; stamps before
2026-11-29 lack it), the golden fingerprint of every method the page
reports (the SHA-256 of ``tests/golden/<method>.json``, first 12 hex digits; tests/test_golden.py holds each method
to it), the seeds and the rounds, and the command that made them::

    python scripts/stamps.py stamp docs/results/gas.md --methods gas,fedbuff --seeds 0,1,2 --rounds 60 \\
        --command "python docs/results/run_gas.py"
    python scripts/stamps.py stamp benchmarks/RESULTS.md --section "Reliability II" --methods sflv2 ...
    python scripts/stamps.py check            # make check-results (CI): no training, reads the stamps only

``--commit HASH`` names the commit the runs were made at where it is not HEAD (a study run from a worktree, or a
page stamped after later commits); the default is HEAD. ``--stale REASON`` stamps a page made before a change it
has not been rerun for: the check prints it (and the page carries a "Stale" line at its top, or at its section's
top) but does not fail. ``--made-at A,B`` names the commits the runs were made at where the text names them and
they are not ``--commit`` (runs spanning commits, a section restamped later): on every stamped page (docs/results/,
docs/, benchmarks/RESULTS.md) every commit of this repository the text of a stamped section names must be its
stamp's commit or one of its ``made_at``, else the check fails naming it (issue 73: commits in the text that differ
from the stamp). A page whose stamp names a
fingerprint other than today's fails the check, naming page, section and method: the method's behaviour changed
(tests/golden/ was rewritten) and the numbers on the page were not made again.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
PAGES = ("docs/results/*.md", "docs/results/notes/*.md", "docs/*.md", "benchmarks/RESULTS.md",
         "benchmarks/archive/*.md")
STAMP = re.compile(r"^<!-- stamp: (\{.*\}) -->$", re.M)
VISIBLE = re.compile(r"^\*Stamp: .*\*$", re.M)
STALE = re.compile(r"^> \*\*Stale:\*\* .*$", re.M)


def fingerprint(method: str) -> str:
    """``scripts/golden.py``'s digest of the method's stored fingerprint (what ``golden.py --fingerprints``
    prints)."""
    path = GOLDEN / f"{method}.json"
    if not path.is_file():
        known = sorted(p.stem for p in GOLDEN.glob("*.json"))
        raise SystemExit(f"no golden fingerprint for method {method!r} ({path}); known: {', '.join(known)}")
    sys.path[:0] = [p for p in (str(ROOT), str(Path(__file__).resolve().parent)) if p not in sys.path]
    from golden import digest

    return digest(path)


def short_names_fingerprint(method: str) -> str | None:
    """The fingerprint today's record had when metrics had their short names (``accuracy``, not ``eval/accuracy``):
    the same file written by scripts/golden.py with each round's names mapped back. A page stamped before the names
    were grouped names that digest; it matches only if every value and every metric is still the same, so a rename
    alone leaves such a page current and any change of behaviour still fails it. None if the record cannot be read
    that way (not a golden record)."""
    sys.path[:0] = [p for p in (str(ROOT), str(Path(__file__).resolve().parent)) if p not in sys.path]
    from golden import dumps
    from raysplit.metrics import short_name

    record = json.loads((GOLDEN / f"{method}.json").read_text())
    if not isinstance(record.get("rounds"), list):
        return None
    record["rounds"] = [{(k if k == "round" else short_name(k)): v for k, v in r.items()} for r in record["rounds"]]
    return hashlib.sha256(dumps(record).encode()).hexdigest()[:12]


def _sections(text: str) -> list[tuple[str | None, int, int]]:
    """``(title, start, end)`` of the page's preamble (title None) and each ``## `` section."""
    starts = [(m.group(1).strip(), m.start()) for m in re.finditer(r"^## (.+)$", text, re.M)]
    bounds = [(None, 0)] + starts
    return [(t, s, bounds[i + 1][1] if i + 1 < len(bounds) else len(text)) for i, (t, s) in enumerate(bounds)]


def _find_section(text: str, section: str | None) -> tuple[int, int]:
    if section is None:
        return 0, len(text)
    hits = [(s, e) for t, s, e in _sections(text) if t is not None and t.startswith(section)]
    if len(hits) != 1:
        raise SystemExit(f"{len(hits)} sections start with {section!r} (need exactly one)")
    return hits[0]


PAIR = re.compile(r"\n*(?:^\*Stamp: .*\*\n)?^<!-- stamp: (\{.*\}) -->\n?", re.M)


def _strip(body: str, section: str | None) -> tuple[str, str]:
    """``body`` without the stamp of ``section`` (None: the page's) and its stale banner, and the page's stamp when
    it closes ``body`` (kept apart, to stay last)."""
    tail = ""
    m = list(PAIR.finditer(body))
    if m and m[-1].end() == len(body) and json.loads(m[-1].group(1)).get("section") is None:
        tail = body[m[-1].start():].strip("\n")
        body = body[:m[-1].start()]
    body = PAIR.sub(lambda x: "\n" if json.loads(x.group(1)).get("section") == section else x.group(0), body)
    if section is None:
        first = re.search(r"^## ", body, re.M)
        cut = first.start() if first else len(body)
        return STALE.sub("", body[:cut]) + body[cut:], ""
    heading, _, rest = body.partition("\n")
    first = re.search(r"^### |^<!-- stamp", rest, re.M)  # the section's own banner sits above its first subsection
    cut = first.start() if first else len(rest)
    return heading + "\n" + STALE.sub("", rest[:cut]) + rest[cut:], tail


def stamp(page: Path, section: str | None, methods: list[str], seeds: str, rounds: str, command: str,
          stale: str | None, commit: str | None = None, made_at: list[str] | None = None) -> None:
    text = page.read_text()
    start, end = _find_section(text, section)
    # the stamp names the full heading: an earlier stamp of this section is found by it, whatever prefix was given
    title = None if section is None else re.match(r"## (.+)", text[start:end]).group(1).strip()
    body, tail = _strip(text[start:end], title)
    body = re.sub(r"\n{3,}", "\n\n", body).rstrip("\n")
    commit = commit[:7] if commit else subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT,
                                                      capture_output=True, text=True).stdout.strip() or "unknown"
    from raysplit.runtime.devices import cpu_kind

    data = {"commit": commit, "date": datetime.date.today().isoformat(), "section": title, "machine": cpu_kind(),
            "methods": {m: (None if stale else fingerprint(m)) for m in methods}, "seeds": seeds, "rounds": rounds,
            "command": command, "stale": stale}
    if made_at:
        data["made_at"] = [c[:7] for c in made_at]
    shown = ", ".join(f"{m} (golden {f})" if f else m for m, f in data["methods"].items()) or "none"
    visible = (f"*Stamp: {'stale, ' if stale else ''}stamped at commit {commit} on {data['date']} ({data['machine']}); "
               f"methods: {shown}; seeds: {seeds}; rounds: {rounds}; command: `{command}`"
               + (f"; runs made at {', '.join(data['made_at'])}" if made_at else "") + ".*")
    if stale:
        lines = body.split("\n", 1)  # the banner goes under the page's title or the section's heading
        body = lines[0] + f"\n\n> **Stale:** {stale} (see the stamp at the end)." + (
            "\n" + lines[1] if len(lines) > 1 else "")
        body = re.sub(r"\n{3,}", "\n\n", body)
    body += f"\n\n{visible}\n<!-- stamp: {json.dumps(data, sort_keys=True)} -->\n"
    if tail:
        body += f"\n{tail}\n"
    if end < len(text):
        body += "\n"
    page.write_text(text[:start] + body + text[end:])
    print(f"stamped {page.relative_to(ROOT)}{' / ' + section if section else ''}")


HEX = re.compile(r"(?<![\w/.#-])[0-9a-f]{7,12}(?![\w-])")


def _commits(tokens: set[str]) -> set[str]:
    """Those of ``tokens`` that name a commit of this repository (git cat-file; none where git cannot tell, a
    shallow clone missing old commits)."""
    if not tokens:
        return set()
    try:
        out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, capture_output=True, text=True,
                             input="".join(f"{t}^{{commit}}\n" for t in sorted(tokens)), timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    lines = out.splitlines()
    return {t for t, line in zip(sorted(tokens), lines) if not line.endswith("missing") and " commit " in line}


def named_commits(text: str, is_commit=None) -> list[str]:
    """Commits of this repository a page's text names (outside its stamps) that its stamp does not: each section's
    prose is held to its own stamp (the page's where it has none), whose ``commit`` and ``made_at`` (the commits
    its runs were made at, where it was stamped later) must name every commit the text names (issue 73: commits in
    the text that differ from the stamp). A section under no stamp is not held."""
    is_commit = is_commit or _commits
    stamps = [json.loads(m.group(1)) for m in STAMP.finditer(text)]
    page = next((d for d in stamps if d.get("section") is None), None)
    out = []
    for title, s, e in _sections(text):
        own = next((d for d in stamps if title is not None and d.get("section") == title), page)
        if own is None:
            continue
        prose = PAIR.sub("\n", text[s:e])
        tokens = {t for t in HEX.findall(prose) if re.search(r"[a-f]", t) and re.search(r"\d", t)}
        known = {str(c)[:7] for c in [own.get("commit"), *own.get("made_at", [])] if c}
        for t in sorted(is_commit(tokens)):
            if t[:7] not in known:
                out.append(f"{title or '(the page)'}: the text names commit {t}, its stamp {own.get('commit')}"
                           + (f" (made at {', '.join(own['made_at'])})" if own.get("made_at") else "")
                           + ": restamp with --made-at, or correct the text")
    return out


def check() -> int:
    pages = sorted({p for pattern in PAGES for p in ROOT.glob(pattern)})
    changed, stale, stamped = [], [], 0
    for page in pages:
        text = page.read_text()
        rel = page.relative_to(ROOT)
        sections = _sections(text)
        changed += [f"{rel} / {line}" for line in named_commits(text)]  # every stamped page's text held to its stamps
        for m in STAMP.finditer(text):
            data = json.loads(m.group(1))
            title = data.get("section")
            head = next((text[s:e] for t, s, e in sections if t == title), "")[:2000]
            where = f"{rel}" + (f" / {title}" if title else "")
            stamped += 1
            if data.get("stale"):
                if not STALE.search(head):
                    changed.append(f"{where}: stamped stale but carries no 'Stale' line at its top")
                stale.append(f"{where}: {data['stale']}")
                continue
            for method, fp in data["methods"].items():
                now = fingerprint(method)
                if fp != now and fp != short_names_fingerprint(method):
                    changed.append(f"{where}: {method} changed since the page was made at {data['commit']} "
                                   f"(golden {fp} then, {now} now): rerun `{data['command']}` and restamp")
    for line in stale:
        print(f"stale on purpose: {line}")
    for line in changed:
        print(f"CHANGED: {line}")
    print(f"check-results: {stamped} stamps, {len(stale)} stale on purpose, {len(changed)} out of date")
    if stamped == 0:
        print("no stamps found: failing")
        return 1
    return 1 if changed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    st = sub.add_parser("stamp", help="write (or rewrite) a page's or a section's stamp")
    st.add_argument("page", type=Path)
    st.add_argument("--section", help="the '## ' heading the stamp closes (its beginning); default: the page")
    st.add_argument("--methods", default="", help="comma-separated algorithm names the numbers come from")
    st.add_argument("--seeds", required=True)
    st.add_argument("--rounds", required=True)
    st.add_argument("--command", required=True, help="the committed command that made the numbers")
    st.add_argument("--stale", help="why the numbers are stale on purpose (made before a change, not rerun)")
    st.add_argument("--commit", help="the commit the runs were made at, where it is not HEAD (a study run from a "
                    "worktree, or stamped after later commits); default HEAD")
    st.add_argument("--made-at", default="", help="comma-separated commits the runs were made at, where the text "
                    "names them and they are not --commit (runs of several commits, a page restamped later)")
    sub.add_parser("check", help="name every stamped page whose methods changed since it was made")
    args = ap.parse_args(argv)
    if args.what == "stamp":
        for c in [args.commit, *args.made_at.split(",")]:
            if c and not re.fullmatch(r"[0-9a-f]{7,40}", c):
                ap.error(f"--commit/--made-at {c!r}: not a commit hash (7 to 40 hex digits)")
    if args.what == "check":
        return check()
    stamp(args.page.resolve(), args.section, [m for m in args.methods.split(",") if m], args.seeds, args.rounds,
          args.command, args.stale, args.commit, [c for c in args.made_at.split(",") if c])
    return 0


if __name__ == "__main__":
    sys.exit(main())
