"""Reproduce docs/results/cyclesl.md: the CycleSL comparison on Fashion-MNIST (configs/cyclesl/fmnist.yaml).

    .venv/bin/python docs/results/run_cyclesl.py [--seeds 0 1 2] [--jobs 2] [--backend local]

Runs PSL, SGLR, SFLV1, SFLV2, CyclePSL, CycleSGLR, CycleSFL (E = 1) and CycleSFL with E in {2, 4, 8} for each seed,
each a full raysplit run logged to MLflow (experiment cyclesl-fmnist in ./mlflow.db), then prints the markdown
table of final accuracy, macro-F1 and MCC (median [min, max] over seeds) plus rounds to 70 % and the mean/std of
the gradient norms sent to clients, then each Cycle variant's accuracy minus its original's, paired by seed.
``--backend local`` runs the same hosts in-process (identical results to the Ray backend, tested in
tests/test_semantics.py) to fit the sweep on 2 cores.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from _runs import ROOT, median_range, run_cached

METHODS = [("psl", {}), ("sglr", {}), ("sflv1", {}), ("sflv2", {}), ("cyclepsl", {}), ("cyclesglr", {}),
           ("cyclesfl", {}), ("cyclesfl", {"server_epochs": 2}), ("cyclesfl", {"server_epochs": 4}),
           ("cyclesfl", {"server_epochs": 8})]


PAIRS = [("cyclepsl", "psl"), ("cyclesglr", "sglr"), ("cyclesfl", "sflv1"), ("cyclesfl", "sflv2"),
         ("cyclesfl E=2", "sflv2"), ("cyclesfl E=4", "sflv2"), ("cyclesfl E=8", "sflv2")]


def one(method, extra, seed, backend, out_dir):
    label = method + (f" E={extra['server_epochs']}" if extra else "")
    out = out_dir / f"{label.replace(' ', '_').replace('=', '')}_s{seed}.json"
    code = f"""
import json, sys
from raysplit.config import load_config
from raysplit.experiment import run_experiment
cfg = load_config({str(ROOT / 'configs/cyclesl/fmnist.yaml')!r}, {{"algorithm": {{"name": {method!r}, **{extra!r}}},
      "seed": {seed}, "runtime.backend": {backend!r}, "tracking.progress": False,
      "tracking.run_name": {f'{label} seed {seed}'!r}}})
res = run_experiment(cfg)
print("RESULT" + json.dumps({{k: v for k, v in res.items() if isinstance(v, (int, float, str))}}))
"""
    return label, seed, run_cached(code, out, f"{label} seed {seed}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--backend", default="local", choices=["local", "ray"])
    ap.add_argument("--out", default=str(ROOT / "outputs" / "cyclesl_table"))
    ap.add_argument("--methods", nargs="*", default=None, help="only these algorithm names (e.g. psl sglr sflv1)")
    a = ap.parse_args()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # create the MLflow store once before parallel runs (sqlite schema race)
    subprocess.run([sys.executable, "-c", "import mlflow; mlflow.set_tracking_uri('sqlite:///mlflow.db');"
                    "mlflow.set_experiment('cyclesl-fmnist')"], cwd=ROOT, check=True, capture_output=True)
    jobs = [(m, e, s) for m, e in METHODS for s in a.seeds if a.methods is None or m in a.methods]
    with ThreadPoolExecutor(a.jobs) as pool:
        results = list(pool.map(lambda j: one(*j, a.backend, out_dir), jobs))
    by: dict[str, list[dict]] = {}
    for label, _, res in results:
        by.setdefault(label, []).append(res)
    print("| method | accuracy % | macro-F1 | MCC | rounds to 70 % (per seed) | grad norm mean | grad norm std |")
    print("|---|---|---|---|---|---|---|")

    for label, rs in by.items():
        def col(k, scale=1.0, fmt=".3f"):
            return median_range(np.array([r.get(k, np.nan) for r in rs], dtype=float) * scale, fmt)
        rt_s = ", ".join(str(x) if x is not None else ">300" for x in (r.get("eval/rounds_to_target") for r in rs))
        print(f"| {label} | {col('eval/accuracy', 100, '.2f')} | {col('eval/f1_macro')} | {col('eval/mcc')} | {rt_s} | "
              f"{col('summary/grad_norm_mean', fmt='.4f')} | {col('summary/grad_norm_std', fmt='.4f')} |")
    acc = {(label, seed): 100 * res["eval/accuracy"] for label, seed, res in results}
    print("\n| Cycle variant - original | accuracy difference (points), paired by seed | per seed |")
    print("|---|---|---|")
    for new_, old_ in PAIRS:
        d = [acc[(new_, s)] - acc[(old_, s)] for s in a.seeds if (new_, s) in acc and (old_, s) in acc]
        if d:
            print(f"| {new_} - {old_} | {median_range(np.array(d), '+.2f')} | {' '.join(f'{x:+.2f}' for x in d)} |")

if __name__ == "__main__":
    main()
