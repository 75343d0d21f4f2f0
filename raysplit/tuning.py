"""Ray Tune sweep over any dotted config key; each trial is one whole raysplit run.

    raysplit sweep tune/examples/digits_grid.yaml [key=value ...]     (same: python tune/sweep.py ...)

A sweep file (every key optional except ``base``; unknown keys are errors):

    base: ../configs/digits.yaml         # experiment config (relative to the sweep file, or to the cwd)
    overrides: {train.rounds: 5}         # fixed dotted overrides of the base
    space:                               # dotted key -> one of grid / choice / uniform / loguniform
      train.optimizer.lr: {loguniform: [1e-4, 1e-1]}
      algorithm.name: {grid: [sflv1, sflv2]}
    arms:                                # named sets of overrides, crossed with the space (a grid over the arms):
      SFLV2: {algorithm.name: sflv2}     #   a study's arms, each several keys at once; each trial's MLflow run
      CycleSFL E=2: {algorithm: {name: cyclesfl, server_epochs: 2}}   # is tagged raysplit.arm = its name
    presets: [cut_points]                # named spaces for the papers' questions (PRESETS, JOINT_PRESETS below:
                                         # tiers, cut_budget); a preset may carry its own values: {server_epochs:
                                         # [1, 2]}, {tiers: [[{cut: conv1, share: 0.5}, {cut: fc1, share: 0.5}]]}
    metric: eval/accuracy                # reported every evaluated round (eval.every); an old short name
                                         #   (accuracy) is read as its grouped one
    mode: max
    num_samples: 1                       # repeats of the grid x samples of the random dimensions
    scheduler: asha                      # asha | fifo  (ASHA stops trials on the per-round metric)
    grace_period: 1                      # rounds before ASHA may stop a trial
    search: random                       # random (Tune's variant generator) | optuna (pip install optuna)
    mlflow: trial                        # trial: each trial logs its full raysplit run (params, per-round metrics,
                                         #   artifacts) -- needs a tracking URI every node can reach;
                                         # callback: Tune's MLflowLoggerCallback logs on the driver instead
    max_concurrent_trials: null          # default: as many trials as the cluster's CPUs hold at once
    storage_path: outputs/tune
    max_failures: 2                      # a trial that died (lost node, dead actor past its retries) is run again,
                                         #   from its last Tune checkpoint
    checkpoint_every: null               # rounds between a trial's Tune checkpoints; default: the base's
                                         #   tracking.checkpoint_every if set, else 1 (every round); 0: none
    name: my-sweep                       # Tune experiment name and MLflow experiment (default: the file's stem;
                                         #   the base config's tracking.experiment is not used: overrides or
                                         #   key=value on the command line may set it)

Each trial reserves its server and client actors through a placement-group factory (one bundle for the trial,
one for the server actor, one per client actor), so concurrent trials cannot oversubscribe the cluster. The MLflow
experiment is created on the driver before any trial starts (sqlite schema race, stack.md §5). Every trial's config
is validated on the driver first, so a bad key in the space fails at once. Running the same command again resumes
an interrupted sweep from ``storage_path/name``.

Trial checkpoints: every ``checkpoint_every`` rounds a trial hands its raysplit checkpoint file to Tune
(``tune.report(..., checkpoint=...)``, with the trial's MLflow run id and the rounds it has reported in the
checkpoint's metadata); Tune keeps the latest under ``storage_path/name/<trial>/checkpoint_*``. A trial Tune starts
again (``max_failures``, or a resumed sweep) gets it from ``tune.get_checkpoint()`` and continues from the round after
it, in the same MLflow run, without logging or reporting a round twice. On a multi-node cluster ``storage_path`` must
be shared by all nodes (NFS, ``s3://``); where a trial's node cannot reach it, that trial goes on without checkpoints.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from raysplit.config import ConfigError, apply_overrides, load_config
from raysplit import tags

SPACE_KINDS = ("grid", "choice", "uniform", "loguniform")
ARM = "arm"  # the trial parameter that names its arm (not a config key: its overrides are applied instead)


def _cut_points(cfg) -> list:
    """Every valid cut of the base model, by block name."""
    model = _base_model(cfg)
    by_index: dict[int, str] = {}
    for name, idx in model.cut_points().items():
        by_index.setdefault(idx, name)
    return [by_index[i] for i in sorted(by_index)]


def _base_model(cfg):
    from raysplit.models import MODELS, build_model

    info = MODELS[cfg.model.name]
    return build_model(cfg.model.name, 10, tuple(info.default_input_shape), **cfg.model.options)


def _tiers(cfg) -> dict[str, list]:
    """Two tiers over every pair of the base model's cuts (shallow, deep), with a quarter, half or three quarters
    of the clients deep; the base's ``model.cut`` cleared (a trial gives every client its cut)."""
    cuts = _cut_points(cfg)
    grid = [[{"cut": a, "share": 1 - s}, {"cut": b, "share": s}]
            for i, a in enumerate(cuts) for b in cuts[i + 1:] for s in (0.25, 0.5, 0.75)]
    return {"model.cut": [None], "model.tiers": grid}


def _tier_values(values: list) -> dict[str, list]:
    return {"model.cut": [None], "model.tiers": list(values)}


def _budgets(cfg) -> dict[str, list]:
    """The budget rule at one budget per cut of the base model: the seconds a batch through that cut takes at the
    clients' mean FLOP/s (drawn as the run draws them), so that about the average client affords it."""
    import numpy as np

    from raysplit.models.tiers import cut_flops

    model = _base_model(cfg)
    mean = float(np.mean([p.flops for p in cfg.clock.draw(cfg.data.num_clients, np.random.default_rng([cfg.seed, 2]))]))
    flops = cut_flops(model, sorted(set(model.cut_points().values())), cfg.train.batch_size)
    return _budget_values([flops[k] / mean for k in sorted(flops)])


def _budget_values(values: list) -> dict[str, list]:
    return {"model.cut": [None], "model.tiers": [None],
            "model.cut_budget": [v if isinstance(v, dict) else {"seconds": float(v)} for v in values]}


def _buffer_keys(cfg) -> list[str]:
    """GAS's activation and model buffers, or the one buffer of FedBuff/CA2FL: the keys the base algorithm has."""
    from raysplit.algorithms import get_algorithm

    fields = get_algorithm(cfg.algorithm_name).Params.model_fields
    return [f"algorithm.{k}" for k in ("buffer_size", "model_buffer_size") if k in fields] or ["algorithm.buffer_size"]


# name -> (dotted key(s) — a list or a function of the base config, default values or a function of the config)
PRESETS: dict[str, tuple[Any, Any]] = {
    "cut_points": ("model.cut", _cut_points),  # where to split
    "server_epochs": ("algorithm.server_epochs", [1, 2, 4, 8]),  # CycleSL's E
    "buffer_sizes": (_buffer_keys, [5, 10, 20]),  # GAS's activation and model buffers; FedBuff's K
    "ks_schedules": ("algorithm.ks", ["fixed", "milestones", "ratio"]),  # Semi-SFL's K_s rule
}
# presets over several keys at once (one trial per value: the keys' one-value grids cross with it): name -> (the
# space for the base config, the space for values given: a list of model.tiers lists, or of budgets in seconds)
JOINT_PRESETS: dict[str, tuple[Any, Any]] = {
    "tiers": (_tiers, _tier_values),  # clients with their own cuts: the share of deep clients, each tier's depth
    "cut_budget": (_budgets, _budget_values),  # the budget rule, one budget per trial
}


class SweepFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    base: str
    overrides: dict[str, Any] = Field(default_factory=dict)
    space: dict[str, dict[str, Any]] = Field(default_factory=dict)
    arms: dict[str, dict[str, Any]] = Field(default_factory=dict, description="arm name -> overrides; the trials "
                                            "are every arm crossed with the space")
    presets: list[str | dict[str, list]] = Field(default_factory=list)
    metric: str = "eval/accuracy"
    mode: Literal["max", "min"] = "max"
    num_samples: int = Field(default=1, ge=1)
    scheduler: Literal["asha", "fifo"] = "asha"
    grace_period: int = Field(default=1, ge=1)
    search: Literal["random", "optuna"] = "random"
    mlflow: Literal["trial", "callback"] = "trial"
    max_concurrent_trials: int | None = Field(default=None, ge=1)
    storage_path: str = "outputs/tune"
    max_failures: int = Field(default=2, ge=0, description="Tune's FailureConfig: times a failed trial is started "
                              "again, from its last Tune checkpoint (in the same MLflow run) or, without one, from its "
                              "first round")
    checkpoint_every: int | None = Field(default=None, ge=0, description="rounds between a trial's Tune checkpoints; "
                                         "None: the base's tracking.checkpoint_every if set, else 1; 0: none (a "
                                         "retried trial starts over)")
    name: str | None = None

    @field_validator("metric")
    @classmethod
    def _grouped(cls, v: str) -> str:  # the one-release alias: a sweep file written before the groups still runs
        from raysplit.metrics import grouped_name

        return grouped_name(v)


def load_sweep(path: str, extra_overrides: list[str] | None = None) -> tuple[SweepFile, dict, Any]:
    """Parse the sweep file and its base config; return (sweep, base raw dict, validated base config)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"sweep file not found: {p}")
    try:
        spec = SweepFile.model_validate(yaml.safe_load(p.read_text()) or {})
    except ValidationError as e:
        raise ConfigError(f"sweep file {p}: " + "; ".join(
            f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())) from None
    base = Path(spec.base)
    if not base.is_file():
        base = p.parent / spec.base
    if not base.is_file():
        raise ConfigError(f"sweep file {p}: base config {spec.base} not found (looked in the cwd and {p.parent})")
    raw = apply_overrides(yaml.safe_load(base.read_text()) or {}, dict(spec.overrides))
    if extra_overrides:
        raw = apply_overrides(raw, extra_overrides)
    return spec, raw, load_config(None, raw)


def space_spec(spec: SweepFile, cfg0) -> dict[str, dict]:
    """The sweep's space with presets expanded: dotted key -> {kind: values}."""
    space = dict(spec.space)
    for pr in spec.presets:
        name, values = (pr, None) if isinstance(pr, str) else next(iter(pr.items()))
        if name in JOINT_PRESETS:
            of_base, of_values = JOINT_PRESETS[name]
            space.update({k: {"grid": v} for k, v in (of_base(cfg0) if values is None else of_values(values)).items()})
            continue
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; presets: {', '.join([*PRESETS, *JOINT_PRESETS])}")
        keys, default = PRESETS[name]
        keys = keys(cfg0) if callable(keys) else [keys]
        if values is None:
            values = default(cfg0) if callable(default) else default
        for key in keys:  # several keys: a full grid over each
            space[key] = {"grid": list(values)}
    for key, s in space.items():
        if not isinstance(s, dict) or len(s) != 1 or next(iter(s)) not in SPACE_KINDS:
            raise ConfigError(f"space.{key}: give exactly one of {', '.join(SPACE_KINDS)} (got {s!r})")
    return space


def trial_overrides(params: dict, arms: dict[str, dict] | None = None, sweep: str | None = None) -> dict:
    """A trial's dotted overrides of the base: its arm's overrides (``params["arm"]``), then its other params; its
    MLflow run tagged with its arm (``raysplit.arm``) and its sweep's name (``raysplit.sweep``)."""
    params = dict(params)
    arm = params.pop(ARM, None)
    run_tags = {**({tags.ARM: arm} if arm is not None else {}), **({tags.SWEEP: sweep} if sweep else {})}
    return {**((arms or {})[arm] if arm is not None else {}), **params,
            **({"tracking.tags": run_tags} if run_tags else {})}


def validate_trials(base_raw: dict, space: dict[str, dict], arms: dict[str, dict] | None = None) -> int:
    """Validate the config of every combination of the finite dimensions (and every arm); returns how many there
    are."""
    finite = {k: list(next(iter(s.values()))) for k, s in space.items() if next(iter(s)) in ("grid", "choice")}
    if arms:
        if ARM in space:
            raise ConfigError(f"space.{ARM}: the name is the arms' own; give the values under arms:")
        finite[ARM] = list(arms)
    combos = list(itertools.product(*finite.values())) if finite else [()]
    bundles = trial_bundles(load_config(None, base_raw))
    for values in combos:
        params = dict(zip(finite, values))
        where = f"arm {params[ARM]!r}" if ARM in params else "trial"
        try:
            cfg = load_config(None, apply_overrides(base_raw, trial_overrides(params, arms)))
        except ConfigError as e:
            raise ConfigError(f"sweep {where} {params}: {e}") from None
        if trial_bundles(cfg) != bundles:  # every trial reserves the base's actors (one placement-group factory)
            raise ConfigError(f"sweep {where} {params}: its runtime resources (backend, actors, CPUs, GPUs) differ "
                              "from the base config's, which every trial reserves; set them in overrides instead")
    return len(combos)


def tune_space(space: dict[str, dict], arms: dict[str, dict] | None = None) -> dict:
    from ray import tune

    out = {ARM: tune.grid_search(list(arms))} if arms else {}
    for key, s in space.items():
        kind, val = next(iter(s.items()))
        out[key] = {"grid": lambda v: tune.grid_search(list(v)), "choice": lambda v: tune.choice(list(v)),
                    "uniform": lambda v: tune.uniform(*v), "loguniform": lambda v: tune.loguniform(*v)}[kind](val)
    return out


def trial_bundles(cfg) -> list[dict]:
    """Placement-group bundles: the trial driver, the server actor, then one per client actor. On the local
    backend the trial's own process hosts everything: one bundle, the server's resources (so two trials of one
    CPU each fit a 2-CPU machine, which a token driver bundle beside them would prevent)."""
    r = cfg.runtime

    def bundle(res):
        b = {"CPU": res.num_cpus, "GPU": res.num_gpus, **res.resources}
        return {k: float(v) for k, v in b.items() if v} or {"CPU": 0.001}

    if r.backend == "local":
        return [bundle(r.server)]
    return [{"CPU": 0.001}, bundle(r.server)] + [bundle(r.client) for _ in range(r.num_workers)]


CHECKPOINT_FILE = "checkpoint.pt"  # the raysplit checkpoint inside a trial's Tune checkpoint


# what a trial reports to Tune when it logs to MLflow itself (mlflow: trial): the headline metrics, which Tune prints
# when a trial ends; with mlflow: callback Tune's callback logs every metric, so every one is reported
HEADLINE = ("eval/accuracy", "eval/best_accuracy", "eval/loss", "eval/f1_macro", "eval/mcc", "eval/perplexity",
            "train/loss", "time/sim", "comm/bytes_up")


class Trial:
    """One trial of a sweep: one raysplit run of the base config with the trial's ``params``, reporting every
    evaluated round to Tune and, every ``checkpoint_every`` rounds, its raysplit checkpoint as the trial's Tune
    checkpoint; a trial Tune starts again (``max_failures``, a resumed sweep) continues from its latest checkpoint, in
    the same MLflow run, without logging or reporting a round twice. Tune calls :func:`make_trainable`'s function,
    which makes one and :meth:`run` s it; ``run_sweep(..., trial=...)`` takes a subclass (a test's that ends its
    process at a round, as a lost node would)."""

    def __init__(self, params: dict, base_raw: dict, uri: str, experiment: str, metric: str, log_in_trial: bool,
                 output_dir: str, checkpoint_every: int = 1):
        from ray import tune

        from raysplit.config import validate

        self.name = tune.get_context().get_trial_name()
        # one line per reported checkpoint is noise in a sweep's output (Tune lists checkpoints itself)
        logging.getLogger("ray.train._internal.storage").setLevel(logging.WARNING)
        self.metric, self.log_in_trial, self.every = metric, log_in_trial, checkpoint_every
        self.cfg = validate(apply_overrides(base_raw, {
            **params, "tracking.uri": uri, "tracking.experiment": experiment, "tracking.progress": False,
            "tracking.enabled": log_in_trial, "tracking.output_dir": output_dir, "tracking.run_name": self.name,
            "tracking.checkpoint_every": checkpoint_every}))
        self.restore_dir, self.meta = None, {}
        self.reported, self.pending, self.stash, self.checkpoints = -1, None, None, checkpoint_every > 0

    def run(self) -> None:
        import shutil
        import tempfile

        from ray import tune

        from raysplit.experiment import run_experiment
        from raysplit.runtime import NonFiniteLossError

        # A trial Tune starts again gets its latest checkpoint: the raysplit checkpoint file, and in the metadata
        # the round it holds, the rounds already reported and the MLflow run.
        ckpt = tune.get_checkpoint()
        if ckpt is not None:
            self.restore_dir = tempfile.mkdtemp(prefix="raysplit-tune-restore-")
            ckpt.to_directory(self.restore_dir)
            self.meta = ckpt.get_metadata() or {}
            print(f"raysplit sweep: trial {self.name} continues from its Tune checkpoint after round index "
                  f"{self.meta.get('round')} (MLflow run {self.meta.get('run_id')})", file=sys.stderr, flush=True)
        self.start = self.meta.get("round", -1) + 1
        self.reported = self.meta.get("reported_through", -1)
        cfg = self.cfg
        try:
            final = run_experiment(cfg, resume_run_id=self.meta.get("run_id"), on_round=self.on_round,
                                   checkpoint_file=self.restore_dir and os.path.join(self.restore_dir, CHECKPOINT_FILE),
                                   on_checkpoint=self.on_checkpoint)
        except NonFiniteLossError as e:  # diverged (its MLflow run is FAILED): an outcome, not a fault to retry
            tune.report({self.metric: float("nan"), "diverged": 1, "error": str(e)[:500], "round": cfg.train.rounds})
            return
        finally:
            if self.restore_dir:
                shutil.rmtree(self.restore_dir, ignore_errors=True)
        self.send(cfg.train.rounds - 1, final, final=True)

    def on_round(self, rnd: int, m: dict) -> None:
        """A round is logged. ASHA compares trials at evaluated rounds; a stop it decides arrives as SystemExit from
        ``tune.report`` and ends the MLflow run as KILLED. The last round is reported after the run has finished, so
        that a trial that runs to the end is FINISHED with all its artifacts. A round that is checkpointed is
        reported with its checkpoint, just after the checkpoint is written (:meth:`on_checkpoint`)."""
        if self.metric not in m or rnd + 1 >= self.cfg.train.rounds:
            return
        if self.every and (rnd + 1) % self.every == 0:
            self.stash = (rnd, m)
        else:
            self.send(rnd, m)

    def on_checkpoint(self, rnd: int, path: Path, run_id: str) -> None:
        if not self.checkpoints:
            return
        self.pending = (rnd, path, run_id)  # goes with the next report (this round's, if it has one)
        stash, self.stash = self.stash, None
        if stash is not None:
            self.send(*stash)

    def send(self, rnd: int, m: dict, final: bool = False) -> None:
        """Report round ``rnd`` to Tune (with the pending checkpoint, unless the trial is over)."""
        import shutil
        import tempfile

        from ray import tune

        if rnd <= self.reported:  # reported by an earlier attempt of this trial (or a round redone)
            return
        self.reported = rnd
        keep = (lambda k: True) if not self.log_in_trial else (lambda k: k in HEADLINE or k == self.metric)
        result = {**{k: v for k, v in m.items() if isinstance(v, (int, float)) and keep(k)}, "round": rnd + 1,
                  "start_round": self.start}
        pending, self.pending = self.pending, None
        if pending is None or final:  # a finished trial needs no checkpoint
            tune.report(result)
            return
        at, path, run_id = pending
        with tempfile.TemporaryDirectory(prefix="tune-ckpt-", dir=Path(path).parent) as d:
            try:
                os.link(path, os.path.join(d, CHECKPOINT_FILE))  # _atomic_save replaces, never rewrites
            except OSError:
                shutil.copy2(path, os.path.join(d, CHECKPOINT_FILE))
            checkpoint = tune.Checkpoint.from_directory(d)
            checkpoint.set_metadata({"round": at, "reported_through": rnd,
                                     "run_id": run_id if self.log_in_trial else None})
            try:
                tune.report(result, checkpoint=checkpoint)
            except RuntimeError as e:  # storage_path not reachable from this node (a local path, multi-node)
                if "storage" not in str(e):
                    raise
                print(f"raysplit sweep: trial {self.name} cannot write Tune checkpoints from this node, going on "
                      f"without (a retry starts over): {str(e)[:300]}", file=sys.stderr, flush=True)
                self.checkpoints = False
                tune.report(result)


def make_trainable(base_raw: dict, uri: str, experiment: str, metric: str, log_in_trial: bool, output_dir: str,
                   checkpoint_every: int = 1, trial: type[Trial] = Trial, arms: dict[str, dict] | None = None,
                   sweep: str | None = None):
    """The function trainable Tune calls per trial: ``trial(params, ...).run()``, its arm's overrides (``arms``)
    applied, its run tagged with ``sweep``."""

    def trainable(params: dict):
        trial(trial_overrides(params, arms, sweep), base_raw, uri, experiment, metric, log_in_trial, output_dir,
              checkpoint_every).run()

    return trainable


def closing_callback(uri: str, experiment: str):
    """A Tune callback that closes the MLflow run of a trial Tune ended early: a trial stopped by the scheduler
    is killed with its process before its own run can close, so the driver marks the run KILLED (or FAILED when
    the trial errored) unless the trial finished it itself."""
    from mlflow.tracking import MlflowClient
    from ray.tune import Callback

    class CloseTrialRuns(Callback):
        def _close(self, trial, status: str) -> None:
            client = MlflowClient(uri)
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                return
            name = str(trial).replace("'", "")
            for run in client.search_runs([exp.experiment_id], f"tags.`mlflow.runName` = '{name}'"):
                if run.info.status == "RUNNING":
                    client.set_tag(run.info.run_id, tags.STOPPED, f"trial ended by Tune ({status})")
                    client.set_terminated(run.info.run_id, status)

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._close(trial, "KILLED")

        def on_trial_error(self, iteration, trials, trial, **info):
            self._close(trial, "FAILED")

    return CloseTrialRuns()


def sets_experiment(overrides: dict, extra: list[str] | None) -> bool:
    """Whether the sweep itself names its MLflow experiment (its overrides or the command line's key=value): by
    default a sweep's trials go to an experiment of the sweep's own name, not the base config's, so that a
    sweep's runs are found (and compared) apart from the base config's single runs."""
    nested = overrides.get("tracking")
    return ("tracking.experiment" in overrides or (isinstance(nested, dict) and "experiment" in nested)
            or any(o.split("=", 1)[0].strip() == "tracking.experiment" for o in extra or []))


def run_sweep(path: str, extra_overrides: list[str] | None = None, trial: type[Trial] = Trial):
    """Run the sweep file ``path`` (with ``extra_overrides`` on its base config) under Ray Tune, each trial a
    ``trial`` (:class:`Trial`); returns Tune's ResultGrid."""
    import mlflow
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from raysplit.tracking import ensure_experiment, resolve_uri, store_lock

    spec, base_raw, cfg0 = load_sweep(path, extra_overrides)
    space = space_spec(spec, cfg0)
    n = validate_trials(base_raw, space, spec.arms)
    name = spec.name or Path(path).stem
    experiment = cfg0.tracking.experiment if sets_experiment(spec.overrides, extra_overrides) else name
    uri = resolve_uri(cfg0.tracking.uri)
    mlflow.set_tracking_uri(uri)
    with store_lock(uri):  # another sweep or run may be creating the same store now
        ensure_experiment(mlflow.MlflowClient(uri), experiment)  # tables and experiment made once, on the driver

    # Tune warns at every forced snapshot of its experiment state, which CheckpointConfig(num_to_keep=1) forces at
    # each trial checkpoint (every round by default): cheap on local storage, nine warnings in a small sweep
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    bundles = trial_bundles(cfg0)
    per_trial = sum(b.get("CPU", 0) for b in bundles)
    if not ray.is_initialized():
        if cfg0.runtime.address:
            ray.init(address=cfg0.runtime.address)
        else:  # a local Ray with enough logical CPUs for at least one trial
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(per_trial)),
                     include_dashboard=False)
    from raysplit.runtime.ray.pool import release_idle_actors

    release_idle_actors()  # actors a finished run of this driver kept (runtime.keep_actors_s) hold CPUs trials need
    max_conc = spec.max_concurrent_trials or max(
        1, math.floor(ray.cluster_resources().get("CPU", 1) / max(per_trial, 1e-3)))
    scheduler = (ASHAScheduler(time_attr="round", max_t=cfg0.train.rounds, grace_period=spec.grace_period,
                               reduction_factor=2) if spec.scheduler == "asha" else FIFOScheduler())
    search_alg = None
    if spec.search == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch
        except ImportError as e:  # optuna is an optional extra
            raise ConfigError(f"search: optuna needs the optuna package (pip install 'raysplit[optuna]'): {e}") from None
        if any(next(iter(s)) == "grid" for s in space.values()):
            raise ConfigError("search: optuna cannot take grid dimensions; use choice instead")
        search_alg = OptunaSearch()
    callbacks = [closing_callback(uri, experiment)] if spec.mlflow == "trial" else []
    if spec.mlflow == "callback":
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        callbacks.append(MLflowLoggerCallback(tracking_uri=uri, experiment_name=experiment, save_artifact=False))
    output_dir = str(Path(cfg0.tracking.output_dir).resolve())
    every = spec.checkpoint_every if spec.checkpoint_every is not None else (cfg0.tracking.checkpoint_every or 1)
    trainable = tune.with_resources(
        make_trainable(base_raw, uri, experiment, spec.metric, spec.mlflow == "trial", output_dir, every, trial,
                       spec.arms, name),
        tune.PlacementGroupFactory(bundles, strategy="PACK"))
    storage = str(Path(spec.storage_path).resolve())
    if tune.Tuner.can_restore(os.path.join(storage, name)):
        print(f"resuming the interrupted sweep in {os.path.join(storage, name)}")
        tuner = tune.Tuner.restore(os.path.join(storage, name), trainable, resume_unfinished=True,
                                   resume_errored=True)
    else:
        tuner = tune.Tuner(
            trainable, param_space=tune_space(space, spec.arms),
            tune_config=tune.TuneConfig(metric=spec.metric, mode=spec.mode, scheduler=scheduler,
                                        search_alg=search_alg, num_samples=spec.num_samples,
                                        max_concurrent_trials=max_conc),
            run_config=tune.RunConfig(name=name, storage_path=storage, callbacks=callbacks,
                                      failure_config=tune.FailureConfig(max_failures=spec.max_failures),
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=1)),
        )
    arms = f" ({len(spec.arms)} arms)" if spec.arms else ""
    print(f"sweep {name}: {n} configuration(s){arms} x {spec.num_samples} sample(s), up to {max_conc} at once; "
          f"MLflow experiment {experiment!r} at {uri}; "
          + (f"trials checkpoint every {every} round(s)" if every else "trials keep no checkpoint"))
    results = tuner.fit()
    df = results.get_dataframe()
    cols = [c for c in df.columns if c.startswith("config/")]
    cols += [c for c in (spec.metric, "eval/best_accuracy", "round", "time/sim") if c in df.columns]
    print(df[cols].sort_values(spec.metric, ascending=spec.mode == "min").to_string(index=False))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Ray Tune sweep of raysplit runs")
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
