"""Data sources never silently change: an explicitly given data.root that lacks the dataset is an error naming it
(the system copy of Fashion-MNIST is searched only when no root is given), and every run records what it trained on
as an MLflow input (name, resolved source, digest of the files, partition, sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers import make_config, write_fake_fashion_mnist
from raysplit.data import DatasetNotFoundError, files_digest, load_dataset
from raysplit.data.datasets import DEBIAN_FASHION_MNIST_DIR
from raysplit.experiment import run_experiment


def test_an_explicit_root_without_the_files_is_an_error_naming_it(tmp_path):
    missing = tmp_path / "nonexistent" / "dir"
    with pytest.raises(DatasetNotFoundError) as e:
        load_dataset("fashion_mnist", root=str(missing))
    msg = str(e.value)
    assert str(missing) in msg
    looked = "\n".join(e.value.looked_at)
    assert DEBIAN_FASHION_MNIST_DIR not in looked  # not replaced by the system copy
    assert "leave data.root unset" in msg


@pytest.mark.skipif(not Path(DEBIAN_FASHION_MNIST_DIR).is_dir(), reason="needs the dataset-fashion-mnist package")
def test_without_a_root_the_system_copy_is_found_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPLIT_DATA", str(tmp_path / "empty"))
    b = load_dataset("fashion_mnist")
    assert len(b.files) == 4 and all(f.startswith(DEBIAN_FASHION_MNIST_DIR) for f in b.files)


def test_the_files_digest_tells_copies_apart(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_fake_fashion_mnist(a, n_train=40, n_test=10, seed=0)
    write_fake_fashion_mnist(b, n_train=40, n_test=10, seed=1)
    fa, fb = load_dataset("fashion_mnist", root=str(a)).files, load_dataset("fashion_mnist", root=str(b)).files
    assert files_digest(fa) == files_digest(list(reversed(fa)))  # order-free
    assert files_digest(fa) != files_digest(fb)


def test_a_run_logs_its_dataset_as_an_mlflow_input(tmp_path, mlflow_uri):
    root = tmp_path / "data"
    write_fake_fashion_mnist(root, n_train=120, n_test=40)
    cfg = make_config(tmp_path, mlflow_uri, **{
        "data.dataset": "fashion_mnist", "data.root": str(root), "data.options": {"search_system": False},
        "data.partition.name": "dirichlet", "data.partition.alpha": 0.5, "train.rounds": 1, "train.local_steps": 1,
        "runtime.backend": "local"})
    out = run_experiment(cfg)
    inputs = MlflowClient(mlflow_uri).get_run(out["run_id"]).inputs.dataset_inputs
    assert len(inputs) == 1
    d = inputs[0].dataset
    files = load_dataset("fashion_mnist", root=str(root), search_system=False).files
    assert d.name == "fashion_mnist" and d.digest == files_digest(files)
    assert json.loads(d.source)["uri"] == str((root / "fashion_mnist").resolve())
    profile = json.loads(d.profile)
    assert profile["partition"]["name"] == "dirichlet" and profile["partition"]["alpha"] == 0.5
    assert profile["train_samples"] == 120 and profile["test_samples"] == 40 and sorted(profile["files"]) == sorted(files)
    assert {t.key: t.value for t in inputs[0].tags}["mlflow.data.context"] == "training"


def test_a_run_names_its_code_and_opens_in_mlflow_as_a_training_run(tmp_path, mlflow_uri):
    """Every run carries raysplit.version and raysplit.commit (this checkout's HEAD, -dirty when tracked files
    differ); the experiment is marked for model training (MLflow 3's UI lists its runs as training runs); an
    experiment made before without that mark gets it, one marked otherwise keeps its own."""
    import subprocess

    import raysplit
    from raysplit.tracking import ensure_experiment

    client = MlflowClient(mlflow_uri)
    client.create_experiment("theirs", tags={"mlflow.experimentKind": "genai_development"})
    old = client.create_experiment("old")
    assert ensure_experiment(client, "old") == old and ensure_experiment(client, "theirs")
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    assert client.get_experiment_by_name("theirs").tags["mlflow.experimentKind"] == "genai_development"
    cfg = make_config(tmp_path, mlflow_uri, **{"train.rounds": 1, "train.local_steps": 1, "runtime.backend": "local",
                                               "tracking.experiment": "fresh"})
    run = client.get_run(run_experiment(cfg)["run_id"])
    assert client.get_experiment_by_name("fresh").tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.tags["raysplit.version"] == raysplit.__version__
    root = Path(raysplit.__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert run.data.tags["raysplit.commit"].split("-")[0] == head.stdout.strip()
    else:
        assert run.data.tags["raysplit.commit"] == "unknown"
