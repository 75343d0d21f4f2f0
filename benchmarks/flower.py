"""FedAvg: raysplit vs Flower's Ray simulation, same model, data, clients, participation and local work.

cnn_small on Fashion-MNIST, 100 clients (IID, raysplit's partition), 10% participation, 10 SGD batches of 32 per
sampled client per round (plain SGD, lr 0.01, no momentum, so neither side carries optimizer state), 2 client
processes on each side (raysplit: 2 client actors; Flower: 2 concurrent client actors of 1 CPU), 1 torch thread
per process, no evaluation. Flower runs in its own venv (benchmarks/setup_flower.sh) as a subprocess of this script
(benchmarks/flower_side.py); the two alternate, ``--reps`` times each, so every ratio comes from the same
invocation under the same load. The first round of each run (actor start-up, data loading) is not timed.

    python benchmarks/flower.py [--rounds 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from common import ROOT, fmt, load, log_mlflow, mmm, save

FLOWER_PY = ROOT / "benchmarks" / ".flower-venv" / "bin" / "python"


def raysplit_rounds(a) -> list[float]:
    import ray

    from raysplit.config import load_config
    from raysplit.experiment import prepare
    from raysplit.runtime import Runtime, make_backend

    cfg = load_config(None, {
        "name": "flower-cmp", "seed": 0, "algorithm": {"name": "fedavg"},
        "data.dataset": "fashion_mnist", "data.num_clients": a.clients, "data.partition.name": "iid",
        "data.test_fraction": 0.0, "data.max_test_samples": 100,
        "model.name": "cnn_small", "train.rounds": a.rounds + 1, "train.batch_size": a.batch,
        "train.local_steps": a.steps, "train.optimizer": {"name": "sgd", "lr": a.lr},
        "train.participation.fraction": a.fraction,
        "runtime.num_workers": 2, "runtime.server.num_cpus": 0, "runtime.client.num_cpus": 1,
        "runtime.torch_threads": 1, "tracking.enabled": False, "tracking.progress": False,
    })
    ray.init(num_cpus=4, object_store_memory=512 * 1024**2, include_dashboard=False, log_to_driver=True)
    try:
        p = prepare(cfg)
        rt = Runtime(make_backend(cfg.runtime), p.inputs, cfg.runtime.transport.max_in_flight)
        times, t = [], 0.0
        for r in range(a.rounds + 1):
            clients = [int(c) for c in p.sample_stream[r]]
            ts = time.perf_counter()
            rt.begin_round(r, clients, t)
            p.algorithm.run_round(rt, r, clients, np.random.default_rng([cfg.seed, r, 3]))
            t = rt.end_round().t_end
            times.append(time.perf_counter() - ts)
        rt.shutdown()
    finally:
        ray.shutdown()
    return times[1:]


def compute_floor(a) -> dict:
    """The local work of one round done in this process, serially, with 1 torch thread (no Ray, no Flower): the
    sampled clients' ``steps`` SGD batches on cnn_small. Divided by the 2 client processes it is the best any
    2-process runtime can do; with raysplit's static placement (client c on actor c % 2) the busier actor's share
    is the bound for raysplit."""
    import torch
    import torch.nn.functional as F

    from raysplit.data import load_dataset, to_tensor
    from raysplit.experiment import sample_stream
    from raysplit.models import build_model

    b = load_dataset("fashion_mnist")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("cnn_small", 10, (1, 28, 28))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    per = max(1, int(round(a.fraction * a.clients)))
    rng = np.random.default_rng(0)
    times = []
    for r in range(4):
        t0 = time.perf_counter()
        for _ in range(per * a.steps):
            idx = rng.choice(len(b.y_train), a.batch, replace=False)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(to_tensor(b.x_train[idx], b.spec)), torch.as_tensor(b.y_train[idx])).backward()
            opt.step()
        if r:
            times.append(time.perf_counter() - t0)
    torch.set_num_threads(os.cpu_count() or 1)
    serial = statistics.median(times)
    stream = sample_stream(0, a.clients, per, a.rounds + 1)[1:]
    busiest = statistics.mean(max(int(np.sum(row % 2 == 0)), int(np.sum(row % 2 == 1))) for row in stream)
    return {"serial_s": serial, "two_processes_s": serial / 2, "raysplit_placement_s": serial * busiest / per,
            "busiest_actor_clients_mean": busiest}


def flower_rounds(a) -> list[float]:
    if not FLOWER_PY.exists():
        sys.exit(f"{FLOWER_PY} missing: run benchmarks/setup_flower.sh first")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    cmd = [str(FLOWER_PY), "-c", "import flower_side; flower_side.main()", "--clients", str(a.clients),
           "--fraction", str(a.fraction), "--rounds", str(a.rounds + 1), "--steps", str(a.steps),
           "--batch", str(a.batch), "--lr", str(a.lr)]
    out = subprocess.run(cmd, cwd=ROOT / "benchmarks", env=env, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("FLOWER_RESULT ")), None)
    if line is None:
        sys.exit(f"Flower run failed (rc {out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    res = json.loads(line.split(" ", 1)[1])
    return res["round_s"][1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds per run (one more is run first)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-mlflow", action="store_true")
    a = ap.parse_args()
    print(f"load {load()}")
    floor = compute_floor(a)
    print(f"compute floor per round: serial {floor['serial_s']:.3f} s, on 2 processes {floor['two_processes_s']:.3f} s, "
          f"with raysplit's placement (busier actor has {floor['busiest_actor_clients_mean']:.1f} of the clients) "
          f"{floor['raysplit_placement_s']:.3f} s", flush=True)
    rs, fl, ratios = [], [], []
    for rep in range(a.reps):
        r = raysplit_rounds(a)
        f = flower_rounds(a)
        rs += r
        fl += f
        ratios.append(statistics.median(r) / statistics.median(f))
        print(f"rep {rep}: raysplit s/round {fmt(mmm(r), 1, 3)}  Flower s/round {fmt(mmm(f), 1, 3)}  "
              f"ratio of medians {ratios[-1]:.3f}  (load {load()})", flush=True)
    res = {"raysplit_round_s": mmm(rs), "flower_round_s": mmm(fl), "ratio_raysplit_over_flower": mmm(ratios),
           "compute_floor": floor, "raw": {"raysplit": rs, "flower": fl}}
    print("| | s/round min/median/max |\n|---|---|")
    print(f"| raysplit FedAvg | {fmt(res['raysplit_round_s'], 1, 3)} |")
    print(f"| Flower {a.clients} clients, Ray simulation | {fmt(res['flower_round_s'], 1, 3)} |")
    print(f"| ratio raysplit / Flower (per rep) | {fmt(res['ratio_raysplit_over_flower'], 1, 3)} |")
    path = save("flower", {"args": vars(a), "results": res, "load_at_end": load()})
    if not a.no_mlflow:
        log_mlflow("flower", {**vars(a), "load": load()},
                   {"raysplit_round_s_median": res["raysplit_round_s"]["median"],
                    "flower_round_s_median": res["flower_round_s"]["median"],
                    "ratio_median": res["ratio_raysplit_over_flower"]["median"],
                    "ratio_max": res["ratio_raysplit_over_flower"]["max"],
                    "compute_floor_serial_s": floor["serial_s"],
                    "compute_floor_raysplit_placement_s": floor["raysplit_placement_s"]}, path)


if __name__ == "__main__":
    main()
