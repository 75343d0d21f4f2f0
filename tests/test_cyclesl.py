"""CycleSL family and SGLR: Algorithm 1 against a hand-written reference, pooling, weighting, SGLR's rules."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import make_config, run_rounds
from raysplit.algorithms.cyclesl import positionwise_mean, sglr_shared_gradient
from raysplit.data import to_tensor
from raysplit.experiment import prepare
from raysplit.models import build_model
from raysplit.runtime import Runtime, make_backend
from raysplit.runtime.messages import Tag


def one_round_cfg(tmp_path, mlflow_uri, algorithm, **extra):
    return make_config(tmp_path, mlflow_uri, **{
        "algorithm": {"name": algorithm}, "data.num_clients": 1, "data.test_fraction": 0.0,
        "data.max_train_samples": 200, "train.local_steps": 1, "train.batch_size": 32, "train.rounds": 1,
        "runtime.num_workers": 1, **extra})


def reference_algorithm1(cfg, p):
    """Algorithm 1 by hand for one client and E = 1 with the server batch = the client batch (plain SGD)."""
    torch.manual_seed(cfg.seed)
    model = p.inputs.plan.model
    client, server = build_model(cfg.model.name, model.num_classes, model.input_shape).split(p.cut)
    idx = p.inputs.train_idx[0]
    b = np.random.default_rng([cfg.seed, 0, 0]).permutation(idx)[:cfg.train.batch_size]
    x = to_tensor(p.inputs.train_data["x"][b], model.inputs)
    y = torch.as_tensor(p.inputs.train_data["y"][b])
    lr = cfg.train.optimizer.lr
    f = client(x)  # client extracts features
    # the resampled server batch holds the same rows in another order: the mean loss and its step are the same
    loss = F.cross_entropy(server(f.detach()), y)
    grads = torch.autograd.grad(loss, list(server.parameters()))
    with torch.no_grad():
        for prm, g in zip(server.parameters(), grads):
            prm -= lr * g
    f_in = f.detach().requires_grad_(True)  # frozen, *updated* server computes the client's gradient
    F.cross_entropy(server(f_in), y).backward()
    f.backward(f_in.grad)
    with torch.no_grad():
        for prm in client.parameters():
            prm -= lr * prm.grad
    return client.state_dict(), server.state_dict()


def test_cyclesfl_one_client_matches_algorithm1_and_sflv2_server_update(ray_session, tmp_path, mlflow_uri):
    cfg = one_round_cfg(tmp_path, mlflow_uri, "cyclesfl")
    c_cyc, s_cyc, p, _ = run_rounds(cfg, 1)  # through Ray actors
    c_ref, s_ref = reference_algorithm1(cfg, p)
    for got, ref in ((c_cyc, c_ref), (s_cyc, s_ref)):
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)
    # SFLV2 makes the same server update but computes the client's gradient with the old server
    c_v2, s_v2, _, _ = run_rounds(one_round_cfg(tmp_path, mlflow_uri, "sflv2", **{"runtime.backend": "local"}), 1)
    for k in s_ref:
        torch.testing.assert_close(s_v2[k], s_ref[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(c_v2[k], c_cyc[k], atol=1e-7) for k in c_cyc)


def _hosts(tmp_path, mlflow_uri, algorithm, **extra):
    cfg = make_config(tmp_path, mlflow_uri, **{"algorithm": {"name": algorithm, **extra.pop("alg", {})},
                                               "runtime.backend": "local", "runtime.num_workers": 1,
                                               "data.partition.name": "dirichlet", "data.partition.alpha": 0.5,
                                               "data.partition.min_size": 20, "data.num_clients": 3,
                                               "train.local_steps": 1, **extra})
    p = prepare(cfg)
    rt = Runtime(make_backend(cfg.runtime), p.inputs)
    return cfg, p, rt, rt.backend.server, rt.backend.workers[0]


def test_pooled_dataset_holds_exactly_the_rounds_features(tmp_path, mlflow_uri, monkeypatch):
    cfg, p, rt, server, host = _hosts(tmp_path, mlflow_uri, "cyclepsl")
    decode = type(server).decode
    pooled = []

    def spy(self, act):  # what the server decoded for its hooks, seen from outside the host
        b = decode(self, act)
        pooled.append((b.tag, len(b.y)))
        return b

    monkeypatch.setattr(type(server), "decode", spy)
    clients = [int(c) for c in p.sample_stream[0]]
    rt.begin_round(0, clients, 0.0)
    p.algorithm.run_round(rt, 0, clients, np.random.default_rng(0))
    expected = {Tag(c, 0, 0) for c in clients}
    assert {t for t, _ in pooled} == expected and len(pooled) == len(clients)
    rows = sum(min(cfg.train.batch_size, len(p.inputs.train_idx[c])) for c in clients)
    assert sum(n for _, n in pooled) == rows
    rt.end_round()


def test_resampled_loss_is_weighted_by_client_size(tmp_path, mlflow_uri):
    cfg, p, rt, server, host = _hosts(tmp_path, mlflow_uri, "cyclesfl", alg={"server_batch_size": 10_000})
    sizes = [len(ix) for ix in p.inputs.train_idx]
    assert len(set(sizes)) > 1  # the clients differ in size, so weighting matters
    rt.begin_round(0, [0, 1, 2], 0.0)
    acts = [host.steps.forward(Tag(c, 0, 0)) for c in range(3)]
    model = copy.deepcopy(server.models["main"].module)
    x = torch.cat([torch.from_numpy(np.array(a.x)) for a in acts])
    y = torch.cat([torch.from_numpy(np.array(a.y)) for a in acts])
    w = torch.cat([torch.full((len(a.y),), float(sizes[a.tag.client])) for a in acts])
    loss = (w * F.cross_entropy(model(x), y, reduction="none")).sum() / w.sum()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    server.serve("cycle_step", *acts)  # one resampled batch holds every row: one step on the weighted loss
    lr = cfg.train.optimizer.lr
    for prm, g, new in zip(model.parameters(), grads, server.models["main"].module.parameters()):
        torch.testing.assert_close(new.detach(), (prm - lr * g).detach(), rtol=1e-5, atol=1e-6)
    unweighted = F.cross_entropy(model(x), y)
    assert not torch.isclose(loss, unweighted)


def test_sglr_shared_gradient_by_hand():
    g1 = np.array([[1.0, 0.0], [3.0, 2.0]], np.float32)  # client 1: 2 samples, weight 10
    g2 = np.array([[0.0, 6.0]], np.float32)  # client 2: 1 sample, weight 40
    # (10 * [4, 2] + 40 * [0, 6]) / (10 * 2 + 40 * 1) = [40, 260] / 60
    np.testing.assert_allclose(sglr_shared_gradient([g1, g2], [10, 40]), [40 / 60, 260 / 60], rtol=1e-6)
    # original SGLR: mean over clients per batch position; the shorter client counts only where it has rows
    np.testing.assert_allclose(positionwise_mean([g1, g2]), [[0.5, 3.0], [3.0, 2.0]])


def test_sglr_variants_differ_where_they_should(tmp_path, mlflow_uri):
    # cyclesl variant: copies per client; the first half (1 of 3) gets the shared gradient, the others their own
    cfg, p, rt, server, host = _hosts(tmp_path, mlflow_uri, "sglr", alg={"variant": "cyclesl"})
    rt.begin_round(0, [0, 1, 2], 0.0)
    acts = [host.steps.forward(Tag(c, 0, 0)) for c in range(3)]
    server.models.fork([0, 1, 2])
    g = server.serve("sglr_copies_step", *acts)
    own0 = g[0].g
    assert np.allclose(own0, own0[0])  # one per-sample gradient repeated over the batch
    lr0 = server.models[0].optimizer.param_groups[0]["lr"]
    assert lr0 == pytest.approx(cfg.train.optimizer.lr)  # no learning-rate scaling
    # original variant: one server, lr x N^lr_pow, every client gets the position-wise mean before comm_fraction
    cfg, p, rt, server, host = _hosts(tmp_path, mlflow_uri, "sglr", alg={"variant": "original", "lr_pow": 1.0},
                                      **{"train.rounds": 10})
    rt.begin_round(0, [0, 1, 2], 0.0)
    acts = [host.steps.forward(Tag(c, 0, 0)) for c in range(3)]
    g = server.serve("sglr_concat_step", *acts)
    assert server.models["main"].optimizer.param_groups[0]["lr"] == pytest.approx(3 * cfg.train.optimizer.lr)
    n = min(len(x.g) for x in g)
    assert all(np.allclose(x.g[:n], g[0].g[:n]) for x in g)  # shared while round < 0.6 * rounds
    server.begin_round(7, 0.0)  # past comm_fraction: each client its own slice
    for c in range(3):
        host.steps.pending.clear(), host.begin_round(7, [c], 0.0)
    acts = [host.steps.forward(Tag(c, 7, 0)) for c in range(3)]
    g = server.serve("sglr_concat_step", *acts)
    assert not np.allclose(g[0].g[:n], g[1].g[:n])


def test_clients_eval_covers_sampled_or_all_test_splits(tmp_path, mlflow_uri):
    from raysplit.reporting import evaluate

    for who in ("sampled", "all"):
        cfg, p, rt, server, host = _hosts(tmp_path, mlflow_uri, "cyclepsl", **{"eval.clients": who,
                                                                               "train.participation.count": 2})
        clients = [int(c) for c in p.sample_stream[0]]
        rt.begin_round(0, clients, 0.0)
        p.algorithm.run_round(rt, 0, clients, np.random.default_rng(0))
        rt.end_round()
        y, pred, _ = rt.evaluate_clients(clients if who == "sampled" else [0, 1, 2])
        counted = clients if who == "sampled" else [0, 1, 2]
        assert len(y) == sum(len(p.inputs.test_idx[c]) for c in counted)
        m = evaluate(rt, p, None, clients)
        assert 0.0 <= m["accuracy"] <= 1.0 and m["loss"] > 0
