"""Label privacy in a U-shaped split across the families (issue 56, item 4): how much of the labels the server reads
from the gradients the clients return (Li et al. 2022's norm and direction scores, raysplit/label_privacy.py),
what the defences cost, and whether the U-shape changes what the input reconstruction recovers. Every run:
configs/privacy/fmnist_ushaped.yaml (Fashion-MNIST, 10 IID clients, ``cnn_small``, 20 rounds of 5 local steps of
64, SGD lr 0.02 momentum 0.9), data.test_fraction 0.1 (PSL evaluates per client), the in-process backend (the same
bits as Ray actors on every transport, tests/test_ushape.py), and per part:

    .venv/bin/python docs/results/run_label_privacy.py --part leak [--seeds 0 1 2] [--jobs 2]
    .venv/bin/python docs/results/run_label_privacy.py --part frontier [--seeds 0 1 2] [--jobs 2]
    .venv/bin/python docs/results/run_label_privacy.py --part inputs [--seeds 0 1 2] [--jobs 2]
    .venv/bin/python docs/results/run_label_privacy.py --report [--plot docs/results/label_privacy_frontier.png]

- ``leak``: no defence; splitnn, psl, sflv1 and sflv2 at two cut pairs: head conv1 with the tail fc2 (the server
  holds conv2 and fc1: ``conv1-fc1``), and head conv1 with the tail fc1 and fc2 (the server holds conv2 only:
  ``conv1-conv2``).
- ``frontier``: sflv2 at ``conv1-fc1`` under Gaussian noise on the returned gradient (scale 0.3, 1, 3, 10 times the
  batch's median row norm) and under Li et al.'s max-norm heuristic; psl under noise 1 and max norm.
- ``inputs``: sflv2 with the reconstruction attack (a decoder fitted on the test set's last 1,000 images, scored on
  64 training inputs of clients 0 and 1, every fifth round), cut conv1, without and with the U-shape (tail fc2).

Runs are cached as JSON under ``--out`` (default docs/results/.label_privacy/) and logged to the MLflow experiment
``label-privacy``. The report prints, per (method, cut pair, defence), median [min, max] over seeds of the final
accuracy and of each label score averaged over the run's 20 rounds (every round scores what that round's gradients
gave away), and draws accuracy against the direction score's AUC.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from _runs import ROOT, Run, median_range, named, restored, run_all

HERE = Path(__file__).resolve().parent
CONFIG = ROOT / "configs" / "privacy" / "fmnist_ushaped.yaml"
COMMON = {"privacy.label_defence": {"kind": "none"}, "data.test_fraction": 0.1, "runtime.backend": "local",
          "tracking.log_checkpoint_artifact": False}
METHODS = {"splitnn": {"algorithm": {"name": "splitnn"}}, "psl": {"algorithm": {"name": "psl"}},
           "sflv1": {"algorithm": {"name": "sflv1"}}, "sflv2": {"algorithm": {"name": "sflv2", "order": "shuffled"}}}
CUTS = {"conv1-fc1": {"model.cut": "conv1", "model.tail_cut": "fc1"},
        "conv1-conv2": {"model.cut": "conv1", "model.tail_cut": "conv2"},
        "conv1 (no tail)": {"model.cut": "conv1", "model.tail_cut": None, "privacy.label_attack": {"kind": "none"}}}
DEFENCES = {"none": {}, "max_norm": {"privacy.label_defence": {"kind": "max_norm"}}}
DEFENCES.update({f"noise{s:g}": {"privacy.label_defence": {"kind": "noise", "scale": s}} for s in (0.3, 1, 3, 10)})
DEFENCES["none+rec"] = {"privacy.attack": {"kind": "reconstruction", "aux_size": 1000, "victims": 2, "samples": 64,
                                           "epochs": 10}}
PARTS = {
    "leak": [(m, c, "none") for c in ("conv1-fc1", "conv1-conv2") for m in METHODS],
    # every strength on sflv2; psl at the middle noise and max norm (do two families pay alike?)
    "frontier": ([("sflv2", "conv1-fc1", d) for d in DEFENCES if d.startswith(("noise", "max"))]
                 + [("psl", "conv1-fc1", d) for d in ("noise1", "max_norm")]),
    "inputs": [("sflv2", c, "none+rec") for c in ("conv1 (no tail)", "conv1-fc1")],
}
SCORES = ("privacy/label_auc_norm", "privacy/label_auc_direction", "privacy/label_acc_direction")
KEYS = ("eval/accuracy", *SCORES, "privacy/ssim", "privacy/psnr")


def _label(m: str, c: str, d: str, s: int) -> str:
    return f"{m}_{c.replace(' ', '_').replace('(', '').replace(')', '')}_{d}_s{s}"


def run_one(out: Path, method: str, cut: str, defence: str, seed: int) -> Run:
    over = {**COMMON, **METHODS[method], **CUTS[cut], **DEFENCES[defence], "seed": seed,
            "tracking.experiment": "label-privacy"}
    label = _label(method, cut, defence, seed)
    return Run(CONFIG, over, label, out / f"{label}.json", keys=KEYS)


def cached(out: Path, m: str, c: str, d: str, s: int) -> dict | None:
    f = restored(out / f"{_label(m, c, d, s)}.json")
    return named(json.loads(f.read_text())) if f.is_file() else None


def over_rounds(res: dict, key: str) -> float | None:
    """``key``'s mean over the run's rounds (its per-round history), None where it was not logged."""
    v = [h[key] for h in res.get("history", []) if key in h and h[key] == h[key]]
    return float(np.mean(v)) if v else None


def report(out: Path, seeds: list[int], plot: str | None) -> None:
    points = {}
    for part, rows in PARTS.items():
        print(f"\n{part}:\n\n| method | cut pair | defence | seeds | accuracy (%) | AUC, norm | AUC, direction | "
              "label accuracy, direction | SSIM |\n|---|---|---|---|---|---|---|---|---|")
        for m, c, d in rows:
            res = [r for s in seeds if (r := cached(out, m, c, d, s)) is not None]
            if not res:
                continue

            def col(k, scale=1.0, fmt=".3f", rounds=True):
                v = [x for r in res if (x := (over_rounds(r, k) if rounds else r.get(k))) is not None]
                return median_range([scale * x for x in v], fmt) if v else "-"

            print(f"| {m} | {c} | {d} | {len(res)} | {col('eval/accuracy', 100, '.2f', False)} | "
                  f"{col(SCORES[0])} | {col(SCORES[1])} | {col(SCORES[2])} | {col('privacy/ssim', rounds=False)} |")
            if part != "inputs" and c == "conv1-fc1" and m in ("sflv2", "psl"):
                points[(m, d)] = (float(np.median([over_rounds(r, SCORES[1]) for r in res])),
                                  float(np.median([100 * r["eval/accuracy"] for r in res])))
    if plot and points:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        order = ["none", "noise0.3", "noise1", "noise3", "noise10"]
        for m, marker in (("sflv2", "o"), ("psl", "s")):
            pts = [points[(m, d)] for d in order if (m, d) in points]
            if pts:
                ax.plot(*zip(*pts), marker=marker, color="tab:red", label=f"{m}, noise (scale 0 to 10)", alpha=0.8)
            if (m, "max_norm") in points:
                ax.plot(*points[(m, "max_norm")], marker=marker, color="tab:blue", linestyle="none",
                        label=f"{m}, max norm")
        ax.set_xlabel("label leakage: direction-score AUC (mean over 20 rounds, median over seeds)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title("Fashion-MNIST, U-shaped split conv1 | conv2, fc1 | fc2", fontsize=10)
        ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, -0.45), ncol=2)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=list(PARTS), action="append")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / ".label_privacy")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [(args.out, m, c, d, s) for part in args.part or [] for s in args.seeds for m, c, d in PARTS[part]]
    if todo:
        for job, res in run_all("label-privacy", todo, run_one, args.jobs):
            print(job[1:], {k: round(res[k], 4) for k in KEYS if k in res}, flush=True)
    if args.report or not todo:
        report(args.out, args.seeds, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
