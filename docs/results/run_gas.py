"""Reproduce docs/results/gas.md: GAS against its baselines on Fashion-MNIST (configs/gas/fmnist.yaml).

    .venv/bin/python docs/results/run_gas.py [--rounds 20] [--seeds 0 1 2] [--jobs 2] [--eval-every 4]

The authors' setting (AlexNet split at L2, 20 clients, 10 active, 20 local iterations of 32, SGD 0.01 / 0.9 /
5e-4, clipping 10, GAS's cell model) with shards 2 and with Dirichlet(0.1), for GAS, GAS without generation,
FedBuff, CA2FL, FedAvg, MiniBatch-SFL and S2FL; every run a full raysplit run logged to MLflow (experiment
gas-fmnist in ./mlflow.db). Runs use the local backend with one torch thread each and ``--jobs`` runs at a time
(the same hosts in process: identical results to the Ray backend, tests/test_events.py). A global round is one
aggregation of 10 client models (FedAvg and the synchronous SFL methods: one round of the 10 sampled clients).

Prints the markdown table (accuracy at the last round and the best evaluated accuracy, mean ± std over seeds;
simulated time at the last round; GAS against the synchronous SFL baselines timed to the highest accuracy all reach, per seed) and writes docs/results/gas_rounds.png and gas_time.png (test accuracy against
global rounds and against simulated time, median over seeds). Results are cached per run under
docs/results/.gas_runs/ (delete to rerun).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from _runs import ROOT, Run, common_target, median_range, named, paired_table, restored, run_all, to_target

METHODS = [("GAS", {"name": "gas"}), ("GAS w/o generation", {"name": "gas", "generate": False}),
           ("FedBuff", {"name": "fedbuff"}), ("CA2FL", {"name": "ca2fl"}), ("FedAvg", {"name": "fedavg"}),
           ("MiniBatch-SFL", {"name": "minibatch_sfl"}), ("S2FL", {"name": "s2fl"})]
PARTITIONS = [("shards 2", {"name": "shards", "per_client": 2}), ("Dirichlet 0.1", {"name": "dirichlet", "alpha": 0.1})]
HERE = Path(__file__).resolve().parent
OUT = HERE / ".gas_runs"


def cache_file(method, part_label, seed, rounds) -> Path:
    return restored(OUT / f"{method}_{part_label}_s{seed}_r{rounds}.json".replace(" ", "_").replace("/", ""))


def one(method, alg, part_label, partition, seed, rounds, eval_every):
    out = cache_file(method, part_label, seed, rounds)
    return Run(ROOT / "configs/gas/fmnist.yaml", {
        "algorithm": alg, "seed": seed, "data.partition": partition, "train.rounds": rounds, "eval.every": eval_every,
        "runtime.backend": "local", "runtime.torch_threads": 1, "tracking.checkpoint_every": 0},
        f"{method} {part_label} seed {seed}", out)


def table(results, rounds) -> str:
    """Accuracy at the last round and best evaluated accuracy, median [min, max] over the seeds run (their number
    in the last column), and the median simulated time at the last round, for every partition."""
    lines = [f"| method | partition | acc. @{rounds} | best | sim. time @{rounds} (s) | seeds |", "|---" * 6 + "|"]
    for part, _ in PARTITIONS:
        for method, _ in METHODS:
            rs = results.get((method, part), [])
            if not rs:
                continue
            a = [100 * r["eval/accuracy"] for _, r in rs]
            b = [100 * max(c[2] for c in r["curve"]) for _, r in rs]
            lines.append(f"| {method} | {part} | {median_range(a, '.2f')} | {median_range(b, '.2f')} | "
                         f"{np.median([r['time/sim'] for _, r in rs]):.0f} | {', '.join(str(s) for s, _ in rs)} |")
    return "\n".join(lines)


SYNC = ("S2FL", "MiniBatch-SFL")  # the synchronous SFL baselines GAS's time claim is against


def to_targets(results) -> str:
    """GAS against the synchronous SFL baselines at an equal outcome (issue 73, item 4), as the registry's rule
    measures it (scripts/claims.py ``record_value``, ``time to target``): per partition and seed, the common target
    (the highest accuracy GAS and every synchronous baseline run on that seed reach), each one's simulated time to it
    and GAS's saving against the fastest of them; "-" where a curve has no simulated time."""
    lines = ["| partition | seed | target (%) | GAS time to it (s) | baselines' time to it (s) | "
             "GAS's time saved vs the fastest (%) |", "|---" * 6 + "|"]
    for part, _ in PARTITIONS:
        gas = dict(results.get(("GAS", part), []))
        sync = {m: dict(results.get((m, part), [])) for m in SYNC}
        for s in sorted(gas):
            others = {m: runs[s] for m, runs in sync.items() if s in runs}
            if not others:
                continue
            try:
                target = common_target([gas[s], *others.values()])
                rg, tg, _ = to_target(gas[s], target)
                hit = {m: to_target(r, target)[:2] for m, r in others.items()}
            except ValueError:
                continue
            fastest = min(hit, key=lambda m: hit[m][1])
            them = "; ".join(f"{m} {t:.1f} (round {r})" + (" fastest" if m == fastest and len(hit) > 1 else "")
                             for m, (r, t) in hit.items())
            lines.append(f"| {part} | {s} | {100 * target:.2f} | {tg:.1f} (round {rg}) | {them} | "
                         f"{100 * (1 - tg / hit[fastest][1]):.1f} |")
    return "\n".join(lines)


def figures(results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [(p, q) for p, q in PARTITIONS if any((m, p) in results for m, _ in METHODS)]  # those that were run
    for axis, fname, label in ((0, "gas_rounds.png", "global round"), (1, "gas_time.png", "simulated time (s)")):
        fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4), squeeze=False)
        for ax, (part, _) in zip(axes[0], parts):
            for method, _ in METHODS:
                runs = results.get((method, part), [])
                curves = [np.array(r["curve"]) for _, r in runs]
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                xs = np.median([c[:n, axis] for c in curves], axis=0)
                ys = np.median([c[:n, 2] for c in curves], axis=0)
                seeds = f"median of {len(runs)} seeds" if len(runs) > 1 else f"seed {runs[0][0]} only"
                ax.plot(xs, ys * 100, marker="o", ms=3, label=f"{method} ({seeds})")
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
    ap.add_argument("--methods", nargs="*", default=None, help="only these methods (labels as in the table)")
    ap.add_argument("--partitions", nargs="*", default=None, help='only these partitions ("shards 2", "Dirichlet 0.1")')
    ap.add_argument("--report", action="store_true",
                    help="run nothing: the tables and figures from every cached run of --seeds and --rounds")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    for name, given, known in (("--methods", args.methods, [m for m, _ in METHODS]),
                               ("--partitions", args.partitions, [p for p, _ in PARTITIONS])):
        bad = sorted(set(given or ()) - set(known))
        if bad:
            ap.error(f"{name}: unknown {bad}; known: {known}")
    todo = [(m, alg, pl, p, s) for s in args.seeds for pl, p in PARTITIONS for m, alg in METHODS
            if (args.methods is None or m in args.methods) and (args.partitions is None or pl in args.partitions)]
    if not args.report:
        run_all("gas-fmnist", todo, lambda *job: one(*job, args.rounds, args.eval_every), args.jobs)
    results: dict = {}
    for s in args.seeds:
        for pl, _ in PARTITIONS:
            for m, _ in METHODS:
                f = cache_file(m, pl, s, args.rounds)
                if f.is_file():
                    results.setdefault((m, pl), []).append((s, named(json.loads(f.read_text()))))
    print(table(results, args.rounds))
    print()
    print(paired_table(results, [("GAS", m) for m, _ in METHODS[1:]], [p for p, _ in PARTITIONS], args.rounds,
                       head="GAS minus", label=lambda _, b: b))
    print()
    print(to_targets(results))
    missing = [f"{m} {p}" for p, _ in PARTITIONS for m, _ in METHODS if (m, p) not in results]
    if missing:  # the page's figures show every method and partition: a partial cache must not redraw them
        print(f"\ngas_rounds.png and gas_time.png not redrawn: no cached run of {', '.join(missing)}")
    else:
        figures(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
