"""Chaos runs: N seeded runs, each killing one random actor at a random point (``runtime.faults.inject_fault``), every one
compared, every metric of every round, with the same config's uninterrupted run.

    python benchmarks/chaos.py --runs 24 --seed 0      # make chaos

Run i draws from ``numpy.random.default_rng([seed, i])``: a case of the fault matrix (tests/test_fault_matrix.py
``CASES``: one per family), the victim (the server actor or one of the client actors), the transport (compiled
graphs or actor calls), the round and the host-method call at which the victim SIGKILLs itself. The uninterrupted
reference of each case is its run on the local backend (the Ray backend reproduces it: tests/test_golden.py),
cached under ``--cache`` by case and code digest. Reported: runs, kills (the victim died), restarts, and runs whose
metrics differ from the reference or that failed. Prints a Markdown table and writes ``benchmarks/out/chaos.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _code_digest() -> str:
    h = hashlib.sha256()
    for p in sorted((ROOT / "raysplit").rglob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self):
        for st in self.streams:
            st.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "raysplit" / "chaos")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "chaos.json")
    args = ap.parse_args(argv)

    import tempfile

    import ray

    import test_fault_matrix as fm
    from raysplit.experiment import run_experiment

    digest = _code_digest()
    args.cache.mkdir(parents=True, exist_ok=True)
    cases = sorted(fm.CASES)
    rows, t0 = [], time.time()
    ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, logging_level="ERROR")
    for i in range(args.runs):
        rng = np.random.default_rng([args.seed, i])
        case = cases[int(rng.integers(len(cases)))]
        over, _, _ = fm.CASES[case]
        rounds = int(over["train.rounds"])
        victim = ["server", "client0", "client1"][int(rng.integers(3))]
        transport = ["compiled", "calls"][int(rng.integers(2))]
        kill_round, call = int(rng.integers(rounds)), int(rng.integers(1, 13))
        with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
            ref_file = args.cache / f"{case}-{digest}.json"
            if not ref_file.is_file():
                got: list = []
                run_experiment(fm._config(Path(tmp) / "ref", case, **{"runtime.backend": "local"}),
                               on_round=lambda r, m: got.append((r, m)))
                ref_file.write_text(json.dumps(fm._metrics(got)))
            want = json.loads(ref_file.read_text())
            err = io.StringIO()
            rounds_got: list = []
            fault = {"actor": victim, "round": kill_round, "call": call}
            status = "ok"
            t = time.time()
            try:
                with contextlib.redirect_stderr(_Tee(err, sys.stderr)):
                    run_experiment(fm._config(Path(tmp) / "run", case, **{
                        "runtime.transport.kind": transport, "runtime.faults.inject_fault": fault}),
                        on_round=lambda r, m: rounds_got.append((r, m)))
            except Exception as e:  # noqa: BLE001 - a failed run is a finding, reported
                status = f"failed: {type(e).__name__}: {str(e)[:200]}"
            restarts = len(re.findall(r"every actor replaced and the round redone", err.getvalue()))
            got = fm._metrics(rounds_got)
            differs = fm.differences(want, got)
            if status == "ok" and (differs or len(got) != len(want)):
                status = f"differs: {', '.join(differs[:5]) or 'round count'}"
            rows.append({"run": i, "case": case, "victim": victim, "transport": transport, "round": kill_round,
                         "call": call, "killed": restarts > 0, "restarts": restarts, "status": status,
                         "wall_s": round(time.time() - t, 1)})
            print(f"run {i}: {case} {victim} ({transport}) round {kill_round} call {call}: "
                  f"{restarts} restart(s), {status}", flush=True)
    ray.shutdown()
    kills = sum(r["killed"] for r in rows)
    bad = [r for r in rows if r["status"] != "ok"]
    print(f"\n{len(rows)} runs, {kills} kills, {sum(r['restarts'] for r in rows)} restarts, {len(bad)} runs that "
          f"differ from the uninterrupted run or failed; {time.time() - t0:.0f} s; code {digest}\n")
    print("| run | case | victim | transport | round | call | restarts | result |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['case']} | {r['victim']} | {r['transport']} | {r['round']} | {r['call']} | "
              f"{r['restarts']} | {r['status']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seed": args.seed, "code": digest, "load": os.getloadavg(), "rows": rows},
                                   indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
