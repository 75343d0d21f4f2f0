"""docs/extending.md runs: its code blocks, executed in order, define the page's method (SplitFed V1 with FedProx's
proximal term and its client rule), and that method computes what raysplit's own ``sflv1_prox`` computes, bit for
bit, so a page that drifts from the code (a missing hook, a missing ``__init__``, a renamed name) fails here."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import make_config
import raysplit.experiment as experiment
from raysplit.algorithms import ALGORITHMS
from raysplit.metrics import WALL_CLOCK

PAGE = Path(__file__).resolve().parent.parent / "docs" / "extending.md"


def test_the_pages_method_runs_and_is_sflv1_prox_bit_for_bit(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 3, f"docs/extending.md should hold the method in 3 python blocks, found {len(blocks)}"
    package = ALGORITHMS["sflv1_prox"]
    monkeypatch.setitem(ALGORITHMS, "sflv1_prox", package)  # the page's @register replaces it; restored after
    page: dict = {"__name__": "docs_extending"}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), page)
    assert ALGORITHMS["sflv1_prox"] is page["SplitFedProx"] is not package

    def run(where):
        over = {"runtime.backend": "local", "tracking.enabled": False, "train.rounds": 2,
                "algorithm": {"name": "sflv1_prox", "mu": 0.5}}
        metrics = experiment.run_experiment(make_config(tmp_path / where, None, **over))
        return {k: v for k, v in metrics.items() if k not in WALL_CLOCK and k != "run_id"}

    from_page = run("page")
    ALGORITHMS["sflv1_prox"] = package
    assert from_page == run("package") and from_page["train/loss"] > 0
