"""MLflow tracking for a run: params flattened, metrics per round (step = round), artifacts, FAILED on error; and
nothing lost when the tracking store goes away mid-run.

Default store: ``sqlite:///<cwd>/mlflow.db`` (MLflow 3 refuses the file store); ``tracking.uri`` or
``MLFLOW_TRACKING_URI`` select any other. Credentials for a server behind MLflow's basic-auth app come from the
environment (``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``, or ``MLFLOW_TRACKING_TOKEN``), never
from a config file, and are never logged.

**The spool.** Every call (a batch of metrics, params or tags, an artifact, the run's end) goes to the store in
the order it was made. When one fails because the store cannot be reached (connection refused, timeout, a 5xx,
a locked database), it and every later call are appended to ``<tracking.output_dir>/<run id>/mlflow-spool.jsonl``
instead and training goes on; at most every ``retry_s`` seconds, and at the end of the run, the spool is
replayed in order (metrics keep their original timestamps and steps) and emptied. A spool that still holds calls
when the run ends is reported with the one command that replays it: ``raysplit replay FILE``. Errors that a retry
cannot fix (an invalid metric name, an unknown run) are raised, not spooled; so is a server refusing the
credentials (401) or the user's permission (403): a ``TrackingAuthError`` naming the URI, at the first call if the
credentials are wrong or missing, so the run stops before training starts.

The MLflow HTTP client retries a refused connection 7 times over about four minutes by default; unless the
environment says otherwise, a run sets ``MLFLOW_HTTP_REQUEST_MAX_RETRIES=1``, ``..._BACKOFF_FACTOR=1`` and
``..._TIMEOUT=20`` so an unreachable server costs seconds, not minutes, before the call is spooled.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import math
import os
import sys
import time
import uuid
from raysplit import tags
from pathlib import Path

# errors a later retry cannot fix: the call itself is wrong
_PERMANENT = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE",
              "BAD_REQUEST", "FEATURE_DISABLED"}
# the server refused who we are (401: no or wrong credentials) or what we may do (403): not an outage, never spooled
_AUTH = {"UNAUTHENTICATED", "CUSTOMER_UNAUTHORIZED", "PERMISSION_DENIED"}
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def resolve_uri(uri: str | None) -> str:
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"


class TrackingAuthError(RuntimeError):
    """The tracking server refused the credentials (401) or the user's permission (403). Raised at once, never
    spooled or retried: waiting does not fix a password."""


def _auth_error(uri: str, e: Exception) -> TrackingAuthError | None:
    """The ``TrackingAuthError`` for ``e`` when it is a 401/403 from the server, else None."""
    if isinstance(e, TrackingAuthError):
        return e
    code = getattr(e, "error_code", None)
    if code not in _AUTH:
        return None
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    who = (f"as user {user!r}" if user else "without credentials" if not os.environ.get("MLFLOW_TRACKING_TOKEN")
           else "with the token in MLFLOW_TRACKING_TOKEN")
    if code == "PERMISSION_DENIED":
        what = (f"access denied: 403 Forbidden, permission denied {who} (signed in, but the user may not write to "
                "this experiment or run; a server admin grants it)")
    else:
        what = (f"authentication failed: 401 Unauthorized {who} (set MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD in the run's environment, e.g. the job's runtime env; never in the config)")
    return TrackingAuthError(f"MLflow tracking server {uri} (tracking.uri) refused the run: {what}")


def _transient(e: Exception) -> bool:
    """True for a failure of the store (unreachable, overloaded, locked), not of the call or of the credentials."""
    code = getattr(e, "error_code", None)
    if isinstance(e, TrackingAuthError) or code in _AUTH:
        return False
    return not (code in _PERMANENT or isinstance(e, (TypeError, ValueError)) and code is None)


@contextlib.contextmanager
def store_lock(uri: str):
    """For a sqlite store, an exclusive lock across this machine's processes while the store is opened (created and
    migrated, the first time) and the run's experiment is looked up or created: two runs started together on a new
    ``sqlite:///new.db`` otherwise both run MLflow's schema migration and one dies in it (``duplicate column name``),
    or both create the experiment and one is refused; runs on one dataset likewise race to insert its row when they
    log it as an input (``_apply``). The lock is a ``flock`` on the database's directory (no file
    is created; stores in one directory share it for these few calls). Other stores (a tracking server) serialize
    this themselves."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    folder = Path(uri[len("sqlite:///"):]).resolve().parent
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"


def ensure_experiment(client, name: str) -> str:
    """The id of experiment ``name``, created if missing, tagged as model training (MLflow's experiment kind; its
    3.17 UI still opens an experiment in the view the browser last used, scripts/check_ui.py); an experiment made
    before, without a kind, gets it, one whose kind someone set keeps theirs."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return client.create_experiment(name, tags={KIND_TAG: KIND})
    if KIND_TAG not in exp.tags:
        client.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
    return exp.experiment_id


@functools.cache
def code_version() -> dict[str, str]:
    """Tags naming the code a run ran: ``raysplit.version`` and ``raysplit.commit`` (the checkout's commit, with
    ``-dirty`` when tracked files differ from it; ``unknown`` outside a git checkout, e.g. a job's uploaded
    working_dir)."""
    import subprocess

    from raysplit.version import __version__

    root = Path(__file__).resolve().parent.parent  # the checkout this package runs from
    commit = "unknown"
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--"], timeout=10).returncode
            commit = head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return {tags.VERSION: __version__, tags.COMMIT: commit}


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    for k, v in _HTTP_DEFAULTS.items():
        os.environ.setdefault(k, v)
    with store_lock(uri):  # MlflowClient opens the store at once; a new sqlite store is created and migrated then
        return MlflowClient(uri)


def _apply(client, op: dict) -> None:
    """One spooled call against the store."""
    from mlflow.entities import Metric, Param, RunTag

    kind, run_id = op["op"], op["run_id"]
    if kind == "batch":
        metrics = [Metric(k, v, ts, step) for k, v, ts, step in op.get("metrics", [])]
        params = [Param(k, v) for k, v in op.get("params", [])]
        tags = [RunTag(k, v) for k, v in op.get("tags", [])]
        for i in range(0, max(len(metrics), len(params), len(tags), 1), 100):  # the store's per-call limits
            client.log_batch(run_id, metrics=metrics[i:i + 100], params=params[i:i + 100], tags=tags[i:i + 100])
    elif kind == "input":
        from mlflow.entities import Dataset, DatasetInput, InputTag

        d = op["dataset"]
        source = json.dumps({"uri": d["source"]}) if d["source"] else json.dumps({"uri": f"raysplit:{d['name']}"})
        profile = json.dumps({k: d[k] for k in ("partition", "train_samples", "test_samples", "seed", "files")})
        inputs = [DatasetInput(Dataset(d["name"], d["digest"], "local", source, profile=profile),
                               tags=[InputTag("mlflow.data.context", "training")])]
        # MLflow inserts a dataset row unless one with this (experiment, name, digest) exists, with no lock between
        # the look-up and the insert: runs started together on one dataset race, and the loser is refused with
        # "UNIQUE constraint failed: datasets..." (found by tests/test_store_concurrency.py in CI). A sqlite store
        # is locked across this machine's processes; any store is asked once more, when the row now exists.
        with store_lock(op.get("uri") or ""):
            try:
                client.log_inputs(run_id, datasets=inputs)
            except Exception as e:  # noqa: BLE001 - the other run's row is there now; a second failure is real
                if "unique" not in str(e).lower() and "duplicate" not in str(e).lower():
                    raise
                client.log_inputs(run_id, datasets=inputs)
    elif kind == "artifact":
        client.log_artifact(run_id, op["path"], op.get("artifact_path"))
    elif kind == "terminate":
        client.set_terminated(run_id, op["status"], end_time=op.get("end_time"))
    else:
        raise ValueError(f"unknown spooled call {kind!r}")


def replay(spool: str | Path, uri: str | None = None) -> int:
    """Deliver a spool file's calls in order; returns how many were delivered. The file keeps (atomically
    rewritten) the calls not yet delivered when the store fails again, and is removed once empty."""
    path = Path(spool)
    if not path.is_file():
        raise FileNotFoundError(f"no spool file {path}")
    ops = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    client = _client(resolve_uri(uri or (ops[0].get("uri") if ops else None)))
    done = 0
    try:
        for op in ops:
            try:
                _apply(client, op)
            except Exception as e:  # noqa: BLE001 - a 401/403 is named as such; anything else as it is
                auth = _auth_error(client.tracking_uri, e)
                if auth is None:
                    raise
                raise auth from e
            done += 1
    finally:
        rest = ops[done:]
        if rest:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(o) + "\n" for o in rest))
            os.replace(tmp, path)
        else:
            path.unlink()
    return done


class Tracker:
    """One MLflow run. Use as a context manager: an exception ends the run as FAILED and is re-raised."""

    def __init__(self, uri: str | None, experiment: str, run_name: str | None = None, run_id: str | None = None,
                 enabled: bool = True, output_dir: str | Path = "outputs", retry_s: float = 30.0):
        self.uri = resolve_uri(uri)
        self.experiment = experiment
        self.run_name = run_name
        self.resume_id = run_id
        self.enabled = enabled  # False: metrics leave through another path (Tune's MLflowLoggerCallback)
        self.output_dir = Path(output_dir)
        self.retry_s = retry_s
        self.client = None
        self._run_id: str | None = None
        self._local_id = uuid.uuid4().hex
        self.spool_path: Path | None = None
        self._spooled = 0  # calls in the spool file now
        self._next_retry = 0.0
        self.undelivered = 0  # calls left in the spool when the run ended

    # ---- the run ---------------------------------------------------------------------------------------------
    def __enter__(self) -> "Tracker":
        if not self.enabled:
            return self
        from mlflow.tracking.context.registry import resolve_tags

        self.client = _client(self.uri)
        try:
            if self.resume_id:
                self.client.get_run(self.resume_id)  # an unknown id is an error here
                self.client.update_run(self.resume_id, status="RUNNING")
                self._run_id = self.resume_id
            else:
                with store_lock(self.uri):  # runs started together: one creates the experiment, the others find it
                    exp_id = ensure_experiment(self.client, self.experiment)
                tags = resolve_tags({"mlflow.runName": self.run_name} if self.run_name else {})
                self._run_id = self.client.create_run(exp_id, tags=tags, run_name=self.run_name).info.run_id
        except Exception as e:
            auth = _auth_error(self.uri, e)
            if auth is not None:
                raise auth from e
            raise RuntimeError(f"cannot start an MLflow run at {self.uri} (tracking.uri): {e}") from e
        self.spool_path = self.output_dir / self._run_id / "mlflow-spool.jsonl"
        if self.spool_path.is_file():  # left by an earlier attempt of this run: deliver it first
            self._spooled = sum(1 for line in self.spool_path.read_text().splitlines() if line.strip())
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        if exc_type is not None and issubclass(exc_type, TrackingAuthError):  # the store takes nothing more from us
            print(f"raysplit: run {self.run_id} stays RUNNING in {self.uri}: the server refuses this run's calls, so "
                  f"it cannot be marked FAILED ({exc})", file=sys.stderr)
            return False
        if exc_type is None:
            status = "FINISHED"
        elif issubclass(exc_type, (SystemExit, KeyboardInterrupt)):  # stopped from outside (Tune's scheduler, ^C)
            self.set_tags({tags.STOPPED: f"{exc_type.__name__}: stopped before the last round"})
            status = "KILLED"
        else:
            self.set_tags({tags.ERROR: f"{exc_type.__name__}: {exc}"[:5000]})
            status = "FAILED"
        self._call({"op": "terminate", "run_id": self.run_id, "status": status,
                    "end_time": int(time.time() * 1000)}, force_retry=True)
        if self._spooled:
            self.undelivered = self._spooled
            print(f"raysplit: the tracking store {self.uri} could not take {self._spooled} call(s) of run "
                  f"{self.run_id}; they are kept in order in {self.spool_path}. Deliver them with:\n"
                  f"    raysplit replay {self.spool_path} --tracking-uri {self.uri}", file=sys.stderr)
        return False

    @property
    def run_id(self) -> str:
        return self._run_id or self._local_id

    # ---- calls -------------------------------------------------------------------------------------------------
    def _call(self, op: dict, force_retry: bool = False) -> None:
        """Deliver ``op`` after everything spooled before it, or spool it."""
        op = {**op, "uri": self.uri}
        if self._spooled and (force_retry or time.monotonic() >= self._next_retry):
            self._flush()
        if not self._spooled:
            try:
                _apply(self.client, op)
                return
            except Exception as e:  # noqa: BLE001 - sorted below: transient ones are spooled
                auth = _auth_error(self.uri, e)
                if auth is not None:
                    raise auth from e
                if not _transient(e):
                    raise
                print(f"raysplit: tracking store {self.uri} unreachable ({type(e).__name__}: {str(e)[:200]}); "
                      f"spooling to {self.spool_path}, retrying every {self.retry_s:g} s", file=sys.stderr)
                self._next_retry = time.monotonic() + self.retry_s
        self.spool_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.spool_path, "a") as f:
            f.write(json.dumps(op) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._spooled += 1

    def _flush(self) -> None:
        try:
            replay(self.spool_path, self.uri)
            self._spooled = 0
            print(f"raysplit: tracking store {self.uri} reachable again; the spool is delivered", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - still down: keep what is left, try again later
            if not _transient(e):
                raise
            self._spooled = (sum(1 for ln in self.spool_path.read_text().splitlines() if ln.strip())
                             if self.spool_path.is_file() else 0)
            self._next_retry = time.monotonic() + self.retry_s

    def log_params(self, params: dict) -> None:
        if not self.enabled:
            return
        clean = [[k, str(v)[:6000] if v is not None else "None"] for k, v in params.items()]
        self._call({"op": "batch", "run_id": self.run_id, "params": clean})

    def log_metrics(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        ts = int(time.time() * 1000)
        ok = [[k, float(v), ts, int(step)] for k, v in metrics.items()
              if isinstance(v, (int, float)) and math.isfinite(float(v))]
        if ok:
            self._call({"op": "batch", "run_id": self.run_id, "metrics": ok})

    def set_tags(self, tags: dict) -> None:
        if not self.enabled:
            return
        self._call({"op": "batch", "run_id": self.run_id, "tags": [[k, str(v)] for k, v in tags.items()]})

    def log_input(self, dataset: dict) -> None:
        """The run's dataset (``experiment.provenance``: name, resolved source, digest of the files, partition,
        sizes) as an MLflow input, so the UI's Datasets column shows what the run trained on."""
        if self.enabled:
            self._call({"op": "input", "run_id": self.run_id, "dataset": dataset})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        self._call({"op": "artifact", "run_id": self.run_id, "path": str(Path(path).resolve()),
                    "artifact_path": artifact_path})

    def last_steps(self) -> dict[str, int]:
        """Per metric key, the last step at which it reached the store, spooled calls included (empty for a new
        run). Per key, not per round: a driver killed between two batches of one round's metrics leaves some of
        that round's keys logged and others not, and a resumed run logs exactly the missing ones."""
        if not self.enabled or self._run_id is None:
            return {}
        keys = self.client.get_run(self._run_id).data.metrics
        out = {k: max((m.step for m in self.client.get_metric_history(self._run_id, k)), default=-1) for k in keys}
        if self._spooled:
            for line in self.spool_path.read_text().splitlines():
                op = json.loads(line) if line.strip() else {}
                for k, _, _, step in op.get("metrics", []):
                    out[k] = max(out.get(k, -1), step)
        return out


def get_run(run_id: str, uri: str | None = None):
    from mlflow.tracking import MlflowClient

    return MlflowClient(resolve_uri(uri)).get_run(run_id)
