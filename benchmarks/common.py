"""Shared helpers for the benchmarks: environment, machine facts, statistics, result files and MLflow logging.

Benchmarks are not tests: they print figures and log them; they assert nothing about speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def load() -> str:
    """1/5/15-minute load averages (other people's jobs share this machine)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> dict:
    import numpy
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "cpus": os.cpu_count(), "platform": platform.platform(), "load_when_saved": load()}
    try:
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        pass
    try:
        import psutil

        info["ram_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


@contextlib.contextmanager
def resolved_at_start():
    """Yield a dict that fills with what a run's Ray backend resolved (``RayBackend.resolved()``: transport, torch
    threads and their reasons) once its ``start()`` has resolved them; the in-process backend leaves it empty."""
    from raysplit.runtime.ray import backend as ray_backend

    real, out = ray_backend.RayBackend.start, {}

    def start(self, *args, **kwargs):
        real(self, *args, **kwargs)
        out.update(self.resolved())

    ray_backend.RayBackend.start = start
    try:
        yield out
    finally:
        ray_backend.RayBackend.start = real


def mmm(xs) -> dict:
    """min / median / max of a list of numbers."""
    xs = [float(x) for x in xs]
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def fmt(d: dict, scale: float = 1.0, digits: int = 2) -> str:
    return "/".join(f"{d[k] * scale:.{digits}f}" for k in ("min", "median", "max"))


def save(name: str, payload: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": " ".join([Path(sys.executable).name] + sys.argv), "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=1, default=str))
    print(f"wrote {path}")
    return path


def log_mlflow(run_name: str, params: dict, metrics: dict, artifact: Path | None = None,
               uri: str | None = None) -> None:
    """Log one benchmark's figures as a run of the MLflow experiment ``benchmarks`` (raysplit's default sqlite
    store unless ``MLFLOW_TRACKING_URI``/``uri`` says otherwise). Skipped quietly if mlflow is not importable
    (the Flower venv)."""
    try:
        import mlflow
    except ImportError:
        print("mlflow not importable here; not logged")
        return
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{ROOT / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("benchmarks")
    with mlflow.start_run(run_name=run_name):
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        mlflow.log_metrics({k: float(v) for k, v in metrics.items() if v is not None and v == v})
        if artifact is not None:
            mlflow.log_artifact(str(artifact))
    print(f"logged to MLflow {uri} experiment 'benchmarks' run {run_name!r}")
