"""Run by tests/test_faults.py in its own process (the test session has its own Ray): full experiments
(``raysplit.experiment.run_experiment``, the path users take, with its RoundGuard) on a ray.cluster_utils.Cluster
whose node hosting the client actors is removed mid-run.

Nodes: a head with no CPUs (the driver's), a ``server`` node, and client node A (``client`` resource). The client
actors need ``client``, so they land on A, the only node offering it, and the server actor on the ``server`` node
(``placement``: where each actor was found in the first run's round 0; tests/test_placement.py reads it). Then, in
this order:

1. ``reference``: the uninterrupted run, on the local backend (in process: the Ray backend gives the local one's
   metrics bit for bit, tests/test_direct_steps.py), so that the cluster hosts only the runs that lose a node.
2. ``spare_sigterm``: the same config; after round 1 (from ``on_round``) a spare client node B joins, then A is
   shut down gracefully (SIGTERM) -> the run should complete, one restart tagged, with the reference's per-round
   metrics. ``spare_crash``: the same with B replaced by C, B's processes SIGKILLed as in a machine failure (Ray
   learns of the loss from its health checks).
3. ``noroom``: the same config, its client actors now on C; after round 1 C crashes and no node offers
   ``client`` -> the run should fail with an ActorFailure naming actor, node and round, its MLflow run FAILED;
   ``first_error`` is the actor failure the run's guard was handed first (what the runtime reports of the lost
   node before any replacement is tried).

One cluster serves all three (and tests/test_placement.py, which used to start a cluster of its own). Usage: node_loss_script.py WORKDIR. Prints one
``RESULT {json}`` line."""

import json
import os
import sys
import threading
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import raysplit.experiment as experiment  # noqa: E402
from raysplit.config import load_config  # noqa: E402
from raysplit.runtime.driver import drivers

KEYS = ("eval/accuracy", "eval/loss", "eval/f1_macro", "train/loss", "time/sim", "comm/bytes_up", "comm/bytes_down")
CLIENT_NODE = {"num_cpus": 1, "resources": {"client": 4}}

work = sys.argv[1]
uri = f"sqlite:///{os.path.join(work, 'mlflow.db')}"
WATCHDOG_S = 280  # the whole script; past it the cluster is shut down (no Ray processes left behind) and it exits
out = {}


def watchdog():
    print("RESULT " + json.dumps({**out, "watchdog": WATCHDOG_S}), flush=True)
    try:
        cluster.shutdown()
    finally:
        os._exit(3)


timer = threading.Timer(WATCHDOG_S, watchdog)
timer.daemon = True
timer.start()
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
server_node = cluster.add_node(num_cpus=1, resources={"server": 1})
node_a = cluster.add_node(**CLIENT_NODE)
cluster.wait_for_nodes()
ray.init(address=cluster.address, log_to_driver=False)

backends = []
_make = experiment.make_backend


def capture(rcfg):
    backends.append(_make(rcfg))
    return backends[-1]


experiment.make_backend = capture
recoveries = []  # when RoundGuard.recover was called (an actor failure seen by the run)
_recover = drivers.RoundGuard.recover


errors = []  # what RoundGuard.recover was handed


def recover(self, error, rnd):
    recoveries.append(time.time())
    errors.append(f"{type(error).__name__}: {error}")
    return _recover(self, error, rnd)


drivers.RoundGuard.recover = recover
out.update({"node_a": node_a.node_id, "server_node": server_node.node_id})


def config(name, **more):
    return load_config(None, {**{
        "name": name, "seed": 0, "algorithm.name": "sflv2", "data.dataset": "digits", "data.num_clients": 4,
        "data.partition.name": "iid", "model.name": "cnn_small", "model.cut": "conv1", "train.rounds": 4,
        "train.batch_size": 16, "train.local_steps": 2, "eval.every": 1,
        "tracking.uri": uri, "tracking.experiment": "node-loss", "tracking.progress": False,
        "tracking.output_dir": os.path.join(work, "outputs"),
        "runtime.address": cluster.address, "runtime.num_workers": 2,
        "runtime.server": {"num_cpus": 0.5, "resources": {"server": 1}},
        "runtime.client": {"num_cpus": 0.25, "resources": {"client": 1}},
    }, **more})


def curves(run_id):
    client = MlflowClient(uri)
    return {k: [(h.step, h.value) for h in sorted(client.get_metric_history(run_id, k), key=lambda h: h.step)]
            for k in KEYS}


def run_info(run_id):
    run = MlflowClient(uri).get_run(run_id)
    return {"status": run.info.status, "tags": {k: v for k, v in run.data.tags.items() if k.startswith("raysplit.")}}


def workers_nodes():
    return sorted(set(backends[-1].node_ids()["workers"]))


def until_noticed():
    """Call the client actors until they fail (an ActorFailure out of ``on_round``: the run's guard takes over).
    A crashed node's workers can go on answering for a few seconds, so without this the run could finish (with
    right results) before it notices; bounded, as is everything here."""
    deadline = time.time() + 60
    while time.time() < deadline:
        workers_nodes()
        time.sleep(0.2)


# 1. reference (in process)
t = time.time()
ref = experiment.run_experiment(config("reference", **{"runtime.backend": "local"}))
out["reference"] = {"seconds": time.time() - t, "curves": curves(ref["run_id"])}

# 2. the node hosting the client actors removed while a spare node has room: first gracefully (A -> B), then as a
#    crash (B -> C)
def spare_run(name: str, graceful: bool) -> dict:
    spare = {}

    def remove(rnd, m):
        if rnd == 0 and "placement" not in out:  # where the first run's actors were placed
            nodes = backends[-1].node_ids()
            out["placement"] = {"server": nodes["server"], "workers": sorted(set(nodes["workers"]))}
        if rnd == 1 and "removed_at" not in spare:
            spare["nodes_before"] = workers_nodes()
            victim = next(n for n in cluster.worker_nodes if n.node_id == spare["nodes_before"][0])
            t0 = time.time()
            new = cluster.add_node(**CLIENT_NODE)
            cluster.wait_for_nodes()
            spare["node_b"] = new.node_id
            spare["add_seconds"] = time.time() - t0
            t0 = time.time()
            cluster.remove_node(victim, allow_graceful=graceful)
            spare["remove_seconds"] = time.time() - t0
            spare["removed_at"] = time.time()
            recoveries.clear()
            until_noticed()
        elif "removed_at" in spare:  # after the removal: where the client actors are now (the last call counts)
            spare["nodes_after"] = workers_nodes()

    t = time.time()
    hit = experiment.run_experiment(config(name), on_round=remove)
    spare["seconds"] = time.time() - t
    spare["seconds_removal_to_restarts"] = [r - spare["removed_at"] for r in recoveries]
    spare["seconds_removal_to_end"] = time.time() - spare.pop("removed_at")
    spare["curves"] = curves(hit["run_id"])
    spare.update(run_info(hit["run_id"]))
    return spare


out["spare_sigterm"] = spare_run("spare-sigterm", graceful=True)
out["spare_crash"] = spare_run("spare-crash", graceful=False)

# 3. the node now hosting the client actors crashes and no node offers their resource
noroom = {}


def remove_last(rnd, m):
    if rnd == 1 and "removed_at" not in noroom:
        noroom["nodes_before"] = workers_nodes()
        node = next(n for n in cluster.worker_nodes if n.node_id == noroom["nodes_before"][0])
        cluster.remove_node(node, allow_graceful=False)
        noroom["removed_at"] = time.time()
        recoveries.clear()
        errors.clear()
        until_noticed()


try:
    experiment.run_experiment(config("noroom"), on_round=remove_last)
    noroom["error"] = None
except Exception as e:  # noqa: BLE001 - report what the user would see
    noroom["error"] = f"{type(e).__name__}: {e}"
removed = noroom.pop("removed_at", time.time())
noroom["seconds_removal_to_error"] = time.time() - removed
noroom["seconds_removal_to_restarts"] = [r - removed for r in recoveries]
noroom["first_error"] = errors[0] if errors else None
client = MlflowClient(uri)
runs = client.search_runs([client.get_experiment_by_name("node-loss").experiment_id],
                          filter_string="attributes.run_name = 'noroom'")
noroom.update(run_info(runs[0].info.run_id) if runs else {"status": None})
out["noroom"] = noroom

timer.cancel()
print("RESULT " + json.dumps(out), flush=True)
ray.shutdown()
cluster.shutdown()
