"""Where a small Ray run's time goes (issue 51: what CI's Ray tests pay for): the golden run of one algorithm
(scripts/golden.py: digits, 3 rounds) through a local Ray with two client actors over actor calls and over compiled
graphs, and with one client actor; for each, the seconds until its first round is done (actors started, first round
computed), its rounds, and what follows the last one; then three runs with ``runtime.keep_actors_s`` (the first
starts the actors, the next two reuse them). Then, in a fresh interpreter, what one actor's process imports
before it can train: torch, Ray and raysplit, and torch._dynamo, which torch's optimizers import at their first step.

    python benchmarks/ray_run_cost.py [--algorithm sflv2]      (make bench-ray-run)

Prints the figures; no MLflow, nothing written.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

IMPORTS = """
import time
t = time.perf_counter(); import torch, ray; t1 = time.perf_counter()
import raysplit.runtime.ray.actors, raysplit.algorithms; t2 = time.perf_counter()
import sys
before = "torch._dynamo" in sys.modules
m = torch.nn.Linear(4, 2); m(torch.ones(1, 4)).sum().backward()
t3 = time.perf_counter(); opt = torch.optim.SGD(m.parameters(), lr=0.1); opt.step(); t4 = time.perf_counter()
print(f"{t1 - t:.2f} {t2 - t1:.2f} {t4 - t3:.2f} {before} {'torch._dynamo' in sys.modules}")
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algorithm", default="sflv2")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    import golden

    load = os.getloadavg()[0]
    t0 = time.time()
    ray.init(address="local", num_cpus=2, object_store_memory=512 * 1024**2, include_dashboard=False,
             log_to_driver=False)
    print(f"load average before: {load:.2f}; ray.init: {time.time() - t0:.1f} s")
    print("| run | seconds in all | until round 1 is done | rounds 2-3 | after the last round |")
    print("|---|---:|---:|---|---:|")
    try:
        # the last three: runtime.keep_actors_s, the first of them starting the actors the next two reuse
        for kind, workers, keep in (("calls", 2, 0), ("compiled", 2, 0), ("calls", 1, 0), ("calls", 2, 60),
                                    ("calls", 2, 60), ("compiled", 2, 60)):
            marks: list[float] = []
            t = time.time()
            golden.run(args.algorithm, on_round=lambda r, m: marks.append(time.time()),
                       **{"runtime.backend": "ray", "runtime.server.num_cpus": 0.5, "runtime.client.num_cpus": 0.5,
                          "runtime.transport.kind": kind, "runtime.num_workers": workers,
                          "runtime.keep_actors_s": keep})
            end = time.time()
            how = f", keep_actors_s {keep}" if keep else ""
            print(f"| {args.algorithm}, {workers} client actor{'s' if workers > 1 else ''}, {kind}{how} | "
                  f"{end - t:.1f} | "
                  f"{marks[0] - t:.1f} | {', '.join(f'{b - a:.1f}' for a, b in zip(marks, marks[1:]))} | "
                  f"{end - marks[-1]:.1f} |")
    finally:
        ray.shutdown()
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT).stdout.split()
    print(f"a fresh process: import torch and ray {out[0]} s, raysplit's runtime and algorithms {out[1]} s, the "
          f"first optimizer made and stepped {out[2]} s (torch._dynamo imported before it: {out[3]}, after: {out[4]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
