"""Ray Tune sweep over any dotted config key; each trial is one whole raysplit run tracked in MLflow.

    raysplit sweep tune/examples/digits_grid.yaml      (or: python tune/sweep.py ...)

A sweep file:

    base: configs/quickstart.yaml        # experiment config (path relative to the sweep file or cwd)
    overrides: {train.rounds: 5}         # fixed dotted overrides
    space:                               # dotted key -> one of grid / choice / uniform / loguniform
      train.optimizer.lr: {grid: [0.01, 0.05]}
      algorithm.name: {choice: [sflv1, sflv2]}
    metric: accuracy                     # reported every evaluated round
    mode: max
    num_samples: 1                       # repeats of the grid / samples of random dimensions
    scheduler: asha                      # asha | fifo
    grace_period: 1
    max_concurrent_trials: null          # default: what the cluster's CPUs allow
    storage_path: outputs/tune
    name: my-sweep                       # also the MLflow experiment, unless tracking.experiment is overridden

Each trial reserves its own server and client actors through a placement-group factory, so concurrent trials
cannot oversubscribe the cluster; per-round metrics go to ``tune.report`` (for ASHA) and to the trial's MLflow run,
whose params include the swept values. The MLflow experiment is created on the driver before trials start
(sqlite schema race, stack.md §5).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import yaml
from ray import tune

from raysplit.config import ConfigError, apply_overrides, load_config

SPACE_KINDS = ("grid", "choice", "uniform", "loguniform")


def build_space(space: dict) -> dict:
    out = {}
    for key, spec in (space or {}).items():
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in SPACE_KINDS:
            raise ConfigError(f"space.{key}: give exactly one of {', '.join(SPACE_KINDS)} (got {spec!r})")
        kind, val = next(iter(spec.items()))
        if kind == "grid":
            out[key] = tune.grid_search(list(val))
        elif kind == "choice":
            out[key] = tune.choice(list(val))
        elif kind == "uniform":
            out[key] = tune.uniform(*val)
        else:
            out[key] = tune.loguniform(*val)
    return out


def trial_bundles(cfg) -> list[dict]:
    """Placement-group bundles: the trial driver, the server actor, then one per client actor."""
    r = cfg.runtime

    def bundle(res):
        b = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.resources}
        return {k: float(v) for k, v in b.items() if v} or {"CPU": 0.001}

    return [{"CPU": 0.001}, bundle(r.server)] + [bundle(r.client) for _ in range(r.num_workers)]


def make_trainable(base_raw: dict, uri: str, experiment: str, metric: str):
    def trainable(params: dict):
        from raysplit.config import validate
        from raysplit.experiment import run_experiment

        raw = apply_overrides(base_raw, {**params, "tracking.uri": uri, "tracking.experiment": experiment,
                                         "tracking.progress": False})
        cfg = validate(raw)
        ctx = tune.get_context()
        cfg.tracking.run_name = ctx.get_trial_name()
        cfg.tracking.output_dir = str(Path(base_raw.get("tracking", {}).get("output_dir", "outputs")).resolve())

        def report(rnd: int, m: dict):
            if metric in m:
                tune.report({**{k: v for k, v in m.items() if isinstance(v, (int, float))}, "round": rnd + 1})

        run_experiment(cfg, on_round=report)

    return trainable


def run_sweep(path: str, extra_overrides: list[str] | None = None):
    import mlflow
    import ray
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from raysplit.tracking import resolve_uri

    spec = yaml.safe_load(Path(path).read_text())
    unknown = set(spec) - {"base", "overrides", "space", "metric", "mode", "num_samples", "scheduler",
                           "grace_period", "max_concurrent_trials", "storage_path", "name"}
    if unknown:
        raise ConfigError(f"sweep file {path}: unknown keys {sorted(unknown)}")
    base_path = Path(spec["base"])
    if not base_path.is_file():
        base_path = Path(path).parent / spec["base"]
    base_raw = yaml.safe_load(base_path.read_text()) or {}
    base_raw = apply_overrides(base_raw, {**(spec.get("overrides") or {})})
    if extra_overrides:
        base_raw = apply_overrides(base_raw, extra_overrides)
    cfg0 = load_config(None, base_raw)  # the base must validate before any trial starts
    name = spec.get("name") or Path(path).stem
    experiment = cfg0.tracking.experiment if "experiment" in base_raw.get("tracking", {}) else name
    uri = resolve_uri(cfg0.tracking.uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)  # create tables and experiment once, on the driver

    metric, mode = spec.get("metric", "accuracy"), spec.get("mode", "max")
    bundles = trial_bundles(cfg0)
    per_trial = sum(b.get("CPU", 0) for b in bundles)
    if not ray.is_initialized():
        if cfg0.runtime.address:
            ray.init(address=cfg0.runtime.address)
        else:  # a local Ray with enough logical CPUs for at least one trial
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(per_trial)), include_dashboard=False)
    max_conc = spec.get("max_concurrent_trials") or max(1, math.floor(ray.cluster_resources().get("CPU", 1) /
                                                                      max(per_trial, 1e-3)))
    if spec.get("scheduler", "asha") == "asha":
        scheduler = ASHAScheduler(time_attr="round", max_t=cfg0.train.rounds,
                                  grace_period=spec.get("grace_period", 1), reduction_factor=2)
    else:
        scheduler = FIFOScheduler()
    trainable = tune.with_resources(make_trainable(base_raw, uri, experiment, metric),
                                    tune.PlacementGroupFactory(bundles, strategy="PACK"))
    storage = str(Path(spec.get("storage_path", "outputs/tune")).resolve())
    if tune.Tuner.can_restore(os.path.join(storage, name)):
        tuner = tune.Tuner.restore(os.path.join(storage, name), trainable, resume_unfinished=True)
    else:
        tuner = tune.Tuner(
            trainable, param_space=build_space(spec.get("space")),
            tune_config=tune.TuneConfig(metric=metric, mode=mode, scheduler=scheduler,
                                        num_samples=spec.get("num_samples", 1), max_concurrent_trials=max_conc),
            run_config=tune.RunConfig(name=name, storage_path=storage),
        )
    results = tuner.fit()
    df = results.get_dataframe()
    cols = [c for c in df.columns if c.startswith("config/")] + [c for c in (metric, "round") if c in df.columns]
    print(df[cols].to_string(index=False))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sweep")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    try:
        run_sweep(a.sweep, a.overrides)
    except ConfigError as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
