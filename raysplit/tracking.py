"""MLflow tracking for a run: params flattened, metrics per round (step = round), artifacts, FAILED on error.

Default store: ``sqlite:///<cwd>/mlflow.db`` (MLflow 3 refuses the file store); ``tracking.uri`` or
``MLFLOW_TRACKING_URI`` select any other.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient


def resolve_uri(uri: str | None) -> str:
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"


class Tracker:
    """One MLflow run. Use as a context manager: an exception ends the run as FAILED and is re-raised."""

    def __init__(self, uri: str | None, experiment: str, run_name: str | None = None, run_id: str | None = None):
        self.uri = resolve_uri(uri)
        self.experiment = experiment
        self.run_name = run_name
        self.resume_id = run_id
        self.run = None

    def __enter__(self) -> "Tracker":
        mlflow.set_tracking_uri(self.uri)
        if self.resume_id:
            self.run = mlflow.start_run(run_id=self.resume_id)
        else:
            mlflow.set_experiment(self.experiment)
            self.run = mlflow.start_run(run_name=self.run_name)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            mlflow.set_tag("raysplit.error", f"{exc_type.__name__}: {exc}"[:5000])
        mlflow.end_run(status="FAILED" if exc_type is not None else "FINISHED")
        return False

    @property
    def run_id(self) -> str:
        return self.run.info.run_id

    def log_params(self, params: dict) -> None:
        clean = {k: (str(v)[:6000] if v is not None else "None") for k, v in params.items()}
        items = list(clean.items())
        for i in range(0, len(items), 100):
            mlflow.log_params(dict(items[i:i + 100]))

    def log_metrics(self, metrics: dict, step: int) -> None:
        ok = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if ok:
            mlflow.log_metrics(ok, step=step)

    def set_tags(self, tags: dict) -> None:
        mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        mlflow.log_artifact(str(path), artifact_path)


def get_run(run_id: str, uri: str | None = None):
    return MlflowClient(resolve_uri(uri)).get_run(run_id)
