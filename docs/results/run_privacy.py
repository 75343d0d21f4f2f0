"""Privacy across the families (issue 31, item 5): what an honest-but-curious server reconstructs from what each
method sends, and what the defences cost. Every run: configs/privacy/fmnist.yaml (Fashion-MNIST, 10 IID clients,
``cnn_small``, 20 rounds of 5 local steps of 64, SGD lr 0.02 momentum 0.9) with the reconstruction attack at every
fifth round (decoder fitted on the test set's last 1,000 images through the client part, scored on 64 training
inputs of clients 0 and 1), data.test_fraction 0.1 (PSL evaluates per client), the in-process backend (the same
results as Ray actors, tests/test_golden.py) and per method:

    .venv/bin/python docs/results/run_privacy.py --part leak [--seeds 0 1 2] [--jobs 2]
    .venv/bin/python docs/results/run_privacy.py --part frontier [--seeds 0 1 2] [--jobs 2]
    .venv/bin/python docs/results/run_privacy.py --report [--plot docs/results/privacy_frontier.png]

- ``leak``: no defence; sflv2, sflv1, psl, gas (low-rank covariance, rank 32), gas without generated activations,
  ampere (one-shot export after 10 device rounds, 10 server epochs) and fedavg (no cut: accuracy only), at the cuts
  conv1 and conv2.
- ``frontier``: sflv2, psl and gas at conv1 under the noise defence (clip 20, sigma 0.01, 0.03, 0.1, 0.3; epsilon
  at delta 1e-5) and NoPeek (alpha 1, 3, 10).
- ``quantize``: sflv2, psl and gas at conv1 with activations quantized to 8, 4 and 2 bits.
- ``wider``: the frontier beyond its first three methods and cut: sflv1 and ampere at conv1 under noise 0.03 and
  0.1 (NoPeek is refused under Ampere), sflv2 at conv2 under noise 0.03, 0.1 and NoPeek 3.
- ``inversion``: the model-inversion attack through the averaged client model (``privacy.attack.kind:
  inversion``, 200 Adam steps, total variation 0.1; the defence's name ends in ``+inv``) instead of the decoder:
  sflv2, sflv1, gas and ampere (psl averages no client model) at conv1 and conv2, and sflv2 at conv1 under noise
  0.01 and 0.03, NoPeek 3 and 4-bit quantization.

Runs are cached as JSON under docs/results/.privacy/ and logged to the MLflow experiment ``privacy-study``. The
report prints median [min, max] over seeds of the final accuracy, privacy/ssim, privacy/psnr, privacy/dcor and
privacy/epsilon per (method, cut, defence), and draws accuracy against SSIM.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _runs import ROOT, Run, median_range, run_all

HERE = Path(__file__).resolve().parent
OUT = HERE / ".privacy"
CONFIG = ROOT / "configs" / "privacy" / "fmnist.yaml"
# a defence or an attack is given as its whole section: its kind picks it, and the keys it takes are its own
COMMON = {"privacy.defence": {"kind": "none"}, "data.test_fraction": 0.1, "runtime.backend": "local"}
METHODS = {
    "sflv2": {"algorithm": {"name": "sflv2", "order": "shuffled"}},
    "sflv1": {"algorithm": {"name": "sflv1"}},
    "psl": {"algorithm": {"name": "psl"}},
    "gas": {"algorithm": {"name": "gas", "covariance": "lowrank", "rank": 32}},
    "gas_nogen": {"algorithm": {"name": "gas", "covariance": "lowrank", "rank": 32, "generate": False}},
    "ampere": {"algorithm": {"name": "ampere", "device_rounds": 10, "server_epochs": 10, "patience": 5}},
    "fedavg": {"algorithm": {"name": "fedavg"}, "privacy.attack": {"kind": "none"}},
}
DEFENCES = {"none": {}}
DEFENCES.update({f"noise{s}": {"privacy.defence": {"kind": "noise", "sigma": s, "clip": 20.0, "delta": 1e-5}}
                 for s in (0.01, 0.03, 0.1, 0.3)})
DEFENCES.update({f"nopeek{a}": {"privacy.defence": {"kind": "nopeek", "alpha": a}} for a in (1, 3, 10)})
DEFENCES.update({f"quantize{b}": {"privacy.defence": {"kind": "quantize", "bits": b}} for b in (8, 4, 2)})
# the same runs under the model-inversion attack through the averaged client model ("+inv": attack inversion, on
# the config's victims and samples)
DEFENCES.update({f"{d}+inv": {**DEFENCES[d], "privacy.attack": {"kind": "inversion", "victims": 2, "samples": 64}}
                 for d in ("none", "noise0.01", "noise0.03", "nopeek3", "quantize4")})
PARTS = {
    "leak": [(m, cut, "none") for cut in ("conv1", "conv2") for m in METHODS],
    "frontier": [(m, "conv1", d) for d in DEFENCES if d.startswith(("noise", "nopeek")) and "+" not in d
                 for m in ("sflv2", "psl", "gas")],
    "quantize": [(m, "conv1", d) for d in DEFENCES if d.startswith("quantize") and "+" not in d
                 for m in ("sflv2", "psl", "gas")],
    "wider": ([(m, "conv1", d) for d in ("noise0.03", "noise0.1") for m in ("sflv1", "ampere")]
              + [("sflv2", "conv2", d) for d in ("noise0.03", "noise0.1", "nopeek3")]),
    "inversion": ([(m, cut, "none+inv") for cut in ("conv1", "conv2") for m in ("sflv2", "sflv1", "gas", "ampere")]
                  + [("sflv2", "conv1", f"{d}+inv") for d in ("noise0.01", "noise0.03", "nopeek3", "quantize4")]),
}
KEYS = ("eval/accuracy", "privacy/ssim", "privacy/psnr", "privacy/dcor", "privacy/epsilon")


def run_one(method: str, cut: str, defence: str, seed: int) -> Run:
    over = {**COMMON, **METHODS[method], **DEFENCES[defence], "model.cut": cut, "seed": seed,
            "tracking.experiment": "privacy-study", "tracking.log_checkpoint_artifact": False}
    label = f"{method}_{cut}_{defence}_s{seed}"
    return Run(CONFIG, over, label, OUT / f"{label}.json", keys=KEYS)


def cached(method: str, cut: str, defence: str, seed: int) -> dict | None:
    import json

    from _runs import named, restored

    f = restored(OUT / f"{method}_{cut}_{defence}_s{seed}.json")
    return named(json.loads(f.read_text())) if f.is_file() else None


def _row(m: str, c: str, d: str, res: list[dict]) -> dict:
    """Print one table row (median [min, max] over the runs ``res``); returns its point for the frontier figure
    (conv1, decoder attack only)."""
    import numpy as np

    def col(k, scale=1.0, fmt=".2f"):
        v = [scale * r[k] for r in res if k in r]
        return median_range(v, fmt) if v else "-"

    print(f"| {m} | {c} | {d} | {len(res)} | {col('eval/accuracy', 100)} | {col('privacy/ssim', 1, '.3f')} | "
          f"{col('privacy/psnr', 1, '.1f')} | {col('privacy/dcor', 1, '.3f')} | {col('privacy/epsilon', 1, '.3g')} |")
    if c != "conv1" or "privacy/ssim" not in res[0] or d.endswith("+inv"):
        return {}
    return {(m, d): (float(np.median([r["privacy/ssim"] for r in res])),
                     float(np.median([100 * r["eval/accuracy"] for r in res])))}


def report(seeds: list[int], plot: str | None) -> None:
    points = {}
    for part, rows in PARTS.items():
        print(f"\n{part}:\n\n| method | cut | defence | seeds | accuracy (%) | SSIM | PSNR (dB) | dCor | epsilon "
              "(delta 1e-5) |\n|---|---|---|---|---|---|---|---|---|")
        for m, c, d in rows:
            res = [r for s in seeds if (r := cached(m, c, d, s)) is not None]
            if res:
                points.update(_row(m, c, d, res))
    pairs = [(a, b) for m, c, d in PARTS["inversion"] for s in seeds
             if (a := cached(m, c, d, s)) is not None and (b := cached(m, c, d.removesuffix("+inv"), s)) is not None]
    same = sum(all(a[k] == b[k] for k in ("eval/accuracy", "eval/loss", "train/loss")) for a, b in pairs)
    print(f"\nruns under the inversion attack whose accuracy and losses equal the same run under the decoder: "
          f"{same} of {len(pairs)}")
    if plot and points:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for m, marker in (("sflv2", "o"), ("psl", "s"), ("gas", "^"), ("sflv1", "D"), ("ampere", "v")):
            for kind, colour in (("noise", "tab:red"), ("nopeek", "tab:blue"), ("quantize", "tab:green")):
                pts = [points[(m, "none")]] if (m, "none") in points else []
                pts += [points[(m, d)] for d in DEFENCES if d.startswith(kind) and (m, d) in points]
                if len(pts) > 1:
                    ax.plot(*zip(*pts), marker=marker, color=colour, label=f"{m}, {kind}", alpha=0.8)
        for (m, d), (x, y) in points.items():
            if d == "none":
                ax.annotate(m, (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("reconstruction SSIM (clients 0, 1; median over seeds)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title("Fashion-MNIST, cut conv1: accuracy against leakage", fontsize=10)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=list(PARTS), action="append")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    todo = [(m, c, d, s) for part in args.part or [] for s in args.seeds for m, c, d in PARTS[part]]
    if todo:
        for job, res in run_all("privacy-study", todo, run_one, args.jobs):
            print(job, {k: round(res[k], 4) for k in KEYS if k in res}, flush=True)
    if args.report or not todo:
        report(args.seeds, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
