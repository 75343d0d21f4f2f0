"""`ray job submit` against a local head started with `ray start --head` with Ray's token authentication on: the job
runs with the token, and both the job API and `ray job submit` refuse a caller without it."""

from __future__ import annotations

import os
import re
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

pytestmark = [pytest.mark.cluster, pytest.mark.subprocess]

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# every run here has one client actor (runtime.num_workers=1): the job path, not the actor count, is under test
# the rounds of the job stopped and resubmitted: it is stopped after round 1 (measured: `ray job stop` took 6.7 s,
# about 3 rounds)
ROUNDS = 10


@pytest.mark.slow
def test_job_submit_with_token_auth_runs_into_mlflow_and_a_resubmitted_job_resumes(tmp_path):
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
        # one job, stopped mid-run and resubmitted (issue 51: a separate two-round job before it cost CI ~25 s; what
        # it checked, a job that succeeds into MLflow on this cluster and shows in `raysplit compare`, is checked on
        # the resubmitted one)
        cmd = [ray_cli, "job", "submit", "--address", "http://127.0.0.1:8271", "--working-dir", str(ROOT),
               "--runtime-env", str(ROOT / "jobs" / "runtime_env.yaml"), "--",
               "python", "jobs/train.py", "configs/digits.yaml", f"train.rounds={ROUNDS}", "runtime.num_workers=1",
               f"tracking.uri={uri}", "tracking.experiment=jobs", "tracking.progress=false",
               f"tracking.output_dir={tmp_path / 'out'}", "tracking.run_name=resumable", "tracking.checkpoint_every=1"]
        refused = subprocess.run(cmd, env=no_token, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert refused.returncode != 0 and "auth" in (refused.stdout + refused.stderr).lower(), refused.stderr[-2000:]

        # a job with no tracking store the user can read is refused at start, saying how to set one: the job's
        # entry point decides before it touches Ray, so it is run here as the job would run it
        bare = [sys.executable, *cmd[cmd.index("--") + 2:]]
        bare = [a for a in bare if not a.startswith("tracking.uri=")]
        no_uri = {k: v for k, v in env.items() if k != "MLFLOW_TRACKING_URI"}
        r = subprocess.run(bare, env=no_uri, capture_output=True, text=True, timeout=300, cwd=ROOT)
        out = r.stdout + r.stderr
        assert r.returncode != 0 and "refusing to start the job: no MLflow tracking store is set" in out, out[-3000:]
        assert "tracking.uri=http://MLFLOW_HOST:5000" in out

        # a job stopped mid-run and resubmitted with the same run name continues its run: every round once
        for _ in range(30):  # the head's job agent comes up a little after its dashboard answers
            first = subprocess.run([*cmd[:3], "--no-wait", *cmd[3:]], env=env, capture_output=True, text=True,
                                   timeout=300, cwd=ROOT)
            if "No available agent" not in first.stdout + first.stderr:
                break
            time.sleep(2)
        job_id = re.search(r"raysubmit_\w+", first.stdout + first.stderr).group(0)
        client = MlflowClient(uri)
        run_id, deadline = None, time.time() + 240
        while time.time() < deadline:  # stop the job once round 1 is logged and checkpointed
            exp = client.get_experiment_by_name("jobs") if Path(uri[len("sqlite:///"):]).is_file() else None
            found = client.search_runs([exp.experiment_id], filter_string="tags.mlflow.runName = 'resumable'") \
                if exp else []
            if found and client.get_metric_history(found[0].info.run_id, "train/loss"):
                run_id = found[0].info.run_id
                ckpt = found[0].data.tags.get("raysplit.checkpoint")
                if len(client.get_metric_history(run_id, "train/loss")) >= 2 and ckpt and Path(ckpt).is_file():
                    break
            time.sleep(0.3)
        subprocess.run([ray_cli, "job", "stop", "--address", "http://127.0.0.1:8271", job_id], env=env,
                       capture_output=True, text=True, timeout=120)
        assert run_id is not None, first.stdout + first.stderr
        stopped_at = len(client.get_metric_history(run_id, "train/loss"))
        assert client.get_run(run_id).info.status in ("RUNNING", "KILLED") and stopped_at < ROUNDS  # stopped mid-run
        again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert again.returncode == 0 and f"resuming run {run_id}" in again.stdout + again.stderr, again.stdout[-3000:]
        assert "succeeded" in again.stdout + again.stderr
        found = client.search_runs([client.get_experiment_by_name("jobs").experiment_id],
                                   filter_string="tags.mlflow.runName = 'resumable'")
        assert [r.info.run_id for r in found] == [run_id] and found[0].info.status == "FINISHED"
        assert [h.step for h in sorted(client.get_metric_history(run_id, "train/loss"), key=lambda h: h.step)] == \
            list(range(ROUNDS))  # every round exactly once
        # the refused submission left no run; the job joined this cluster rather than starting its own Ray
        assert len(client.search_runs([client.get_experiment_by_name("jobs").experiment_id])) == 1
        assert found[0].data.params["runtime.address"] == "auto"
        # ... and the user finds it where they look: `raysplit compare` on their side of the store
        cmp = subprocess.run([str(BIN / "raysplit"), "compare", "jobs", "--tracking-uri", uri], env=env,
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert cmp.returncode == 0 and run_id[:8] in cmp.stdout, cmp.stdout + cmp.stderr
        acc = client.get_metric_history(run_id, "eval/accuracy")[-1].value
        assert f"{acc:.4f}" in cmp.stdout, cmp.stdout

        # with this head running, a plain `raysplit run` (no address) still starts its own private Ray
        own = subprocess.run([str(BIN / "raysplit"), "run", "configs/digits.yaml", "train.rounds=1",
                              "runtime.num_workers=1",
                              f"tracking.uri={uri}", "tracking.experiment=private", "tracking.progress=false",
                              f"tracking.output_dir={tmp_path / 'out'}", "runtime.num_cpus=2"],
                             env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert own.returncode == 0, own.stderr[-3000:]  # before: ValueError, num_cpus given to an existing cluster
        mine = client.search_runs([client.get_experiment_by_name("private").experiment_id])
        assert mine[0].data.params["runtime.address"] == "None" and mine[0].info.status == "FINISHED"
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp, ignore_errors=True)


def test_a_job_needs_a_store_the_user_can_read():
    from raysplit.jobrun import store_problem

    for bad in (None, "", "sqlite:///mlflow.db", "file:./mlruns", "file:mlruns", "mlruns"):
        assert "tracking.uri=http://MLFLOW_HOST:5000" in store_problem(bad), bad
    assert "no MLflow tracking store is set" in store_problem(None)
    for good in ("http://mlflow:5000", "https://x/y", "sqlite:////shared/mlflow.db", "file:///shared/mlruns",
                 "/shared/mlruns", "databricks"):
        assert store_problem(good) == "", good


def test_a_resubmitted_job_continues_its_unfinished_run_and_only_that(tmp_path, monkeypatch):
    from raysplit.errors import ConfigError
    from raysplit.jobrun import JOB_CHECKPOINT_EVERY, job_argv

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(ROOT)  # a job runs from the repository (its working_dir): the config path is relative to it
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    args = ["configs/digits.yaml", f"tracking.uri={uri}", "tracking.run_name=nightly", "train.rounds=3"]
    with pytest.raises(ConfigError, match="refusing to start the job: no MLflow tracking store is set"):
        job_argv(args[:1], env={})
    argv, what = job_argv(args, env={})
    assert argv[:2] == ["run", "configs/digits.yaml"] and what.startswith("new run 'nightly'")
    assert "runtime.address=auto" in argv and f"tracking.checkpoint_every={JOB_CHECKPOINT_EVERY}" in argv
    assert f"tracking.output_dir={tmp_path / 'home' / 'raysplit' / 'outputs'}" in argv
    assert "tracking.checkpoint_every=2" in job_argv([*args, "tracking.checkpoint_every=2"], env={})[0]

    client = MlflowClient(uri)
    exp = client.create_experiment("digits")
    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_bytes(b"x")

    def run(status, path=ckpt, name="nightly"):
        r = client.create_run(exp, run_name=name, tags={"raysplit.checkpoint": str(path)})
        if status != "RUNNING":
            client.set_terminated(r.info.run_id, status)
        return r.info.run_id

    run("FINISHED")
    assert job_argv(args, env={})[0][1] == "configs/digits.yaml"  # a finished run of that name: a new run
    run("FAILED", path=tmp_path / "gone.pt")
    assert job_argv(args, env={})[0][1] == "configs/digits.yaml"  # no checkpoint left: nothing to continue
    run("RUNNING", name="other")
    assert job_argv(args, env={})[0][1] == "configs/digits.yaml"  # another name
    died = run("RUNNING")
    argv, what = job_argv(args, env={})
    assert argv[:3] == ["run", "--resume", died] and f"tracking.uri={uri}" in argv
    assert what.startswith(f"resuming run {died} ('nightly', RUNNING)")
