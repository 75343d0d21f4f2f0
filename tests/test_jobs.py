"""`ray job submit` against a local head started with `ray start --head` with Ray's token authentication on: the job
runs with the token, and both the job API and `ray job submit` refuse a caller without it."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_job_submit_with_token_auth_runs_a_two_round_experiment_into_mlflow(tmp_path):
    home = tmp_path / "home"  # no ~/.ray/auth_token to fall back on: the token is only where the test puts it
    home.mkdir()
    token = secrets.token_hex(32)
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0", HOME=str(home),
               PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    no_token = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}
    ray_cli = str(BIN / "ray") if (BIN / "ray").exists() else shutil.which("ray")
    temp = tempfile.mkdtemp(prefix="rsj", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # --block keeps this head's processes tied to this one command: stopping it stops them (and only them;
    # `ray stop` would also kill the test session's own Ray)
    # the test session's own Ray already runs a dashboard agent on the default port: give this head's agent others
    agent_ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            agent_ports.append(s.getsockname()[1])
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--port=6391", "--num-cpus=2",
                             "--disable-usage-stats", "--dashboard-port=8271", f"--temp-dir={temp}",
                             f"--dashboard-agent-listen-port={agent_ports[0]}",
                             f"--dashboard-agent-grpc-port={agent_ports[1]}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:  # wait for the dashboard's job API: without the token it answers 401
            try:
                urllib.request.urlopen("http://127.0.0.1:8271/api/version", timeout=2)
                raise AssertionError("the job API answered a request without the token")
            except urllib.error.HTTPError as e:
                assert e.code == 401, e
                break
            except OSError:
                assert head.poll() is None, head.stdout.read()[-3000:]
                assert time.time() < deadline, "the Ray head did not come up in 120 s"
                time.sleep(1)
        uri = f"sqlite:///{tmp_path / 'jobs.db'}"
        cmd = [ray_cli, "job", "submit", "--address", "http://127.0.0.1:8271", "--working-dir", str(ROOT),
               "--runtime-env", str(ROOT / "jobs" / "runtime_env.yaml"), "--",
               "python", "jobs/train.py", "configs/digits.yaml", "train.rounds=2", f"tracking.uri={uri}",
               "tracking.experiment=jobs", "tracking.progress=false", f"tracking.output_dir={tmp_path / 'out'}"]
        refused = subprocess.run(cmd, env=no_token, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert refused.returncode != 0 and "auth" in (refused.stdout + refused.stderr).lower(), refused.stderr[-2000:]
        for _ in range(30):  # the head's job agent comes up a little after its dashboard answers
            sub = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
            if "No available agent" not in sub.stdout + sub.stderr:
                break
            time.sleep(2)
        assert sub.returncode == 0, (sub.stdout[-3000:], sub.stderr[-3000:])
        assert "succeeded" in sub.stdout + sub.stderr
        client = MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("jobs").experiment_id])
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # the refused submission left no run
        assert [h.step for h in client.get_metric_history(runs[0].info.run_id, "accuracy")] == [0, 1]
        # the job joined this cluster rather than starting its own Ray
        assert runs[0].data.params["runtime.address"] == "auto"
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp, ignore_errors=True)
