"""The Python API, for notebooks and scripts: ``raysplit.run``, ``raysplit.sweep`` and ``raysplit.compare`` do what
``raysplit run``, ``raysplit sweep`` and ``raysplit compare`` do, with the same validation and errors (a bad key
raises the :class:`~raysplit.errors.ConfigError` the command line prints), and return what they found as Python
objects: a run's id, its resolved config and its per-round metrics as a pandas DataFrame (pandas comes with
MLflow). A run shows the command line's progress bar, drawn as a notebook widget inside Jupyter (``tqdm.auto``).

Overrides are the command line's dotted keys, given as a dict or as keyword arguments
(``raysplit.run("configs/digits.yaml", {"train.rounds": 5})``, ``raysplit.run(path, **{"train.rounds": 5})``);
in a keyword, ``__`` stands for the dot (``train__rounds=5``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd


def _overrides(overrides: dict | None, keywords: dict) -> dict[str, Any]:
    out = dict(overrides or {})
    out.update({k.replace("__", "."): v for k, v in keywords.items()})
    return out


def _config(config, overrides: dict):
    """An :class:`~raysplit.config.ExperimentConfig` from a path, a raw dict or a config, with ``overrides``."""
    from raysplit.config import ExperimentConfig, apply_overrides, load_config, validate

    if isinstance(config, ExperimentConfig):
        return validate(apply_overrides(config.model_dump(mode="json"), overrides)) if overrides else config
    if isinstance(config, dict):
        return validate(apply_overrides(config, overrides) if overrides else config)
    if isinstance(config, (str, Path)):
        return load_config(config, overrides)
    raise TypeError(f"raysplit.run: config must be a path, a dict or an ExperimentConfig, not {type(config).__name__}")


@dataclass
class RunResult:
    """A finished run: its MLflow ``run_id``, the ``config`` it ran with (resolved: every default filled in), its
    ``final`` metrics and one row of ``rounds`` per round, indexed by ``round`` counted from 0 as everywhere else
    (docs/usage.md)."""

    run_id: str
    config: Any
    final: dict
    rounds: pd.DataFrame

    def __repr__(self) -> str:
        shown = {k: self.final[k] for k in ("eval/accuracy", "eval/loss", "time/sim") if k in self.final}
        return (f"RunResult(run_id={self.run_id!r}, algorithm={self.config.algorithm_name!r}, "
                f"rounds={len(self.rounds)}, final={shown})")


def run(config, overrides: dict | None = None, **keywords) -> RunResult:
    """Run one experiment (``raysplit run``) and return it as a :class:`RunResult`."""
    from raysplit.experiment import run_experiment

    cfg = _config(config, _overrides(overrides, keywords))
    rows: list[dict] = []
    final = run_experiment(cfg, on_round=lambda rnd, metrics: rows.append({"round": rnd, **metrics}))
    return RunResult(final["run_id"], cfg, {k: v for k, v in final.items() if k != "run_id"},
                     pd.DataFrame(rows).set_index("round") if rows else pd.DataFrame())


@dataclass
class Comparison:
    """An MLflow experiment's runs (``raysplit compare``): ``table``, the text the command prints, and ``runs``,
    one row per run."""

    table: str
    runs: pd.DataFrame

    def __repr__(self) -> str:
        return self.table

    def __str__(self) -> str:
        return self.table


def compare(experiment: str, tracking_uri: str | None = None, metric: str = "eval/accuracy",
            plot: str | None = None, against: str | None = None) -> Comparison:
    """The runs of an MLflow experiment (``raysplit compare``; ``plot``: a PNG of ``metric`` per round)."""
    from raysplit.comparison import comparison

    table, rows = comparison(experiment, tracking_uri, metric, plot, against)  # one read of the store
    return Comparison(table, pd.DataFrame([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]))


def sweep(path: str | Path, overrides: dict | None = None, **keywords) -> pd.DataFrame:
    """A Ray Tune sweep from a sweep YAML (``raysplit sweep``): one row per trial, with its configuration and its
    last reported metrics (Tune's own table)."""
    from raysplit.tuning import run_sweep

    extra = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in _overrides(overrides, keywords).items()]
    return run_sweep(str(path), extra).get_dataframe()
