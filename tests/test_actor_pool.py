"""``runtime.keep_actors_s``: a finished run's actors reused by the driver's next run (ray_pool.ActorPool,
HostActor.reset). A reused actor gives the same metrics as a fresh one and has a fresh process's thread count; it is
handed out only to a run asking for the same resources; idle ones are killed when their seconds pass, when a run asks for other resources, and before a
sweep (release_idle_actors), so they hold nothing another run needs; a failed run's actors are not reused."""

from __future__ import annotations

import time

import pytest
import torch

import raysplit.experiment as experiment
from helpers import make_config
from raysplit.metrics import WALL_CLOCK
from raysplit.runtime.ray import pool as ray_pool


def _cpu_free(ray) -> float:
    time.sleep(0.5)  # the GCS's view of freed resources lags a kill by a moment
    return ray.available_resources().get("CPU", 0.0)


def test_reused_actors_give_a_fresh_runs_metrics_and_are_only_reused_when_asked_for(ray_session, tmp_path,
                                                                                     monkeypatch):
    ray = ray_session
    ray_pool.POOL.drain()
    total = ray.cluster_resources()["CPU"]
    fresh = experiment.run_experiment(make_config(tmp_path, None, **{"tracking.enabled": False,
                                                                      "runtime.keep_actors_s": 0}))
    assert _cpu_free(ray) == pytest.approx(total)  # 0: killed at the end
    assert ray_pool.POOL._idle == []

    over = {"tracking.enabled": False, "runtime.keep_actors_s": 60}
    first = experiment.run_experiment(make_config(tmp_path, None, **over))
    idle = [a for _, a, _ in ray_pool.POOL._idle]
    assert len(idle) == 3 and _cpu_free(ray) == pytest.approx(total - 1.5)  # server + 2 client actors, 0.5 each
    ids = {a._actor_id for a in idle}
    # the same resources: the same three processes serve the next run, compiled graphs included
    second = experiment.run_experiment(make_config(tmp_path, None, **{**over, "runtime.transport.kind": "compiled",
                                                                       "algorithm.name": "psl"}))
    again = {a._actor_id for _, a, _ in ray_pool.POOL._idle}
    assert again == ids, "the second run did not reuse the first run's actors"
    third = experiment.run_experiment(make_config(tmp_path, None, **over))
    assert {a._actor_id for _, a, _ in ray_pool.POOL._idle} == ids
    strip = lambda m: {k: v for k, v in m.items() if k not in WALL_CLOCK and k != "run_id"}  # noqa: E731
    assert strip(first) == strip(fresh) == strip(third)  # a reused actor computes what a fresh one does
    psl_fresh = experiment.run_experiment(make_config(tmp_path, None, **{
        "tracking.enabled": False, "runtime.keep_actors_s": 0, "runtime.transport.kind": "compiled",
        "algorithm.name": "psl", "runtime.server.num_cpus": 0.25, "runtime.client.num_cpus": 0.25}))
    # asking for other resources (actors of 0.25 CPU): the idle actors were killed first, none reused
    assert not ({a._actor_id for _, a, _ in ray_pool.POOL._idle} & ids)
    assert strip(second) == strip(psl_fresh)
    assert _cpu_free(ray) == pytest.approx(total)


def test_idle_actors_expire_and_a_sweep_releases_them(ray_session, tmp_path):
    ray = ray_session
    ray_pool.POOL.drain()
    total = ray.cluster_resources()["CPU"]
    experiment.run_experiment(make_config(tmp_path, None, **{"tracking.enabled": False, "runtime.keep_actors_s": 2,
                                                             "train.rounds": 1}))
    assert len(ray_pool.POOL._idle) == 3
    time.sleep(3)
    assert ray_pool.POOL._idle == [] and _cpu_free(ray) == pytest.approx(total)
    experiment.run_experiment(make_config(tmp_path, None, **{"tracking.enabled": False, "runtime.keep_actors_s": 60,
                                                             "train.rounds": 1}))
    assert _cpu_free(ray) < total
    ray_pool.release_idle_actors()  # what run_sweep calls before its trials
    assert ray_pool.POOL._idle == [] and _cpu_free(ray) == pytest.approx(total)


def test_a_failed_runs_actors_are_not_reused(ray_session, tmp_path):
    from raysplit.runtime import NonFiniteLossError

    ray_pool.POOL.drain()
    with pytest.raises(NonFiniteLossError):
        experiment.run_experiment(make_config(tmp_path, None, **{"tracking.enabled": False,
                                                                 "runtime.keep_actors_s": 60,
                                                                 "train.optimizer.lr": 1e30}))
    assert ray_pool.POOL._idle == []


def test_a_reused_actor_has_a_fresh_processs_threads(ray_session, tmp_path):
    """A host given torch threads (``runtime.torch_threads: 2``) sets them in its process; the next run's host in
    that process, with torch's own default (null), finds the process's first count again (Ray gives an actor of
    less than one CPU one thread), not the 2 the run before left."""
    ray = ray_session
    ray_pool.POOL.drain()
    over = {"tracking.enabled": False, "runtime.keep_actors_s": 60, "train.rounds": 1}

    def threads():
        idle = [a for _, a, _ in ray_pool.POOL._idle]
        return {a._actor_id: ray.get(a.__ray_call__.remote(lambda self: torch.get_num_threads()), timeout=60)
                for a in idle}

    experiment.run_experiment(make_config(tmp_path, None, **{**over, "runtime.torch_threads": 2}))
    before = threads()
    assert len(before) == 3 and set(before.values()) == {2}
    experiment.run_experiment(make_config(tmp_path, None, **{**over, "runtime.torch_threads": None}))
    after = threads()
    assert set(after) == set(before) and set(after.values()) == {1}, after
    ray_pool.POOL.drain()
