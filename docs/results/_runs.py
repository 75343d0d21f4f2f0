"""Shared by the results scripts: run one raysplit experiment in a fresh interpreter, cached as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from raysplit.metrics import grouped_name  # noqa: E402

# what a cached result holds besides metrics; every other key is a metric, under its grouped name
NOT_METRICS = ("run_id", "curve", "history", "diverged", "round")


def named(res: dict) -> dict:
    """A cached result with its metrics under their grouped names (``eval/accuracy``, ``time/sim``), also when the
    cache was written before the names were grouped (``accuracy``, ``sim_time``); a ``_last5`` mean keeps its
    suffix (``eval/accuracy_last5``). The per-round ``history`` entries are renamed the same way."""
    def name(k: str) -> str:
        if k in NOT_METRICS or "/" in k:
            return k
        return grouped_name(k[:-6]) + "_last5" if k.endswith("_last5") else grouped_name(k)

    out = {name(k): v for k, v in res.items()}
    if "history" in out:
        out["history"] = [{name(k): v for k, v in h.items()} for h in out["history"]]
    return out


def median_range(values, fmt: str = ".2f") -> str:
    """``median [min, max]`` of ``values`` as the result pages write it; the single value when there is one."""
    import numpy as np

    v = np.asarray(values, dtype=float)
    if len(v) == 1:
        return f"{v[0]:{fmt}}"
    return f"{np.median(v):{fmt}} [{np.min(v):{fmt}}, {np.max(v):{fmt}}]"


def paired_table(results: dict, pairs: list[tuple[str, str]], partitions: list[str], rounds: int,
                 head: str = "difference", label=lambda a, b: f"{a} minus {b}") -> str:
    """Accuracy at the last round of ``a`` minus ``b`` for every pair and partition, paired by seed (the seeds both
    ran): median [min, max] and each seed's. ``results[(method, partition)]``: ``[(seed, result), ...]``."""
    lines = [f"| partition | {head} | accuracy difference @{rounds} (points), paired by seed | per seed |",
             "|---" * 4 + "|"]
    for part in partitions:
        for a, b in pairs:
            first = {s: 100 * r["eval/accuracy"] for s, r in results.get((a, part), [])}
            other = {s: 100 * r["eval/accuracy"] for s, r in results.get((b, part), [])}
            seeds = sorted(set(first) & set(other))
            if seeds:
                d = [first[s] - other[s] for s in seeds]
                lines.append(f"| {part} | {label(a, b)} | {median_range(d, '+.2f')} | "
                             f"{', '.join(f'{x:+.2f} (seed {s})' for s, x in zip(seeds, d))} |")
    return "\n".join(lines)


def run_cached(code: str, out: Path, what: str) -> dict:
    """Run ``code`` (which prints one ``RESULT{json}`` line) with this interpreter in the repository root and
    return the parsed result; reuse ``out`` when it exists, write it otherwise."""
    if out.is_file():
        return named(json.loads(out.read_text()))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if not line:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(line[-1][6:])
    out.write_text(json.dumps(res))
    return named(res)


def run_config(config: Path, overrides: dict, label: str, out: Path, keys: tuple[str, ...] = ()) -> dict:
    """One ``run_experiment`` of ``config`` with ``overrides`` (cached in ``out``): the final metrics, the evaluated
    rounds as ``curve`` = [(round, sim_time, accuracy)], and ``history`` = the per-round values of ``keys``. A run
    that diverged (non-finite loss) is a result too: accuracy NaN and ``diverged`` = the error naming round and
    client."""
    code = f"""
import json
from raysplit.config import load_config
from raysplit.experiment import run_experiment
cfg = load_config({str(config)!r}, {{**{overrides!r}, "tracking.progress": False, "tracking.run_name": {label!r}}})
from raysplit.runtime import NonFiniteLossError
hist = []
try:
    res = run_experiment(cfg, on_round=lambda r, m: hist.append((r, m)))
except NonFiniteLossError as e:  # a diverged run is a result: kept, shown as diverged, never averaged
    res = {{"eval/accuracy": float("nan"), "diverged": str(e),
           "time/sim": hist[-1][1].get("time/sim", 0.0) if hist else 0.0}}
out = {{k: v for k, v in res.items() if isinstance(v, (int, float, str))}}
out["curve"] = [(r + 1, m["time/sim"], m["eval/accuracy"]) for r, m in hist if "eval/accuracy" in m]
out["history"] = [{{"round": r + 1, **{{k: m[k] for k in {list(keys)!r} if k in m}}}} for r, m in hist]
print("RESULT" + json.dumps(out))
"""
    return run_cached(code, out, label)


def run_all(experiment: str, todo: list, run_one, jobs: int) -> list:
    """``run_one(*job)`` for every job, ``jobs`` at a time, all logging to the MLflow experiment ``experiment`` of
    ./mlflow.db in the repository root (or $MLFLOW_TRACKING_URI); returns ``[(job, result), ...]`` in order."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import mlflow

    from raysplit.tracking import resolve_uri

    os.chdir(ROOT)
    mlflow.set_tracking_uri(resolve_uri(None))  # the store made once here, before parallel runs race to make it
    mlflow.set_experiment(experiment)
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda job: (job, run_one(*job)), todo))
