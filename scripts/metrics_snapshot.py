"""Run shipped configs and record every logged metric at every step, to show that a change leaves results as
they were, to the last digit (wall-clock metrics excluded).

    python scripts/metrics_snapshot.py run --out before.json [--cases quickstart digits-sflv2 ...]
    python scripts/metrics_snapshot.py compare before.json after.json     # exit 1 if anything differs

Run ``run`` on the old commit (a ``git worktree`` with ``PYTHONPATH`` pointing at it) and on the new one, then
``compare``. The cases: the quickstart in full, each family's config shortened (rounds stated below), and every
registered synchronous algorithm on digits.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from raysplit.metrics import WALL_CLOCK, grouped_name  # noqa: E402

CASES: dict[str, tuple[str, list[str]]] = {
    "quickstart": ("configs/quickstart.yaml", []),
    "cyclesl-fmnist": ("configs/cyclesl/fmnist.yaml", ["train.rounds=60", "eval.every=20"]),
    "hydra-fmnist": ("configs/hydra/fmnist.yaml", ["train.rounds=3"]),
    "hydra-fmnist-sflv2": ("configs/hydra/fmnist.yaml", ["train.rounds=3", "algorithm={name: sflv2, order: cyclic, phi: 5}"]),
}
for _alg in ["splitnn", "psl", "sflv1", "sflv2", "fedavg", "sglr", "cyclepsl", "cyclesfl", "cyclesglr", "hydra",
             "sflv3", "multihead"]:
    _extra = {"hydra": ["algorithm.order=cyclic", "algorithm.phi=2"]}.get(_alg, [])
    CASES[f"digits-{_alg}"] = ("configs/digits.yaml", [f"algorithm.name={_alg}", "train.rounds=4"] + _extra)
CASES["digits-sglr-original"] = ("configs/digits.yaml", ["algorithm.name=sglr", "algorithm.variant=original",
                                                          "train.rounds=4"])
CASES["digits-sflv2-random-local"] = ("configs/digits.yaml", ["algorithm.name=sflv2", "algorithm.order=random",
                                                               "train.rounds=4", "runtime.backend=local"])


def run(out_path: str, cases: list[str]) -> None:
    from mlflow.tracking import MlflowClient

    from raysplit.config import load_config
    from raysplit.experiment import run_experiment

    tmp = Path(tempfile.mkdtemp())
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    out = json.loads(Path(out_path).read_text()) if Path(out_path).exists() else {}
    for name in cases:
        path, ov = CASES[name]
        cfg = load_config(path, ov + [f"tracking.uri={uri}", f"tracking.output_dir={tmp / 'out'}",
                                      "tracking.progress=false", f"tracking.experiment=eq-{name}"])
        t = time.time()
        final = run_experiment(cfg)
        client = MlflowClient(uri)
        hist = {}
        for k in sorted(client.get_run(final["run_id"]).data.metrics):
            if grouped_name(k) not in WALL_CLOCK:
                hist[k] = [(m.step, m.value) for m in sorted(client.get_metric_history(final["run_id"], k),
                                                              key=lambda m: (m.step, m.timestamp))]
        out[name] = hist
        print(f"{name}: {time.time() - t:.0f}s accuracy={final.get('eval/accuracy', final.get('accuracy'))}",
              flush=True)
        Path(out_path).write_text(json.dumps(out, indent=0, sort_keys=True))


def compare(before_path: str, after_path: str) -> int:
    """Metrics are compared under their grouped names, so a snapshot taken before the names were grouped
    (accuracy, not eval/accuracy) compares with one taken after."""
    a, b = ({case: {grouped_name(k): v for k, v in hist.items()} for case, hist in snap.items()}
            for snap in (json.loads(Path(p).read_text()) for p in (before_path, after_path)))
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'after' if name not in a else 'before'}")
            continue
        ka, kb = set(a[name]), set(b[name])
        diffs = [k for k in sorted(ka & kb) if a[name][k] != b[name][k]]
        if ka != kb or diffs:
            bad += 1
            print(f"{name}: DIFFERENT: missing {sorted(ka - kb)} new {sorted(kb - ka)} changed {diffs}")
        else:
            print(f"{name}: identical ({len(ka)} metrics, {sum(len(v) for v in a[name].values())} values)")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.out, args.cases)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
