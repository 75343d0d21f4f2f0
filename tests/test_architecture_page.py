"""docs/architecture.md is checked against the code: its table of the runtime's rooms names every runtime file,
each where it is, and nothing that is not there; the page's walk of a run's config names modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
RUNTIME = ROOT / "raysplit" / "runtime"


def rooms_table() -> dict[str, str]:
    """The runtime files the page's table of rooms lists: path under raysplit/runtime -> its room."""
    text = PAGE.read_text().split("## The rooms of the runtime", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("room", "---"):
            continue
        room, files = cells[0], re.findall(r"`([\w/]+\.py)`", cells[1])
        folder = ""
        for f in files:
            if "/" in f:
                folder = f.rsplit("/", 1)[0] + "/"
                out[f] = room
            else:
                out[folder + f] = room
    return out


def test_the_rooms_table_lists_every_runtime_file_where_it_is():
    listed = rooms_table()
    actual = {str(p.relative_to(RUNTIME)) for p in RUNTIME.rglob("*.py") if p.name != "__init__.py"}
    assert set(listed) == actual, (f"on the page, not in the code: {sorted(set(listed) - actual)}; in the code, not on "
                                   f"the page: {sorted(actual - set(listed))}")
    for path, room in listed.items():  # a folder's files are its room's; the shared pieces lie at the top
        assert room == (path.split("/")[0] if "/" in path else "shared"), (path, room)


def test_the_config_walk_names_modules_that_exist():
    text = PAGE.read_text().split("## A run's config through the code", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", text))
    assert named, "the walk names no module"
    missing = [m for m in named if not any(p.exists() for p in (ROOT / "raysplit" / m, RUNTIME / m, ROOT / m))]
    assert not missing, missing
