"""The user surface: `raysplit list`, `raysplit compare`, cluster.yaml against Ray's own schema."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
import yaml

from raysplit.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_list_shows_required_names(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ["splitnn", "psl", "sflv1", "sflv2", "fedavg", "sglr", "cyclepsl", "cyclesfl", "cyclesglr", "hydra",
                 "sflv3", "multihead", "gas", "fedbuff", "ca2fl", "fedasync", "minibatch_sfl", "s2fl", "semisfl",
                 "fedswitch_sl", "supervised_only", "semifl", "ampere", "pipar", "splitgp", "sflv1_scaffold",
                 "vit_small", "device_dirichlet", "mergesfl",
                 "femnist_cnn", "celeba_cnn", "shakespeare_lstm", "resnet9", "alexnet_gas", "vgg16_bn_gas",
                 "semisfl_cnn", "alexnet2", "mobilenet_v1", "mobilenet_v3_large", "resnet18", "resnet101",
                 "cnn_small", "fashion_mnist", "digits", "cifar10", "cifar100", "svhn", "femnist", "shakespeare",
                 "synthetic", "iid", "dirichlet", "shards", "dominant_label"]:
        assert f"  {name}" in out, name


def test_compare_prints_known_runs(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'c.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("cmp")
    for alg, accs in (("sflv2", [0.5, 0.7, 0.6]), ("psl", [0.4, 0.45, 0.5])):
        with mlflow.start_run(run_name=f"run-{alg}"):
            mlflow.log_params({"algorithm.name": alg, "model.name": "cnn_small", "data.dataset": "digits",
                               "seed": 0, "resolved.cut_name": "conv1"})
            for i, a in enumerate(accs):
                mlflow.log_metrics({"accuracy": a, "sim_time": 10.0 * (i + 1), "bytes_up": 1000.0}, step=i)
    plot = tmp_path / "cmp.png"
    assert main(["compare", "cmp", "--tracking-uri", uri, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out.splitlines()
    header = out[0].split()
    rows = {line.split()[1]: dict(zip(header, line.split())) for line in out[1:3]}
    assert rows["run-sflv2"]["algorithm"] == "sflv2" and rows["run-psl"]["algorithm"] == "psl"
    assert float(rows["run-sflv2"]["final_accuracy"]) == 0.6 and float(rows["run-sflv2"]["best_accuracy"]) == 0.7
    assert float(rows["run-psl"]["final_accuracy"]) == 0.5 and rows["run-psl"]["rounds"] == "3"
    assert plot.stat().st_size > 0


def test_compare_unknown_experiment_names_it(tmp_path):
    from raysplit.compare import compare_runs

    with pytest.raises(ValueError, match="no MLflow experiment 'nope'"):
        compare_runs("nope", uri=f"sqlite:///{tmp_path / 'e.db'}")


def test_cluster_yaml_passes_rays_validator():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(cfg))
    types = cfg["available_node_types"]
    assert any("server" in t.get("resources", {}) for t in types.values())
    assert any("client" in t.get("resources", {}) for t in types.values())
    starts = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)  # token auth on every node
    assert any(dst.endswith(".ray/auth_token") for dst in cfg["file_mounts"])
    import jsonschema

    broken = dict(cfg, max_workers="many")
    with pytest.raises(jsonschema.ValidationError, match="many"):
        validate_config(prepare_config(broken))


@pytest.mark.subprocess
def test_untracked_run_needs_no_mlflow(tmp_path):
    """tracking.enabled=false: a run completes in a process where importing mlflow fails (e.g. a GPU box
    without it), and returns its metrics."""
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["mlflow"] = None  # any 'import mlflow' now raises ImportError
sys.path.insert(0, {str(Path(__file__).parent)!r})
from helpers import make_config
from raysplit.experiment import run_experiment
cfg = make_config(__import__("pathlib").Path({str(tmp_path)!r}), "sqlite:///unused.db",
                  **{{"runtime.backend": "local", "tracking.enabled": False, "train.rounds": 1}})
rounds = []
res = run_experiment(cfg, on_round=lambda r, m: rounds.append(r))
assert rounds == [0] and 0 <= res["accuracy"] <= 1, res
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]
    assert not (tmp_path / "unused.db").exists()
