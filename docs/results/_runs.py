"""Shared by the results scripts: a study's runs go through ``raysplit sweep`` (one sweep file per base config, an
arm per run, under outputs/studies/), are read back from MLflow by one reader and cached as JSON, so that a page
is rewritten from its caches without running anything. ``raysplit compare EXPERIMENT`` shows the same runs.

Each run's small record (issue 73, item 6: its final metrics, the evaluated curve, the per-round values its study
keeps, a digest of its config, the commit and the machine) is written as the run finishes to
docs/results/records/<cache folder>/<cache file>.json, a committed file beside the pages, so that a study continues
on the next machine and a page's numbers can be re-read without rerunning: a run whose cache is absent but whose
record is there (of the same config digest) is restored from its record, not run again. The caches (ignored) stay
for what is large; ``scripts/records.py check`` (make check-results) validates every record and holds each
table a page generates from records to what they give."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from raysplit.metrics import grouped_name  # noqa: E402

RECORDS = ROOT / "docs" / "results" / "records"  # committed: one small JSON record per finished run

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


def scores(res: dict) -> list[tuple[int, float, float]]:
    """A run's evaluated ``(round, time/sim, score)`` points, the score rising as the model gets better: its
    ``curve`` (accuracy) where it has one; a language model's, which has no accuracy, from its per-round
    ``history`` (``eval/perplexity`` and ``time/sim`` kept as keys), the score the negative perplexity (so that
    the highest score all runs reach is the lowest perplexity all reach, and reaching it is falling to it)."""
    if res.get("curve"):
        return [tuple(pt) for pt in res["curve"]]
    return [(h["round"], h["time/sim"], -h["eval/perplexity"]) for h in res.get("history", [])
            if "eval/perplexity" in h and "time/sim" in h]


def common_target(results: list[dict]) -> float:
    """Issue 73's equal outcome: the highest score every one of ``results`` reaches (:func:`scores`: accuracy, or a
    language model's negative perplexity), the smallest of their best evaluated scores, the target a time or
    traffic claim is measured to."""
    if not results or any(not scores(r) for r in results):
        raise ValueError("a common target needs every run's evaluated curve (accuracy, or perplexity per round)")
    return min(max(pt[-1] for pt in scores(r)) for r in results)


def to_target(res: dict, target: float, keys: tuple[str, ...] = ()) -> tuple[int, float, float]:
    """``(round, simulated time, traffic)`` of a run at its first evaluation whose score (:func:`scores`) reaches
    ``target``: the round and ``time/sim`` of that point and the per-round values of ``keys`` (its ``history``,
    e.g. ``comm/bytes_up``) summed over the rounds up to it (0 without keys). Raises ValueError when the run never
    reaches the target, or its curve has no simulated time."""
    for pt in scores(res):
        if len(pt) != 3:
            raise ValueError("to_target needs a curve of (round, time/sim, accuracy) points")
        rnd, t, acc = pt
        if acc >= target - 1e-12:
            hist = [h for h in res.get("history", []) if h["round"] <= rnd]
            if keys and len({h["round"] for h in hist}) < rnd:
                raise ValueError(f"the history misses rounds before round {rnd}: traffic to it is not known")
            return int(rnd), float(t), float(sum(h.get(k, 0.0) for h in hist for k in keys))
    raise ValueError(f"the run never reaches the score {target:.4f}")


def early_stop(res: dict, patience: int, key: str = "eval/validation_accuracy") -> tuple[int, int, float]:
    """Early stopping read from a run's recorded curves, the rule Ampere's phases apply (``Ampere._improved``): the
    validation score (``key``, per round in its ``history``) improves when it is strictly above the best so far; the
    run stops at the ``patience``-th evaluation in a row without an improvement, or at its last. Returns ``(best
    round, stop round, test accuracy at the best round)``: the model an early stop that restores its best-validated
    weights reports. A run stopped at round r is the first r rounds of the recorded one where nothing after r feeds
    back (a constant learning rate; no schedule over ``train.rounds``). Raises ValueError without the curve."""
    val = [(h["round"], h[key]) for h in res.get("history", []) if key in h]
    test = {int(pt[0]): pt[-1] for pt in res.get("curve", [])}
    if not val or not test:
        raise ValueError(f"early_stop needs the run's {key} per round (eval.validation) and its test curve")
    best, best_round, bad, stop = float("-inf"), val[0][0], 0, val[-1][0]
    for rnd, v in val:
        if v > best:
            best, best_round, bad = v, rnd, 0
        else:
            bad += 1
            if bad >= patience:
                stop = rnd
                break
    return int(best_round), int(stop), float(test[int(best_round)])


@dataclass(frozen=True)
class Run:
    """One run of a study: ``config`` with the dotted ``overrides``, named ``label`` (its arm in the sweep and its
    MLflow run's ``raysplit.arm`` tag; unique in its study), cached as JSON at ``out``; ``keys``: the metrics whose
    per-round values the cache keeps (``history``)."""
    config: Path
    overrides: dict
    label: str
    out: Path
    keys: tuple[str, ...] = ()


def sweep_file(experiment: str, config: Path, runs: list[Run], jobs: int, uri: str,
               metric: str = "eval/accuracy") -> Path:
    """The ``raysplit sweep`` file of ``runs`` (one base config): their common overrides as the sweep's, the rest as
    one arm per run; named by a digest of its content, so that running an interrupted study again resumes its Tune
    experiment (trials from their last checkpoint). Written under outputs/studies/."""
    plain = [json.loads(json.dumps(r.overrides)) for r in runs]  # tuples as lists, as YAML has them
    common = {k: v for k, v in plain[0].items() if all(k in o and o[k] == v for o in plain)}
    arms = {r.label: {k: v for k, v in o.items() if k not in common} for r, o in zip(runs, plain)}
    def here(p: Path) -> str:  # relative to the repository root (where the sweep runs) where it is inside it
        return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)

    spec = {"base": here(config), "overrides": {**common, "tracking.experiment": experiment,
                                               "tracking.uri": uri},
            "arms": arms, "metric": metric, "scheduler": "fifo", "max_concurrent_trials": jobs,
            "max_failures": 1, "checkpoint_every": 10, "storage_path": here(ROOT / "outputs" / "tune")}
    if metric.endswith(("perplexity", "loss")):  # lower is better: Tune's best trial is the lowest
        spec["mode"] = "min"
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]
    spec["name"] = f"{experiment}-{config.stem}-{digest}"
    path = ROOT / "outputs" / "studies" / f"{spec['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False, width=120))
    return path


def record_path(out: Path) -> Path:
    """Where the record of the run cached at ``out`` is kept: records/<the cache's folder, without its dot>/<its file>
    (docs/results/.gas_runs/GAS_shards_2_s0_r20.json -> records/gas_runs/GAS_shards_2_s0_r20.json)."""
    return RECORDS / out.parent.name.lstrip(".") / out.name


def spec_digest(spec) -> str:
    """A digest of what a run was asked to be (any JSON-able description of it)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]


def config_digest(run: Run) -> str:
    """A digest of what a run was asked to be: its base config's content and its overrides."""
    text = run.config.read_text() if run.config.is_file() else str(run.config)
    return spec_digest({"config": yaml.safe_load(text), "overrides": json.loads(json.dumps(run.overrides))})


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def _machine() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def write_record(experiment: str, run: Run, res: dict) -> Path:
    """The run's record, written whole (a temporary file renamed) beside the pages."""
    config = str(run.config.relative_to(ROOT)) if run.config.is_relative_to(ROOT) else str(run.config)
    return _write(run.out, {"record": 1, "kind": "run", "experiment": experiment, "label": run.label,
                            "config": config, "overrides": json.loads(json.dumps(run.overrides, default=str)),
                            "config_digest": config_digest(run)}, res)


def keep(out: Path, experiment: str, label: str, spec: dict, res) -> None:
    """For a script that computes its runs itself (not through :func:`study`): write its cache ``out`` and the run's
    record, ``spec`` (what it was asked to be, JSON-able) standing for the config and its digest."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res))
    _write(out, {"record": 1, "kind": "script", "experiment": experiment, "label": label, "config": "(the script)",
                 "overrides": json.loads(json.dumps(spec, default=str)), "config_digest": spec_digest(spec)}, res)


def kept(out: Path, experiment: str, label: str, spec: dict, compute):
    """For a script's own computation (a run it makes itself, or a count at given shapes): its result from the cache
    ``out``, else from the committed record of the same ``spec`` (:func:`restore`), else ``compute()``, then cached
    and recorded (:func:`keep`)."""
    if not restore(out, digest=spec_digest(spec)):
        keep(out, experiment, label, spec, compute())
    return json.loads(out.read_text())


def recorded(cache: Path, experiment: str, label: str, folder: str) -> Path:
    """For a run made elsewhere and read here (the authors' code, benchmarks/peers/<peer>/run.py, cached in that
    folder): its record, records/``folder``/<the cache's name>, written from the cache when the record is absent or
    holds another result; the cache restored from the record when the cache is absent. Returns ``cache``."""
    path = RECORDS / folder / cache.name
    if cache.is_file():
        res = json.loads(cache.read_text())
        same = path.is_file() and (json.dumps(json.loads(path.read_text()).get("result"), sort_keys=True)
                                   == json.dumps(res, sort_keys=True))  # as text: a NaN equals itself
        if not same:
            where = str(cache.relative_to(ROOT)) if cache.is_relative_to(ROOT) else str(cache)
            spec = {"cache": where}
            _write(cache, {"record": 1, "kind": "script", "experiment": experiment, "label": label,
                           "config": "(the authors' code)", "overrides": spec,
                           "config_digest": spec_digest(spec)}, res, path)
    elif path.is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(json.loads(path.read_text())["result"]))
    return cache


def _write(out: Path, head: dict, res, path: Path | None = None) -> Path:
    rec = {**head, "commit": _commit(), "machine": _machine(),
           "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "result": res}
    path = path or record_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1, sort_keys=True, default=float) + "\n")
    tmp.replace(path)
    return path


def restore(out: Path, run: Run | None = None, digest: str | None = None) -> bool:
    """Write the cache ``out`` from its record when the cache is absent and the record is there (and, given ``run``
    or a ``digest`` (:func:`spec_digest`), of the same config digest); whether the cache is there now. A record of
    another config is left alone and the run is run again."""
    if out.is_file():
        return True
    path = record_path(out)
    if not path.is_file():
        return False
    rec = json.loads(path.read_text())
    want = config_digest(run) if run is not None else digest
    if want is not None and rec.get("config_digest") != want:
        print(f"{rec.get('label')}: its record {path.name} is of another config ({rec.get('config_digest')} against "
              f"{want}); run again", flush=True)
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec["result"]))
    tmp.replace(out)
    return True


def restored(out: Path) -> Path:
    """``out``, its cache first restored from its record where the cache is absent (:func:`restore`): for the
    scripts' report paths, which read the caches without running anything."""
    restore(out)
    return out


POLL_S = 30.0  # seconds between looks at the store for runs a running sweep has finished


def _cache(experiment: str, uri: str, sweep: str, runs: list[Run], metric: str = "eval/accuracy") -> None:
    """Cache each of ``runs`` whose MLflow run (of the sweep named ``sweep``) has finished or diverged."""
    from raysplit.comparison import arm_results

    if not runs:
        return
    found = arm_results(experiment, uri, tuple({k for r in runs for k in r.keys}), sweep=sweep,
                        only={r.label for r in runs})
    for r in [r for r in runs if r.label in found]:
        res = found[r.label]
        res["history"] = [{k: v for k, v in h.items() if k == "round" or k in r.keys} for h in res["history"]]
        r.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = r.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(r.out)  # a cache file is whole or absent
        write_record(experiment, r, res)  # as the run finishes: the committed record beside the pages
        print(f"{r.label:48s} {metric.split('/')[-1]} {res.get(metric, float('nan')):.4f} {res.get('diverged', '')}",
              flush=True)


def study(experiment: str, runs: list[Run], jobs: int = 1, uri: str | None = None,
          metric: str = "eval/accuracy") -> list[dict]:
    """Each run's result, in order: from its cache where it has one; the others, per base config, as one
    ``raysplit sweep`` (:func:`sweep_file`: each run an arm) logging to the MLflow experiment ``experiment`` of
    ``uri`` (default ./mlflow.db in the repository root, or $MLFLOW_TRACKING_URI), their runs read back from MLflow
    (:func:`raysplit.comparison.arm_results`) and cached. ``metric``: what the trials report to Tune (a language
    model's runs have ``eval/perplexity``, no accuracy)."""
    # one store for the sweep (run in the repository root) and the reader, wherever the script was started
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{ROOT / 'mlflow.db'}"
    labels = [r.label for r in runs]
    if len(set(labels)) < len(labels):
        raise ValueError(f"{experiment}: two runs share a label: {sorted(x for x in labels if labels.count(x) > 1)}")
    todo = [r for r in runs if not restore(r.out, r)]  # a cache, or a record of the same config, is reused
    for config in dict.fromkeys(r.config for r in todo):
        group = [r for r in todo if r.config == config]
        path = sweep_file(experiment, config, group, jobs, uri, metric)
        print(f"{experiment}: {len(group)} run(s) of {config.name}: raysplit sweep {path.relative_to(ROOT)}",
              flush=True)
        proc = subprocess.Popen([sys.executable, "-m", "raysplit.cli", "sweep", str(path)], cwd=ROOT)
        while True:  # each run is cached as soon as it has finished, so that a study cut short keeps what it ran
            ended = proc.poll() is not None
            _cache(experiment, uri, path.stem, [r for r in group if not r.out.is_file()], metric)
            if ended:
                break
            time.sleep(POLL_S)
        missing = [r.label for r in group if not r.out.is_file()]
        if missing:
            raise RuntimeError(f"{experiment}: the sweep {path} (exit {proc.returncode}) left no finished run of "
                               f"{', '.join(missing)}; its output above says why (the others are cached)")
    return [named(json.loads(r.out.read_text())) for r in runs]


def run_all(experiment: str, todo: list, request, jobs: int) -> list:
    """``request(*job)`` (a :class:`Run`) for every job, run as one :func:`study`; returns ``[(job, result), ...]`` in
    order."""
    return list(zip(todo, study(experiment, [request(*job) for job in todo], jobs)))
