"""Runtime speed and scale II (issue 15): the forward window, placement by load, spilled client state.

Three measurements, each comparing the old path and the new one in the same run (interleaved where timed):

* ``window``: peak memory of the client actors with 10 and 100 clients per round, SFLV2 on cnn_small (cut
  conv1, Fashion-MNIST, 1,000 clients, IID), every client's first forward at once (``runtime.transport.window: null``, the
  old path) against ``runtime.transport.window: 4``. Peak RSS/USS per process sampled every 0.1 s (psutil).
* ``placement``: FedAvg (cnn_small, 1,000 clients, 10 per round, 10 local batches of 32) on 2 client actors, client
  ``c`` on actor ``c mod 2`` (``runtime.placement.strategy: home``, the old rule) against the balanced placement: clients on
  the busier actor per round and round time. Each repetition times one round of each, back to back.
* ``spill``: PSL and SplitFedV3 with every client keeping its own ResNet18 client part (cut after layer1, 32x32
  inputs) and its momentum, 100 clients per round, at V = 1,000 and V = 100,000 virtual clients, with a budget
  of ``--budget-mb`` per client actor for that state (``runtime.placement.client_state_mb``; the rest spills to disk):
  round time, client-actor RSS, bytes spilled and read back. The clients' data are 8 images each drawn (with
  overlap) from a pool of synthetic images, so 100,000 clients fit in memory; the server copies train with plain
  SGD so that 100 ResNet18 server copies fit too (the benchmark is about client state).

    python benchmarks/scale2.py window|placement|spill [--rounds N] ...
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np
import ray  # noqa: F401  (Ray ships psutil under ray/thirdparty_files and puts it on sys.path)
import psutil

from common import fmt, load, log_mlflow, mmm, save

from raysplit.config import load_config
from raysplit.experiment import prepare, sample_stream
from raysplit.runtime import Runtime, runtime_for


class Peak(threading.Thread):
    """Peak RSS and USS (MiB) of the given processes, sampled every ``period`` seconds."""

    def __init__(self, pids: dict[str, int], period: float = 0.1):
        super().__init__(daemon=True)
        self.procs = {k: psutil.Process(p) for k, p in pids.items()}
        self.peak = {k: {"rss": 0.0, "uss": 0.0} for k in pids}
        self.period, self.halt = period, threading.Event()

    def sample(self) -> None:
        for k, p in self.procs.items():
            try:
                m = p.memory_full_info()
            except psutil.Error:
                continue
            self.peak[k]["rss"] = max(self.peak[k]["rss"], m.rss / 2**20)
            self.peak[k]["uss"] = max(self.peak[k]["uss"], m.uss / 2**20)

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(self.period)

    def stop(self) -> dict:
        self.halt.set()
        self.join()
        self.sample()
        return self.peak


def plus(values, spec: str = ".0f") -> str:
    """``a + b + ...`` of per-actor figures."""
    return " + ".join(format(x, spec) for x in values)


def actor_pids(rt) -> dict[str, int]:
    b = rt.backend
    out = {"server": ray.get(b.server.__ray_call__.remote(lambda s: os.getpid()))}
    for i, w in enumerate(b.workers):
        out[f"client_actor_{i}"] = ray.get(w.__ray_call__.remote(lambda s: os.getpid()))
    return out


def one_round(rt, p, cfg, r: int, t: float) -> tuple[float, float]:
    """Round ``r`` of the prepared run; (wall seconds, simulated end time)."""
    clients = [int(c) for c in p.sample_stream[r]]
    t0 = time.perf_counter()
    rt.begin_round(r, clients, t)
    p.algorithm.run_round(rt, r, clients, np.random.default_rng([cfg.seed, r, 3]))
    t_end = rt.end_round().t_end
    return time.perf_counter() - t0, t_end


def runtime_of(cfg, p) -> Runtime:
    r = cfg.runtime
    return runtime_for(r, p.inputs)


def base_cfg(**over):
    cfg = {"seed": 0, "data.dataset": "fashion_mnist", "data.partition.name": "iid", "data.test_fraction": 0.0,
           "data.max_test_samples": 100, "model.name": "cnn_small", "model.cut": "conv1", "train.rounds": 1000,
           "train.optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9}, "runtime.num_workers": 2,
           "runtime.server.num_cpus": 1, "runtime.client.num_cpus": 0, "runtime.faults.max_retries": 0,
           "tracking.enabled": False, "tracking.progress": False}
    cfg.update(over)
    return load_config(None, cfg)


# ---- window -------------------------------------------------------------------------------------------------------
def bench_window(a) -> dict:
    print("| clients/round | window | round s min/med/max | peak RSS MiB per client actor | peak USS MiB per client "
          "actor | USS growth over 10/round, MiB |")
    print("|---|---|---|---|---|---|")
    out, uss10 = {}, {}
    for per in a.per_round:
        for window in (None, 4):
            cfg = base_cfg(**{"name": f"window-{per}-{window}", "algorithm": {"name": "sflv2", "order": "shuffled"},
                              "data.num_clients": 1000, "train.batch_size": 32, "train.local_steps": 2,
                              "train.participation": {"count": per, "fraction": None}, "runtime.transport.window": window})
            p = prepare(cfg)
            rt = runtime_of(cfg, p)
            try:
                pids = actor_pids(rt)
                t = 0.0
                for r in range(a.warmup):
                    t = one_round(rt, p, cfg, r, t)[1]
                peak = Peak({k: v for k, v in pids.items() if k.startswith("client")})
                peak.start()
                times = []
                for r in range(a.warmup, a.warmup + a.rounds):
                    dt, t = one_round(rt, p, cfg, r, t)
                    times.append(dt)
                mem = peak.stop()
            finally:
                rt.shutdown()
            key = f"{per}/{window}"
            uss = [m["uss"] for m in mem.values()]
            if per == min(a.per_round):
                uss10[window] = uss
            grow = [u - b for u, b in zip(uss, uss10.get(window, uss))]
            out[key] = {"round_s": mmm(times), "peak": mem, "uss_growth_mib": grow, "load": load()}
            print(f"| {per} | {window} | {fmt(mmm(times), 1, 3)} | {plus(m['rss'] for m in mem.values())} | "
                  f"{plus(uss)} | {plus(grow, '+.0f')} |", flush=True)
    return out


# ---- placement ----------------------------------------------------------------------------------------------------
def bench_placement(a) -> dict:
    runs = {}
    for place in ("home", "balanced"):
        cfg = base_cfg(**{"name": f"placement-{place}", "algorithm": {"name": "fedavg"}, "data.num_clients": 1000,
                          "train.batch_size": 32, "train.local_steps": 10,
                          "train.participation": {"count": 10, "fraction": None}, "runtime.placement.strategy": place,
                          "runtime.client.num_cpus": 1, "runtime.server.num_cpus": 0})
        p = prepare(cfg)
        runs[place] = (cfg, p, runtime_of(cfg, p))
    times = {k: [] for k in runs}
    busiest = {k: [] for k in runs}
    clock = {k: 0.0 for k in runs}
    try:
        for r in range(a.warmup + a.rounds):
            for place, (cfg, p, rt) in runs.items():
                dt, clock[place] = one_round(rt, p, cfg, r, clock[place])
                on = np.bincount(rt.holders[p.sample_stream[r]], minlength=len(rt.backend.workers))
                if r >= a.warmup:
                    times[place].append(dt)
                    busiest[place].append(int(on.max()))
        same = clock["home"] == clock["balanced"]
    finally:
        for _, _, rt in runs.values():
            rt.shutdown()
    ratio = [b / h for b, h in zip(times["balanced"], times["home"])]
    print("| placement | clients on the busier actor (mean; of 10) | round s min/med/max |")
    print("|---|---|---|")
    for place in runs:
        print(f"| {place} | {np.mean(busiest[place]):.2f} | {fmt(mmm(times[place]), 1, 3)} |")
    print(f"balanced / home per round, min/med/max: {fmt(mmm(ratio), 1, 3)}; same simulated clock: {same}")
    return {"round_s": {k: mmm(v) for k, v in times.items()}, "busiest_mean": {k: float(np.mean(v))
            for k, v in busiest.items()}, "ratio": mmm(ratio), "same_sim_clock": same, "load": load()}


# ---- spill --------------------------------------------------------------------------------------------------------
def spill_case(algorithm: str, v: int, a) -> dict:
    cfg = base_cfg(**{"name": f"spill-{algorithm}-{v}", "algorithm": {"name": algorithm},
                      "data.dataset": "synthetic", "data.options": {"num_samples": a.pool, "shape": [3, 32, 32],
                                                                     "test_fraction": 0.05},
                      "data.num_clients": 100, "data.test_fraction": 0.1, "model.name": "resnet18",
                      "model.cut": "layer1",
                      "train.batch_size": 8, "train.local_steps": 1,
                      "train.server_optimizer": {"name": "sgd", "lr": 0.01},
                      "train.participation": {"count": a.spill_per_round, "fraction": None},
                      "runtime.placement.client_state_mb": a.budget_mb})
    p = prepare(cfg)
    rng = np.random.default_rng([0, v])
    n = len(p.inputs.train_data["y"])
    p.inputs.train_idx = [np.sort(rng.choice(n, 8, replace=False)) for _ in range(v)]
    p.inputs.test_idx = [np.zeros(0, np.int64)] * v
    p.inputs.profiles = [p.inputs.profiles[0]] * v
    p.sample_stream = sample_stream(cfg.seed, v, a.spill_per_round, a.warmup + a.rounds)
    t0 = time.perf_counter()
    rt = runtime_of(cfg, p)
    startup = time.perf_counter() - t0
    try:
        pids = actor_pids(rt)
        peak = Peak({k: x for k, x in pids.items() if k.startswith("client")})
        peak.start()
        times, t = [], 0.0
        for r in range(a.warmup + a.rounds):
            dt, t = one_round(rt, p, cfg, r, t)
            if r >= a.warmup:
                times.append(dt)
        mem = peak.stop()
        stores = ray.get([w.__ray_call__.remote(
            lambda s: {"in_memory_mib": s.host.store.bytes_in_memory / 2**20, "spills": s.host.store.spills,
                       "loads": s.host.store.loads, "values": len(s.host.store._mem) + len(s.host.store._disk)})
            for w in rt.backend.workers])
    finally:
        rt.shutdown()
    return {"V": v, "startup_s": startup, "round_s": mmm(times), "peak": mem, "stores": stores, "load": load()}


def bench_spill(a) -> dict:
    print(f"budget {a.budget_mb} MB of client state per client actor; {a.spill_per_round} clients per round; "
          f"{a.warmup} warm-up + {a.rounds} timed rounds")
    print("| algorithm | V | start-up s | round s min/med/max | peak RSS MiB per client actor | state in memory MiB "
          "| values spilled / read back | values held |")
    print("|---|---|---|---|---|---|---|---|")
    out = {}
    for algorithm in a.algorithms:
        for v in a.clients:
            r = spill_case(algorithm, v, a)
            out[f"{algorithm}/{v}"] = r
            st = r["stores"]
            print(f"| {algorithm} | {v} | {r['startup_s']:.1f} | {fmt(r['round_s'], 1, 2)} | "
                  f"{plus(m['rss'] for m in r['peak'].values())} | {plus(x['in_memory_mib'] for x in st)} | "
                  f"{sum(x['spills'] for x in st)} / {sum(x['loads'] for x in st)} | "
                  f"{sum(x['values'] for x in st)} |", flush=True)
        lo, hi = out[f"{algorithm}/{min(a.clients)}"], out[f"{algorithm}/{max(a.clients)}"]
        print(f"{algorithm}: round time at V={max(a.clients)} / V={min(a.clients)} = "
              f"{hi['round_s']['median'] / lo['round_s']['median']:.2f}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["window", "placement", "spill"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--per-round", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--clients", type=int, nargs="+", default=[1000, 100000])
    ap.add_argument("--algorithms", nargs="+", default=["psl", "sflv3"])
    ap.add_argument("--budget-mb", type=float, default=64.0)
    ap.add_argument("--spill-per-round", type=int, default=100)
    ap.add_argument("--pool", type=int, default=4000, help="synthetic images the spill clients draw from")
    ap.add_argument("--no-mlflow", action="store_true")
    a = ap.parse_args()
    ray.init(num_cpus=4, object_store_memory=2 * 1024**3, include_dashboard=False, log_to_driver=True)
    print(f"load {load()}")
    res = {"window": bench_window, "placement": bench_placement, "spill": bench_spill}[a.what](a)
    ray.shutdown()
    path = save(f"scale2-{a.what}", {"args": vars(a), "results": res, "load_at_end": load()})
    if not a.no_mlflow:
        flat = {}
        for k, r in (res.items() if a.what != "placement" else []):
            flat[f"{k.replace('/', '_')}_round_s_median"] = r["round_s"]["median"]
        if a.what == "placement":
            flat = {"balanced_over_home": res["ratio"]["median"], **{f"busiest_{k}": x for k, x in
                                                                    res["busiest_mean"].items()}}
        log_mlflow(f"scale2-{a.what}", {**vars(a), "load": load()}, flat, path)


if __name__ == "__main__":
    main()
