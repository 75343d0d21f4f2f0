"""MLflow tracking for a run: params flattened, metrics per round (step = round), artifacts, FAILED on error.

Default store: ``sqlite:///<cwd>/mlflow.db`` (MLflow 3 refuses the file store); ``tracking.uri`` or
``MLFLOW_TRACKING_URI`` select any other.
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path


class _LazyMlflow:
    """``mlflow`` imported on first use, so runs with ``tracking.enabled: false`` need no MLflow install."""

    def __getattr__(self, name):
        import mlflow as _mlflow

        return getattr(_mlflow, name)


mlflow = _LazyMlflow()


def resolve_uri(uri: str | None) -> str:
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"


class Tracker:
    """One MLflow run. Use as a context manager: an exception ends the run as FAILED and is re-raised."""

    def __init__(self, uri: str | None, experiment: str, run_name: str | None = None, run_id: str | None = None,
                 enabled: bool = True):
        self.uri = resolve_uri(uri)
        self.experiment = experiment
        self.run_name = run_name
        self.resume_id = run_id
        self.enabled = enabled  # False: metrics leave through another path (Tune's MLflowLoggerCallback)
        self.run = None
        self._local_id = uuid.uuid4().hex

    def __enter__(self) -> "Tracker":
        if not self.enabled:
            return self
        mlflow.set_tracking_uri(self.uri)
        if self.resume_id:
            self.run = mlflow.start_run(run_id=self.resume_id)
        else:
            mlflow.set_experiment(self.experiment)
            self.run = mlflow.start_run(run_name=self.run_name)
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enabled:
            return False
        if exc_type is None:
            mlflow.end_run(status="FINISHED")
        elif issubclass(exc_type, (SystemExit, KeyboardInterrupt)):  # stopped from outside (Tune's scheduler, ^C)
            mlflow.set_tag("raysplit.stopped", f"{exc_type.__name__}: stopped before the last round")
            mlflow.end_run(status="KILLED")
        else:
            mlflow.set_tag("raysplit.error", f"{exc_type.__name__}: {exc}"[:5000])
            mlflow.end_run(status="FAILED")
        return False

    @property
    def run_id(self) -> str:
        return self.run.info.run_id if self.run is not None else self._local_id

    def log_params(self, params: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (str(v)[:6000] if v is not None else "None") for k, v in params.items()}
        items = list(clean.items())
        for i in range(0, len(items), 100):
            mlflow.log_params(dict(items[i:i + 100]))

    def log_metrics(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        ok = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if ok:
            mlflow.log_metrics(ok, step=step)

    def set_tags(self, tags: dict) -> None:
        if not self.enabled:
            return
        mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        mlflow.log_artifact(str(path), artifact_path)


def get_run(run_id: str, uri: str | None = None):
    from mlflow.tracking import MlflowClient

    return MlflowClient(resolve_uri(uri)).get_run(run_id)
