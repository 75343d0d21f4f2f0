"""Run by tests/test_placement.py in its own process: a head + 2-node ray.cluster_utils.Cluster (one node with
the `server` resource, one with `client`), actors placed by raysplit's resource config, then the client node is
removed mid-run. Prints one JSON line with what it saw."""

import json
import os
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.join(os.path.dirname(__file__)))

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from raysplit.config import load_config  # noqa: E402
from raysplit.experiment import prepare  # noqa: E402
from raysplit.runtime import Runtime  # noqa: E402
from raysplit.runtime.ray_backend import RayBackend  # noqa: E402

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
server_node = cluster.add_node(num_cpus=1, resources={"server": 1})
client_node = cluster.add_node(num_cpus=1, resources={"client": 4})
cluster.wait_for_nodes()
ray.init(address=cluster.address, log_to_driver=False)
out = {}
cfg = load_config(None, {
    "algorithm.name": "sflv2", "data.dataset": "digits", "data.num_clients": 4, "data.partition.name": "iid",
    "model.cut": "conv1", "train.rounds": 3, "train.local_steps": 2, "tracking.progress": False,
    "runtime.num_workers": 2, "runtime.address": cluster.address,
    "runtime.server": {"num_cpus": 0.5, "resources": {"server": 1}},
    "runtime.client": {"num_cpus": 0.25, "resources": {"client": 1}},
})
p = prepare(cfg)
backend = RayBackend(cfg.runtime, get_timeout=60)
rt = Runtime(backend, p.inputs)
nodes = backend.node_ids()
out["server_on_server_node"] = nodes["server"][0] == server_node.node_id
out["workers_on_client_node"] = all(n == client_node.node_id for n in nodes["workers"])
clients = [int(c) for c in p.sample_stream[0]]
rt.begin_round(0, clients, 0.0)
p.algorithm.run_round(rt, 0, clients, np.random.default_rng(0))
out["round0_ok"] = rt.end_round().t_end > 0
cluster.remove_node(client_node)
t0 = time.time()
try:
    rt.begin_round(1, clients, 0.0)
    p.algorithm.run_round(rt, 1, clients, np.random.default_rng(1))
    rt.end_round()
    out["error"] = None
except Exception as e:  # noqa: BLE001 - report what the user would see
    out["error"] = f"{type(e).__name__}: {e}"
out["seconds_to_error"] = time.time() - t0
print("RESULT " + json.dumps(out), flush=True)
ray.shutdown()
cluster.shutdown()
