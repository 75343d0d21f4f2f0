"""Scale: V = 100, 1,000, 10,000 virtual clients on 2 client actors (SFLV2, cnn_small, Fashion-MNIST).

Fashion-MNIST's 60,000 training images are split IID so every client has at least one batch at V = 10,000
(6 images each, batch size 6). Two participation settings:

* ``1%``: 1, 10, 100 clients per round (the issue's setting; round work grows with V, so the comparable figure is
  time per sampled client);
* ``fixed``: 10 clients per round at every V (same work per round; isolates what V itself costs).

Reported per V: start-up (driver preparation: data, partition, model; then actors created and ready), time per
round and per sampled client (min/median/max over the timed rounds), peak RSS and USS of the driver and of each
actor (psutil, sampled every 0.25 s), the object store in use (Ray's memory summary), and the size of the
client actors' per-client state (their pickled checkpoint state).

    python benchmarks/scale.py [--clients 100 1000 10000] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import threading
import time

import numpy as np
import ray  # noqa: F401  (Ray ships psutil under ray/thirdparty_files and puts it on sys.path)
import psutil

from common import fmt, load, log_mlflow, mmm, save

from raysplit.config import load_config
from raysplit.experiment import prepare
from raysplit.runtime import runtime_for


def make_cfg(v: int, per_round: int | None, steps: int, batch: int):
    part = {"count": per_round, "fraction": None} if per_round else {"fraction": 0.01}
    return load_config(None, {
        "name": f"scale-{v}", "seed": 0, "algorithm": {"name": "sflv2"},
        "data.dataset": "fashion_mnist", "data.num_clients": v, "data.partition.name": "iid",
        "data.test_fraction": 0.0, "data.max_test_samples": 100,
        "model.name": "cnn_small", "model.cut": "conv1",
        "train.rounds": 1000, "train.batch_size": batch, "train.local_steps": steps,
        "train.optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "train.participation": part,
        "runtime.num_workers": 2, "runtime.server.num_cpus": 1, "runtime.client.num_cpus": 0,
        "tracking.enabled": False, "tracking.progress": False,
    })


class MemSampler(threading.Thread):
    """Peak RSS/USS per process (driver and the given actor pids), and peak object-store use."""

    def __init__(self, pids: dict[str, int], gcs: str, period: float = 0.25):
        super().__init__(daemon=True)
        self.procs = {k: psutil.Process(p) for k, p in pids.items()}
        self.peak = {k: {"rss": 0, "uss": 0} for k in pids}
        self.store_peak = 0.0
        self.gcs = gcs
        self.period = period
        self.stop = threading.Event()

    def sample(self):
        for k, p in self.procs.items():
            try:
                m = p.memory_full_info()
            except psutil.Error:
                continue
            self.peak[k]["rss"] = max(self.peak[k]["rss"], m.rss)
            self.peak[k]["uss"] = max(self.peak[k]["uss"], m.uss)

    def run(self):
        n = 0
        while not self.stop.is_set():
            self.sample()
            if n % 8 == 0:
                self.store_peak = max(self.store_peak, object_store_mib(self.gcs)[0])
            n += 1
            self.stop.wait(self.period)


def object_store_mib(gcs: str) -> tuple[float, int]:
    from ray._private.internal_api import memory_summary

    s = memory_summary(address=gcs, stats_only=True)
    m = re.search(r"Plasma memory usage (\d+(?:\.\d+)?) MiB, (\d+) objects", s)
    return (float(m.group(1)), int(m.group(2))) if m else (float("nan"), -1)


def run_case(v: int, per_round: int | None, a, gcs: str) -> dict:

    t0 = time.perf_counter()
    cfg = make_cfg(v, per_round, a.steps, a.batch)
    p = prepare(cfg)
    t_prepare = time.perf_counter() - t0
    t1 = time.perf_counter()
    r = cfg.runtime
    rt = runtime_for(r, p.inputs)
    t_actors = time.perf_counter() - t1
    b = rt.backend
    pids = {"driver": os.getpid(), "server": ray.get(b.server.__ray_call__.remote(lambda s: os.getpid()))}
    for i, w in enumerate(b.workers):
        pids[f"client_actor_{i}"] = ray.get(w.__ray_call__.remote(lambda s: os.getpid()))
    mem = MemSampler(pids, gcs)
    mem.start()
    per = p.sample_stream.shape[1]
    times, t = [], 0.0
    try:
        for r in range(a.warmup + a.rounds):
            clients = [int(c) for c in p.sample_stream[r]]
            ts = time.perf_counter()
            rt.begin_round(r, clients, t)
            p.algorithm.run_round(rt, r, clients, np.random.default_rng([cfg.seed, r, 3]))
            t = rt.end_round().t_end
            if r >= a.warmup:
                times.append(time.perf_counter() - ts)
        store_after = object_store_mib(gcs)
        states = rt.state_dict()["workers"]
        state_bytes = sum(len(pickle.dumps(s)) for s in states)
        global_bytes = sum(len(pickle.dumps(s["global"])) for s in states)
        hosted = sum(len(s["held"]) for s in states)
    finally:
        mem.stop.set()
        mem.join()
        mem.sample()
        rt.shutdown()
    out = {
        "V": v, "clients_per_round": per, "startup_prepare_s": t_prepare, "startup_actors_s": t_actors,
        "startup_s": t_prepare + t_actors, "round_s": mmm(times),
        "per_client_s": mmm([x / per for x in times]),
        "peak_mem_mib": {k: {m: x / 2**20 for m, x in d.items()} for k, d in mem.peak.items()},
        "object_store_peak_mib": mem.store_peak, "object_store_after_mib": store_after[0],
        "object_store_after_objects": store_after[1],
        "client_state_bytes": state_bytes, "client_state_bytes_without_global_model": state_bytes - global_bytes,
        "clients_hosted": hosted, "load": load(),
    }
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", nargs="+", type=int, default=[100, 1000, 10000])
    ap.add_argument("--modes", nargs="+", default=["1%", "fixed"], choices=["1%", "fixed"])
    ap.add_argument("--fixed", type=int, default=10, help="clients per round in the fixed mode")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--no-mlflow", action="store_true")
    a = ap.parse_args()

    ctx = ray.init(num_cpus=4, object_store_memory=1024**3, include_dashboard=False, log_to_driver=True)
    gcs = ctx.address_info["gcs_address"]
    print(f"load {load()}")
    print("| participation | V | clients/round | start-up s (prepare + actors) | round s min/med/max | "
          "per sampled client ms | peak RSS MiB driver / server / client actors | peak USS MiB client actors | "
          "object store peak MiB | client state KiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = {}
    for mode in a.modes:
        for v in a.clients:
            r = run_case(v, a.fixed if mode == "fixed" else None, a, gcs)
            results[f"{mode}/{v}"] = r
            pm = r["peak_mem_mib"]
            ca = [k for k in pm if k.startswith("client_actor")]
            rss_list = " + ".join(f"{pm[k]['rss']:.0f}" for k in ca)
            uss_list = " + ".join(f"{pm[k]['uss']:.0f}" for k in ca)
            print(f"| {mode} | {v} | {r['clients_per_round']} | {r['startup_s']:.1f} ({r['startup_prepare_s']:.1f} + "
                  f"{r['startup_actors_s']:.1f}) | {fmt(r['round_s'], 1, 3)} | {fmt(r['per_client_s'], 1e3, 1)} | "
                  f"{pm['driver']['rss']:.0f} / {pm['server']['rss']:.0f} / "
                  f"{rss_list} | {uss_list} | "
                  f"{r['object_store_peak_mib']:.0f} | {r['client_state_bytes'] / 1024:.0f} |", flush=True)
    ray.shutdown()
    path = save("scale", {"args": vars(a), "results": results, "load_at_end": load()})
    if not a.no_mlflow:
        m = {}
        for key, r in results.items():
            k = key.replace("%", "pct").replace("/", "_V")
            m[f"{k}_round_s_median"] = r["round_s"]["median"]
            m[f"{k}_per_client_ms_median"] = r["per_client_s"]["median"] * 1e3
            m[f"{k}_startup_s"] = r["startup_s"]
            m[f"{k}_client_actor_rss_mib_max"] = max(d["rss"] for n, d in r["peak_mem_mib"].items()
                                                     if n.startswith("client_actor"))
            m[f"{k}_driver_rss_mib"] = r["peak_mem_mib"]["driver"]["rss"]
            m[f"{k}_object_store_peak_mib"] = r["object_store_peak_mib"]
            m[f"{k}_client_state_kib"] = r["client_state_bytes"] / 1024
        log_mlflow("scale", {**vars(a), "load": load()}, m, path)


if __name__ == "__main__":
    main()
