"""Corrupt input is rejected by client (runtime.faults.on_bad_client): an activation that is non-finite, of the wrong
shape or dtype, with bad labels or a tag from another round, and a gradient that does not fit its activation, fail
the run naming client, round and step (``fail``), or drop that client for the round, logged, without touching the
server model or the aggregate (``drop``)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

import raysplit.experiment as experiment
from helpers import make_config
from raysplit.errors import BadClientInput
from raysplit.runtime import Runtime, make_backend
from raysplit.runtime.screening import activation_fault, gradient_fault
from raysplit.runtime.messages import Activation, Gradient, Tag, batch_step

def _nan_every_7th(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[::7] = float("nan")
    return x


# each on the activation as it leaves the client host: in process a tensor (the client's own, handed over: the
# server's screen reads its values at the round's end under ``fail``, at once under ``drop``), through Ray an array
CORRUPTIONS = {
    "nan": lambda m: dataclasses.replace(m, x=_nan_every_7th(m.x)),
    "shape": lambda m: dataclasses.replace(m, x=m.x[..., :-1].contiguous()),
    "dtype": lambda m: dataclasses.replace(m, x=m.x.double()),
    "round": lambda m: dataclasses.replace(m, tag=dataclasses.replace(m.tag, round=m.tag.round - 1)),
    "labels": lambda m: dataclasses.replace(m, y=np.full_like(m.y, 99)),
}


def corrupting(base: type, kind: str, client: int = 3, rnd: int | None = 1, step: int = 0) -> type:
    """``base`` (a client host class) whose client ``client`` sends a corrupted activation at (``rnd``, ``step``)
    (``rnd`` None: at that step of every round or job)."""

    class Corrupt(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            forward = self.steps.forward  # the split steps' forward: every path to it (forward_many too) sees this

            def corrupted(tag, batch_size=None):
                msg = forward(tag, batch_size)
                if tag.client == client and tag.step == step and rnd in (None, tag.round):
                    msg = CORRUPTIONS[kind](msg)
                return msg

            self.steps.forward = corrupted

    return Corrupt


@pytest.fixture
def corrupt(monkeypatch):
    """``corrupt(kind, **where)``: the runs that follow use a corrupting client host (sent by value to actors)."""

    def install(kind, **where):
        import sys

        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the corrupting host travels to actors
        orig = experiment.prepare

        def prepare(cfg):
            p = orig(cfg)
            host = corrupting(p.inputs.client_host, kind, **where)
            return dataclasses.replace(p, inputs=dataclasses.replace(p.inputs, client_host=host))

        monkeypatch.setattr(experiment, "prepare", prepare)

    return install


def _act(**kw):
    a = Activation(Tag(3, 2, 5), np.zeros((4, 8, 3, 3), np.float32), np.array([0, 1, 2, 9]), 0.0)
    return dataclasses.replace(a, **kw)


def test_each_activation_and_gradient_fault_is_named():
    form = ((8, 3, 3), np.dtype(np.float32), 10, 2)
    assert activation_fault(_act(), *form) == ""
    assert activation_fault(_act(y=np.zeros(0, np.int64)), *form) == ""  # labels kept on the client
    bad = _act().x.copy()
    bad[0, 0, 0, 0], bad[1, 2, 1, 1] = np.nan, np.inf
    assert "2 of 288 values are NaN or inf" in activation_fault(_act(x=bad), *form)
    assert "round 1, the server is serving round 2" in activation_fault(_act(tag=Tag(3, 1, 5)), *form)
    assert "dtype float64" in activation_fault(_act(x=np.zeros((4, 8, 3, 3))), *form)
    assert "shape (4, 8, 3, 2)" in activation_fault(_act(x=np.zeros((4, 8, 3, 2), np.float32)), *form)
    assert "shape (0, 8, 3, 3)" in activation_fault(_act(x=np.zeros((0, 8, 3, 3), np.float32)), *form)
    assert "for a batch of 4" in activation_fault(_act(y=np.array([0, 1])), *form)
    assert "out of range [0, 10): min 0, max 10" in activation_fault(_act(y=np.array([0, 1, 2, 10])), *form)
    assert "dtype float64 for a batch" in activation_fault(_act(y=np.zeros(4)), *form)
    out = torch.zeros(4, 8, 3, 3)
    assert gradient_fault(np.zeros((4, 8, 3, 3), np.float32), out) == ""
    assert "expected (4, 8, 3, 3)" in gradient_fault(np.zeros((4, 8, 3), np.float32), out)
    assert "dtype float64" in gradient_fault(np.zeros((4, 8, 3, 3)), out)
    assert "1 of 288 values" in gradient_fault(np.where(np.eye(1, 288, 7).reshape(4, 8, 3, 3) > 0, np.nan,
                                                        0).astype(np.float32), out)
    # tensors (handed over in process) are judged alike, by numpy's names for their dtypes
    t = torch.zeros(4, 8, 3, 3)
    assert activation_fault(_act(x=t), *form) == "" and gradient_fault(t, out) == ""
    t[0, 0, 0, 0] = float("inf")
    assert "1 of 288 values are NaN or inf" in activation_fault(_act(x=t), *form)
    assert "1 of 288 values" in gradient_fault(t, out)
    assert "activation dtype float64, expected float32" in activation_fault(_act(x=t.double()), *form)
    assert "dtype float64, expected (4, 8, 3, 3) and float32" in gradient_fault(t.double(), out)


def test_deferred_checks_are_judged_in_order_with_one_read():
    """The round's checks of device values: judged when settled, in the order made (floats in their place), the
    first that fails raising; nothing is read before (the values may still change the verdict's inputs)."""
    from raysplit.runtime.screening import Deferred, check_loss, NonFiniteLossError

    d, seen = Deferred(), []
    loss = torch.tensor(1.0)
    check_loss(d, loss, True, "a")
    d.add(2.5, seen.append)
    check_loss(d, torch.tensor(float("nan")), True, "round 1, client 2 (step 3)")
    check_loss(d, torch.tensor(float("inf")), True, "later")
    loss.fill_(float("nan"))  # read at settle, not when the check was made: this one fails first now
    with pytest.raises(NonFiniteLossError, match="non-finite loss nan at a"):
        d.settle()
    assert d.checks == [] and seen == []
    check_loss(d, torch.tensor(1.0), True, "a")
    d.add(torch.tensor(2.5), seen.append)
    check_loss(d, torch.tensor(float("nan")), True, "round 1, client 2 (step 3)")
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss nan at round 1, client 2 \(step 3\)"):
        d.settle()
    assert seen == [2.5]
    flagged = []
    check_loss(d, torch.tensor(float("nan")), False, "x", on_nonfinite=lambda: flagged.append(1))
    d.settle()  # stop_on_nonfinite off: flagged, no raise
    assert flagged == [1]


@pytest.mark.parametrize("kind,says", [("nan", "values are NaN or inf"),
                                       ("shape", "activation shape (16, 16, 8, 7), expected (batch, 16, 8, 8)"),
                                       ("dtype", "dtype float64"), ("round", "tagged with round 0"),
                                       ("labels", "labels out of range")])
def test_fail_names_client_round_and_step_and_marks_the_run_failed(tmp_path, mlflow_uri, corrupt, kind, says):
    corrupt(kind)
    cfg = make_config(tmp_path, mlflow_uri, **{"runtime.backend": "local", "tracking.experiment": f"bad-{kind}"})
    with pytest.raises(BadClientInput, match=r"client 3, round [01], step 0: activation rejected by the server") as e:
        experiment.run_experiment(cfg)
    assert says in str(e.value)
    runs = MlflowClient(mlflow_uri).search_runs([MlflowClient(mlflow_uri).get_experiment_by_name(
        f"bad-{kind}").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]


def _metric(client, run_id, key):
    return [(h.step, h.value) for h in sorted(client.get_metric_history(run_id, key), key=lambda h: h.step)]


@pytest.mark.parametrize("algorithm", ["sflv2", "psl", "cyclesfl"])
def test_drop_leaves_the_client_out_of_its_round_and_logs_it(tmp_path, mlflow_uri, corrupt, algorithm):
    """A NaN activation from client 3 in round 1: without the screen the server's loss would be NaN and the run
    would stop (stop_on_nonfinite). With ``drop`` the run goes on with finite losses, the round logs one dropped
    client and a tag naming client 3, the other rounds none."""
    over = {"algorithm.name": algorithm, "runtime.backend": "local", "runtime.faults.on_bad_client": "drop",
            "train.rounds": 3, "tracking.experiment": f"drop-{algorithm}", "eval.every": 1}
    if algorithm == "psl":
        over["eval.mode"] = "clients"
    clean = experiment.run_experiment(make_config(tmp_path / "clean", mlflow_uri, **over))
    corrupt("nan")
    final = experiment.run_experiment(make_config(tmp_path, mlflow_uri, **over))
    client = MlflowClient(mlflow_uri)
    run = client.get_run(final["run_id"])
    assert run.info.status == "FINISHED"
    assert _metric(client, run.info.run_id, "train/dropped_clients") == [(0, 0.0), (1, 1.0), (2, 0.0)]
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("raysplit.dropped")}
    assert list(tags) == ["raysplit.dropped.round_1"]
    assert tags["raysplit.dropped.round_1"].startswith("client 3, round 1, step 0")
    assert "NaN or inf" in tags["raysplit.dropped.round_1"]
    assert all(math.isfinite(v) for _, v in _metric(client, run.info.run_id, "train/loss"))
    got, want = (_metric(client, r, "eval/accuracy") for r in (final["run_id"], clean["run_id"]))
    assert got[0] == want[0]  # round 0 untouched
    assert got[1:] != want[1:] and abs(got[-1][1] - want[-1][1]) < 0.1  # client 3 missed round 1, nothing broke


def test_a_dropped_client_is_left_out_of_the_aggregate_and_keeps_its_model(tmp_path, mlflow_uri):
    """Host level: after client 3's activation is withheld, the workers' partial sums carry the other clients'
    weight only, and client 3 is reported dropped with the reason."""
    cfg = make_config(tmp_path, mlflow_uri, **{"runtime.backend": "local", "runtime.faults.on_bad_client": "drop"})
    p = experiment.prepare(cfg)
    inputs = dataclasses.replace(p.inputs, client_host=corrupting(p.inputs.client_host, "shape", rnd=0))
    rt = Runtime(make_backend(cfg.runtime), inputs)
    try:
        rt.begin_round(0, [0, 1, 2, 3], 0.0)
        rt.split_steps([0, 1, 2, 3, 3, 0])
        parts = [x for x in rt.workers.partial_sum({c: 1.0 for c in range(4)}) if x is not None]
        assert sum(x.weight for x in parts) == 3.0  # not 4: client 3 is out
        stats = rt.end_round()
    finally:
        rt.shutdown()
    assert list(stats.server["dropped"]) == [3]
    assert "activation shape" in stats.server["dropped"][3]
    assert stats.clients[3]["dropped"] == 1 and "activation shape" in stats.clients[3]["drop_reason"]
    assert stats.clients[3]["steps"] == 2  # both of its steps were answered (with an empty gradient)
    assert len(stats.server["losses"]) == 4  # the server trained on the other clients' four steps only


class NaNGradientServer:
    """Mixin: the server's gradient for client 1 at round 0, step 1 is NaN (a corrupt transfer)."""

    as_array = False  # the gradient as it arrives through Ray (an array) instead of the server's tensor

    @batch_step(starts="on_arrival")
    def train_step(self, b, key="main"):
        g = super().train_step(b, key)
        if b.tag.client == 1 and b.tag.step == 1 and b.tag.round == 0:
            nan = torch.full_like(g.g, float("nan"))
            return Gradient(g.tag, nan.numpy() if self.as_array else nan, g.t_sent, g.loss)
        return g


@pytest.mark.parametrize("form", ["tensor", "array"])
@pytest.mark.parametrize("policy", ["fail", "drop"])
def test_a_corrupt_gradient_is_rejected_by_the_client(tmp_path, mlflow_uri, policy, form):
    """Under ``fail`` a tensor handed over in process is screened on its device and the run fails at the round's
    end (its one read), an array that travelled at once; under ``drop`` both at once (the client must decide)."""
    cfg = make_config(tmp_path, mlflow_uri, **{"runtime.backend": "local", "runtime.faults.on_bad_client": policy})
    p = experiment.prepare(cfg)
    server = type("Srv", (NaNGradientServer, p.inputs.server_host), {"as_array": form == "array"})
    rt = Runtime(make_backend(cfg.runtime), dataclasses.replace(p.inputs, server_host=server))
    try:
        rt.begin_round(0, [0, 1], 0.0)
        if policy == "fail":
            with pytest.raises(BadClientInput, match=r"client 1, round 0, step 1: rejected by the client: gradient:"):
                rt.split_steps([0, 1, 0, 1, 1])
                assert form == "tensor", "an array's values are screened as it arrives"
                rt.end_round()
            return
        rt.split_steps([0, 1, 0, 1, 1])
        parts = [x for x in rt.workers.partial_sum({0: 1.0, 1: 1.0}) if x is not None]
        assert sum(x.weight for x in parts) == 1.0
        stats = rt.end_round()
    finally:
        rt.shutdown()
    assert stats.clients[1]["dropped"] == 1 and "NaN or inf" in stats.clients[1]["drop_reason"]
    assert "dropped" not in stats.clients[0]


def test_through_ray_actors_the_error_names_the_client(ray_session, tmp_path, mlflow_uri, corrupt):
    """The server actor drives the steps and raises; the error reaches the user as itself, naming client 3."""
    corrupt("nan", rnd=0, step=1)
    cfg = make_config(tmp_path, mlflow_uri, **{"train.rounds": 1, "tracking.experiment": "bad-ray"})
    with pytest.raises(BadClientInput, match=r"client 3, round 0, step 1: activation rejected by the server"):
        experiment.run_experiment(cfg)
    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("bad-ray").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]


def test_gas_drops_a_bad_client_for_its_job_through_the_event_loop(ray_session, tmp_path, mlflow_uri, corrupt):
    """Asynchronous mode: client 3's second activation of every job is NaN; the server answers with empty
    gradients for the rest of that job and ignores its model upload; the run completes with finite losses."""
    corrupt("nan", rnd=None, step=1)
    over = {"algorithm.name": "gas", "train.rounds": 4, "train.participation.count": 2, "clock.profile": "uniform",
            "runtime.faults.on_bad_client": "drop", "tracking.experiment": "bad-gas", "eval.every": 1}
    final = experiment.run_experiment(make_config(tmp_path, mlflow_uri, **over))
    client = MlflowClient(mlflow_uri)
    run = client.get_run(final["run_id"])
    dropped = _metric(client, run.info.run_id, "train/dropped_clients")
    assert run.info.status == "FINISHED" and sum(v for _, v in dropped) >= 1
    tags = [v for k, v in run.data.tags.items() if k.startswith("raysplit.dropped.round_")]
    assert tags and all(v.startswith("client 3, round ") and "NaN or inf" in v for v in tags)
    assert all(math.isfinite(v) for _, v in _metric(client, run.info.run_id, "train/loss"))
