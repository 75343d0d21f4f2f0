"""Reproduce docs/results/hydra.md: Hydra's forgetting study on Fashion-MNIST (configs/hydra/fmnist.yaml).

    .venv/bin/python docs/results/run_hydra.py [--seeds 0 1 2] [--jobs 2] [--backend local]

For c in {1, 2} (10 or 20 clients, dominant label 0.8) runs SFLV2 and SFLV2+Hydra in the cyclic and the random
order, and SplitFedV1, SplitFedV3 and MultiHead (their per-client server copies make the order irrelevant), each
seed a full raysplit run logged to MLflow (experiment hydra-fmnist in ./mlflow.db). Prints the markdown table
(final global accuracy, performance gap, backward transfer; mean ± std over seeds) and writes the per-position
figure docs/results/hydra_positions.png (cyclic order; accuracy of each position's label averaged over the last
5 rounds, median over seeds). ``--backend local`` runs the same hosts in-process (identical results to the Ray
backend, tested in tests/test_semantics.py) so that the 42 runs fit on 2 cores.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from _runs import ROOT, run_cached
ORDERED = [("SFLV2", "sflv2", {}), ("SFLV2+Hydra", "hydra", {"cut_b": "conv2"}),
           ("SFLV2+Hydra head=fc2", "hydra", {"cut_b": "fc1"})]
PARALLEL = [("SplitFedV1", "sflv1"), ("SplitFedV3", "sflv3"), ("MultiHead", "multihead")]


def jobs(seeds):
    out = []
    for c in (1, 2):
        for order in ("cyclic", "random"):
            for label, name, extra in ORDERED:
                out += [(c, order, label, {"name": name, "order": order, "phi": 5, **extra}, s) for s in seeds]
        for label, name in PARALLEL:
            out += [(c, "-", label, {"name": name}, s) for s in seeds]
    return out


def one(c, order, label, alg, seed, backend, out_dir, overrides):
    out = out_dir / f"{label}_{order}_c{c}_s{seed}.json".replace("+", "_").replace("=", "").replace(" ", "_")
    cached = out.is_file()
    code = f"""
import json
from raysplit.config import load_config
from raysplit.experiment import run_experiment
cfg = load_config({str(ROOT / 'configs/hydra/fmnist.yaml')!r}, {{"algorithm": {alg!r}, "seed": {seed},
      "data.num_clients": {10 * c}, "runtime.backend": {backend!r}, "tracking.progress": False,
      "tracking.run_name": {f'{label} {order} c={c} seed {seed}'!r}, **{overrides!r}}})
hist = []
res = run_experiment(cfg, on_round=lambda r, m: hist.append(m))
out = {{k: v for k, v in res.items() if isinstance(v, (int, float, str))}}
for key in ["accuracy", "performance_gap"] + [f"position_acc_{{i}}" for i in range(10)]:
    h = [float(m[key]) for m in hist if key in m]
    if h:
        out[key + "_last5"] = sum(h[-5:]) / len(h[-5:])
print("RESULT" + json.dumps(out))
"""
    res = run_cached(code, out, f"{label} {order} c={c} seed {seed}")
    if not cached:
        print(f"done {label} {order} c={c} seed {seed}: acc {res['accuracy']:.4f}", flush=True)
    return c, order, label, seed, res


def figure(results, path):
    """Row 1: per-position accuracy (cyclic). Row 2: the same minus that label's final accuracy under the random
    order (same method, seed and c), which removes how hard each label is and leaves the effect of the order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(ROOT))
    from raysplit.algorithms.orders import label_order

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.2), sharex=True)
    for col, c in enumerate((1, 2)):
        for label, color in (("SFLV2", "tab:red"), ("SFLV2+Hydra", "tab:blue"), ("SFLV2+Hydra head=fc2", "tab:green")):
            runs = {s: r for (cc, o, lab, s), r in results.items() if cc == c and o == "cyclic" and lab == label}
            if not runs:
                continue
            pos = np.array([[r[f"position_acc_{i}_last5"] for i in range(10)] for r in runs.values()])
            axes[0, col].plot(range(1, 11), np.median(pos, axis=0), "o-", color=color, ms=4, label=label)
            delta = []
            for s, r in runs.items():
                rnd = results.get((c, "random", label, s))
                if rnd is None:
                    continue
                labs = label_order(s, 10)
                delta.append([r[f"position_acc_{i}"] - rnd[f"label_acc_{lab}"] for i, lab in enumerate(labs)])
            if delta:
                axes[1, col].plot(range(1, 11), np.median(delta, axis=0), "o-", color=color, ms=4, label=label)
        axes[0, col].set_title(f"cyclic order, c = {c} ({10 * c} clients), DL 0.8")
        axes[1, col].axhline(0, color="k", lw=0.8)
        axes[1, col].set_xlabel("position in the processing cycle"), axes[1, col].set_xticks(range(1, 11))
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("accuracy of the position's label\n(last 5 rounds, median of seeds)")
    axes[1, 0].set_ylabel("minus the label's accuracy\nunder the random order (final)")
    axes[0, 0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--backend", default="local", choices=["local", "ray"])
    ap.add_argument("--out", default=str(ROOT / "outputs" / "hydra_table"))
    ap.add_argument("--no-mlflow", action="store_true", help="tracking.enabled=false (runs need no MLflow)")
    ap.add_argument("--data-root", default=None, help="data.root for Fashion-MNIST")
    ap.add_argument("--only-c", type=int, choices=[1, 2], default=None)
    ap.add_argument("--set", nargs="*", default=[], help="extra dotted key=value overrides for every run")
    ap.add_argument("--methods", nargs="*", default=None, help="only these method labels")
    ap.add_argument("--orders", nargs="*", default=None, help="only these orders (cyclic, random, -)")
    a = ap.parse_args()
    overrides = {"tracking.enabled": False} if a.no_mlflow else {}
    if a.data_root:
        overrides["data.root"] = a.data_root
    import yaml

    overrides.update({kv.split("=", 1)[0]: yaml.safe_load(kv.split("=", 1)[1]) for kv in a.set})
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # create the MLflow store once before parallel runs (sqlite schema race)
    if not a.no_mlflow:
        subprocess.run([sys.executable, "-c", "import mlflow; mlflow.set_tracking_uri('sqlite:///mlflow.db');"
                        "mlflow.set_experiment('hydra-fmnist')"], cwd=ROOT, check=True, capture_output=True)
    todo = [j for j in jobs(a.seeds) if a.only_c in (None, j[0]) and (a.methods is None or j[2] in a.methods)
            and (a.orders is None or j[1] in a.orders)]
    with ThreadPoolExecutor(a.jobs) as pool:
        done = list(pool.map(lambda j: one(*j, a.backend, out_dir, overrides), todo))
    results = {(c, o, lab, s): r for c, o, lab, s, r in done}
    print(f"runs: {len(results)}; overrides: {overrides}")
    print("| c | order | method | global accuracy (%) | PG (pp) | BW (pp) | PG, mean of last 5 rounds (pp) |")
    print("|---|---|---|---|---|---|---|")
    keys = sorted({(c, o, lab) for c, o, lab, _ in results}, key=lambda k: (k[0], k[1] == "-", k[1], k[2]))
    for c, o, lab in keys:
        rs = [r for (cc, oo, ll, _), r in results.items() if (cc, oo, ll) == (c, o, lab)]

        def ms(k):
            v = np.array([r[k] for r in rs], dtype=float) * 100
            return f"{v.mean():.2f} ± {v.std():.2f}"

        print(f"| {c} | {o} | {lab} | {ms('accuracy')} | {ms('performance_gap')} | {ms('backward_transfer')} | "
              f"{ms('performance_gap_last5')} |")
    if a.only_c is None and a.methods is None and a.orders is None:
        figure(results, ROOT / "docs" / "results" / "hydra_positions.png")


if __name__ == "__main__":
    main()
