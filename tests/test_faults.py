"""Fault survival (runtime.max_retries): a dead client or server actor is replaced, the last round boundary
restored and the round redone, so the finished run equals an uninterrupted one and logs every round once; past
the retry budget the run fails naming the actor, its node and the round, and is marked FAILED."""

from __future__ import annotations

import threading
import time

import pytest
import ray
from mlflow.tracking import MlflowClient

import raysplit.experiment as experiment
from conftest import make_config
from raysplit.errors import ActorFailure
from raysplit.experiment import run_experiment


@pytest.fixture
def backends(monkeypatch):
    """The backends the runs of a test make (to kill their actors)."""
    made = []
    orig = experiment.make_backend

    def capture(rcfg):
        made.append(orig(rcfg))
        return made[-1]

    monkeypatch.setattr(experiment, "make_backend", capture)
    return made


def _curves(mlflow_uri, run_id, keys=("accuracy", "train_loss", "sim_time", "bytes_up")):
    client = MlflowClient(mlflow_uri)
    out = {}
    for k in keys:
        hist = sorted(client.get_metric_history(run_id, k), key=lambda h: h.step)
        out[k] = [(h.step, h.value) for h in hist]
    return out


@pytest.mark.parametrize("algorithm,victim", [("sflv2", "client"), ("psl", "server"), ("gas", "client")])
def test_a_dead_actor_is_replaced_and_the_run_equals_an_uninterrupted_one(ray_session, tmp_path, mlflow_uri,
                                                                          backends, algorithm, victim):
    over = {"algorithm.name": algorithm, "train.rounds": 4, "tracking.experiment": f"faults-{algorithm}",
            "eval.every": 1}
    if algorithm == "psl":
        over["eval.mode"] = "clients"
    if algorithm == "gas":
        over.update({"train.participation.count": 2, "data.num_clients": 4, "clock.profile": "uniform"})
    full = run_experiment(make_config(tmp_path / "a", mlflow_uri, **over))
    killed = []

    def kill(rnd, m):
        if rnd == 1 and not killed:
            b = backends[-1]
            ray.kill(b.server if victim == "server" else b.workers[0])
            killed.append(rnd)

    hit = run_experiment(make_config(tmp_path / "b", mlflow_uri, **over), on_round=kill)
    assert killed == [1]
    run = MlflowClient(mlflow_uri).get_run(hit["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["raysplit.actor_restarts"] == "1"
    assert "died" in run.data.tags["raysplit.restart_1"]
    got, want = _curves(mlflow_uri, hit["run_id"]), _curves(mlflow_uri, full["run_id"])
    assert got == want  # every round logged once, every value as in the uninterrupted run
    assert [s for s, _ in got["train_loss"]] == [0, 1, 2, 3]


def test_an_actor_killed_mid_round_is_survived(ray_session, tmp_path, mlflow_uri, backends):
    """The server dies while a round is under way (a timer, so wherever the round happens to be)."""
    over = {"algorithm.name": "sflv2", "train.rounds": 4, "train.local_steps": 20, "tracking.experiment": "faults-mid"}
    full = run_experiment(make_config(tmp_path / "a", mlflow_uri, **over))

    def kill_soon(rnd, m):
        if rnd == 0:
            b = backends[-1]
            threading.Timer(0.2, lambda: ray.kill(b.server)).start()

    hit = run_experiment(make_config(tmp_path / "b", mlflow_uri, **over), on_round=kill_soon)
    time.sleep(0.5)
    assert MlflowClient(mlflow_uri).get_run(hit["run_id"]).data.tags.get("raysplit.actor_restarts") == "1"
    assert _curves(mlflow_uri, hit["run_id"]) == _curves(mlflow_uri, full["run_id"])


def test_past_the_retry_budget_the_run_fails_naming_actor_node_and_round(ray_session, tmp_path, mlflow_uri,
                                                                         backends):
    cfg = make_config(tmp_path, mlflow_uri, **{"runtime.max_retries": 0, "train.rounds": 3,
                                               "tracking.experiment": "faults-budget"})

    def kill(rnd, m):
        if rnd == 0:
            ray.kill(backends[-1].workers[1])

    with pytest.raises(ActorFailure) as e:
        run_experiment(cfg, on_round=kill)
    msg = str(e.value)
    assert "client actor 1" in msg and "on node" in msg and "in round 1" in msg and "max_retries=0" in msg
    client = MlflowClient(mlflow_uri)
    run = client.search_runs([client.get_experiment_by_name("faults-budget").experiment_id])[0]
    assert run.info.status == "FAILED" and "ActorFailure" in run.data.tags["raysplit.error"]
