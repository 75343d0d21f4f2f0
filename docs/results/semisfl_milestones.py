"""What Semi-SFL's milestones rule read in the runs of semisfl.md (issue 28, item 2; no training): at each milestone,
the windowed change of the supervised loss (``milestone_change``, what ``method/ks_loss_change`` logs since
2026-11-26) with the 5-round windows the runs used and the paper's 10, against the paper's thresholds rho1 = 0.01
(halve below) and rho2 = 0.05 (double above).

    .venv/bin/python docs/results/semisfl_milestones.py [--tracking-uri sqlite:///mlflow.db]

Reads each run of docs/results/.semisfl_runs/ (run_semisfl.py; its cache restored from its committed record where
absent) and its ``method/loss_x`` history: from the run's own per-round history where it keeps it (the records do),
else from the MLflow store the run logged to (its run id is in the cache), the trace then kept as a committed record
(docs/results/records/semisfl_milestones/, ``_runs.kept``, kind script) so that the next machine reads it from there. Prints one row per method and partition: the change at
each milestone, median [min, max] over seeds, and what the rule decides on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _runs import ROOT, kept, median_range, named, record_path, restored

HERE = Path(__file__).resolve().parent
RUNS = HERE / ".semisfl_runs"
TRACES = HERE / ".semisfl_milestones"  # the loss traces read from MLflow (ignored); records/semisfl_milestones/
MILESTONES = (20, 30, 40, 50)
RHO1, RHO2 = 0.01, 0.05


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tracking-uri", default=f"sqlite:///{ROOT / 'mlflow.db'}")
    ap.add_argument("--methods", nargs="*", default=["Semi-SFL", "Semi-SFL fixed K_s", "FedSwitch-SL"])
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from mlflow.tracking import MlflowClient

    from raysplit.algorithms.semisfl import milestone_change
    from raysplit.metrics import short_name

    client = MlflowClient(a.tracking_uri)
    print("| method | partition | seeds | window | " + " | ".join(f"change at round {m}" for m in MILESTONES)
          + " |\n|---|---|---|---|" + "---|" * len(MILESTONES))
    for method in a.methods:
        for part in ("IID", "Dirichlet 0.1"):
            traces, seeds = [], []
            for seed in (0, 1, 2):
                f = restored(RUNS / f"{method}_{part}_s{seed}_r60.json".replace(" ", "_"))
                if not f.is_file():
                    continue
                run = named(json.loads(f.read_text()))
                own = [h["method/loss_x"] for h in run.get("history", []) if "method/loss_x" in h]
                spec = {"run": f.name, "run_id": run.get("run_id"), "metric": "method/loss_x"}

                def from_store(rid=run.get("run_id")):
                    hist = sorted(client.get_metric_history(rid, "method/loss_x")  # or as logged before the groups
                                  or client.get_metric_history(rid, short_name("method/loss_x")),
                                  key=lambda m: m.step)
                    return {"loss_x": [m.value for m in hist]}
                trace = own or kept(TRACES / f.name, "semisfl-milestones", f"{method} {part} seed {seed}", spec,
                                    from_store)["loss_x"]
                if not own and not trace:  # nothing in that store (a worktree's): not kept, the seeds column says
                    (TRACES / f.name).unlink(missing_ok=True)
                    record_path(TRACES / f.name).unlink(missing_ok=True)
                if trace:
                    traces.append(trace)
                    seeds.append(str(seed))
            if not traces:
                continue
            for window in (5, 10):
                cells = []
                for m in MILESTONES:
                    ch = [milestone_change(m - 1, t[:m], list(MILESTONES), window) for t in traces]
                    ch = [c for c in ch if c is not None]
                    if not ch:
                        cells.append("")
                        continue
                    rule = ["halve" if abs(c) < RHO1 else "double" if abs(c) > RHO2 else "keep" for c in ch]
                    cells.append(f"{median_range(ch, '+.3f')} ({', '.join(sorted(set(rule)))})")
                print(f"| {method} | {part} | {', '.join(seeds)} | {window} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
