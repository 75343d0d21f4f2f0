"""The event-driven mode: events in simulated-time order (by hand), slots refilled from the latest global model,
determinism across backends and actor counts, exact resume from a checkpoint taken with forwards in flight."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import crashed_run, make_config
from raysplit.algorithms import ALGORITHMS, AsyncAlgorithm
from raysplit.experiment import prepare, run_experiment
from raysplit.models import build_model
from raysplit.runtime import AsyncRule


class RecordingServer(AsyncRule):
    """The default asynchronous server (a step per arrival, models averaged per M uploads) that records what it
    serves: (client, job round, step) per arrival, (client, version the job started from) per upload."""

    log: list = []

    def on_arrival(self, act):
        RecordingServer.log.append(("arrival", act.tag.client, act.tag.round, act.tag.step, act.t_sent))
        return super().on_arrival(act)

    def on_model_upload(self, cid, msg, job):
        RecordingServer.log.append(("upload", cid, job.version, self.ctx.global_model.version, msg.t_sent))
        return super().on_model_upload(cid, msg, job)


class AsyncSL(AsyncAlgorithm):
    """Asynchronous split learning with the default hooks (test algorithm)."""

    name = "test_async_sl"
    description = "test: asynchronous split learning"
    server_rule = RecordingServer


class AsyncFL(AsyncAlgorithm):
    """Asynchronous FL with the default hooks (local SGD jobs; test algorithm)."""

    name = "test_async_fl"
    description = "test: asynchronous FL"
    server_rule = RecordingServer
    split = False


@pytest.fixture(autouse=True)
def registered():
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's hosts travel to the actors
    ALGORITHMS[AsyncSL.name] = AsyncSL
    ALGORITHMS[AsyncFL.name] = AsyncFL
    RecordingServer.log = []
    yield
    ALGORITHMS.pop(AsyncSL.name)
    ALGORITHMS.pop(AsyncFL.name)


def async_cfg(tmp_path, mlflow_uri, **over):
    base = {"algorithm.name": AsyncSL.name, "data.num_clients": 5, "train.participation.count": 2,
            "train.local_steps": 3, "train.rounds": 3, "clock.profile": "uniform", "runtime.backend": "local",
            "tracking.experiment": "events", "train.optimizer.momentum": 0.9}
    base.update(over)
    return make_config(tmp_path, mlflow_uri, **base)


def _flops(fn):
    with FlopCounterMode(display=False) as fc:
        out = fn()
    return out, fc.get_total_flops()


def test_event_order_equals_hand_computation(tmp_path, mlflow_uri):
    """Two clients, both always active (N = M = 2), GAS's clock (no server time, free downloads): each client's
    activations arrive at a_1 = fwd/f + A/up, a_(k+1) = a_k + bwd/f + fwd/f + A/up within a job, and a job ends
    with the model upload bwd/f + M/up after its last arrival; the server must take them merged by time."""
    cfg = async_cfg(tmp_path, mlflow_uri, **{
        "data.num_clients": 2, "data.partition.name": "iid", "data.max_train_samples": 256, "train.batch_size": 16,
        "train.rounds": 2, "clock.profile": "homogeneous", "clock.charge_server": False, "data.test_fraction": 0.0})
    p = prepare(cfg)
    # give the two clients different speeds and bandwidths (profiles are data: replace them before the run)
    from raysplit.clock import ClientProfile

    profs = (ClientProfile(1e9, 2e6, 1e7), ClientProfile(2.5e9, 5e5, 1e7))
    import dataclasses

    events = dataclasses.replace(p.inputs.plan.events, profiles=profs)
    plan = dataclasses.replace(p.inputs.plan, events=events)
    p.inputs = dataclasses.replace(p.inputs, plan=plan, profiles=list(profs))
    from raysplit.runtime import Runtime, make_backend
    from raysplit.runtime.driver.drivers import EventDriver

    rt = Runtime(make_backend(cfg.runtime), p.inputs)
    try:
        EventDriver(rt, p.algorithm, p.sample_stream, cfg.seed).run(0, 2, lambda r, st: None)
    finally:
        rt.shutdown()
    # by hand
    torch.manual_seed(0)
    client, _ = build_model(cfg.model.name, p.num_classes, p.inputs.plan.model.input_shape).split(p.cut)
    x = torch.zeros(16, *p.inputs.plan.model.input_shape)
    a, fwd = _flops(lambda: client(x))
    _, bwd = _flops(lambda: a.backward(torch.ones_like(a)))
    act_bytes = a.numel() * 4 + 16 * 8
    model_bytes = sum(v.numel() * v.element_size() for v in client.state_dict().values())
    events = []
    for c, pr in enumerate(profs):
        t = 0.0
        for job in range(10):  # more jobs than two global rounds take
            for k in range(3):
                t = t + fwd / pr.flops + act_bytes / pr.up
                events.append((t, c, "arrival", k))
                t = t + bwd / pr.flops
            t = t + model_bytes / pr.up
            events.append((t, c, "upload", job))
    events.sort(key=lambda e: (e[0], e[1]))
    got = [(e[1], e[0], e[3] if e[0] == "arrival" else None) for e in RecordingServer.log]
    want = [(c, kind, k if kind == "arrival" else None) for _, c, kind, k in events][:len(got)]
    assert got == want
    times = [e[-1] for e in RecordingServer.log]
    assert times == pytest.approx([e[0] for e in events][:len(times)], rel=1e-12)
    assert sum(1 for e in got if e[1] == "upload") == 4  # two global rounds of M = 2 uploads


def test_slots_refill_from_the_latest_global_model(tmp_path, mlflow_uri):
    cfg = async_cfg(tmp_path, mlflow_uri, **{"train.rounds": 4})
    final = run_experiment(cfg)
    ups = [e for e in RecordingServer.log if e[0] == "upload"]
    assert len(ups) == 4 * 2  # M = 2 uploads per global round
    versions = [e[3] for e in ups]
    assert versions == sorted(versions) and versions[-1] == 3  # version counts the global models made so far
    # jobs start from the global model of their time: some uploads are stale by the models made meanwhile
    assert all(e[3] >= e[2] for e in ups) and any(e[3] > e[2] for e in ups)
    arrivals = [e for e in RecordingServer.log if e[0] == "arrival"]
    assert all(b[4] >= a[4] for a, b in zip(RecordingServer.log, RecordingServer.log[1:]))  # time never goes back
    assert len({e[1] for e in arrivals}) > 2  # replaced clients joined
    assert final["time/sim"] == pytest.approx(ups[-1][4])  # a global round ends with its last upload


@pytest.mark.parametrize("algorithm", [AsyncSL.name, "gas", "fedbuff"])
def test_same_metrics_with_three_client_actors_as_in_process(ray_session, tmp_path, mlflow_uri, algorithm):
    """Clients computing ahead on three actors are consumed in simulated-time order: the in-process run's metrics.
    (One client actor: tests/test_golden.py runs every event method through Ray with one; whole-model uploads are
    fedbuff's here.)"""
    keys = ("eval/accuracy", "eval/loss", "train/loss", "time/sim", "comm/bytes_up", "comm/bytes_down",
            "compute/client_flops", "compute/server_flops")
    runs = []
    for backend, workers in (("local", 2), ("ray", 3)):
        cfg = async_cfg(tmp_path / f"{backend}{workers}", mlflow_uri, **{
            "algorithm.name": algorithm, "runtime.backend": backend, "runtime.num_workers": workers,
            "train.local_steps": 12 if algorithm in (AsyncFL.name, "fedbuff") else 3})
        runs.append(run_experiment(cfg))
    for r in runs[1:]:
        for k in keys:
            assert r[k] == runs[0][k] or (np.isnan(r[k]) and np.isnan(runs[0][k])), k
    assert runs[0]["eval/accuracy"] > 0.15, runs[0]  # it trained (digits, 10 classes)


@pytest.mark.parametrize("backend,algorithm", [("local", AsyncSL.name), pytest.param("ray", "gas", marks=pytest.mark.ray),
                                               ("local", "ca2fl")])
def test_async_resume_equals_uninterrupted(request, tmp_path, mlflow_uri, backend, algorithm):
    """A checkpoint taken at a global-round boundary, with clients' forwards awaiting their gradients, resumes
    into exactly the run that was not interrupted (computed in process: the event loop's metrics do not depend on
    the backend, test_same_metrics_with_three_client_actors_as_in_process)."""
    if backend == "ray":
        request.getfixturevalue("ray_session")
    over = {"train.rounds": 4, "tracking.checkpoint_every": 2, "runtime.backend": backend,
            "tracking.experiment": f"async-resume-{backend}-{algorithm}", "algorithm.name": algorithm}
    full = run_experiment(async_cfg(tmp_path / "a", mlflow_uri, **{**over, "runtime.backend": "local",
                                                                   "tracking.experiment": "async-resume-reference"}))
    cfg = async_cfg(tmp_path / "b", mlflow_uri, **over)
    crashed = crashed_run(cfg, mlflow_uri)
    resumed = run_experiment(cfg, resume_run_id=crashed.info.run_id)
    for k in ("eval/accuracy", "eval/loss", "train/loss", "time/sim", "comm/bytes_up", "compute/client_flops"):
        assert resumed[k] == full[k], k


def test_async_config_errors_before_any_actor(tmp_path, mlflow_uri):
    from raysplit.errors import ConfigError

    with pytest.raises(ConfigError, match="local_epochs"):
        prepare(async_cfg(tmp_path, mlflow_uri, **{"train.local_epochs": 1}))


@pytest.mark.parametrize("algorithm", [AsyncSL.name, AsyncFL.name])
def test_drop_last_reaches_the_event_loops_prediction(tmp_path, mlflow_uri, algorithm):
    """train.drop_last: 20 samples per client at batch 16 make every pass one full batch and a 4-sample tail; the
    client hosts skip the tail and the event loop's prediction of their clocks must skip it too (the loop raises
    when a host's clock and its prediction disagree)."""
    from helpers import run_rounds

    cfg = async_cfg(tmp_path, mlflow_uri, **{"algorithm.name": algorithm, "data.max_train_samples": 100,
                                             "data.partition.name": "iid", "data.test_fraction": 0.0,
                                             "train.batch_size": 16, "train.drop_last": True})
    _, _, _, stats = run_rounds(cfg)
    assert sum(st.get("steps", 0) for rnd in stats for st in rnd.clients.values()) >= 6  # passes were crossed
