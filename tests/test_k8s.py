"""k8s/rayjob.yaml: what KubeRay requires of a RayJob (ray.io/v1) and what raysplit needs from it (token auth, the
server pinned to the GPU group by its `server` resource, clients on CPU workers, the MLflow URI from a ConfigMap or
Secret on every pod), and its entrypoint a command raysplit accepts: jobs/train.py with a config and overrides that
validate, refused by nothing (no cluster here: the manifest and the command are checked, not run)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from raysplit.config import load_config
from raysplit.jobrun import job_argv

ROOT = Path(__file__).resolve().parent.parent
IMAGE_ROOT = "/opt/raysplit"  # where k8s/Dockerfile puts the repository


def _job() -> dict:
    return yaml.safe_load((ROOT / "k8s" / "rayjob.yaml").read_text())


def _start_resources(group: dict) -> dict:
    raw = group.get("rayStartParams", {}).get("resources")
    return json.loads(json.loads(raw)) if raw else {}  # KubeRay's form: a quoted JSON string


def test_the_rayjob_has_what_kuberay_requires():
    job = _job()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob" and job["metadata"]["name"]
    spec = job["spec"]
    assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    assert spec["activeDeadlineSeconds"] > 0
    yaml.safe_load(spec["runtimeEnvYAML"])  # a YAML string, as KubeRay passes it on
    cluster = spec["rayClusterSpec"]
    pinned = next(line for line in (ROOT / "requirements.txt").read_text().splitlines() if line.startswith("ray["))
    assert cluster["rayVersion"] == pinned.split("==")[1]
    assert cluster["authOptions"]["mode"] == "token"  # Ray's token auth on (KubeRay >= 1.5.1, Ray >= 2.52)
    head = cluster["headGroupSpec"]
    groups = cluster["workerGroupSpecs"]
    for template in [head["template"]] + [g["template"] for g in groups]:
        [container] = template["spec"]["containers"]
        assert container["image"] and container["resources"]["limits"]
        uri = [e for e in container["env"] if e["name"] == "MLFLOW_TRACKING_URI"]
        assert uri and ("configMapKeyRef" in uri[0]["valueFrom"] or "secretKeyRef" in uri[0]["valueFrom"])
    for g in groups:
        assert g["groupName"] and g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    gpu = [g for g in groups if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]]
    cpu = [g for g in groups if g not in gpu]
    assert len(gpu) == 1 and _start_resources(gpu[0]) == {"server": 1}  # the server actor can land only there
    assert cpu and all(_start_resources(g).get("client", 0) >= 1 for g in cpu)
    assert not any("server" in _start_resources(g) for g in cpu) and "server" not in _start_resources(head)


def test_the_entrypoint_is_a_command_raysplit_accepts(tmp_path):
    argv = shlex.split(_job()["spec"]["entrypoint"])
    assert argv[0] == "python" and argv[1] == f"{IMAGE_ROOT}/jobs/train.py"
    local = [a.replace(IMAGE_ROOT, str(ROOT)) for a in argv[2:]]
    assert Path(local[0]).is_file(), local[0]
    # the store the ConfigMap names (a server in the cluster) stands here as an empty local one: job_argv looks there
    # for an unfinished run of the job's name to continue
    run, what = job_argv(local, env={"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    assert run[:2] == ["run", local[0]] and "runtime.address=auto" in run and what.startswith("new run"), run
    cfg = load_config(run[1], run[2:])  # every override a key raysplit knows, with a valid value
    assert cfg.runtime.address == "auto" and cfg.runtime.server.num_gpus == 1
    assert cfg.runtime.server.resources == {"server": 1} and cfg.runtime.client.resources == {"client": 1}
    clients = cfg.runtime.num_workers * cfg.runtime.client.resources["client"]
    offered = sum(_start_resources(g).get("client", 0) * g["minReplicas"] for g in _job()["spec"]["rayClusterSpec"]
                  ["workerGroupSpecs"])
    assert clients <= offered, (clients, offered)  # the client actors fit the smallest cluster the job may get
