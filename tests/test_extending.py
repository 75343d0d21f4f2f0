"""docs/extending.md runs: its code blocks, executed in order, define the page's two methods (SplitFed V2 with a
decaying label smoothing in a server rule's own step; SplitFed V1 with FedProx's proximal term and its client rule),
and they compute what raysplit's own ``sflv2`` (without smoothing) and ``sflv1_prox`` compute, bit for bit, so a page
that drifts from the code (a missing hook, a missing ``__init__``, a renamed name) fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import make_config
import raysplit.experiment as experiment
from raysplit.algorithms import ALGORITHMS
from raysplit.metrics import WALL_CLOCK

PAGE = Path(__file__).resolve().parent.parent / "docs" / "extending.md"


@pytest.fixture
def page(monkeypatch) -> dict:
    """The page's blocks executed in order, in one namespace; what they register is taken back afterwards."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 5, f"docs/extending.md should hold its methods in 5 python blocks, found {len(blocks)}"
    monkeypatch.setitem(ALGORITHMS, "sflv1_prox", ALGORITHMS["sflv1_prox"])  # the page's @register replaces it
    monkeypatch.setitem(ALGORITHMS, "sflv2_smooth", None)  # a name of the page's: deleted again after the test
    out: dict = {"__name__": "docs_extending"}
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), out)
    return out


def run(tmp_path, where: str, algorithm: dict) -> dict:
    over = {"runtime.backend": "local", "tracking.enabled": False, "train.rounds": 2, "algorithm": algorithm}
    metrics = experiment.run_experiment(make_config(tmp_path / where, None, **over))
    return {k: v for k, v in metrics.items() if k not in WALL_CLOCK and k != "run_id"}


def test_the_pages_client_rule_method_is_sflv1_prox_bit_for_bit(tmp_path, page):
    package = ALGORITHMS["sflv1_prox"]
    assert package is page["SplitFedProx"]  # registered by the page (the fixture restores the package's)
    from_page = run(tmp_path, "page", {"name": "sflv1_prox", "mu": 0.5})
    import raysplit.algorithms.sflprox as sflprox

    ALGORITHMS["sflv1_prox"] = sflprox.SplitFedProx
    assert from_page == run(tmp_path, "package", {"name": "sflv1_prox", "mu": 0.5}) and from_page["train/loss"] > 0


def test_the_pages_server_rule_method_is_sflv2_without_smoothing_and_differs_with_it(tmp_path, page):
    assert ALGORITHMS["sflv2_smooth"] is page["SmoothSplitFed"]
    plain = run(tmp_path, "sflv2", {"name": "sflv2"})
    assert run(tmp_path, "eps0", {"name": "sflv2_smooth", "smoothing": 0.0}) == plain  # its step, the plain loss
    smoothed = run(tmp_path, "eps", {"name": "sflv2_smooth", "smoothing": 0.2})
    assert smoothed["method/smoothing"] == pytest.approx(0.2 * (1 - 1 / 2))  # round 1 of 2: decayed, logged
    assert smoothed["train/loss"] > plain["train/loss"]  # a smoothed target's cross-entropy cannot reach 0
    assert smoothed["eval/accuracy"] != plain["eval/accuracy"] or smoothed["eval/loss"] != plain["eval/loss"]
