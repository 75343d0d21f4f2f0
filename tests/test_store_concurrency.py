"""Several runs started together on one new sqlite store all finish: the store is created and migrated, and the
experiment created, under a lock (raysplit/tracking.py ``store_lock``), instead of every run racing through MLflow's
schema migration (``sqlite3.OperationalError: duplicate column name: step``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raysplit.tracking import store_lock

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.subprocess
def test_four_runs_started_together_on_a_new_sqlite_store_all_finish(tmp_path):
    uri = f"sqlite:///{tmp_path / 'new.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "RAY_AUTH_MODE": "disabled"}
    args = ["data.dataset=digits", "data.num_clients=2", "train.rounds=1", "train.local_steps=1",
            "runtime.backend=local", "tracking.experiment=together", "tracking.progress=false",
            f"tracking.output_dir={tmp_path / 'out'}"]
    procs = [subprocess.Popen([sys.executable, "-m", "raysplit.cli", "run", str(ROOT / "configs" / "digits.yaml"),
                               *args, f"seed={i}"], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(4)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], "\n---\n".join(o[-1500:] for o in outs)
    client = MlflowClient(uri)
    exps = [e for e in client.search_experiments() if e.name == "together"]
    assert len(exps) == 1
    runs = client.search_runs([exps[0].experiment_id])
    assert sorted(r.data.params["seed"] for r in runs) == ["0", "1", "2", "3"]
    assert {r.info.status for r in runs} == {"FINISHED"}


def test_the_store_lock_excludes_other_holders_of_the_same_store_only(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    a, b = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'elsewhere' / 'b.db'}"
    order = []
    with store_lock(a):
        other = threading.Thread(target=lambda: (store_lock(a).__enter__(), order.append("second holder in")))
        other.start()
        other.join(timeout=0.5)
        assert other.is_alive() and order == []  # the same store: waits
        with store_lock(b):  # a store in another directory: not held up
            order.append("other store")
        order.append("first holder out")
    other.join(timeout=5)
    assert order == ["other store", "first holder out", "second holder in"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]  # no lock file left behind
    with store_lock("http://127.0.0.1:5000"):  # a tracking server: no lock at all
        pass


def test_a_dataset_row_inserted_by_another_run_meanwhile_does_not_fail_the_input(tmp_path):
    """MLflow looks the dataset up, then inserts it; a run that loses that race is refused with a unique-constraint
    error (seen in CI with four runs on digits). The input is asked for once more and then lands; any other error
    still fails."""
    from mlflow.exceptions import MlflowException

    from raysplit.tracking import _apply

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("e"))
    real, calls = client.log_inputs, []

    def racing(run_id, datasets):
        calls.append(run_id)
        if len(calls) == 1:
            real(run_id, datasets)  # the other run's insert, meanwhile: the row now exists
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id")
        return real(run_id, datasets)

    client.log_inputs = racing
    op = {"op": "input", "run_id": run.info.run_id, "uri": uri,
          "dataset": {"name": "digits", "digest": "abc", "source": "/x/digits.csv.gz", "partition": {},
                      "train_samples": 1, "test_samples": 1, "seed": 0, "files": []}}
    _apply(client, op)
    assert len(calls) == 2
    assert [d.dataset.digest for d in client.get_run(run.info.run_id).inputs.dataset_inputs] == ["abc"]

    def broken(run_id, datasets):
        raise MlflowException("disk I/O error")

    client.log_inputs = broken
    with pytest.raises(MlflowException, match="disk I/O"):
        _apply(client, op)
