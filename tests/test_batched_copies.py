"""``algorithm.batched_copies``: per-client server copies stepped in one vmapped computation give the updates,
gradients, losses and clock of the per-copy steps (``ServerHost.train_copies``), in whole runs of PSL, SFLV1 and
SGLR (variant cyclesl) and step by step; what vmap cannot batch falls back to the per-copy path.

Tolerances: the batched kernels (a grouped convolution, batched matmuls) sum in another order than the per-copy
ones, so results agree to float32 rounding, not bit for bit. Measured on these configs: weights differ by at most
9e-8 after two rounds, round train losses by 5e-8, single losses by 5e-7, gradients by 3e-10. The assertions allow
1e-6 on weights and losses (more than 10x the measured differences, 1e4 times below what one round changes: up to
1.2e-2 on the server weights at lr 0.1) and 1e-8 on gradients, and require identical accuracies, step counts and
simulated clocks.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from helpers import make_config
from raysplit import reporting
from raysplit.config import ConfigError
from raysplit.experiment import prepare
from raysplit.runtime import Activation, NonFiniteLossError, Runtime, ServerHost, Tag, make_backend

TOL = 1e-6
# Adam divides each step by sqrt(v): where a gradient is near zero, float rounding of the batched computation moves a
# weight by a fraction of the learning rate (1e-3 here) rather than of the weight (measured: 1.04e-6 after 3 rounds
# on this machine's CPU); 1 % of one step still fails for any copy that stepped differently
TOL_ADAM = 1e-5


def batched_plan(plan, batched: bool):
    """``plan`` whose server host is told ``algorithm.batched_copies: batched`` (the driver's algorithm still follows
    its own config)."""
    params = plan.method.params.model_copy(update={"batched_copies": batched})
    return dataclasses.replace(plan, method=dataclasses.replace(plan.method, params=params))


def run(cfg, spec_batched: bool | None = None):
    """Run ``cfg``'s rounds; returns per round (train_loss, accuracy, RoundStats) and the final runtime state.
    ``spec_batched`` overrides what the server host is told (the algorithm still follows the config)."""
    p = prepare(cfg)
    if spec_batched is not None:
        p.inputs.plan = batched_plan(p.inputs.plan, spec_batched)
    rt = Runtime(make_backend(cfg.runtime), p.inputs)
    try:
        driver = p.algorithm.driver(rt, p.algorithm, p.sample_stream, cfg.seed)
        rounds = []

        def after(r, st):
            acc = reporting.evaluate(rt, p, driver.global_handle, st.participants)["accuracy"]
            rounds.append((reporting.round_metrics(st)["train_loss"], acc, st))

        driver.run(0, cfg.train.rounds, after)
        return rounds, rt.state_dict()
    finally:
        rt.shutdown()


def weights(state) -> dict:
    """Every model in a runtime state: the server's and each client's own or global client model."""
    out = {f"server.{k}": v for k, (ms, _) in state["server"]["models"].items() for k, v in ms.items()}
    for w in state["workers"]:
        out.update({f"global.{k}": v for k, v in w["global"].items()})
        out.update({f"own{c}.{k}": v for c, f in w["clients"].items() for k, v in f.get("own", {}).items()})
    return out


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def assert_same_runs(a, b, same_clock: bool = True, tol: float = TOL) -> None:
    (ra, sa), (rb, sb) = a, b
    assert max_diff(weights(sa), weights(sb)) < tol
    for (la, acc_a, st_a), (lb, acc_b, st_b) in zip(ra, rb, strict=True):
        assert la == pytest.approx(lb, abs=tol)
        assert acc_a == acc_b
        assert {c: v["steps"] for c, v in st_a.clients.items()} == {c: v["steps"] for c, v in st_b.clients.items()}
        if same_clock:
            assert st_a.t_end == st_b.t_end
            assert {c: v["t_end"] for c, v in st_a.clients.items()} == {c: v["t_end"] for c, v in st_b.clients.items()}
            assert st_a.server["flops"] == st_b.server["flops"]


CASES = {
    "psl": {"algorithm.name": "psl"},
    "sflv1": {"algorithm.name": "sflv1"},
    "sglr": {"algorithm": {"name": "sglr", "variant": "cyclesl"}},
    # unequal step counts per client (one epoch of dirichlet shares) and short last batches: per-copy fallbacks
    "psl-epochs": {"algorithm.name": "psl", "train.local_epochs": 1, "data.partition.name": "dirichlet"},
    # optimizer state carried into the copies from the second round on, several steps per client: each copy's
    # own state, so the interleaved order gives the same models
    "sflv1-momentum": {"algorithm.name": "sflv1", "train.optimizer.momentum": 0.9, "train.rounds": 3},
    "psl-adam": {"algorithm.name": "psl", "train.optimizer": {"name": "adam", "lr": 0.001}, "train.rounds": 3},
}


@pytest.mark.parametrize("case", list(CASES))
def test_batched_run_equals_per_copy_run(tmp_path, mlflow_uri, case):
    """Same metrics every round and the same final server and client weights with and without batching."""
    over = {"runtime.backend": "local", **CASES[case]}
    per_copy = run(make_config(tmp_path, mlflow_uri, **over, **{"algorithm.batched_copies": False}))
    batched = run(make_config(tmp_path, mlflow_uri, **over, **{"algorithm.batched_copies": True}))
    assert_same_runs(per_copy, batched, same_clock=case == "sglr",  # SGLR's service order does not change
                     tol=TOL_ADAM if "adam" in case else TOL)
    assert per_copy[0][-1][0] < per_copy[0][0][0]  # it trained
    if case == "psl-epochs":
        steps = per_copy[0][0][2].clients
        assert len({v["steps"] for v in steps.values()}) > 1  # the clients really had different step counts


def test_interleaved_service_is_the_per_copy_clock_in_that_order(tmp_path, mlflow_uri):
    """With batching, PSL serves step k of every client before step k+1 of any. The clock is exactly that of the
    per-copy steps served in the same order (same weights too), and shorter than one client after another."""
    over = {"runtime.backend": "local", "algorithm.name": "psl", "train.local_epochs": 1,
            "data.partition.name": "dirichlet"}
    cfg = make_config(tmp_path, mlflow_uri, **over, **{"algorithm.batched_copies": True})
    batched = run(cfg)
    interleaved_per_copy = run(cfg, spec_batched=False)
    consecutive = run(make_config(tmp_path, mlflow_uri, **over))
    assert_same_runs(batched, interleaved_per_copy, same_clock=True)
    assert_same_runs(batched, consecutive, same_clock=False)
    for (_, _, b), (_, _, c) in zip(batched[0], consecutive[0]):
        assert b.t_end < 0.5 * c.t_end  # the server no longer idles while one client's next batch comes up
        assert b.server["flops"] == c.server["flops"]  # the same work, charged


def test_ray_backend_direct_and_driver_chained_equal_local(ray_session, tmp_path, mlflow_uri):
    """Through actors, server-driven and driver-chained pooled steps (per-client step counts) give exactly the
    local backend's run."""
    over = {"algorithm.name": "sflv1", "train.local_epochs": 1, "data.partition.name": "dirichlet",
            "algorithm.batched_copies": True, "train.rounds": 1}
    local = run(make_config(tmp_path, mlflow_uri, **over, **{"runtime.backend": "local"}))
    for direct in (True, False):
        ray_run = run(make_config(tmp_path, mlflow_uri, **over, **{"runtime.transport.direct_steps": direct}))
        assert max_diff(weights(local[1]), weights(ray_run[1])) == 0.0
        assert local[0][0][2].t_end == ray_run[0][0][2].t_end
        assert local[0][0][2].server["losses"] == ray_run[0][0][2].server["losses"]


# ---- the batched step against the per-copy step ------------------------------------------------------------------

def host_pair(tmp_path, mlflow_uri, **over):
    """Two server hosts of the digits config with momentum SGD, per-copy and batched."""
    cfg = make_config(tmp_path, mlflow_uri, **{"runtime.backend": "local", "algorithm.name": "psl",
                                               "train.optimizer.momentum": 0.9, **over})
    i = prepare(cfg).inputs
    return [ServerHost(batched_plan(i.plan, b), i.server_init, i.client_init, i.test_data) for b in (False, True)]


def fork_random_copies(hosts, clients, main=None, seed=0):
    """The same random, different copies in every host (``main``: another server model to fork them from)."""
    g = torch.Generator().manual_seed(seed)
    for h in hosts:
        h.begin_round(3, 0.0)
        if main is not None:
            h.models["main"].module = copy.deepcopy(main)
            h.models["main"].optimizer = torch.optim.SGD(h.models["main"].module.parameters(), lr=0.1, momentum=0.9)
        h.models.fork(clients)
    for c in clients:
        noise = [torch.randn(p.shape, generator=g) * 0.05 for p in hosts[0].models[c].module.parameters()]
        for h in hosts:
            with torch.no_grad():
                for p, n in zip(h.models[c].module.parameters(), noise):
                    p.add_(n)


def activations(host, clients, step, rng, sizes=None, t0=0.0):
    shape, dtype = host.screen.form()
    return [Activation(Tag(c, 3, step), rng.standard_normal(((sizes or {}).get(c, 16), *shape)).astype(dtype),
                       rng.integers(0, 10, (sizes or {}).get(c, 16)), t0 + 1e-5 * (c % 3)) for c in clients]


def assert_same_steps(hosts, clients, steps, sizes=None, buffers=False) -> None:
    """``steps`` calls of ``train_copies`` on both hosts; every answer, loss, norm, clock and copy agrees."""
    rng = np.random.default_rng(1)
    for k in range(steps):
        acts = activations(hosts[0], clients, k, rng, sizes, t0=1e-4 * k)
        a, b = (h.serve("train_copies", *copy.deepcopy(acts)) for h in hosts)
        for ga, gb in zip(a, b, strict=True):
            assert ga.tag == gb.tag and ga.t_sent == gb.t_sent
            assert float(ga.loss) == pytest.approx(float(gb.loss), abs=TOL)
            np.testing.assert_allclose(ga.g, gb.g, atol=1e-8)
            assert ga.g.shape == gb.g.shape and ga.g.dtype == gb.g.dtype
    per, bat = hosts
    assert per.clock == bat.clock and per.trainer.tally.flops == bat.trainer.tally.flops
    np.testing.assert_allclose(per.trainer.tally.read()[0], bat.trainer.tally.read()[0], atol=TOL)
    np.testing.assert_allclose(per.trainer.tally.grad_norms, bat.trainer.tally.grad_norms, rtol=1e-6)
    for c in clients:
        sa, sb = (h.models[c].module.state_dict() for h in hosts)
        assert max_diff(sa, sb) < TOL
        if buffers:  # BatchNorm: running statistics and batch counters written back per copy
            nbt = [k for k in sa if k.endswith("num_batches_tracked")]
            assert nbt and all(int(sb[k]) == steps for k in nbt)
        oa, ob = (h.models[c].optimizer.state_dict()["state"] for h in hosts)
        assert max_diff({i: s["momentum_buffer"] for i, s in oa.items()},
                        {i: s["momentum_buffer"] for i, s in ob.items()}) < TOL


@pytest.mark.parametrize("clip", [None, 0.5])
def test_batched_step_equals_per_copy_steps(tmp_path, mlflow_uri, monkeypatch, clip):
    """Random copies, momentum SGD, several steps (gradient clipping per copy when set): one batched
    computation per call, every result as from ``train_step`` one after another."""
    hosts = host_pair(tmp_path, mlflow_uri, **{"train.clip_grad_norm": clip})
    calls = spy(monkeypatch)
    fork_random_copies(hosts, [0, 1, 2, 5])
    assert_same_steps(hosts, [0, 1, 2, 5], steps=4)
    assert calls == [4] * 4  # every call was one batched computation of the 4 copies


def test_batchnorm_running_stats_are_written_back(tmp_path, mlflow_uri, monkeypatch):
    """ResNet-18's last block: BatchNorm in training mode updates each copy's running statistics."""
    hosts = host_pair(tmp_path, mlflow_uri, **{
        "model.name": "resnet18", "model.cut": "layer4.0", "data.dataset": "synthetic", "train.batch_size": 4,
        "data.options": {"num_samples": 64, "shape": [3, 32, 32]}})
    calls = spy(monkeypatch)
    fork_random_copies(hosts, [0, 1, 2])
    assert_same_steps(hosts, [0, 1, 2], steps=3, sizes={0: 4, 1: 4, 2: 4}, buffers=True)
    assert calls == [3] * 3


def test_unequal_batches_and_single_copies_take_the_per_copy_path(tmp_path, mlflow_uri, monkeypatch):
    hosts = host_pair(tmp_path, mlflow_uri)
    calls = spy(monkeypatch)
    fork_random_copies(hosts, [0, 1, 2, 3])
    assert_same_steps(hosts, [0, 1, 2, 3], steps=2, sizes={0: 16, 1: 8, 2: 16, 3: 5})
    assert calls == [2, 2]  # clients 0 and 2 batched; 1 and 3 (batch sizes of their own) one after another
    fork_random_copies(hosts, [7])
    assert_same_steps(hosts, [7], steps=2)
    assert calls == [2, 2]  # a single copy: no batched computation


@pytest.mark.parametrize("unbatchable", ["dropout", "batchnorm_cumulative"])
def test_model_vmap_refuses_falls_back_with_a_warning(tmp_path, mlflow_uri, monkeypatch, unbatchable):
    """Dropout in training mode (its masks must follow the server's random stream) and BatchNorm with
    ``momentum=None`` (Python control flow on its batch counter): vmap refuses, the host warns once and steps the
    copies one after another, bit for bit as the per-copy host (random draws included)."""
    layer = torch.nn.Dropout(0.5) if unbatchable == "dropout" else torch.nn.BatchNorm1d(32, momentum=None)
    main = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16 * 8 * 8, 32), layer, torch.nn.ReLU(),
                               torch.nn.Linear(32, 10))
    hosts = host_pair(tmp_path, mlflow_uri)
    fork_random_copies(hosts, [0, 1, 2], main=main)
    rng = np.random.default_rng(1)
    for k in range(3):
        acts = activations(hosts[0], [0, 1, 2], k, rng)
        torch.manual_seed(k)
        a = hosts[0].serve("train_copies", *copy.deepcopy(acts))
        torch.manual_seed(k)
        if k == 0:
            with pytest.warns(UserWarning, match="batched_copies: the server model cannot be batched"):
                b = hosts[1].serve("train_copies", *copy.deepcopy(acts))
        else:
            b = hosts[1].serve("train_copies", *copy.deepcopy(acts))
        for ga, gb in zip(a, b, strict=True):
            assert np.array_equal(ga.g, gb.g) and ga.loss == gb.loss and ga.t_sent == gb.t_sent
    assert hosts[1].models.unbatched
    for c in (0, 1, 2):
        sa, sb = (h.models[c].module.state_dict() for h in hosts)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_nonfinite_loss_names_round_client_and_step(tmp_path, mlflow_uri):
    hosts = host_pair(tmp_path, mlflow_uri)
    fork_random_copies(hosts, [0, 1, 2])
    for h in hosts:
        with torch.no_grad():
            next(h.models[1].module.parameters()).fill_(float("nan"))
    acts = activations(hosts[0], [0, 1, 2], 0, np.random.default_rng(0))
    for h in hosts:  # the step's loss is read at the round's end, with the round's other deferred checks
        h.serve("train_copies", *copy.deepcopy(acts))
        with pytest.raises(NonFiniteLossError, match=r"round 3, client 1 \(step 0\)"):
            h.end_round()
    assert max_diff(*(h.models[0].module.state_dict() for h in hosts)) < TOL  # copies 0 and 2 stepped alike
    assert max_diff(*(h.models[2].module.state_dict() for h in hosts)) < TOL


def spy(monkeypatch) -> list[int]:
    """Sizes of the batched computations run from now on."""
    from raysplit.runtime import batched

    calls, real = [], batched.copies_backward

    def counted(modules, *args, **kwargs):
        calls.append(len(modules))
        return real(modules, *args, **kwargs)

    monkeypatch.setattr(batched, "copies_backward", counted)
    return calls


# ---- the switch ------------------------------------------------------------------------------------------------

def test_switch_is_validated_documented_and_reaches_the_server_host(tmp_path, mlflow_uri):
    """An algorithm parameter of the methods with per-client server copies; the old runtime key still works."""
    from raysplit.algorithms import ALGORITHMS
    from raysplit.algorithms.base import CopiesParams

    field = CopiesParams.model_fields["batched_copies"]
    assert field.default is False and "interleaved" in field.description
    having = sorted(n for n, a in ALGORITHMS.items() if "batched_copies" in a.Params.model_fields)
    assert having == ["pipar", "psl", "sflv1", "sflv1_prox", "sflv3", "sglr", "splitgp", "splitlora"]
    with pytest.raises(ConfigError, match="algorithm.batched_copies"):
        make_config(tmp_path, mlflow_uri, **{"algorithm.name": "psl", "algorithm.batched_copies": "sometimes"})
    with pytest.raises(ConfigError, match="unknown key 'algorithm.batched_copies' for multihead"):
        make_config(tmp_path, mlflow_uri, **{"algorithm.name": "multihead", "algorithm.batched_copies": True})
    def server_batches(cfg) -> bool:  # what the server host's models were told
        i = prepare(cfg).inputs
        return ServerHost(i.plan, i.server_init, i.client_init, i.test_data).models.batch_copies

    cfg = make_config(tmp_path, mlflow_uri, **{"algorithm.batched_copies": True, "algorithm.name": "psl"})
    assert server_batches(cfg) is True
    assert server_batches(make_config(tmp_path, mlflow_uri)) is False  # sflv2 has no copies to batch
    with pytest.warns(FutureWarning, match="runtime.batched_copies is now algorithm.batched_copies"):
        old = make_config(tmp_path, mlflow_uri, **{"runtime.batched_copies": True, "algorithm.name": "sflv1"})
    assert old.algorithm.batched_copies is True and prepare(old).inputs.plan.method.params.batched_copies is True


@pytest.mark.parametrize("opt", [{"name": "sgd", "lr": 0.1, "momentum": 0.9}, {"name": "adam", "lr": 0.001}],
                         ids=["momentum", "adam"])
def test_forked_copies_own_their_optimizer_state(tmp_path, mlflow_uri, opt):
    """A copy's step leaves the server model's and the other copies' optimizer state (momentum buffers, Adam's
    moments and step count) as they were: merging then averages states that each copy built alone."""
    host = host_pair(tmp_path, mlflow_uri, **{"train.optimizer": opt})[0]
    host.begin_round(3, 0.0)
    host.models.fork([9])
    host.serve("train_copies", *activations(host, [9], 0, np.random.default_rng(0)))
    host.models.merge({9: 1.0})  # the server optimizer now holds state
    host.models.fork([0, 1])
    before = copy.deepcopy(host.models[1].optimizer.state_dict()["state"])
    host.serve("train_copies", *activations(host, [0], 1, np.random.default_rng(1)))
    for key in ("main", 1):
        now = host.models[key].optimizer.state_dict()["state"]
        for i, st in before.items():
            for name, v in st.items():
                assert torch.equal(now[i][name], v), (key, i, name)
    moved = host.models[0].optimizer.state_dict()["state"]
    assert any(not torch.equal(moved[i][name], v) for i, st in before.items() for name, v in st.items())
