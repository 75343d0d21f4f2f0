"""Tune sweeps end to end (in the session's Ray) and the sweep file's validation."""

from __future__ import annotations

import json
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


def test_arms_cross_the_space_and_a_bad_arm_is_named_before_any_trial(tmp_path):
    """A sweep's ``arms:`` (named sets of overrides, as a study's methods are) are crossed with its space; an arm
    whose config is invalid, or that would need other actors than the base reserves, fails before any trial."""
    from raysplit.tuning import load_sweep, space_spec, trial_overrides, validate_trials

    arms = {"SFLV1": {"algorithm.name": "sflv1"}, "SFLV2, seed=1 [b]": {"algorithm": {"name": "sflv2"}, "seed": 1}}
    spec, raw, cfg0 = load_sweep(str(write_sweep(tmp_path, arms=arms)))
    assert validate_trials(raw, space_spec(spec, cfg0), spec.arms) == 8  # 2 arms x 2 methods x 2 rates
    assert trial_overrides({"arm": "SFLV2, seed=1 [b]", "train.optimizer.lr": 0.3}, spec.arms) == {
        "algorithm": {"name": "sflv2"}, "seed": 1, "train.optimizer.lr": 0.3,
        "tracking.tags": {"raysplit.arm": "SFLV2, seed=1 [b]"}}
    assert trial_overrides({"arm": "SFLV1"}, spec.arms, "grid")["tracking.tags"] == {
        "raysplit.arm": "SFLV1", "raysplit.sweep": "grid"}
    assert trial_overrides({"train.optimizer.lr": 0.3}, None) == {"train.optimizer.lr": 0.3}
    for bad, said in (({"algorithm.server_epochs": 2}, "arm 'bad'.*server_epochs"),
                      ({"runtime.num_workers": 1}, "arm 'bad'.*runtime resources")):
        spec, raw, cfg0 = load_sweep(str(write_sweep(tmp_path, space={}, arms={**arms, "bad": bad})))
        with pytest.raises(ConfigError, match=said):
            validate_trials(raw, space_spec(spec, cfg0), spec.arms)
    spec, raw, cfg0 = load_sweep(str(write_sweep(tmp_path, space={"arm": {"grid": [1]}}, arms=arms)))
    with pytest.raises(ConfigError, match="space.arm"):
        validate_trials(raw, space_spec(spec, cfg0), spec.arms)


def test_the_study_reader_takes_each_arms_newest_finished_or_diverged_run(tmp_path, monkeypatch):
    """``comparison.arm_results``: per ``raysplit.arm`` tag the newest run that finished or diverged (accuracy NaN,
    the error kept), with its curve and per-round history; a run that failed otherwise is left out; ``sweep`` keeps
    one sweep's runs."""
    import math
    import time

    from raysplit.comparison import arm_results

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("study")

    def run(arm, status, acc, error=None, sweep="s1"):
        r = client.create_run(exp, tags={"raysplit.arm": arm, "raysplit.sweep": sweep,
                                         **({"raysplit.error": error} if error else {})})
        for step, (a, t) in enumerate(zip(acc, (1.5, 3.0, 4.5))):
            client.log_metric(r.info.run_id, "eval/accuracy", a, step=step)
            client.log_metric(r.info.run_id, "time/sim", t, step=step)
            client.log_metric(r.info.run_id, "train/loss", 1.0 - a, step=step)
        client.set_terminated(r.info.run_id, status)
        time.sleep(0.01)  # start times apart
        return r.info.run_id

    run("A", "FINISHED", [0.1, 0.2, 0.3])
    newest = run("A", "FINISHED", [0.2, 0.4, 0.6])
    run("A", "FAILED", [0.5], error="RuntimeError: an actor died")  # newer, failed for another reason
    run("B", "FAILED", [0.1, 0.2], error="NonFiniteLossError: loss nan at round 2, client 3")
    run("C", "KILLED", [0.1])
    other = run("D", "FINISHED", [0.3], sweep="s2")
    got = arm_results("study", uri, keys=("train/loss",))
    assert set(got) == {"A", "B", "D"}
    assert got["A"]["run_id"] == newest and got["A"]["eval/accuracy"] == pytest.approx(0.6)
    assert got["A"]["curve"] == [(1, 1.5, 0.2), (2, 3.0, 0.4), (3, 4.5, 0.6)]
    assert [h["round"] for h in got["A"]["history"]] == [1, 2, 3]
    assert got["A"]["history"][0]["train/loss"] == pytest.approx(0.8)
    assert math.isnan(got["B"]["eval/accuracy"]) and got["B"]["diverged"] == "loss nan at round 2, client 3"
    assert set(arm_results("study", uri, sweep="s1")) == {"A", "B"}
    assert arm_results("study", uri, sweep="s2")["D"]["run_id"] == other
    assert set(arm_results("study", uri, only={"B", "C"})) == {"B"}

    # docs/results/_runs: a running study caches each run of its own sweep as soon as it has finished
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "results"))
    import _runs

    runs = [_runs.Run(ROOT / "configs" / "digits.yaml", {}, arm, tmp_path / "cache" / f"{arm}.json",
                      keys=("train/loss",)) for arm in ("A", "D", "E")]
    monkeypatch.setattr(_runs, "RECORDS", tmp_path / "records")  # the committed records stay untouched
    _runs._cache("study", uri, "s1", runs)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["A.json"]  # D is another sweep's, E not run
    assert json.loads((tmp_path / "records" / "cache" / "A.json").read_text())["result"]["run_id"] == newest
    cached = json.loads((tmp_path / "cache" / "A.json").read_text())
    assert cached["run_id"] == newest and cached["history"][2] == {"round": 3, "train/loss": pytest.approx(0.4)}
    assert arm_results("no such experiment", uri) == {}


@pytest.mark.slow
def test_a_results_study_runs_through_raysplit_sweep_and_is_cached(tmp_path, monkeypatch):
    """docs/results/_runs.study: the runs a page needs go through ``raysplit sweep`` (an arm per run), are read back
    from MLflow and cached; they equal the same configs run directly, and a second call runs nothing."""
    import sys

    from raysplit.comparison import comparison
    from raysplit.config import load_config
    from raysplit.experiment import run_experiment

    sys.path.insert(0, str(ROOT / "docs" / "results"))
    import _runs

    uri = f"sqlite:///{tmp_path / 'study.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(_runs, "ROOT", tmp_path)  # the sweep file, Tune's state and the run files go there
    monkeypatch.setattr(_runs, "RECORDS", tmp_path / "records")
    over = {"train.rounds": 2, "eval.every": 1, "runtime.backend": "local", "runtime.torch_threads": 1,
            "tracking.checkpoint_every": 0}
    digits = ROOT / "configs" / "digits.yaml"
    runs = [_runs.Run(digits, {**over, "algorithm": {"name": name}, "seed": seed}, f"{name}, seed={seed} [x]",
                      tmp_path / "cache" / f"{name}_{seed}.json", keys=("train/loss",))
            for name, seed in (("sflv1", 0), ("sflv2", 1))]
    got = _runs.study("study-test", runs, jobs=1)
    sweep = yaml.safe_load(next((tmp_path / "outputs" / "studies").glob("*.yaml")).read_text())
    assert sweep["overrides"] == {**over, "tracking.experiment": "study-test", "tracking.uri": uri}  # what they share
    assert sweep["arms"] == {r.label: {"algorithm": r.overrides["algorithm"], "seed": r.overrides["seed"]}
                             for r in runs}
    hist = []
    ref = run_experiment(load_config(digits, {**over, "algorithm": {"name": "sflv2"}, "seed": 1, "tracking.uri":
                                              f"sqlite:///{tmp_path / 'ref.db'}", "tracking.progress": False,
                                              "tracking.output_dir": str(tmp_path / "ref")}),
                         on_round=lambda r, m: hist.append(m))
    for key in ("eval/accuracy", "eval/loss", "train/loss", "time/sim", "comm/bytes_up"):
        assert got[1][key] == pytest.approx(ref[key], rel=1e-6), key
    assert [c[0] for c in got[1]["curve"]] == [1, 2]
    assert [h["train/loss"] for h in got[1]["history"]] == pytest.approx([m["train/loss"] for m in hist], rel=1e-6)
    assert got[0]["eval/accuracy"] != got[1]["eval/accuracy"]  # each arm its own run
    _, rows = comparison("study-test", uri)  # `raysplit compare study-test` shows the same runs
    assert sorted((r["name"], r["status"]) for r in rows) == sorted((r.label, "FINISHED") for r in runs)
    client = MlflowClient(uri)
    tagged = client.search_runs([client.get_experiment_by_name("study-test").experiment_id])
    assert {(r.data.tags["raysplit.arm"], r.data.tags["raysplit.sweep"]) for r in tagged} == {
        (r.label, sweep["name"]) for r in runs}
    monkeypatch.setattr(_runs.subprocess, "run", lambda *a, **k: pytest.fail("a cached run was run again"))
    assert _runs.study("study-test", runs) == got
