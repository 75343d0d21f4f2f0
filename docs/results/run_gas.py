"""Reproduce docs/results/gas.md: GAS against its baselines on Fashion-MNIST (configs/gas/fmnist.yaml).

    .venv/bin/python docs/results/run_gas.py [--rounds 20] [--seeds 0 1 2] [--jobs 2] [--eval-every 4]

The authors' setting (AlexNet split at L2, 20 clients, 10 active, 20 local iterations of 32, SGD 0.01 / 0.9 /
5e-4, clipping 10, GAS's cell model) with shards 2 and with Dirichlet(0.1), for GAS, GAS without generation,
FedBuff, CA2FL, FedAvg, MiniBatch-SFL and S2FL; every run a full raysplit run logged to MLflow (experiment
gas-fmnist in ./mlflow.db). Runs use the local backend with one torch thread each and ``--jobs`` runs at a time
(the same hosts in process: identical results to the Ray backend, tests/test_events.py). A global round is one
aggregation of 10 client models (FedAvg and the synchronous SFL methods: one round of the 10 sampled clients).

Prints the markdown table (accuracy at the last round and the best evaluated accuracy, mean ± std over seeds;
simulated time at the last round) and writes docs/results/gas_rounds.png and gas_time.png (test accuracy against
global rounds and against simulated time, median over seeds). Results are cached per run under
docs/results/.gas_runs/ (delete to rerun).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from _runs import ROOT, run_all, run_config

METHODS = [("GAS", {"name": "gas"}), ("GAS w/o generation", {"name": "gas", "generate": False}),
           ("FedBuff", {"name": "fedbuff"}), ("CA2FL", {"name": "ca2fl"}), ("FedAvg", {"name": "fedavg"}),
           ("MiniBatch-SFL", {"name": "minibatch_sfl"}), ("S2FL", {"name": "s2fl"})]
PARTITIONS = [("shards 2", {"name": "shards", "per_client": 2}), ("Dirichlet 0.1", {"name": "dirichlet", "alpha": 0.1})]
HERE = Path(__file__).resolve().parent
OUT = HERE / ".gas_runs"


def one(method, alg, part_label, partition, seed, rounds, eval_every):
    out = OUT / f"{method}_{part_label}_s{seed}_r{rounds}.json".replace(" ", "_").replace("/", "")
    res = run_config(ROOT / "configs/gas/fmnist.yaml", {
        "algorithm": alg, "seed": seed, "data.partition": partition, "train.rounds": rounds, "eval.every": eval_every,
        "runtime.backend": "local", "runtime.torch_threads": 1, "tracking.checkpoint_every": 0},
        f"{method} {part_label} seed {seed}", out)
    print(f"{method:20s} {part_label:14s} seed {seed}: accuracy {res['accuracy']:.4f} sim {res['sim_time']:.0f}s",
          flush=True)
    return res


def table(results, rounds) -> str:
    lines = [f"| method | {' | '.join(f'{p} acc. @{rounds}' for p, _ in PARTITIONS)} | "
             f"{' | '.join(f'{p} best' for p, _ in PARTITIONS)} | {' | '.join(f'{p} sim. time @{rounds} (s)' for p, _ in PARTITIONS)} |",
             "|---" * (1 + 3 * len(PARTITIONS)) + "|"]
    for method, _ in METHODS:
        accs, bests, times = [], [], []
        for part, _ in PARTITIONS:
            rs = results[(method, part)]
            a = np.array([r["accuracy"] for r in rs]) * 100
            b = np.array([max(c[2] for c in r["curve"]) for r in rs]) * 100
            accs.append(f"{a.mean():.2f} ± {a.std():.2f}")
            bests.append(f"{b.mean():.2f} ± {b.std():.2f}")
            times.append(f"{np.median([r['sim_time'] for r in rs]):.0f}")
        lines.append(f"| {method} | {' | '.join(accs)} | {' | '.join(bests)} | {' | '.join(times)} |")
    return "\n".join(lines)


def figures(results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for axis, fname, label in ((0, "gas_rounds.png", "global round"), (1, "gas_time.png", "simulated time (s)")):
        fig, axes = plt.subplots(1, len(PARTITIONS), figsize=(6 * len(PARTITIONS), 4), squeeze=False)
        for ax, (part, _) in zip(axes[0], PARTITIONS):
            for method, _ in METHODS:
                curves = [np.array(r["curve"]) for r in results[(method, part)]]
                n = min(len(c) for c in curves)
                xs = np.median([c[:n, axis] for c in curves], axis=0)
                ys = np.median([c[:n, 2] for c in curves], axis=0)
                ax.plot(xs, ys * 100, marker="o", ms=3, label=method)
            ax.set_title(f"Fashion-MNIST, {part}"), ax.set_xlabel(label), ax.set_ylabel("test accuracy (%)")
            if axis == 1:
                ax.set_xscale("log")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(HERE / fname, dpi=120)
        plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=4)
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    todo = [(m, alg, pl, p, s) for s in args.seeds for pl, p in PARTITIONS for m, alg in METHODS]
    done = run_all("gas-fmnist", todo, lambda *job: one(*job, args.rounds, args.eval_every), args.jobs)
    results: dict = {}
    for (m, _, pl, _, _), res in done:
        results.setdefault((m, pl), []).append(res)
    print(table(results, args.rounds))
    figures(results)
    (OUT / f"summary_r{args.rounds}.json").write_text(json.dumps({f"{k[0]}|{k[1]}": v for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
