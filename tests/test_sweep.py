"""Tune sweeps end to end (in the session's Ray) and the sweep file's validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysplit.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def write_sweep(tmp_path, **extra):
    spec = {"base": str(ROOT / "configs" / "digits.yaml"),
            "overrides": {"train.rounds": 2, "eval.every": 1, "tracking.output_dir": str(tmp_path / "out")},
            "space": {"algorithm.name": {"grid": ["sflv1", "sflv2"]},
                      "train.optimizer.lr": {"grid": [0.3, 1e-5]}},
            "metric": "train_loss", "mode": "min", "scheduler": "asha", "grace_period": 1,
            "max_concurrent_trials": 1, "storage_path": str(tmp_path / "tune"), "name": "grid"}
    spec.update(extra)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slow
def test_two_by_two_sweep_lands_in_mlflow_and_asha_stops_a_trial(ray_session, tmp_path):
    from raysplit.sweep import run_sweep

    uri = f"sqlite:///{tmp_path / 'sweep.db'}"
    results = run_sweep(str(write_sweep(tmp_path)), [f"tracking.uri={uri}"])
    df = results.get_dataframe()
    assert len(df) == 4 and not results.errors
    # ASHA (grace 1 round, reduction 2) stops at least one of the lr=1e-5 trials after its first round
    assert (df["training_iteration"] < 2).any() and (df["training_iteration"] == 2).any()
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("digits")  # the base config names its experiment
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 4
    seen = {(r.data.params["algorithm.name"], float(r.data.params["train.optimizer.lr"])) for r in runs}
    assert seen == {("sflv1", 0.3), ("sflv1", 1e-5), ("sflv2", 0.3), ("sflv2", 1e-5)}
    for r in runs:
        steps = [h.step for h in client.get_metric_history(r.info.run_id, "accuracy")]
        assert steps and steps == list(range(len(steps))), steps  # per-round metrics, step = round
        assert r.data.tags["mlflow.runName"].startswith("trainable_")
        # a trial ASHA stopped is KILLED after its first round; one that ran to the end is FINISHED
        assert r.info.status == ("FINISHED" if len(steps) == 2 else "KILLED"), (r.info.status, steps)


def test_presets_expand_and_bad_trials_fail_before_any_trial(tmp_path):
    from raysplit.sweep import load_sweep, space_spec, validate_trials

    spec, raw, cfg0 = load_sweep(str(write_sweep(tmp_path, space={}, presets=["cut_points"])))
    space = space_spec(spec, cfg0)
    assert space == {"model.cut": {"grid": ["conv1", "conv2", "fc1"]}}
    assert validate_trials(raw, space) == 3
    # server_epochs is CycleSL's; sflv2 has no such parameter: the error names the trial and the key
    spec, raw, cfg0 = load_sweep(str(write_sweep(tmp_path, space={}, presets=[{"server_epochs": [1, 2]}])))
    with pytest.raises(ConfigError, match="algorithm.server_epochs"):
        validate_trials(raw, space_spec(spec, cfg0))
    with pytest.raises(ConfigError, match="unknown preset"):
        space_spec(load_sweep(str(write_sweep(tmp_path, presets=["nope"])))[0], cfg0)
    with pytest.raises(ConfigError, match="space.train.optimizer.lr"):
        space_spec(load_sweep(str(write_sweep(tmp_path, space={"train.optimizer.lr": {"range": [1, 2]}})))[0],
                   cfg0)
    with pytest.raises(ConfigError, match="sweep file"):
        load_sweep(str(write_sweep(tmp_path, schedulr="asha")))


def test_shipped_sweep_examples_validate():
    from raysplit.sweep import load_sweep, space_spec, validate_trials

    files = sorted((ROOT / "tune" / "examples").glob("*.yaml"))
    assert files
    for f in files:
        spec, raw, cfg0 = load_sweep(str(f))
        assert validate_trials(raw, space_spec(spec, cfg0)) >= 2, f


def test_buffer_sizes_preset_sweeps_both_gas_buffers_and_fedbuffs_k(tmp_path):
    from raysplit.sweep import load_sweep, space_spec, validate_trials

    base = {"algorithm": {"name": "gas"}, "train.participation": {"count": 5}, "train.local_steps": 4}
    spec, raw, cfg0 = load_sweep(str(write_sweep(tmp_path, space={}, presets=[{"buffer_sizes": [2, 5]}],
                                                 overrides={**base, "train.rounds": 2})))
    space = space_spec(spec, cfg0)
    assert space == {"algorithm.buffer_size": {"grid": [2, 5]}, "algorithm.model_buffer_size": {"grid": [2, 5]}}
    assert validate_trials(raw, space) == 4
    spec, raw, cfg0 = load_sweep(str(write_sweep(tmp_path, space={}, presets=["buffer_sizes"], overrides={
        **base, "algorithm": {"name": "fedbuff"}, "data.num_clients": 10})))
    space = space_spec(spec, cfg0)
    assert space == {"algorithm.buffer_size": {"grid": [5, 10, 20]}}
    assert validate_trials(raw, space) == 3
    # a buffer larger than the participants can fill is refused before any trial, naming the trial and the key
    spec, raw, cfg0 = load_sweep(str(write_sweep(tmp_path, space={}, presets=[{"buffer_sizes": [2, 50]}],
                                                 overrides={**base, "train.rounds": 2})))
    with pytest.raises(ConfigError, match="sweep trial .*model_buffer_size=50 exceeds the 10 clients"):
        validate_trials(raw, space_spec(spec, cfg0))


def test_ks_schedules_preset_sweeps_the_semisfl_rules(tmp_path):
    from raysplit.sweep import load_sweep, space_spec, validate_trials

    spec, raw, cfg0 = load_sweep(str(write_sweep(tmp_path, base=str(ROOT / "configs/semisfl/fmnist.yaml"), space={},
                                                 presets=["ks_schedules"], overrides={"train.rounds": 2})))
    space = space_spec(spec, cfg0)
    assert space == {"algorithm.ks": {"grid": ["fixed", "milestones", "ratio"]}}
    assert validate_trials(raw, space) == 3


def test_local_backend_trials_reserve_one_bundle_so_two_fit_two_cpus(tmp_path):
    from raysplit.config import load_config
    from raysplit.sweep import trial_bundles

    local = load_config(None, {"runtime.backend": "local", "runtime.server.num_cpus": 1})
    assert trial_bundles(local) == [{"CPU": 1.0}]
    assert 2 * sum(b.get("CPU", 0) for b in trial_bundles(local)) <= 2
    ray_cfg = load_config(None, {"runtime.backend": "ray", "runtime.server.num_cpus": 1, "runtime.num_workers": 2,
                                 "runtime.client.num_cpus": 0.5})
    assert trial_bundles(ray_cfg) == [{"CPU": 0.001}, {"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}]
