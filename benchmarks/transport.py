"""Which transport for activations and gradients: numpy arrays or torch tensors through Ray's object store?

Measures one actor-to-actor hop as raysplit uses it: actor A returns the payload, actor B receives it as an
argument (ObjectRef chained by the driver, no driver ray.get of the payload) and touches every element.
Prints a markdown table of median milliseconds per hop (and effective MB/s) per payload size.

    .venv/bin/python benchmarks/transport.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import ray
import torch


@ray.remote(num_cpus=0)
class Producer:
    def make(self, nbytes: int, kind: str):
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        return t.numpy() if kind == "numpy" else t


@ray.remote(num_cpus=0)
class Consumer:
    def take(self, x):
        t = torch.from_numpy(np.array(x)) if isinstance(x, np.ndarray) else x  # writable copy, as the server does
        return float(t[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=1024**3, log_to_driver=False)
    prod, cons = Producer.remote(), Consumer.remote()
    ray.get([prod.make.remote(4, "numpy"), cons.take.remote(np.zeros(1))])
    print("| payload | numpy ms/hop (MB/s) | torch ms/hop (MB/s) |")
    print("|---|---|---|")
    for nbytes in [1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]:
        row = []
        for kind in ("numpy", "torch"):
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                ray.get(cons.take.remote(prod.make.remote(nbytes, kind)), timeout=60)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            row.append(f"{med * 1e3:.2f} ({nbytes / med / 1e6:.0f})")
        label = f"{nbytes >> 10} KB" if nbytes < (1 << 20) else f"{nbytes >> 20} MB"
        print(f"| {label} | {row[0]} | {row[1]} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
