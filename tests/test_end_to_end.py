"""Every algorithm end to end through Ray actors and MLflow; resume; failure handling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from helpers import Touch, crashed_run, make_config
from raysplit.algorithms import ALGORITHMS
from raysplit.config import ConfigError
from raysplit.experiment import run_experiment

BASELINES = ["splitnn", "psl", "sflv1", "sflv2", "fedavg"]
CYCLESL = ["sglr", "cyclepsl", "cyclesfl", "cyclesglr"]


def test_baselines_registered():
    assert set(BASELINES + CYCLESL) <= set(ALGORITHMS)


@pytest.mark.parametrize("algorithm", BASELINES + CYCLESL)
def test_algorithm_two_rounds_logs_mlflow(tmp_path, mlflow_uri, algorithm):
    """Local backend (the same hosts as in Ray actors: tests/test_golden.py holds both to one fingerprint)."""
    cfg = make_config(tmp_path, mlflow_uri, **{"algorithm.name": algorithm, "tracking.experiment": "e2e",
                                               "train.local_steps": 10, "runtime.backend": "local"})
    final = run_experiment(cfg)
    client = MlflowClient(mlflow_uri)
    run = client.get_run(final["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["algorithm.name"] == algorithm
    hist = client.get_metric_history(final["run_id"], "eval/accuracy")
    assert [h.step for h in hist] == [0, 1]
    # trained something on 10-class digits: well above chance (0.1) after 2 rounds of 4 clients x 10 steps
    assert hist[-1].value > 0.25
    for key in ("train/loss", "time/sim", "comm/bytes_up", "comm/bytes_down", "compute/client_flops", "eval/f1_macro",
                "eval/mcc",
                "eval/performance_gap", "eval/backward_transfer"):
        assert key in run.data.metrics, key
    assert run.data.metrics["comm/bytes_up"] > 0 and run.data.metrics["compute/client_flops"] > 0
    if algorithm != "fedavg":
        assert run.data.metrics["compute/server_flops"] > 0 and run.data.metrics["train/grad_norm_mean"] > 0
    arts = {a.path for a in client.list_artifacts(final["run_id"])}
    assert {"config.yaml", "partition.png", "curves.png", "label_accuracy.png", "checkpoint.pt",
            "client_rounds.csv", "client_accounting.csv"} <= arts
    # per-client, per-round accounting: every sampled client of every round has a row that adds up
    import csv

    local = client.download_artifacts(final["run_id"], "client_rounds.csv", str(tmp_path))
    rows = list(csv.DictReader(open(local)))
    assert sorted({int(r["round"]) for r in rows}) == [0, 1]
    assert len(rows) == 2 * cfg.data.num_clients  # full participation
    last = [r for r in rows if r["round"] == "1"]
    assert sum(float(r["bytes_up"]) for r in last) == pytest.approx(run.data.metrics["comm/bytes_up"])


def test_resume_equals_uninterrupted(ray_session, tmp_path, mlflow_uri):
    over = {"train.rounds": 4, "tracking.checkpoint_every": 2, "train.optimizer.name": "adam",
            "train.optimizer.lr": 0.003, "tracking.experiment": "resume"}
    # the uninterrupted run in process (the Ray backend gives its numbers: tests/test_golden.py)
    full = run_experiment(make_config(tmp_path / "a", mlflow_uri, **over, **{"runtime.backend": "local"}))
    cfg = make_config(tmp_path / "b", mlflow_uri, **over)
    crashed = crashed_run(cfg, mlflow_uri)  # the checkpoint of round index 1 exists; round index 2 is lost with it
    client = MlflowClient(mlflow_uri)
    assert crashed.info.status == "FAILED"
    resumed = run_experiment(cfg, resume_run_id=crashed.info.run_id)
    assert resumed["run_id"] == crashed.info.run_id
    assert client.get_run(crashed.info.run_id).info.status == "FINISHED"
    for k in ("eval/accuracy", "eval/loss", "eval/f1_macro", "train/loss", "time/sim", "comm/bytes_up"):
        assert resumed[k] == pytest.approx(full[k], rel=1e-6), k
    hist = client.get_metric_history(crashed.info.run_id, "eval/accuracy")
    assert sorted(h.step for h in hist) == [0, 1, 2, 3]  # round index 2, logged before the crash, once
    for key in ("train/loss", "time/sim"):
        assert sorted(h.step for h in client.get_metric_history(crashed.info.run_id, key)) == [0, 1, 2, 3], key
    final = [h.value for h in hist if h.step == 3]
    assert final == [pytest.approx(full["eval/accuracy"])]


def test_nonfinite_loss_stops_naming_round_and_client_and_marks_failed(ray_session, tmp_path, mlflow_uri):
    cfg = make_config(tmp_path, mlflow_uri, **{"train.optimizer.lr": 1e6, "train.rounds": 30,
                                               "tracking.experiment": "nan"})
    from raysplit.runtime import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match=r"round \d+, client \d+"):
        run_experiment(cfg)
    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("nan").experiment_id])
    assert runs[0].info.status == "FAILED"
    assert "NonFiniteLossError" in runs[0].data.tags["raysplit.error"]


def test_config_and_data_errors_fail_before_any_actor(tmp_path, mlflow_uri, monkeypatch):
    import raysplit.runtime.driver.api as api

    def no_actors(*a, **k):
        raise AssertionError("runtime started despite a bad config")

    monkeypatch.setattr(api.Runtime, "__init__", no_actors)
    with pytest.raises(ConfigError, match="model.cut.*conv1"):
        run_experiment(make_config(tmp_path, mlflow_uri, **{"model.cut": "conv9"}))
    with pytest.raises(ConfigError, match="unknown model.name"):
        run_experiment(make_config(tmp_path, mlflow_uri, **{"model.name": "nope"}))
    from raysplit.data import DatasetNotFoundError

    with pytest.raises(DatasetNotFoundError, match=str(tmp_path)):
        run_experiment(make_config(tmp_path, mlflow_uri, **{"data.dataset": "cifar10", "data.root": str(tmp_path)}))
    with pytest.raises(ConfigError, match="eval.mode=global"):
        run_experiment(make_config(tmp_path, mlflow_uri, **{"algorithm.name": "psl", "eval.mode": "global"}))


def test_missing_resources_fail_at_once_naming_them(ray_session, tmp_path, mlflow_uri):
    from raysplit.runtime.ray.backend import ResourceError

    cfg = make_config(tmp_path, mlflow_uri, **{"runtime.server.num_gpus": 1, "runtime.server.resources":
                                               {"server": 1}, "tracking.experiment": "res"})
    with pytest.raises(ResourceError) as e:
        run_experiment(cfg)
    assert "GPU" in str(e.value) and "server" in str(e.value)
    assert MlflowClient(mlflow_uri).get_experiment_by_name("res") is None  # refused before any MLflow run


def test_same_seed_same_metrics(ray_session, tmp_path, mlflow_uri):
    # the second run in process (issue 51: a second Ray run cost CI 15 s): a run through Ray that equals it is
    # reproducible, and every round-based method's Ray run equals its in-process one bit for bit
    # (tests/test_direct_steps.py)
    a = run_experiment(make_config(tmp_path / "a", mlflow_uri, **{"algorithm.name": "sflv1"}))
    b = run_experiment(make_config(tmp_path / "b", mlflow_uri, **{"algorithm.name": "sflv1",
                                                                   "runtime.backend": "local"}))
    for k in ("eval/accuracy", "eval/loss", "train/loss", "time/sim", "comm/bytes_up"):
        assert a[k] == b[k], k
    c = run_experiment(make_config(tmp_path / "c", mlflow_uri, **{"algorithm.name": "sflv1", "seed": 1,
                                                                   "runtime.backend": "local"}))
    assert c["eval/loss"] != a["eval/loss"]


def test_sampling_stream_identical_across_algorithms():
    from raysplit.experiment import sample_stream

    s = sample_stream(3, 100, 5, 10)
    assert s.shape == (10, 5) and all(len(set(r)) == 5 for r in s)
    assert np.array_equal(s, sample_stream(3, 100, 5, 10))
    assert not np.array_equal(s, sample_stream(4, 100, 5, 10))


def test_sflv1_with_plain_sgd_equals_fedavg(tmp_path, mlflow_uri):
    """Averaged per-client server copies + FedAvg of client parts is FedAvg of the whole model."""
    over = {"runtime.backend": "local", "train.rounds": 3, "tracking.experiment": "equiv"}
    a = run_experiment(make_config(tmp_path / "a", mlflow_uri, **{**over, "algorithm.name": "sflv1"}))
    b = run_experiment(make_config(tmp_path / "b", mlflow_uri, **{**over, "algorithm.name": "fedavg"}))
    assert a["eval/loss"] == pytest.approx(b["eval/loss"], rel=1e-5) and a["eval/accuracy"] == b["eval/accuracy"]


@pytest.mark.parametrize("alg,test_fraction", [("sflv2", 0.2), ("gas", 0.2), ("sflv2", 0.0)])
def test_checkpoints_load_weights_only_and_a_tampered_or_truncated_one_names_the_file(tmp_path, mlflow_uri, alg,
                                                                                     test_fraction):
    from raysplit.experiment import load_checkpoint_file

    # test_fraction 0: clients hold empty test-index arrays, whose data pickle writes as bytes() (a resumed sweep of
    # the second Hydra study once failed on exactly that)
    cfg = make_config(tmp_path, mlflow_uri, **{"algorithm.name": alg, "train.rounds": 2, "runtime.backend": "local",
                                               "tracking.checkpoint_every": 1, "tracking.experiment": "ckpt",
                                               "data.test_fraction": test_fraction})
    out = run_experiment(cfg)
    path = Path(MlflowClient(mlflow_uri).get_run(out["run_id"]).data.tags["raysplit.checkpoint"])
    ck = load_checkpoint_file(path)  # a genuine checkpoint (GAS's holds modules and numpy generators) loads
    assert ck["round"] == 1 and "runtime" in ck
    marker = tmp_path / "ran"
    tampered = tmp_path / "tampered.pt"
    torch.save({**ck, "extra": Touch(marker)}, tampered)
    with pytest.raises(ConfigError, match="refusing to load") as e:
        load_checkpoint_file(tampered)
    assert str(tampered) in str(e.value) and not marker.exists()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="unreadable") as e:
        load_checkpoint_file(truncated)
    assert str(truncated) in str(e.value)
