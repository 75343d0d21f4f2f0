"""Tune sweeps end to end (in the session's Ray) and the sweep file's validation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysplit.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def dies_once(at: int, marker: Path) -> type:
    """A sweep trial (:class:`raysplit.tuning.Trial`) that, the first time it finishes round index ``at`` (logged to
    MLflow), ends its worker process (``os._exit``) as a lost node would, before Tune hears of the round; ``marker``
    records that it did. Made here, so it travels to Tune's worker by value."""
    from raysplit.tuning import Trial

    def on_round(self, rnd: int, m: dict) -> None:
        if rnd == at and not marker.exists():
            marker.write_text(f"trial worker {os.getpid()} ended after round index {rnd}\n")
            os._exit(1)
        Trial.on_round(self, rnd, m)

    return type("DiesOnce", (Trial,), {"on_round": on_round})


def write_sweep(tmp_path, **extra):
    spec = {"base": str(ROOT / "configs" / "digits.yaml"),
            "overrides": {"train.rounds": 2, "eval.every": 1, "tracking.output_dir": str(tmp_path / "out")},
            "space": {"algorithm.name": {"grid": ["sflv1", "sflv2"]},
                      "train.optimizer.lr": {"grid": [0.3, 1e-5]}},
            "metric": "train/loss", "mode": "min", "scheduler": "asha", "grace_period": 1,
            "max_concurrent_trials": 1, "storage_path": str(tmp_path / "tune"), "name": "grid"}
    spec.update(extra)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slow
def test_a_grid_sweep_lands_in_mlflow_and_asha_stops_a_trial(ray_session, tmp_path, capfd):
    from raysplit.tuning import run_sweep

    uri = f"sqlite:///{tmp_path / 'sweep.db'}"
    # two trials through Ray actors (each reserves its server and client actors): the second, at lr 1e-5, reaches
    # ASHA's first rung (grace 1 round, reduction 2) worse than the first and is stopped there
    # (one client actor per trial: the sweep's path, not the actor count, is under test)
    results = run_sweep(str(write_sweep(tmp_path, space={"train.optimizer.lr": {"grid": [0.3, 1e-5]}})),
                        [f"tracking.uri={uri}", "algorithm.name=sflv1", "runtime.num_workers=1"])
    df = results.get_dataframe()
    assert len(df) == 2 and not results.errors
    said = "".join(capfd.readouterr())
    # issue 57: a sweep printed 355 lines: nine snapshot warnings and every metric in each trial's closing table
    assert "snapshotting" not in said and "bytes_down" not in said, said[-3000:]
    assert "eval/accuracy" in df.columns and not any(c.startswith("comm/bytes_down") for c in df.columns)
    assert (df["training_iteration"] < 2).any() and (df["training_iteration"] == 2).any()
    assert (df["start_round"] == 0).all()  # trials that did not die began at round index 0
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("grid")  # the sweep's own name, not the base config's experiment
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 2
    seen = {(r.data.params["algorithm.name"], float(r.data.params["train.optimizer.lr"])) for r in runs}
    assert seen == {("sflv1", 0.3), ("sflv1", 1e-5)}
    for r in runs:
        steps = [h.step for h in client.get_metric_history(r.info.run_id, "eval/accuracy")]
        assert steps and steps == list(range(len(steps))), steps  # per-round metrics, step = round
        assert r.data.tags["mlflow.runName"].startswith("trainable_")
        # a trial ASHA stopped is KILLED after its first round; one that ran to the end is FINISHED
        assert r.info.status == ("FINISHED" if len(steps) == 2 else "KILLED"), (r.info.status, steps)


def test_presets_expand_and_bad_trials_fail_before_any_trial(tmp_path):
    from raysplit.tuning import load_sweep, space_spec, validate_trials

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
    from raysplit.tuning import load_sweep, space_spec, validate_trials

    files = sorted((ROOT / "tune" / "examples").glob("*.yaml"))
    assert files
    for f in files:
        spec, raw, cfg0 = load_sweep(str(f))
        assert validate_trials(raw, space_spec(spec, cfg0)) >= 2, f


def test_buffer_sizes_preset_sweeps_both_gas_buffers_and_fedbuffs_k(tmp_path):
    from raysplit.tuning import load_sweep, space_spec, validate_trials

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
    from raysplit.tuning import load_sweep, space_spec, validate_trials

    spec, raw, cfg0 = load_sweep(str(write_sweep(tmp_path, base=str(ROOT / "configs/semisfl/fmnist.yaml"), space={},
                                                 presets=["ks_schedules"], overrides={"train.rounds": 2})))
    space = space_spec(spec, cfg0)
    assert space == {"algorithm.ks": {"grid": ["fixed", "milestones", "ratio"]}}
    assert validate_trials(raw, space) == 3


def test_local_backend_trials_reserve_one_bundle_so_two_fit_two_cpus(tmp_path):
    from raysplit.config import load_config
    from raysplit.tuning import trial_bundles

    local = load_config(None, {"runtime.backend": "local", "runtime.server.num_cpus": 1})
    assert trial_bundles(local) == [{"CPU": 1.0}]
    assert 2 * sum(b.get("CPU", 0) for b in trial_bundles(local)) <= 2
    ray_cfg = load_config(None, {"runtime.backend": "ray", "runtime.server.num_cpus": 1, "runtime.num_workers": 2,
                                 "runtime.client.num_cpus": 0.5})
    assert trial_bundles(ray_cfg) == [{"CPU": 0.001}, {"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}]


@pytest.mark.slow
def test_a_trial_that_dies_resumes_from_its_tune_checkpoint_in_the_same_mlflow_run(ray_session, tmp_path):
    """The trial's worker process ends (``os._exit``, as on a lost node) once round index 2 is computed and logged to
    MLflow but before Tune hears of it. Tune (max_failures=1) starts it again from its checkpoint of round index 1:
    rounds 0-1 are not rerun, round 2 is redone but neither reported nor logged twice, the MLflow run is the same,
    and the results equal an uninterrupted run's."""
    from raysplit.config import load_config
    from raysplit.experiment import run_experiment
    from raysplit.tuning import run_sweep

    over = {"train.rounds": 4, "eval.every": 1, "runtime.backend": "local"}
    d = tmp_path / "hit"
    d.mkdir()
    uri = f"sqlite:///{d / 'mlflow.db'}"
    path = write_sweep(d, space={}, scheduler="fifo", max_failures=1, name="hit",
                       overrides={**over, "tracking.output_dir": str(d / "out")})
    results = run_sweep(str(path), [f"tracking.uri={uri}"], trial=dies_once(2, tmp_path / "trial-died"))
    assert not results.errors and len(results) == 1
    hit, client = results[0], MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("hit").experiment_id])
    assert (tmp_path / "trial-died").is_file()  # the first attempt did die
    rows = hit.metrics_dataframe
    assert rows["round"].tolist() == [1, 2, 3, 4]  # every round reported to Tune once
    assert rows["start_round"].tolist() == [0, 0, 2, 2]  # the second attempt began at round index 2
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # the same MLflow run, continued and finished

    # the uninterrupted reference: the same config run in process (a trial runs the config it is given; a clean
    # trial's start_round stays 0, checked by the grid sweep above through Tune's reports)
    ref_uri = f"sqlite:///{tmp_path / 'ref.db'}"
    clean = run_experiment(load_config(ROOT / "configs" / "digits.yaml", {
        **over, "tracking.uri": ref_uri, "tracking.output_dir": str(tmp_path / "ref"), "tracking.progress": False}))
    ref_client = MlflowClient(ref_uri)
    for key in ("train/loss", "eval/accuracy", "time/sim"):
        got = client.get_metric_history(runs[0].info.run_id, key)
        assert sorted(h.step for h in got) == [0, 1, 2, 3], key  # round index 2: logged before the death, once
        want = {h.step: h.value for h in ref_client.get_metric_history(clean["run_id"], key)}
        assert {h.step: h.value for h in got} == pytest.approx(want, rel=1e-6), key
    for k in ("eval/accuracy", "eval/loss", "eval/f1_macro", "train/loss", "time/sim", "comm/bytes_up"):
        assert hit.metrics[k] == pytest.approx(clean[k], rel=1e-6), k
    assert hit.metrics["round"] == 4


def test_a_sweep_logs_under_its_own_name_unless_it_names_an_experiment():
    """The base config's tracking.experiment (digits.yaml: digits) does not decide where a sweep's trials go; the
    sweep's overrides or its command line may."""
    from raysplit.tuning import sets_experiment

    assert not sets_experiment({"train.rounds": 2}, None)
    assert sets_experiment({"tracking.experiment": "mine"}, None)
    assert sets_experiment({"tracking": {"experiment": "mine"}}, None)
    assert sets_experiment({}, ["train.rounds=2", "tracking.experiment = mine"])
    assert not sets_experiment({}, ["tracking.uri=sqlite:///x.db"])
