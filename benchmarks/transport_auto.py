"""Does the default transport cost the user? Seconds per round with ``runtime.transport.kind`` = auto (the default),
compiled and calls, side by side in one run of this script, on the workloads issue 29 names: the quickstart
(configs/quickstart.yaml), GAS in the authors' setting (configs/gas/fmnist.yaml, evaluation every round as the
authors do) and ResNet18 (SFLV2, 32x32 synthetic images, cut after layer1, 16 clients of one batch of 8).
``--axis threads`` compares ``runtime.torch_threads`` = auto (opt-in) and 1 (the default) instead (issue 29 item 2);
``--axis rdt`` the Ray Direct Transport prototype (driver-chained steps over gloo) beside compiled and calls (item 5).

    .venv/bin/python benchmarks/transport_auto.py [--workloads quickstart gas resnet18] [--rounds 4] [--repeats 2]
        [--axis transport|threads]

Every run is a fresh interpreter (its own private Ray), tracking off, the config's default threads and actors;
the transports alternate within each repeat (auto, compiled, calls, then the next repeat) so that a drift in the
machine's load reaches all three alike. A round's time is the wall time between two ``on_round`` callbacks; the
first round (start-up, graph compilation) is left out. Prints a markdown table (median [min, max] over repeats of
each run's median round) with each transport over the best of the three, the transport ``auto`` resolved to, and
the load average before and after; writes benchmarks/out/TAG.json (``--tag``, default transport_auto).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "quickstart": ("configs/quickstart.yaml", {"eval.every": 1000}),
    "gas": ("configs/gas/fmnist.yaml", {"eval.every": 1}),
    "resnet18": ("configs/quickstart.yaml", {
        "model.name": "resnet18", "model.cut": "layer1", "data.dataset": "synthetic",
        "data.options": {"num_samples": 4000, "shape": [3, 32, 32]}, "data.num_clients": 16,
        "data.partition": {"name": "iid"}, "train.batch_size": 8, "train.local_steps": 1, "eval.every": 1000}),
}
CODE = """
import json, sys, time
from raysplit.config import load_config
from raysplit.experiment import run_experiment
sys.path.insert(0, "benchmarks")
from common import resolved_at_start
cfg = load_config(sys.argv[1], json.loads(sys.argv[2]))
marks = [time.perf_counter()]
with resolved_at_start() as resolved:
    run_experiment(cfg, on_round=lambda r, m: marks.append(time.perf_counter()))
print("RESULT" + json.dumps({"rounds": [b - a for a, b in zip(marks, marks[1:])], **resolved}))
"""


# --axis: the variants compared, each (label, overrides); the first is the one under test
AXES = {
    "transport": [(k, {"runtime.transport.kind": k}) for k in ("auto", "compiled", "calls")],
    # issue 29 item 2: torch threads from the machine (opt-in) against one per actor (the default)
    "threads": [("auto", {"runtime.torch_threads": "auto"}), ("1", {"runtime.torch_threads": 1})],
    # issue 29 item 5: the Ray Direct Transport prototype (driver-chained steps, gloo) beside the two others
    "rdt": [("rdt", {"runtime.transport.kind": "rdt", "runtime.transport.direct_steps": False}),
            ("compiled", {"runtime.transport.kind": "compiled"}), ("calls", {"runtime.transport.kind": "calls"})],
}


def one(workload: str, variant: dict, rounds: int) -> dict:
    config, over = WORKLOADS[workload]
    over = {**over, "train.rounds": rounds, **variant, "tracking.enabled": False,
            "tracking.progress": False, "tracking.checkpoint_every": 0}
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", CODE, str(ROOT / config), json.dumps(over)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=3600)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    if out.returncode or not line:
        raise RuntimeError(f"{workload} {variant} failed:\n{out.stderr[-3000:]}")
    res = json.loads(line[-1][6:])
    res["median"] = statistics.median(res["rounds"][1:])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--axis", choices=list(AXES), default="transport",
                    help="what varies: runtime.transport.kind (item 1), runtime.torch_threads (item 2), "
                         "or rdt beside compiled and calls (item 5)")
    ap.add_argument("--tag", default="transport_auto", help="the output's name: benchmarks/out/TAG.json")
    args = ap.parse_args()
    variants = AXES[args.axis]
    names = [v for v, _ in variants]
    load = [os.getloadavg()[0]]
    runs: dict = {}
    for w in args.workloads:
        for rep in range(args.repeats):
            for name, over in variants:
                r = one(w, over, args.rounds)
                runs.setdefault((w, name), []).append(r)
                print(f"{w:10s} {args.axis} {name:8s} repeat {rep}: {r['median']:.3f} s/round "
                      f"({r.get('transport')}, {r.get('torch_threads')} threads)", flush=True)
    load.append(os.getloadavg()[0])
    lines = [f"load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after; {os.cpu_count()} CPUs", "",
             f"| workload | {names[0]} resolved to | " + " | ".join(f"{n} s/round" for n in names) +
             f" | {names[0]} / best |", "|---" * (len(names) + 3) + "|"]
    for w in args.workloads:
        med = {k: [r["median"] for r in runs[(w, k)]] for k in names}
        mid = {k: statistics.median(v) for k, v in med.items()}

        def cell(v):
            return f"{statistics.median(v):.2f} [{min(v):.2f}, {max(v):.2f}]"
        first = runs[(w, names[0])][0]
        lines.append(f"| {w} | {first.get('transport')}, {first.get('torch_threads')} threads | " +
                     " | ".join(cell(med[k]) for k in names) + f" | {mid[names[0]] / min(mid.values()):.3f} |")
    print("\n".join(lines))
    out = ROOT / "benchmarks" / "out"
    out.mkdir(exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(
        {"load": load, "runs": {f"{w}|{k}": v for (w, k), v in runs.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
