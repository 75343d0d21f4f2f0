"""Shared by the results scripts: run one raysplit experiment in a fresh interpreter, cached as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cached(code: str, out: Path, what: str) -> dict:
    """Run ``code`` (which prints one ``RESULT{json}`` line) with this interpreter in the repository root and
    return the parsed result; reuse ``out`` when it exists, write it otherwise."""
    if out.is_file():
        return json.loads(out.read_text())
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if not line:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(line[-1][6:])
    out.write_text(json.dumps(res))
    return res
