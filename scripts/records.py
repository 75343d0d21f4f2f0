"""The study runs' committed records (docs/results/records/<folder>/<run>.json, written by docs/results/_runs.py as
each run finishes: its final metrics, the evaluated curve, its config digest, the commit and the machine; issue 73,
item 6) and the tables the result pages generate from them::

    python scripts/records.py write    # rewrite every records table of the result pages from the records
    python scripts/records.py check    # (make check-results) every record validates, and every records table of
                                       # a result page is what its records give: each number it shows traces
                                       # to a record

A page generates a table between ``<!-- records table: begin FOLDER [METRIC ...] -->`` and
``<!-- records table: end -->``: one row per record of records/FOLDER (by label), the run's final value of each
METRIC (default ``eval/accuracy``; a metric in [0, 1] named ``accuracy`` shown in %), its last evaluated round, its
config digest, commit and machine.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
RECORDS = RESULTS / "records"
FIELDS = ("record", "experiment", "label", "config", "overrides", "config_digest", "commit", "machine", "finished",
          "result")
BEGIN = re.compile(r"<!-- records table: begin ([\w.-]+)((?: [\w/.-]+)*) -->")
END = "<!-- records table: end -->"


def load(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def invalid(path: Path) -> list[str]:
    """What is wrong with one record file (nothing: an empty list)."""
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return [f"{name}: not a JSON record ({e})"]
    out = [f"{name}: no {k}" for k in FIELDS if k not in rec]
    if out:
        return out
    res = rec["result"]
    if rec.get("kind", "run") == "script":  # a script's own computation: its result as the script keeps it
        pass
    elif not isinstance(res, dict) or not {"eval/accuracy", "accuracy", "eval/perplexity"} & set(res):
        out.append(f"{name}: its result has no final accuracy (nor a language model's perplexity)")
    elif not all(isinstance(pt, list) and len(pt) in (2, 3) for pt in res.get("curve", [])):
        out.append(f"{name}: its curve is not [(round, [time/sim,] accuracy), ...]")
    if not re.fullmatch(r"[0-9a-f]{12}", str(rec["config_digest"])):
        out.append(f"{name}: config_digest {rec['config_digest']!r} is not a 12-digit digest")
    return out


def _value(res: dict, metric: str) -> str:
    x = res.get(metric)
    if x is None and metric == "eval/accuracy":
        x = res.get("accuracy")  # a cache written before the metric names were grouped
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "diverged"
    return f"{100 * x:.2f}" if metric.endswith("accuracy") and 0 <= x <= 1 else f"{x:.4g}"


def table(folder: str, metrics: list[str]) -> str:
    """The records table of records/``folder``."""
    recs = sorted(load(RECORDS / folder), key=lambda r: r["label"])
    heads = [m + (" (%)" if m.endswith("accuracy") else "") for m in metrics]
    lines = ["| run | " + " | ".join(heads) + " | last round | config digest | commit | machine |",
             "|---" * (len(metrics) + 5) + "|"]
    for r in recs:
        res = r["result"]
        last = res["curve"][-1][0] if res.get("curve") else "-"
        lines.append(f"| {r['label']} | " + " | ".join(_value(res, m) for m in metrics)
                     + f" | {last} | {r['config_digest']} | {r['commit']} | {r['machine'].split(':')[0]} |")
    return "\n".join(lines)


def generated(text: str) -> str:
    """``text`` with every records table rewritten from its records."""
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        end = text.find(END, m.end())
        if end < 0:
            raise ValueError(f"records table {m.group(1)}: no end marker")
        metrics = m.group(2).split() or ["eval/accuracy"]
        out += [text[pos:m.end()], "\n", table(m.group(1), metrics), "\n"]
        pos = end
    return "".join(out) + text[pos:]


def pages() -> list[Path]:
    return sorted(RESULTS.glob("*.md")) + sorted((RESULTS / "notes").glob("*.md"))


def problems(result_pages: list[Path] | None = None) -> list[str]:
    """Every record that does not validate, and every records table of the result pages that is not what its
    records give."""
    out = [p for f in sorted(RECORDS.glob("*/*.json")) for p in invalid(f)]
    for page in result_pages if result_pages is not None else pages():
        name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
        text = page.read_text()
        for m in BEGIN.finditer(text):
            if not (RECORDS / m.group(1)).is_dir():
                out.append(f"{name}: records table of {m.group(1)}: no folder records/{m.group(1)}")
        try:
            want = generated(text)
        except ValueError as e:
            out.append(f"{name}: {e}")
            continue
        if want != text:
            out.append(f"{name}: a records table is not what its records give (a number that does "
                       "not trace to a record, or records added since: scripts/records.py write)")
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("write", "check"):
        print(__doc__)
        return 2
    if argv[0] == "write":
        for page in pages():
            text = page.read_text()
            if BEGIN.search(text):
                page.write_text(generated(text))
        return 0
    found = problems()
    for p in found:
        print(p, file=sys.stderr)
    n = len(list(RECORDS.glob("*/*.json")))
    print(f"records: {n} run record(s) under {RECORDS.relative_to(ROOT)}, {len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
