"""MLflow on a database a lab would run: an MLflow server on PostgreSQL (helpers.Postgres: Debian's package, a
server of its own on a free port), and a Ray Tune sweep of four trials running at once, each a raysplit run logging
to that server. Concurrent trials writing to one store is what broke sqlite before (a migration race and a
dataset-row race, fixed by a file lock that a server's clients do not share); here nothing may be lost or
duplicated: four runs, each FINISHED, each round of each metric logged once, one dataset input each."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from helpers import MlflowServer, Postgres

pytestmark = [pytest.mark.mlflow_server, pytest.mark.slow]

ROUNDS = 2
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def postgres_server(tmp_path_factory):
    pg = Postgres(tmp_path_factory.mktemp("pg"))
    pg.start()
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-pg"), backend_store_uri=pg.create("mlflow"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
        pg.stop()


def test_four_concurrent_trials_log_everything_once_to_mlflow_on_postgresql(ray_session, postgres_server, tmp_path):
    from raysplit.tuning import run_sweep

    spec = {"base": str(ROOT / "configs" / "digits.yaml"),
            "overrides": {"train.rounds": ROUNDS, "eval.every": 1, "runtime.backend": "local",
                          "tracking.output_dir": str(tmp_path / "out")},
            "space": {"train.optimizer.lr": {"grid": [0.05, 0.1, 0.2, 0.4]}},
            "metric": "eval/accuracy", "mode": "max", "scheduler": "fifo", "max_concurrent_trials": 4,
            "storage_path": str(tmp_path / "tune"), "name": "pg-sweep"}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    results = run_sweep(str(path), [f"tracking.uri={postgres_server.uri}"])
    assert not results.errors and len(results) == 4
    client = MlflowClient(postgres_server.uri)
    exp = client.get_experiment_by_name("pg-sweep")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 4 and {r.info.status for r in runs} == {"FINISHED"}, [r.info.status for r in runs]
    assert sorted(float(r.data.params["train.optimizer.lr"]) for r in runs) == [0.05, 0.1, 0.2, 0.4]
    for run in runs:
        for key in ("train/loss", "eval/accuracy", "time/sim", "comm/bytes_up"):
            steps = [h.step for h in client.get_metric_history(run.info.run_id, key)]
            assert sorted(steps) == list(range(ROUNDS)), (run.info.run_name, key, steps)  # each round once
        inputs = client.get_run(run.info.run_id).inputs.dataset_inputs
        assert len(inputs) == 1 and inputs[0].dataset.name, inputs  # one dataset row, not one per racing writer
    # the runs' datasets: one logged dataset shared by the four runs (the same data), none duplicated
    digests = {client.get_run(r.info.run_id).inputs.dataset_inputs[0].dataset.digest for r in runs}
    assert len(digests) == 1
