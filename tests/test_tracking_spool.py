"""The tracking store going away mid-run loses nothing: calls are spooled in order and delivered when the store is
back (during the run, or afterwards with ``raysplit replay``). A real ``mlflow server`` process is stopped and
started under a running experiment."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers import MlflowServer, make_config
from raysplit.cli import main as cli_main
from raysplit.experiment import run_experiment

pytestmark = [pytest.mark.mlflow_server]

ROUNDS = 5


@pytest.fixture(scope="module")
def module_server(tmp_path_factory):
    """One MLflow server for the module (each test stops and restarts it; experiments keep the tests apart)."""
    s = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    s.start()
    yield s
    s.stop()


@pytest.fixture
def server(module_server):
    if module_server.proc is None:
        module_server.start()
    yield module_server
    if module_server.proc is None:  # a test that failed while the store was down
        module_server.start()


def _history(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, key)]


def _config(tmp_path, uri, experiment):
    return make_config(tmp_path, uri, **{"train.rounds": ROUNDS, "runtime.backend": "local", "tracking.retry_s": 0,
                                         "tracking.experiment": experiment, "tracking.checkpoint_every": 0})


def test_a_store_outage_mid_run_is_delivered_once_in_order_when_it_returns(tmp_path, server, capfd):
    def outage(rnd, m):
        if rnd == 0:
            server.stop()  # rounds 1 and 2 are logged while the store is down
        if rnd == 2:
            server.start()

    out = run_experiment(_config(tmp_path, server.uri, "spool-back"), on_round=outage)
    client = MlflowClient(server.uri)
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED"
    assert _history(client, out["run_id"], "train/loss") == list(range(ROUNDS))
    assert "spooling to" in capfd.readouterr().err
    assert not list(Path(tmp_path / "outputs").rglob("mlflow-spool.jsonl"))


def test_a_store_down_until_the_end_leaves_a_spool_that_replay_delivers(tmp_path, server, capfd):
    def outage(rnd, m):
        if rnd == 1:
            server.stop()

    out = run_experiment(_config(tmp_path, server.uri, "spool-replay"), on_round=outage)  # finishes training
    spool = next(Path(tmp_path / "outputs").rglob("mlflow-spool.jsonl"))
    assert f"raysplit replay {spool}" in capfd.readouterr().err
    assert cli_main(["replay", str(spool)]) == 1  # still down: nothing lost, the file stays
    assert spool.is_file()
    server.start()
    assert cli_main(["replay", str(spool)]) == 0
    assert not spool.exists()
    client = MlflowClient(server.uri)
    assert client.get_run(out["run_id"]).info.status == "FINISHED"
    assert _history(client, out["run_id"], "train/loss") == list(range(ROUNDS))
    assert _history(client, out["run_id"], "eval/accuracy")[-1] == ROUNDS - 1
