"""What a Ray run asks for and what it gets: Ray started or joined (``init_ray``), the actors' resources checked
against the cluster before any actor exists (``check_resources``), and the automatic choices that follow from the
cores behind the actors (``auto_transport``, ``auto_threads``, ``usable_cores``). Used by :mod:`ray_backend`.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import ray

from raysplit.errors import ResourceError
from raysplit.runtime.devices import check_local_gpus, machine_cores


def init_ray(rcfg) -> bool:
    """Join the cluster at ``runtime.address`` (``auto``: the one running on this machine or named by
    RAY_ADDRESS), taking its resources as they are; or, with no address, start a private local Ray for this run
    (``address="local"``: never attach to a cluster that happens to run on this machine, whose resources were not
    sized for this run). Returns True if this call started/connected Ray."""
    if ray.is_initialized():
        return False
    if rcfg.address:
        ray.init(address=rcfg.address, log_to_driver=True)
        return True
    check_local_gpus(rcfg)  # a private Ray has this machine's GPUs only: what it lacks is refused before it starts
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private single-user Ray on this machine (stack.md §6)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    need = rcfg.server.num_cpus + rcfg.num_workers * rcfg.client.num_cpus
    num_cpus = rcfg.num_cpus or max(os.cpu_count() or 1, math.ceil(need))
    ray.init(address="local", num_cpus=num_cpus, object_store_memory=rcfg.object_store_memory,
             include_dashboard=False, log_to_driver=True)
    return True


def bundle(res) -> dict[str, float]:
    b = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.resources}
    if res.memory:
        b["memory"] = float(res.memory)
    return {k: float(v) for k, v in b.items() if v}


def visible(res: dict) -> dict:
    """A node's (or the cluster's) resources without Ray's per-node and placement-group entries."""
    return {k: round(v, 3) for k, v in res.items() if not k.startswith("node:") and "_group_" not in k}


def placed_node(actor) -> str | None:
    """The node where Ray has given a not yet constructed actor a worker (its creation is leased), None while no
    node has taken it: read from the GCS actor table (``ray._private.state``; the public state API needs the
    dashboard). None when unknown."""
    try:
        from ray._private import state

        address = state.actors(actor._actor_id.hex()).get("Address") or {}
        return address.get("NodeID") if address.get("Port") else None
    except Exception:  # noqa: BLE001 - only refines an error message
        return None


def check_resources(rcfg) -> None:
    """Fail at once, naming what is missing, if the server and client actors cannot fit this cluster."""
    total = ray.cluster_resources()
    server, client = bundle(rcfg.server), bundle(rcfg.client)
    need: dict[str, float] = defaultdict(float)
    for k, v in server.items():
        need[k] += v
    for k, v in client.items():
        need[k] += v * rcfg.num_workers
    problems = [f"{k}: need {v:g} (server {server.get(k, 0):g} + {rcfg.num_workers} client actors x "
                f"{client.get(k, 0):g}), cluster has {total.get(k, 0):g}"
                for k, v in need.items() if v > total.get(k, 0) + 1e-9]
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if server and not any(all(n.get(k, 0) >= v for k, v in server.items()) for n in nodes):
        offered = [{k: v for k, v in n.items() if not k.startswith("node:")} for n in nodes]
        problems.append(f"no single node offers the server actor's resources {server} (runtime.server); "
                        f"nodes offer {offered}")
    if client and not any(all(n.get(k, 0) >= v for k, v in client.items()) for n in nodes):
        problems.append(f"no node offers a client actor's resources {client} (runtime.client)")
    if problems:
        raise ResourceError("the requested actors do not fit this Ray cluster: " + "; ".join(problems))


def auto_transport(cores: float, num_workers: int) -> tuple[str, str]:
    """``runtime.transport.kind: auto``: ``compiled`` where ``cores`` (the CPU cores Ray may use) give one to each
    actor and one to the driver; else ``compiled-steps``: compiled graphs for the split- and pooled-step loops,
    actor calls for the event loop. Returns it with the reason.

    Ray 2.60's compiled-graph actors poll their channels while idle (40-86 % of a core each, benchmarks/RESULTS.md).
    In a step loop the actors compute one after another, so on a machine with fewer cores than processes the
    pollers take the idle core and the channels' lower latency wins: on 2 cores (a server and two client actors)
    the quickstart's rounds took 1.80 s compiled against 2.30 s with calls, ResNet18's 4.73 against 4.62 s (within
    the repeats' spread). In the event loop (the asynchronous methods, GAS) every actor computes at once and the
    pollers take CPU from the compute: GAS's rounds took 56.0 s compiled against 50.2 s with calls
    (``make bench-transport``, benchmarks/RESULTS.md "Runtime III")."""
    need = num_workers + 2  # the client actors, the server actor, the driver
    if cores >= need:
        return "compiled", f"{cores:g} CPU cores for {num_workers} client actors, the server actor and the driver"
    return "compiled-steps", (f"{cores:g} CPU cores for {need} processes ({num_workers} client actors, the server "
                              "actor, the driver): compiled graphs for step loops, where the actors compute in "
                              "turn; actor calls for the event loop, where the pollers would take CPU from the "
                              "compute")


def auto_threads(rcfg, cores: float, polling: bool, concurrent: bool = False) -> tuple[dict, str]:
    """``runtime.torch_threads: auto``: torch threads per actor role, with the reason. Joining a cluster, an actor
    gets its CPU share (``runtime.server``/``runtime.client`` ``num_cpus``, rounded up), since other runs' actors
    may share its node. A private Ray runs on this machine's ``cores``; how many each actor may use depends on what
    the idle actors do while one computes:

    - ``polling`` (the run's loop travels over compiled graphs, whose idle actors poll their channels): each actor
      gets its share, ``cores // (client actors + 1)``, at least 1, so that no two compute teams fight for a core.
      On the 2-core machine two threads per actor made the quickstart's rounds 4.1x as long (9.73 against 2.37 s)
      and ResNet18's 1.17x: torch's worker threads wait for each other at every operation while pollers hold the
      cores (measured before ``limit_threads`` stopped limiting torch's OpenMP pool; not remeasured).
    - ``concurrent`` (the event loop: the server and the client actors compute at once): the same share. With
      every actor on all cores, GAS's rounds were 1.6x as long as in the local backend with 2 threads (3.24
      against 2.04 s per server update, one round each).
    - otherwise (a step loop over actor calls: idle actors block): each actor gets the machine's cores, as a lone
      PyTorch process would, since one computes while the others wait for it.

    ``make bench-threads``, ``make bench-gas-floor``; benchmarks/RESULTS.md "Runtime III"."""
    if rcfg.address:
        share = {"server": rcfg.server.num_cpus, "client": rcfg.client.num_cpus}
        threads = {k: max(1, math.ceil(v or 1)) for k, v in share.items()}
        return threads, (f"joined a cluster: each actor's CPU share, rounded up (server {share['server']:g}, "
                         f"client {share['client']:g} CPUs)")
    n = max(1, int(cores))
    if polling or concurrent:
        k = max(1, n // (rcfg.num_workers + 1))
        why = ("over compiled graphs, whose idle actors poll" if polling else
               "in the event loop, whose actors compute at once")
        return {"server": k, "client": k}, (f"a private Ray on {n} cores {why}: a share of {k} per actor "
                                            f"({rcfg.num_workers} client actors and the server)")
    return {"server": n, "client": n}, (f"a private Ray on {n} cores over actor calls, whose idle actors block: "
                                        "each actor may use them all while the others wait for it")


def usable_cores(rcfg) -> float:
    """CPU cores behind the actors: this machine's (those the process may run on) for a private local Ray, whose
    logical CPUs may be raised above them to fit the actors; the cluster's CPUs when joining one."""
    return float(ray.cluster_resources().get("CPU", 0.0) if rcfg.address else machine_cores())
