"""The tracking store going away mid-run loses nothing: calls are spooled in order and delivered when the store is
back (during the run, or afterwards with ``raysplit replay``). A real ``mlflow server`` process is stopped and
started under a running experiment."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import make_config
from raysplit.cli import main as cli_main
from raysplit.experiment import run_experiment

ROUNDS = 5


class Server:
    """``mlflow server`` on a free port over one sqlite file; start() and stop() as often as needed."""

    def __init__(self, tmp: Path):
        self.db = f"sqlite:///{tmp / 'server.db'}"
        self.art = tmp / "artifacts"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.db, "--artifacts-destination",
             str(self.art), "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("mlflow server exited at start")
                time.sleep(0.5)
        raise RuntimeError("mlflow server did not come up in 120 s")

    def stop(self) -> None:
        import os
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its workers, as a crash would
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path)
    s.start()
    yield s
    s.stop()


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
    assert _history(client, out["run_id"], "train_loss") == list(range(ROUNDS))
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
    assert _history(client, out["run_id"], "train_loss") == list(range(ROUNDS))
    assert _history(client, out["run_id"], "accuracy")[-1] == ROUNDS - 1
