"""Shared fixtures: one Ray instance per test session (stack.md §9), one MLflow sqlite store per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

GET_TIMEOUT = 120  # seconds; every ray.get in tests has one


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # address="local": a fresh instance even when another Ray runs on this machine (a test's head or cluster
        # that outlived it would otherwise be joined, and num_cpus refused)
        ray.init(address="local", num_cpus=4, object_store_memory=512 * 1024**2, include_dashboard=False,
                 log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


class MlflowServer:
    """``mlflow server`` on a free port over one sqlite file in ``tmp``; start() and stop() as often as needed.
    ``admin_password``: run MLflow's basic-auth app (``--app-name basic-auth``, needs ``mlflow[auth]``) with its
    user database in ``tmp`` and an admin user ``admin`` created with that password at first start."""

    def __init__(self, tmp, admin_password: str | None = None):
        import socket

        self.db = f"sqlite:///{tmp / 'server.db'}"
        self.art = tmp / "artifacts"
        self.env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.args = []
        if admin_password is not None:
            ini = tmp / "basic_auth.ini"  # server side only; the admin password goes through the environment
            ini.write_text(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{tmp / 'auth.db'}\n"
                           "admin_username = admin\n"
                           "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
            self.env.update(MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_AUTH_ADMIN_PASSWORD=admin_password,
                            MLFLOW_FLASK_SERVER_SECRET_KEY=os.urandom(16).hex())
            self.args = ["--app-name", "basic-auth"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        import subprocess
        import sys
        import time
        import urllib.request

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.db, "--artifacts-destination",
             str(self.art), "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1", *self.args],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2)  # unprotected under basic auth too
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("mlflow server exited at start")
                time.sleep(0.5)
        raise RuntimeError("mlflow server did not come up in 120 s")

    def stop(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its workers, as a crash would
            self.proc.wait(timeout=30)
        self.proc = None


def make_config(tmp_path, mlflow_uri, **overrides):
    """A small digits experiment (fast on 2 cores) with dotted-key overrides."""
    from raysplit.config import load_config

    base = {
        "name": "test", "seed": 0,
        "algorithm.name": "sflv2",
        "data.dataset": "digits", "data.num_clients": 4, "data.partition.name": "iid", "data.test_fraction": 0.2,
        "model.name": "cnn_small", "model.cut": "conv1",
        "train.rounds": 2, "train.batch_size": 16, "train.local_steps": 4,
        "train.optimizer.lr": 0.1,
        "runtime.num_workers": 2, "runtime.server.num_cpus": 0.5, "runtime.client.num_cpus": 0.5,
        "tracking.uri": mlflow_uri, "tracking.experiment": "tests", "tracking.progress": False,
        "tracking.output_dir": str(tmp_path / "outputs"),
    }
    base.update(overrides)
    return load_config(None, base)


def write_fake_cifar10(root, per_batch: int, test: int = 40, seed: int = 0) -> None:
    """CIFAR-10's python pickles in the real layout under ``root/cifar10`` (random images, balanced labels)."""
    import pickle

    import numpy as np

    rng = np.random.default_rng(seed)
    d = root / "cifar10" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    for fname, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", test)]:
        with open(d / fname, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                         b"labels": np.tile(np.arange(10), n // 10).tolist()}, f)


@pytest.fixture(scope="session")
def fmnist_root(tmp_path_factory):
    """Small fake Fashion-MNIST in the real IDX format (uint8 28x28 images, balanced labels, a class pattern)."""
    import gzip
    import struct

    import numpy as np

    root = tmp_path_factory.mktemp("fmnist")
    folder = root / "fashion_mnist"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 600), ("t10k", 100)):
        y = np.tile(np.arange(10, dtype=np.uint8), n // 10)
        x = rng.integers(0, 120, (n, 28, 28), dtype=np.uint8)
        for c in range(10):
            x[y == c, 2 * c:2 * c + 6, 4:24] += 120  # a band per class: learnable, still images
        for kind, arr in (("images-idx3", x), ("labels-idx1", y)):
            header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + b"".join(struct.pack(">I", d) for d in arr.shape)
            with gzip.open(folder / f"{prefix}-{kind}-ubyte.gz", "wb") as f:
                f.write(header + arr.tobytes())
    return root


class Touch:
    """Unpickling this runs ``marker.touch()``: what a malicious pickle (a "CIFAR batch", a "checkpoint") from the
    internet would do. Tests check it is refused and ``marker`` never appears."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (self.marker,))
