"""What the round-boundary snapshots of ``runtime.faults.max_retries`` cost per round (``RoundGuard``), measured with the
code of the tree it runs from (run it from an older checkout, with ``PYTHONPATH`` pointing there, for "before").

    python benchmarks/snapshot_cost.py [--rounds 12] [--cases resnet18,clients1000]

Two cases, each on the Ray backend with 2 client actors and the calls transport:

* ``resnet18``: SFLV2 with ResNet18 cut after layer1 (32x32 synthetic images, 100 clients, 10 per round, one batch
  of 8 each, SGD momentum 0.9): a snapshot holds the server part and its momentum (about 90 MB) every round.
* ``clients1000``: PSL (every client keeps its own client model and momentum, never aggregated) with ``cnn_small``
  on 28x28 synthetic images, 1,000 clients, 10 per round: the first snapshot holds all 1,000 clients, each later
  one the server and the 10 changed clients.

Rounds alternate: a snapshot before even rounds, none before odd ones (the next snapshot still holds every change
since the last); reported per case: the driver's time inside ``RoundGuard.snapshot`` (what blocks the round
loop), and the median round time with and without a snapshot before it (the first two rounds are warm-up). Prints
a Markdown row per case and writes ``benchmarks/out/snapshot_cost-<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

CASES = {
    "resnet18": {"algorithm": {"name": "sflv2"}, "model.name": "resnet18", "model.cut": "layer1",
                 "data.options": {"num_samples": 2000, "shape": [3, 32, 32], "test_fraction": 0.05},
                 "data.num_clients": 100, "train.batch_size": 8},
    "clients1000": {"algorithm": {"name": "psl"}, "model.name": "cnn_small", "model.cut": "conv1",
                    "data.options": {"num_samples": 12000, "shape": [1, 28, 28], "test_fraction": 0.05},
                    "data.num_clients": 1000, "data.test_fraction": 0.1, "train.batch_size": 8},
}


def run_case(name: str, rounds: int) -> dict:
    from raysplit.config import load_config
    from raysplit.experiment import prepare
    from raysplit.runtime import runtime_for
    from raysplit.runtime.driver.drivers import RoundGuard

    cfg = load_config(None, {"seed": 0, "data.dataset": "synthetic", "data.partition.name": "iid",
                             "data.test_fraction": 0.0, "train.rounds": rounds, "train.local_steps": 1,
                             "train.participation": {"count": 10, "fraction": None},
                             "train.optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
                             "runtime.num_workers": 2, "runtime.transport.kind": "calls", "runtime.server.num_cpus": 1,
                             "runtime.client.num_cpus": 0, "tracking.enabled": False, "eval.every": 10**6,
                             **CASES[name]})
    p = prepare(cfg)
    rt = runtime_for(cfg.runtime, p.inputs)
    driver = p.algorithm.driver(rt, p.algorithm, p.sample_stream, cfg.seed)
    guard = RoundGuard(rt, driver, max_retries=3)
    blocked, with_snap, without = [], [], []
    try:
        for r in range(rounds):
            t0 = time.perf_counter()
            if r % 2 == 0:
                guard.snapshot(r)
                blocked.append(time.perf_counter() - t0)
            stats = driver.round(r)
            rt.get(rt.server.get_state())  # the round's work is done
            dt = time.perf_counter() - t0
            if r >= 2:
                (with_snap if r % 2 == 0 else without).append(dt)
            driver.t_sim = stats.t_end
    finally:
        if hasattr(guard, "close"):
            guard.close()
        rt.shutdown()
    med = lambda xs: float(np.median(xs)) if xs else float("nan")  # noqa: E731
    return {"case": name, "snapshot_call_s": med(blocked[1:]), "first_snapshot_call_s": blocked[0],
            "round_with_snapshot_s": med(with_snap), "round_without_s": med(without),
            "rounds": rounds, "load": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--label", default=None, help="name of this measurement (default: the code's git commit)")
    a = ap.parse_args(argv)
    import raysplit

    where = Path(raysplit.__file__).resolve().parent.parent
    label = a.label or subprocess.run(["git", "-C", str(where), "describe", "--always", "--dirty"],
                                      capture_output=True, text=True).stdout.strip()
    out = {"label": label, "code": str(where), "cases": []}
    for name in a.cases.split(","):
        res = run_case(name, a.rounds)
        out["cases"].append(res)
        print(f"| {label} | {name} | {res['first_snapshot_call_s']:.3f} | {res['snapshot_call_s']:.4f} | "
              f"{res['round_with_snapshot_s']:.2f} | {res['round_without_s']:.2f} | "
              f"{' '.join(f'{x:.2f}' for x in res['load'])} |", flush=True)
    dest = ROOT / "benchmarks" / "out" / f"snapshot_cost-{label}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
