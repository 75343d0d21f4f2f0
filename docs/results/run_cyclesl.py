"""Reproduce docs/results/cyclesl.md: the CycleSL comparison on Fashion-MNIST (configs/cyclesl/fmnist.yaml).

    .venv/bin/python docs/results/run_cyclesl.py [--seeds 0 1 2] [--jobs 2] [--backend local]

Runs PSL, SGLR, SFLV1, SFLV2, CyclePSL, CycleSGLR, CycleSFL (E = 1) and CycleSFL with E in {2, 4, 8} for each seed,
each a full raysplit run logged to MLflow (experiment cyclesl-fmnist in ./mlflow.db), then prints the markdown
table of final accuracy, macro-F1 and MCC (median [min, max] over seeds) plus rounds to 70 % and the mean/std of
the gradient norms sent to clients, then each Cycle variant's accuracy minus its original's, paired by seed.
``--backend local`` runs the same hosts in-process (identical results to the Ray backend, tested in
tests/test_semantics.py) to fit the sweep on 2 cores.

``--ladder`` (issue 55 item 2) runs CycleSFL (E = 1) and SFLV2 instead at raysplit's setting and with each of the
paper's settings that differ from it (``LADDER``: the paper's FEMNIST learning rate, its participation, its client
test split, its model and cut), then with all four, then with all four at the paper's FEMNIST round count, and
prints CycleSFL minus SFLV2 for each, paired by seed: which difference turns the E = 1 sign, or that none does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from _runs import ROOT, Run, median_range, restored, study

METHODS = [("psl", {}), ("sglr", {}), ("sflv1", {}), ("sflv2", {}), ("cyclepsl", {}), ("cyclesglr", {}),
           ("cyclesfl", {}), ("cyclesfl", {"server_epochs": 2}), ("cyclesfl", {"server_epochs": 4}),
           ("cyclesfl", {"server_epochs": 8})]


PAIRS = [("cyclepsl", "psl"), ("cyclesglr", "sglr"), ("cyclesfl", "sflv1"), ("cyclesfl", "sflv2"),
         ("cyclesfl E=2", "sflv2"), ("cyclesfl E=4", "sflv2"), ("cyclesfl E=8", "sflv2")]


# the paper's settings that differ from configs/cyclesl/fmnist.yaml (cyclesl.md's table, Appendix G: FEMNIST with
# Adam 3e-4, -C 0.05, LEAF's 90/10 sample-wise split, CNN_femnist cut after its two conv blocks, 601 rounds), one
# at a time, then together
PAPER = {"lr 3e-4": {"train.optimizer.lr": 3e-4},
         "5 of 100 a round": {"train.participation.count": 5},
         "test split 10 %": {"data.test_fraction": 0.1},
         "LEAF CNN, cut 2": {"model.name": "femnist_cnn", "model.cut": 2}}
LADDER = {"raysplit's setting": {}, **PAPER, "all four": {k: v for o in PAPER.values() for k, v in o.items()},
          "all four, 600 rounds": {**{k: v for o in PAPER.values() for k, v in o.items()}, "train.rounds": 600}}


def one(method, extra, seed, backend, out_dir, setting=None):
    label = method + (f" E={extra['server_epochs']}" if extra else "")
    over = LADDER[setting] if setting else {}
    tag = label + (f" [{setting}]" if setting else "")
    return label, seed, Run(ROOT / "configs/cyclesl/fmnist.yaml",
                            {"algorithm": {"name": method, **extra}, "seed": seed, "runtime.backend": backend, **over},
                            f"{tag} seed {seed}", _cache(tag, seed, out_dir))


def run(runs: list[tuple], jobs: int) -> list[tuple]:
    """``[(label, seed, Run), ...]`` as one study (MLflow experiment cyclesl-fmnist): ``[(label, seed, result)]``."""
    return [(label, seed, res) for (label, seed, _), res in zip(runs, study("cyclesl-fmnist", [r for *_, r in runs],
                                                                              jobs))]


def _cache(tag: str, seed: int, out_dir: Path) -> Path:
    """Where the run of ``tag`` (a method, with its ladder setting in brackets) and ``seed`` is cached."""
    stem = tag.replace(" ", "_").replace("=", "").replace("[", "").replace("]", "").replace("'", "").replace(",", "")
    return restored(out_dir / f"{stem.replace('%', 'pc')}_s{seed}.json")


def ladder(a, out_dir):
    """CycleSFL (E = 1) minus SFLV2 at each setting of ``LADDER``, paired by seed (``--cached-only``: the settings
    whose runs are all cached, nothing run)."""
    settings = a.settings or list(LADDER)
    jobs = [(m, s, st) for st in settings for s in a.seeds for m in ("cyclesfl", "sflv2")]
    if a.cached_only:
        jobs = [j for j in jobs if all(_cache(f"{m} [{j[2]}]", j[1], out_dir).is_file() for m in ("cyclesfl", "sflv2"))]
    done = [(j[2], *r) for j, r in zip(jobs, run([one(j[0], {}, j[1], a.backend, out_dir, setting=j[2])
                                                   for j in jobs], a.jobs))]
    acc = {(st, label, seed): 100 * res["eval/accuracy"] for st, label, seed, res in done}
    print("| setting | changed from raysplit's | cyclesfl (E=1) accuracy % | sflv2 accuracy % | "
          "cyclesfl - sflv2 (points), paired by seed | per seed |")
    print("|---|---|---|---|---|---|")
    for st, over in ((st, LADDER[st]) for st in settings):
        if any((st, m, s) not in acc for m in ("cyclesfl", "sflv2") for s in a.seeds):
            print(f"| {st} | not run yet | | | | |")
            continue
        c = [acc[(st, "cyclesfl", s)] for s in a.seeds]
        v = [acc[(st, "sflv2", s)] for s in a.seeds]
        d = [x - y for x, y in zip(c, v)]
        changed = ", ".join(f"{k.split('.')[-1]} {val}" for k, val in over.items()) or "-"
        print(f"| {st} | {changed} | {median_range(c)} | {median_range(v)} | {median_range(d, '+.2f')} | "
              f"{' '.join(f'{x:+.2f}' for x in d)} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--backend", default="local", choices=["local", "ray"])
    ap.add_argument("--out", default=str(ROOT / "outputs" / "cyclesl_table"))
    ap.add_argument("--methods", nargs="*", default=None, help="only these algorithm names (e.g. psl sglr sflv1)")
    ap.add_argument("--cached-only", action="store_true", help="--ladder: report the settings already run, run none")
    ap.add_argument("--settings", nargs="*", default=None, choices=list(LADDER),
                    help="--ladder: only these settings (default: every one, in LADDER's order)")
    ap.add_argument("--ladder", action="store_true", help="CycleSFL (E = 1) and SFLV2 from raysplit's setting toward "
                                                          "the paper's (LADDER), instead of the table")
    a = ap.parse_args()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.ladder:
        return ladder(a, out_dir)
    jobs = [(m, e, s) for m, e in METHODS for s in a.seeds if a.methods is None or m in a.methods]
    results = run([one(*j, a.backend, out_dir) for j in jobs], a.jobs)
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
