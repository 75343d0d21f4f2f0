"""The Markdown the generated pages share (scripts/claims.py, scripts/figures.py): GitHub's heading anchors and a
part of a page between two markers."""

from __future__ import annotations

import re


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, characters other than letters, digits, underscore,
    hyphen and space dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (fenced code skipped), repeats numbered as GitHub does."""
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            a = slug(line.lstrip("#"))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def between(page: str, name: str, begin: str, end: str, body: str) -> str:
    """``page`` (named ``name`` in the error) with the text between ``begin`` and ``end`` replaced by ``body``."""
    if begin not in page or end not in page:
        raise SystemExit(f"{name}: the markers {begin!r} and {end!r} are missing")
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"
