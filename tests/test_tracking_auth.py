"""A shared MLflow server behind MLflow's basic-auth app (``mlflow server --app-name basic-auth``, from
``mlflow[auth]``): raysplit logs through it with credentials taken from the environment only
(``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``), the password ends up in no param, tag or artifact, and
a refused login (401) or permission (403) stops the run at once with one error naming the server, before training
starts; a 401 in the middle of a run is raised, never spooled as if the server were down."""

from __future__ import annotations

import base64
import json
import secrets
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers import MlflowServer, make_config
from raysplit import experiment as experiment_module
from raysplit.experiment import run_experiment
from raysplit.tracking import TrackingAuthError

pytestmark = [pytest.mark.mlflow_server]

ADMIN_PASSWORD = f"admin-{secrets.token_hex(8)}"
CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    import flask_wtf  # noqa: F401 - mlflow[auth]'s extra (requirements.txt); without it the server exits at start

    s = MlflowServer(tmp_path_factory.mktemp("mlflow-auth"), admin_password=ADMIN_PASSWORD)
    s.start()
    yield s
    s.stop()


def _rest(server, method: str, path: str, body: dict | None = None, auth: tuple[str, str] | None = None):
    """One REST call to the server with explicit basic-auth credentials (not the environment's); (status, body)."""
    req = urllib.request.Request(f"{server.uri}/api/2.0/mlflow/{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _admin(server, method: str, path: str, body: dict | None = None) -> dict:
    status, text = _rest(server, method, path, body, auth=("admin", ADMIN_PASSWORD))
    assert status == 200, (path, status, text)
    return json.loads(text or "{}")


def _new_user(server, name: str) -> tuple[str, str]:
    """A non-admin user (default permission READ; MANAGE on the experiments it creates) with a fresh password."""
    user, password = f"{name}-{secrets.token_hex(3)}", f"pw-{secrets.token_hex(12)}"
    _admin(server, "POST", "users/create", {"username": user, "password": password})
    return user, password


def _login(monkeypatch, user: str | None, password: str | None) -> None:
    for k in CREDENTIALS:
        monkeypatch.delenv(k, raising=False)
    if user is not None:
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)


def _config(tmp_path, server, experiment: str, rounds: int = 2, **extra):
    return make_config(tmp_path, server.uri, **{"train.rounds": rounds, "runtime.backend": "local",
                                                "tracking.retry_s": 0, "tracking.experiment": experiment,
                                                "tracking.checkpoint_every": 0, **extra})


def _where(client: MlflowClient, run, artifacts: Path, secret: str) -> list[str]:
    """Every place of the run that holds ``secret``: param keys/values, tag keys/values, artifact files."""
    found = [f"param {k}" for k, v in run.data.params.items() if secret in k or secret in v]
    found += [f"tag {k}" for k, v in run.data.tags.items() if secret in k or secret in v]
    found += [f"artifact {p.relative_to(artifacts)}" for p in sorted(artifacts.rglob("*"))
              if p.is_file() and secret.encode() in p.read_bytes()]
    return found


def test_a_run_logs_through_basic_auth_with_credentials_from_the_environment(tmp_path, auth_server, monkeypatch):
    user, password = _new_user(auth_server, "alice")
    _login(monkeypatch, user, password)
    marker = f"auth-run-{secrets.token_hex(4)}"  # shows that _where looks into params, tags and config.yaml
    out = run_experiment(_config(tmp_path, auth_server, "auth-ok", **{"tracking.run_name": marker}))

    client = MlflowClient(auth_server.uri)  # the same credentials, from the environment
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [0, 1]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [0, 1]
    arts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "downloaded")))
    assert (arts / "config.yaml").is_file()
    seen = _where(client, run, arts, marker)
    assert {"tag mlflow.runName", "artifact config.yaml"} <= set(seen) and any(s.startswith("param") for s in seen)
    assert _where(client, run, arts, password) == []
    local = [p for p in (tmp_path / "outputs").rglob("*") if p.is_file() and password.encode() in p.read_bytes()]
    assert local == []
    # the server really has auth on: the same run is refused to a request without credentials
    status, _ = _rest(auth_server, "GET", f"runs/get?run_id={run.info.run_id}")
    assert status == 401


@pytest.mark.parametrize("who", ["no credentials", "wrong password", "no permission"])
def test_a_refused_login_fails_the_run_at_once_naming_the_server(tmp_path, auth_server, monkeypatch, capfd, who):
    experiment = f"auth-refused-{who.replace(' ', '-')}"
    if who == "no credentials":
        _login(monkeypatch, None, None)
        status = "401"
    elif who == "wrong password":
        user, _ = _new_user(auth_server, "bob")
        _login(monkeypatch, user, "not-the-password-123")
        status = "401"
    else:  # a valid user, but the experiment belongs to someone else and it may only read (default permission)
        _admin(auth_server, "POST", "experiments/create", {"name": experiment})
        _login(monkeypatch, *_new_user(auth_server, "carol"))
        status = "403"
    built = []

    def runtime(*a, **k):  # the actors and training start here
        built.append(1)
        return real_runtime(*a, **k)

    real_runtime = experiment_module.runtime_for
    monkeypatch.setattr(experiment_module, "runtime_for", runtime)
    with pytest.raises(TrackingAuthError) as e:
        run_experiment(_config(tmp_path, auth_server, experiment))
    msg = str(e.value)
    assert auth_server.uri in msg, msg
    if status == "401":
        assert "authentication failed: 401 Unauthorized" in msg and "MLFLOW_TRACKING_USERNAME" in msg, msg
    else:
        assert "403 Forbidden, permission denied" in msg, msg
    assert built == []
    assert not list(tmp_path.rglob("mlflow-spool.jsonl"))
    assert "spooling to" not in capfd.readouterr().err
    exp = _rest(auth_server, "GET", f"experiments/get-by-name?experiment_name={experiment}",
                auth=("admin", ADMIN_PASSWORD))
    if status == "401":  # nothing was created
        assert exp[0] == 404, exp
    else:  # the admin's experiment holds no run
        exp_id = json.loads(exp[1])["experiment"]["experiment_id"]
        assert _admin(auth_server, "POST", "runs/search", {"experiment_ids": [exp_id]}).get("runs", []) == []


def test_a_401_mid_run_is_raised_not_spooled(tmp_path, auth_server, monkeypatch, capfd):
    user, password = _new_user(auth_server, "dave")
    _login(monkeypatch, user, password)
    rounds = []

    def rotate(rnd, m):  # an admin changes the user's password while the run is logging
        rounds.append(rnd)
        if rnd == 0:
            _admin(auth_server, "PATCH", "users/update-password",
                   {"username": user, "password": f"pw-{secrets.token_hex(12)}"})

    with pytest.raises(TrackingAuthError) as e:
        run_experiment(_config(tmp_path, auth_server, "auth-rotated", rounds=4), on_round=rotate)
    assert auth_server.uri in str(e.value) and "401" in str(e.value)
    assert rounds == [0]  # stopped at round 1's first call to the server, not trained on blind
    assert not list(tmp_path.rglob("mlflow-spool.jsonl"))
    assert "spooling to" not in capfd.readouterr().err
