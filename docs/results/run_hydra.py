"""Reproduce docs/results/hydra.md: Hydra's forgetting study on Fashion-MNIST (configs/hydra/fmnist.yaml).

    .venv/bin/python docs/results/run_hydra.py [--seeds 0 1 2] [--jobs 2] [--backend local]

For c in {1, 2} (10 or 20 clients, dominant label 0.8) runs SFLV2 and SFLV2+Hydra in the cyclic and the random
order, and SplitFedV1, SplitFedV3 and MultiHead (their per-client server copies make the order irrelevant), each
seed a full raysplit run logged to MLflow (experiment hydra-fmnist in ./mlflow.db). Prints the markdown table
(final global accuracy, performance gap, backward transfer; mean ± std over seeds) and writes the per-position
figure docs/results/hydra_positions.png (cyclic order; accuracy of each position's label averaged over the last
5 rounds, median over seeds). ``--backend local`` runs the same hosts in-process (identical results to the Ray
backend, tested in tests/test_semantics.py) so that the runs fit on 2 cores.

``--study gap`` is the second study, at the paper's proportions (configs/hydra/fmnist_gap.yaml: cnn_gap, heads
conv4+fc = 62 % of the server or fc alone = 1 %, phi 10 batches of 64, the full test set; MergeSFL among the
baselines; experiment hydra-fmnist-gap; figure docs/results/hydra_gap_positions.png). ``--sweeps`` runs the phi and
head-share sweeps through `raysplit sweep` (a rerun resumes them) and writes docs/results/hydra_phi.png.
``--report`` runs nothing: it prints the table and draws the figure from the runs already cached under --out (with
``--sweeps``: from the sweep trials that finished in MLflow). The second study's page was made with

    .venv/bin/python docs/results/run_hydra.py --study gap --jobs 2 --seeds 1 --only-c 1 \
        --methods SFLV2 SFLV2+Hydra "SFLV2+Hydra head=fc" SplitFedV1        # and --seeds 0 (every method), 2
    .venv/bin/python docs/results/run_hydra.py --study gap --report --seeds 0 1 2
    .venv/bin/python docs/results/run_hydra.py --sweeps [--report]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
from _runs import ROOT, Run, median_range, named, restored, study

# the two settings (--study): the first study (cnn_small, 2-layer heads = 98 % of the server) and the second, at
# the paper's proportions (cnn_gap, heads conv4+fc = 62 % of the server, or fc alone = 1 %; phi 10 batches of 64)
STUDIES = {
    "fc": {"config": "configs/hydra/fmnist.yaml", "phi": 5, "out": "hydra_table", "figure": "hydra_positions.png",
           "ordered": [("SFLV2", "sflv2", {}), ("SFLV2+Hydra", "hydra", {"cut_b": "conv2"}),
                       ("SFLV2+Hydra head=fc2", "hydra", {"cut_b": "fc1"})],
           "parallel": [("SplitFedV1", "sflv1"), ("SplitFedV3", "sflv3"), ("MultiHead", "multihead")]},
    "gap": {"config": "configs/hydra/fmnist_gap.yaml", "phi": 10, "out": "hydra_gap",
            "figure": "hydra_gap_positions.png",
            "ordered": [("SFLV2", "sflv2", {}), ("SFLV2+Hydra", "hydra", {"cut_b": "conv3"}),
                        ("SFLV2+Hydra head=fc", "hydra", {"cut_b": "conv4"})],
            "parallel": [("SplitFedV1", "sflv1"), ("SplitFedV3", "sflv3"), ("MultiHead", "multihead"),
                         ("MergeSFL", "mergesfl")]},
    # issue 28 item 3: the paper's model and cut (MobileNetV1 at width 0.25, cut_a 4, cut_b 23), 100 rounds
    "mobilenet": {"config": "configs/hydra/fmnist_mobilenet.yaml", "phi": 10, "out": "hydra_mobilenet",
                  "figure": "hydra_mobilenet_positions.png",
                  "ordered": [("SFLV2", "sflv2", {}), ("SFLV2+Hydra", "hydra", {"cut_b": 23})],
                  # Table 3's baselines that take no order (SplitFedV1 first: the cheapest; V3 and MultiHead pick the
                  # most confident of 10 client models per test image, 10 inferences an evaluation)
                  "parallel": [("SplitFedV1", "sflv1"), ("SplitFedV3", "sflv3"), ("MultiHead", "multihead")]},
}
STUDY = STUDIES["fc"]


def jobs(seeds):
    out = []
    for c in (1, 2):
        for order in ("cyclic", "random"):
            for label, name, extra in STUDY["ordered"]:
                out += [(c, order, label, {"name": name, "order": order, "phi": STUDY["phi"], **extra}, s)
                        for s in seeds]
        for label, name in STUDY["parallel"]:
            out += [(c, "-", label, {"name": name}, s) for s in seeds]
    return out


def run_file(c, order, label, alg, seed) -> str:
    return f"{label}_{order}_c{c}_s{seed}.json".replace("+", "_").replace("=", "").replace(" ", "_")


# the metrics whose last 5 evaluations the tables and figures average (their cached ``_last5`` values)
LAST5 = ("eval/accuracy", "eval/performance_gap") + tuple(f"eval/position_acc/{i}" for i in range(10))


def one(c, order, label, alg, seed, backend, out_dir, overrides) -> Run:
    return Run(ROOT / STUDY["config"], {"algorithm": alg, "seed": seed, "data.num_clients": 10 * c,
                                        "runtime.backend": backend, **overrides},
               f"{label} {order} c={c} seed {seed}", out_dir / run_file(c, order, label, alg, seed), keys=LAST5)


def last5(res: dict) -> dict:
    """``res`` with the mean of the last 5 evaluations of each ``LAST5`` metric (``<key>_last5``), from its per-round
    history where the cache does not hold it yet."""
    for key in LAST5:
        h = [e[key] for e in res.get("history", []) if key in e]
        if h and key + "_last5" not in res:
            res[key + "_last5"] = sum(h[-5:]) / len(h[-5:])
    return res


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
        for (label, _, _), color in zip(STUDY["ordered"], ("tab:red", "tab:blue", "tab:green")):
            runs = {s: r for (cc, o, lab, s), r in results.items() if cc == c and o == "cyclic" and lab == label}
            if not runs:
                continue
            pos = np.array([[r[f"eval/position_acc/{i}_last5"] for i in range(10)] for r in runs.values()])
            axes[0, col].plot(range(1, 11), np.median(pos, axis=0), "o-", color=color, ms=4, label=label)
            delta = []
            for s, r in runs.items():
                rnd = results.get((c, "random", label, s))
                if rnd is None:
                    continue
                labs = label_order(s, 10)
                delta.append([r[f"eval/position_acc/{i}"] - rnd[f"eval/label_acc/{lab}"] for i, lab in enumerate(labs)])
            if delta:
                axes[1, col].plot(range(1, 11), np.median(delta, axis=0), "o-", color=color, ms=4, label=label)
                print(f"c = {c}, {label}: position's label accuracy minus the random order's (pp, median of "
                      f"{len(delta)} seeds): " + " ".join(f"{100 * v:+.0f}" for v in np.median(delta, axis=0)))
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


SWEEPS = [f"tune/examples/{name}{c}.yaml" for c in ("", "_c2")
          for name in ("sflv2_phi", "hydra_phi", "hydra_heads")]


def sweeps(uri: str, run: bool = True) -> None:
    """The phi and head-share sweeps through `raysplit sweep` (each trial an MLflow run; a rerun resumes), then PG
    against phi per method and c (docs/results/hydra_phi.png) and the head-share table, read back from MLflow.
    ``run=False`` only reads back the trials that finished."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow.tracking import MlflowClient

    for path in SWEEPS if run else ():
        subprocess.run([str(Path(sys.executable).parent / "raysplit"), "sweep", path], cwd=ROOT, check=True)
    client = MlflowClient(uri)

    def finished(experiment):
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'") if exp else []
        return [(r.data.params, named(r.data.metrics)) for r in runs]  # trials logged before the groups too

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    print("| method | c | phi | global accuracy (%) | PG (pp) | BW (pp) |\n|---|---|---|---|---|---|")
    for exp, method, color in (("sflv2-phi", "SFLV2", "tab:red"), ("hydra-phi", "SFLV2+Hydra", "tab:blue")):
        rows = sorted((int(p["data.num_clients"]) // 10, int(p["algorithm.phi"]), m) for p, m in finished(exp))
        for c, style in ((1, "o-"), (2, "s--")):
            for ax, key in zip(axes, ("eval/performance_gap", "eval/accuracy")):
                pts = [(phi, 100 * m[key]) for cc, phi, m in rows if cc == c]
                if pts:
                    ax.plot(*zip(*pts), style, color=color, label=f"{method}, c = {c}")
        for c, phi, m in rows:
            print(f"| {method} | {c} | {phi} | {100 * m['eval/accuracy']:.2f} | "
                  f"{100 * m['eval/performance_gap']:.2f} | "
                  f"{100 * m['eval/backward_transfer']:.2f} |")
    for ax, what in zip(axes, ("performance gap (pp)", "global accuracy (%)")):
        ax.set_xscale("log"), ax.set_xticks([1, 5, 10, 20])
        ax.set_xticklabels(["1", "5", "10", "20"])
        ax.set_xlabel("phi: batches per turn, cyclic order\n(a client's whole round: 20 at c = 1, 10 at c = 2)")
        ax.set_ylabel(f"{what} after 30 rounds")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "results" / "hydra_phi.png", dpi=110)
    share = {"conv4": "fc, 1.1 %", "conv3": "conv4+fc, 62 %", "conv2": "conv3+conv4+fc, 92 %"}
    print("\n| head (share of the server) | c | global accuracy (%) | PG (pp) | BW (pp) |\n|---|---|---|---|---|")
    for p, m in sorted(finished("hydra-heads"), key=lambda r: (r[0]["data.num_clients"], r[0]["algorithm.cut_b"])):
        print(f"| {share[p['algorithm.cut_b']]} | {int(p['data.num_clients']) // 10} | "
              f"{100 * m['eval/accuracy']:.2f} | "
              f"{100 * m['eval/performance_gap']:.2f} | {100 * m['eval/backward_transfer']:.2f} |")


def main():
    global STUDY
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", choices=list(STUDIES), default="fc", help="fc: the first study (cnn_small); gap: at "
                    "the paper's proportions (cnn_gap, configs/hydra/fmnist_gap.yaml); mobilenet: the paper's model "
                    "and cut (configs/hydra/fmnist_mobilenet.yaml)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--backend", default="local", choices=["local", "ray"])
    ap.add_argument("--out", default=None, help="default: outputs/hydra_table (fc), outputs/hydra_gap (gap)")
    ap.add_argument("--seeds-c2", type=int, nargs="*", default=None, help="seeds for c = 2 (default: --seeds)")
    ap.add_argument("--no-mlflow", action="store_true", help="the runs log to a store of their own under --out "
                    "(mlflow.db there), not to ./mlflow.db")
    ap.add_argument("--data-root", default=None, help="data.root for Fashion-MNIST")
    ap.add_argument("--only-c", type=int, choices=[1, 2], default=None)
    ap.add_argument("--set", nargs="*", default=[], help="extra dotted key=value overrides for every run")
    ap.add_argument("--methods", nargs="*", default=None, help="only these method labels")
    ap.add_argument("--orders", nargs="*", default=None, help="only these orders (cyclic, random, -)")
    ap.add_argument("--sweeps", action="store_true", help="run the phi and head-share sweeps (raysplit sweep, "
                    "tune/examples/{hydra,sflv2}_phi.yaml, hydra_heads.yaml) and print/plot them instead")
    ap.add_argument("--report", action="store_true", help="run nothing: the table and figures from the runs "
                    "already cached under --out (and, with --sweeps, the sweep trials that finished)")
    a = ap.parse_args()
    if a.sweeps:
        from raysplit.tracking import resolve_uri

        sweeps(resolve_uri(None), run=not a.report)
        return
    STUDY = STUDIES[a.study]
    default_out = str(ROOT / "outputs" / STUDY["out"])
    a.out = str(Path(a.out).resolve()) if a.out else default_out
    overrides = {}
    if a.data_root:
        overrides["data.root"] = a.data_root
    import yaml

    overrides.update({kv.split("=", 1)[0]: yaml.safe_load(kv.split("=", 1)[1]) for kv in a.set})
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    experiment = yaml.safe_load((ROOT / STUDY["config"]).read_text())["tracking"]["experiment"]
    todo = [j for j in jobs(a.seeds) if a.only_c in (None, j[0]) and (a.methods is None or j[2] in a.methods)
            and (a.orders is None or j[1] in a.orders)
            and (j[0] == 1 or a.seeds_c2 is None or j[4] in a.seeds_c2)]
    every = len(todo)
    if a.report:
        todo = [j for j in todo if restored(out_dir / run_file(*j[:4], j[4])).is_file()]
    todo.sort(key=lambda j: (j[4], j[0]))  # every method's first seed first: a partial run is already a table
    ran = study(experiment, [one(*j, a.backend, out_dir, overrides) for j in todo], a.jobs,
                f"sqlite:///{out_dir / 'mlflow.db'}" if a.no_mlflow else None)
    results = {(c, o, lab, s): last5(r) for (c, o, lab, _, s), r in zip(todo, ran)}
    print(f"runs: {len(results)}; overrides: {overrides}")
    print("| c | order | method | global accuracy (%) | PG (pp) | BW (pp) | PG, mean of last 5 rounds (pp) |")
    print("|---|---|---|---|---|---|---|")
    keys = sorted({(c, o, lab) for c, o, lab, _ in results}, key=lambda k: (k[0], k[1] == "-", k[1], k[2]))
    for c, o, lab in keys:
        rs = [r for (cc, oo, ll, _), r in results.items() if (cc, oo, ll) == (c, o, lab)]

        def ms(k):
            v = np.array([r[k] for r in rs], dtype=float) * 100
            if a.study != "fc":  # the second study and MobileNetV1: median [min, max] over the seeds, and how many
                return f"{median_range(v)} n={len(v)}"
            return f"{v.mean():.2f} ± {v.std():.2f}"

        print(f"| {c} | {o} | {lab} | {ms('eval/accuracy')} | {ms('eval/performance_gap')} | "
              f"{ms('eval/backward_transfer')} | "
              f"{ms('eval/performance_gap_last5')} |")
    if a.study != "fc":  # paired by seed: the spread between seeds is larger than most differences
        paired = []
        print("\n| c | order | method | minus SFLV2 (same seed; same order, else cyclic): accuracy (pp) | PG (pp) | "
              "seeds |\n|---|---|---|---|---|---|")
        for c, o, lab in keys:
            ref = (c, "random" if o == "random" and lab != "SFLV2" else "cyclic", "SFLV2")
            pairs = [(s, r, results[(*ref, s)]) for (cc, oo, ll, s), r in sorted(results.items())
                     if (cc, oo, ll) == (c, o, lab) and (*ref, s) in results]
            if lab == "SFLV2" and o == "cyclic" or not pairs:
                continue
            d = {k: " ".join(f"{100 * (r[k] - b[k]):+.2f}" for _, r, b in pairs)
                 for k in ("eval/accuracy", "eval/performance_gap")}
            print(f"| {c} | {o} | {lab} | {d['eval/accuracy']} | {d['eval/performance_gap']} | "
                  f"{' '.join(str(s) for s, _, _ in pairs)} |")
            paired.append((c, o, lab, pairs))
    # the cyclic order's last evaluation depends on which label trained last: the last 5 evaluations, paired, too
    if a.study == "mobilenet":
        print("\n| c | order | method | minus SFLV2, mean of the last 5 evaluations: accuracy (pp) | PG (pp) | "
              "seeds |\n|---|---|---|---|---|---|")
        for c, o, lab, pairs in paired:
            d = {k: " ".join(f"{100 * (r[k] - b[k]):+.2f}" for _, r, b in pairs)
                 for k in ("eval/accuracy_last5", "eval/performance_gap_last5")}
            print(f"| {c} | {o} | {lab} | {d['eval/accuracy_last5']} | {d['eval/performance_gap_last5']} | "
                  f"{' '.join(str(s) for s, _, _ in pairs)} |")
        # the paper's Table 3: Hydra in the random order against each baseline (random order, or none), by seed
        print("\n| c | Hydra (random) minus | seeds | accuracy, final (pp) | accuracy, mean of last 5 (pp) | "
              "PG, mean of last 5 (pp) |\n|---|---|---|---|---|---|")
        for c, o, lab in keys:
            hyd = {s: r for (cc, oo, ll, s), r in results.items() if (cc, oo, ll) == (c, "random", "SFLV2+Hydra")}
            base = {s: r for (cc, oo, ll, s), r in results.items() if (cc, oo, ll) == (c, o, lab)}
            seeds = sorted(set(hyd) & set(base))
            if o == "cyclic" or lab == "SFLV2+Hydra" or not seeds:
                continue
            d = {k: " ".join(f"{100 * (hyd[s][k] - base[s][k]):+.2f}" for s in seeds)
                 for k in ("eval/accuracy", "eval/accuracy_last5", "eval/performance_gap_last5")}
            print(f"| {c} | {lab}{'' if o == '-' else f' ({o})'} | {' '.join(map(str, seeds))} | "
                  f"{d['eval/accuracy']} | {d['eval/accuracy_last5']} | {d['eval/performance_gap_last5']} |")
    # the page's figure comes from the default runs only, and only from all of them (a report over a partial cache,
    # e.g. one method rerun, must not redraw it from what is there)
    if (a.out == default_out and a.methods is None and a.orders is None and len(todo) == every
            and (a.report or a.only_c is None)):
        figure(results, ROOT / "docs" / "results" / STUDY["figure"])


if __name__ == "__main__":
    main()
