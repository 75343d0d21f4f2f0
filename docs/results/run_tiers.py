"""The study of clients with their own cuts (issue 72, item 7) on Fashion-MNIST (configs/tiers/fmnist.yaml): not run
yet, so no page states its results; this script is how it runs.

    .venv/bin/python docs/results/run_tiers.py [--seeds 0 1 2] [--jobs 2] [--backend local] [--dry-run]

Arms on the clock's heterogeneous (uniform) profiles, each a full raysplit run logged to MLflow (experiment
tiers-fmnist in ./mlflow.db): every client at conv1, every client at conv2, two tiers (conv1, conv2) with a quarter,
half or three quarters of the clients deep (the fastest ones: ``tier_order: speed``), and the budget rule at the
budget the average client needs for conv2. It prints, per arm (median [min, max] over seeds), the final accuracy,
each tier's accuracy, the mean client FLOPs of a round, the bytes up and the simulated time, so that arms of equal
mean client compute can be read side by side (SplitFT's claim, arXiv 2604.26388: adaptive cuts beat one fixed cut in
time and quality). ``--dry-run`` validates every arm's config and prints the arms, running nothing.
"""

from __future__ import annotations

import argparse

from _runs import ROOT, Run, median_range, study

CONFIG = ROOT / "configs" / "tiers" / "fmnist.yaml"
UNIFORM = {"model.tiers": None}
ARMS = {"uniform conv1": {**UNIFORM, "model.cut": "conv1"},
        "uniform conv2": {**UNIFORM, "model.cut": "conv2"},
        **{f"tiers {int(100 * s)}% deep": {"model.tiers": [{"cut": "conv1", "share": 1 - s},
                                                           {"cut": "conv2", "share": s}]} for s in (0.25, 0.5, 0.75)},
        "budget rule": {**UNIFORM, "model.cut_budget": {"seconds": 0.035, "cuts": ["conv1", "conv2"]}}}
KEYS = ("eval/accuracy", "eval/tier0/accuracy", "eval/tier1/accuracy", "compute/client_flops", "comm/bytes_up",
        "time/sim")


def runs(seeds, backend, out_dir) -> list[tuple[str, int, Run]]:
    return [(arm, seed, Run(CONFIG, {**over, "seed": seed, "runtime.backend": backend}, f"{arm} seed {seed}",
                            out_dir / f"{arm.replace(' ', '_').replace('%', 'pc')}_s{seed}.json"))
            for arm, over in ARMS.items() for seed in seeds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--backend", default="local")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    todo = runs(a.seeds, a.backend, ROOT / "outputs" / "studies" / "tiers")
    if a.dry_run:
        from raysplit.config import load_config

        for arm, seed, r in todo:
            cfg = load_config(r.config, r.overrides)
            print(f"{r.label:28s} cut={cfg.model.cut} tiers={cfg.model.tiers and len(cfg.model.tiers)} "
                  f"budget={cfg.model.cut_budget}")
        return
    results = study("tiers-fmnist", [r for *_, r in todo], a.jobs)
    print("| arm | " + " | ".join(KEYS) + " |")
    print("|---" * (len(KEYS) + 1) + "|")
    for arm in ARMS:
        mine = [res for (name, _, _), res in zip(todo, results) if name == arm]
        cells = [median_range([r[k] for r in mine if k in r], ".4g") if any(k in r for r in mine) else "-"
                 for k in KEYS]
        print(f"| {arm} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
