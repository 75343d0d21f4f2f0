"""eval.validation: the clients' held-out splits evaluated beside the global test set, model selection on them, and
the early stop the results scripts read from a recorded validation curve (docs/results/_runs.early_stop)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from helpers import make_config
from raysplit.algorithms.ampere import Ampere
from raysplit.config import ConfigError
from raysplit.experiment import prepare, run_experiment
from raysplit.reporting import best_validated

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "results"))
import _runs  # noqa: E402

SFL = {"algorithm.name": "sflv1", "runtime.backend": "local", "train.rounds": 4, "eval.mode": "global"}


def test_validation_is_the_held_out_evaluation_and_leaves_training_alone(tmp_path, mlflow_uri):
    plain = run_experiment(make_config(tmp_path / "a", mlflow_uri, **SFL, **{"tracking.experiment": "val"}))
    val = run_experiment(make_config(tmp_path / "b", mlflow_uri, **SFL,
                                     **{"tracking.experiment": "val", "eval.validation": True}))
    held = run_experiment(make_config(tmp_path / "c", mlflow_uri, **{
        **SFL, "tracking.experiment": "val", "eval.mode": "clients", "eval.clients": "all"}))
    # the same splits through the same (aggregated) model as eval.mode=clients with every client
    assert val["eval/validation_accuracy"] == held["eval/accuracy"]
    assert val["eval/validation_loss"] == pytest.approx(held["eval/loss"], rel=1e-12)
    # evaluating them changes nothing the run trains or tests
    for k in ("train/loss", "eval/accuracy", "eval/loss", "comm/bytes_up", "time/sim"):
        assert val[k] == plain[k], k
    assert "eval/validation_accuracy" not in plain and "summary/best_validation_round" not in plain
    client = MlflowClient(mlflow_uri)
    hist = {k: {m.step: m.value for m in client.get_metric_history(val["run_id"], k)}
            for k in ("eval/validation_accuracy", "eval/accuracy")}
    assert sorted(hist["eval/validation_accuracy"]) == [0, 1, 2, 3]
    best = max(hist["eval/validation_accuracy"].values())
    first = min(r for r, v in hist["eval/validation_accuracy"].items() if v == best)
    logged = client.get_run(val["run_id"]).data.metrics
    assert logged["summary/best_validation_round"] == first == val["summary/best_validation_round"]
    assert logged["summary/accuracy_at_best_validation"] == hist["eval/accuracy"][first]


@pytest.mark.parametrize("over, key", [({"eval.mode": "clients"}, "eval.mode=global"),
                                       ({"data.test_fraction": 0.0}, "data.test_fraction"),
                                       ({"algorithm.name": "psl", "eval.mode": "auto"}, "eval.mode=global")])
def test_validation_refused_where_it_cannot_work(tmp_path, mlflow_uri, over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        prepare(make_config(tmp_path, mlflow_uri, **{**SFL, "eval.validation": True, **over}))


def test_best_validated_is_the_first_best_and_the_test_metric_there():
    curves = {"validation_accuracy": [(0, 0.5), (1, 0.7), (2, 0.7), (3, 0.6)],
              "accuracy": [(0, 0.4), (1, 0.65), (2, 0.8), (3, 0.9)]}
    assert best_validated(curves, False) == {"summary/best_validation_round": 1,
                                             "summary/accuracy_at_best_validation": 0.65}
    lm = {"validation_perplexity": [(0, 30.0), (1, 20.0), (2, 25.0)], "perplexity": [(0, 31.0), (1, 22.0), (2, 21.0)]}
    assert best_validated(lm, True) == {"summary/best_validation_round": 1, "summary/perplexity_at_best_validation": 22.0}
    assert best_validated({"accuracy": [(0, 0.5)]}, False) == {}


def test_early_stop_is_amperes_patience_rule():
    val = [0.50, 0.60, 0.60, 0.58, 0.61, 0.59, 0.60, 0.61, 0.55, 0.70]
    res = {"history": [{"round": r + 1, "eval/validation_accuracy": v} for r, v in enumerate(val)],
           "curve": [[r + 1, 0.0, 0.1 * r] for r in range(len(val))]}
    for patience in (1, 2, 3, 4, 20):
        rule = SimpleNamespace(best=-1.0, bad=0, params=SimpleNamespace(patience=patience))
        stop = next((r + 1 for r, v in enumerate(val) if not Ampere._improved(rule, v)), len(val))
        best_round, stop_round, acc = _runs.early_stop(res, patience)
        assert stop_round == stop
        seen = val[:stop_round]
        assert best_round == seen.index(max(seen)) + 1 and acc == pytest.approx(0.1 * (best_round - 1))
    assert _runs.early_stop(res, 3)[:2] == (5, 8)  # 0.61 at round 5; rounds 6-8 not above it
    with pytest.raises(ValueError, match="eval.validation"):
        _runs.early_stop({"curve": res["curve"], "history": [{"round": 1}]}, 3)
