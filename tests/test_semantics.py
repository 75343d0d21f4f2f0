"""Semantic checks of the runtime and the baseline algorithms (not smoke tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from helpers import make_config, run_rounds
from raysplit.data import to_tensor
from raysplit.experiment import prepare
from raysplit.models import build_model
from raysplit.runtime import Runtime, make_backend


def centralized_reference(cfg, p, rounds):
    """Plain SGD on the full model over the exact batches the one client draws (seeded permutation per epoch)."""
    torch.manual_seed(cfg.seed)
    spec = p.inputs.plan.model
    model = build_model(cfg.model.name, spec.num_classes, spec.input_shape)
    o = cfg.train.optimizer
    opt = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
    idx = p.inputs.train_idx[0]
    x_all, y_all = p.inputs.train_data["x"], p.inputs.train_data["y"]
    epoch, pos = 0, 0
    perm = np.random.default_rng([cfg.seed, 0, 0]).permutation(idx)
    for _ in range(rounds * cfg.train.local_steps):
        if pos >= len(idx):
            epoch, pos = epoch + 1, 0
            perm = np.random.default_rng([cfg.seed, 0, epoch]).permutation(idx)
        b = perm[pos:pos + cfg.train.batch_size]
        pos += len(b)
        opt.zero_grad()
        F.cross_entropy(model(to_tensor(x_all[b], spec.inputs)), torch.as_tensor(y_all[b])).backward()
        opt.step()
    return model


def one_client_cfg(tmp_path, mlflow_uri, algorithm, backend="local"):
    return make_config(tmp_path, mlflow_uri, **{
        "algorithm.name": algorithm, "data.num_clients": 1, "data.test_fraction": 0.0,
        "data.max_train_samples": 200, "train.local_steps": 5, "train.batch_size": 32, "train.rounds": 3,
        "train.optimizer.momentum": 0.9, "runtime.backend": backend, "runtime.num_workers": 1})


def test_sflv2_one_client_equals_centralized_sgd(tmp_path, mlflow_uri):
    cfg = one_client_cfg(tmp_path, mlflow_uri, "sflv2")
    rounds = 3  # 15 steps over 160 train samples: crosses an epoch boundary (5 batches per epoch)
    client, server, p, _ = run_rounds(cfg, rounds)
    ref = centralized_reference(cfg, p, rounds)
    full = ref.state_dict()
    cut = p.cut
    got = {}
    for k, v in client.items():
        i, rest = k.split(".", 1)
        got[f"blocks.{int(i)}.{rest}"] = v
    for k, v in server.items():
        i, rest = k.split(".", 1)
        got[f"blocks.{int(i)}.{rest}"] = v
    assert set(got) == set(full)
    for k in full:
        torch.testing.assert_close(got[k], full[k], rtol=1e-5, atol=1e-6, msg=k)
    # and it really trained: weights moved away from the initial ones
    torch.manual_seed(cfg.seed)
    init = build_model(cfg.model.name, p.num_classes, p.inputs.plan.model.input_shape).state_dict()
    assert any(not torch.allclose(init[k], full[k]) for k in full)
    assert cut == 1


def test_sflv1_one_client_equals_sflv2_one_client(tmp_path, mlflow_uri):
    c1, s1, _, _ = run_rounds(one_client_cfg(tmp_path, mlflow_uri, "sflv1"), 2)
    c2, s2, _, _ = run_rounds(one_client_cfg(tmp_path, mlflow_uri, "sflv2"), 2)
    for a, b in ((c1, c2), (s1, s2)):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def _flops(fn):
    with FlopCounterMode(display=False) as fc:
        out = fn()
    return out, fc.get_total_flops()


def test_virtual_clock_matches_hand_computation(tmp_path, mlflow_uri):
    """SFLV2, two clients served in fixed order, one step each, homogeneous profile, then FedAvg."""
    f_c, f_s, up, down = 2e9, 5e10, 1e6, 4e6
    cfg = make_config(tmp_path, mlflow_uri, **{
        "algorithm": {"name": "sflv2", "order": "fixed"}, "data.num_clients": 2, "train.local_steps": 1,
        "train.rounds": 1, "runtime.backend": "local", "clock.client_flops": f_c, "clock.server_flops": f_s,
        "clock.up_bandwidth": up, "clock.down_bandwidth": down})
    _, _, p, stats = run_rounds(cfg, 1)
    st = stats[0]
    bs = cfg.train.batch_size
    spec = p.inputs.plan.model
    torch.manual_seed(0)
    client, server = build_model(cfg.model.name, spec.num_classes, spec.input_shape).split(p.cut)
    x = torch.randn(bs, *spec.input_shape)
    a, fwd = _flops(lambda: client(x))
    a_bytes = a.numel() * 4 + bs * 8  # activation + int64 labels
    g_bytes = a.numel() * 4
    a_in = a.detach().requires_grad_(True)
    _, srv = _flops(lambda: F.cross_entropy(server(a_in), torch.zeros(bs, dtype=torch.long)).backward())
    _, bwd = _flops(lambda: a.backward(torch.ones_like(a)))
    m_bytes = sum(v.numel() * v.element_size() for v in client.state_dict().values())
    arrive = fwd / f_c + a_bytes / up  # both clients start at t=0 and compute in parallel
    s1 = arrive + srv / f_s  # server serves client 0 ...
    s2 = s1 + srv / f_s  # ... then client 1, which has been waiting
    uploaded = [s + g_bytes / down + bwd / f_c + m_bytes / up for s in (s1, s2)]
    end = max(uploaded) + m_bytes / down  # the aggregate exists once the last client model has arrived
    assert st.clients[0]["t_end"] == pytest.approx(end, rel=1e-9)
    assert st.clients[1]["t_end"] == pytest.approx(end, rel=1e-9)
    assert st.t_end == pytest.approx(end, rel=1e-9)
    assert st.server["t_end"] == pytest.approx(s2, rel=1e-9)
    assert st.clients[0]["bytes_up"] == a_bytes + m_bytes
    assert st.clients[0]["bytes_down"] == g_bytes + m_bytes
    assert st.clients[1]["flops"] == fwd + bwd
    assert st.server["flops"] == 2 * srv


def test_gradient_pairs_by_tag_not_arrival(tmp_path, mlflow_uri):
    from raysplit.runtime.client.host import ClientHost
    from raysplit.runtime.messages import Gradient, Tag

    cfg = make_config(tmp_path, mlflow_uri, **{"runtime.backend": "local", "runtime.num_workers": 1})
    p = prepare(cfg)
    i = p.inputs
    host = ClientHost(i.plan, 0, i.train_data, dict(enumerate(i.train_idx)), dict(enumerate(i.test_idx)),
                      dict(enumerate(i.profiles)), i.client_init)
    host.begin_round(0, [0, 1], 0.0)
    a0 = host.steps.forward(Tag(0, 0, 0))
    a1 = host.steps.forward(Tag(1, 0, 0))
    # gradients arrive in the opposite order; each must be applied to its own activation
    host.steps.backward(Gradient(a1.tag, np.zeros_like(a1.x), a1.t_sent))
    host.steps.backward(Gradient(a0.tag, np.zeros_like(a0.x), a0.t_sent))
    assert not host.steps.pending
    with pytest.raises(KeyError, match="no pending activation"):
        host.steps.backward(Gradient(Tag(0, 0, 5), np.zeros_like(a0.x), 0.0))


def test_gas_cell_profile_matches_the_formula():
    from raysplit.clock import GasCellClock, gas_cell_rate
    from raysplit.config import ClockConfig

    # at d = 1 km: PL = 128.1 dB; rate = 1e7 * log2(1 + 0.2 * 10^-12.81 / (1e7 * 3.981e-21))
    expected = 1e7 * np.log2(1 + 0.2 * 10 ** (-12.81) / (1e7 * 3.981e-21))
    assert gas_cell_rate(np.array([1.0]))[0] == pytest.approx(expected)
    profs = GasCellClock(profile="gas_cell").draw(50, np.random.default_rng(0))
    assert all(1e9 <= p.flops <= 1e10 for p in profs)
    lo, hi = gas_cell_rate(np.array([1.0]))[0] / 8, gas_cell_rate(np.array([0.1]))[0] / 8
    assert all(lo <= p.up <= hi for p in profs)
    again = GasCellClock(profile="gas_cell").draw(50, np.random.default_rng(0))
    assert profs == again


def test_learning_rate_decays_per_round_on_clients_and_server(tmp_path, mlflow_uri):
    from raysplit.config import OptimizerConfig
    from raysplit.runtime.optim import round_lr

    cfg = OptimizerConfig(lr=0.05, decay=0.5, min_lr=0.01)
    assert [round_lr(cfg, r) for r in range(4)] == pytest.approx([0.05, 0.025, 0.0125, 0.01])
    c = make_config(tmp_path, mlflow_uri, **{"runtime.backend": "local", "train.rounds": 3,
                                             "train.optimizer.decay": 0.5, "train.optimizer.momentum": 0.9})
    p = prepare(c)
    rt = Runtime(make_backend(c.runtime), p.inputs)
    for r in range(3):
        clients = [int(x) for x in p.sample_stream[r]]
        rt.begin_round(r, clients, 0.0)
        p.algorithm.run_round(rt, r, clients, np.random.default_rng(r))
        host = rt.backend.workers[clients[0] % 2]
        # the client's restored optimizer state (momentum) must not bring back an old learning rate
        assert host.states.slots[clients[0]].optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** r)
        assert rt.backend.server.models["main"].optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** r)
        rt.end_round()


def test_frozen_gives_only_the_input_gradient_and_restores_each_flag():
    """ServerHost.frozen: inside, a pass yields dL/dx and no parameter gradient; afterwards every parameter's
    requires_grad is what it was (one frozen before stays frozen), also when the block raises."""
    from raysplit.runtime.server.trainer import frozen

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    x = torch.randn(5, 4, requires_grad=True)
    with frozen(model):
        F.cross_entropy(model(x), torch.tensor([0, 1, 0, 1, 1])).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
    assert [p.requires_grad for p in model.parameters()] == flags == [True, True, True, False]
    with pytest.raises(RuntimeError, match="inside"):
        with frozen(model):
            raise RuntimeError("inside")
    assert [p.requires_grad for p in model.parameters()] == flags


def test_centralised_clock_runs_the_clients_turns_one_after_another(tmp_path, mlflow_uri):
    """Centralised training is one machine taking the clients' batches in turn (issue 71): a round's simulated time
    is the sum of its clients' compute times (each client's FLOPs at its own speed, heterogeneous here), not the
    longest of them; each turn ends where the next one starts, and nothing is charged as traffic."""
    cfg = make_config(tmp_path, mlflow_uri, **{
        "algorithm.name": "centralised", "data.num_clients": 3, "train.local_steps": 2, "train.rounds": 2,
        "runtime.backend": "local", "clock.profile": "uniform"})
    _, _, p, stats = run_rounds(cfg)
    speed = {c: prof.flops for c, prof in enumerate(p.inputs.profiles)}
    assert len(set(speed.values())) == 3  # the clients' speeds differ: a sum and a parallel maximum disagree
    for st in stats:
        turns = {c: row["flops"] / speed[c] for c, row in st.clients.items()}
        assert len(turns) == 3 and all(t > 0 for t in turns.values())
        assert st.sim_time == pytest.approx(sum(turns.values()), rel=1e-9)
        assert st.sim_time > 1.5 * max(turns.values())
        start = st.t_start  # in the order the turns were taken, each starts where the previous one ended
        for c in sorted(st.clients, key=lambda c: st.clients[c]["t_end"]):
            assert st.clients[c]["t_end"] == pytest.approx(start + turns[c], rel=1e-9)
            start = st.clients[c]["t_end"]
        assert all(row.get("bytes_up", 0.0) == 0.0 and row.get("bytes_down", 0.0) == 0.0
                   for row in st.clients.values())


def test_centralised_turn_waits_for_the_previous_turns_end_and_an_old_checkpoint_waits_for_nothing():
    """CentralRule on activation loads the handed-out model and optimizer state, keeps the round's learning rate,
    and waits for the moment the previous turn ended (the hand-out's third field); a checkpoint written before the
    turns were chained holds (weights, optimizer state) only, and then the client waits for nothing (0.0)."""
    from types import SimpleNamespace

    from raysplit.algorithms.centralised import CentralRule

    waits = []
    ctx = SimpleNamespace(meter=SimpleNamespace(wait_until=lambda cid, t: waits.append((cid, t)) or t))
    src, dst = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    opt_src = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    src(torch.ones(4, 3)).sum().backward()
    opt_src.step()  # a momentum buffer to hand on
    rule = CentralRule(ctx)
    rule.on_activate(0, SimpleNamespace(module=dst, optimizer=torch.optim.SGD(dst.parameters(), lr=0.5)))
    assert waits == []  # no model handed out yet: the first turn of the run loads and waits for nothing
    for central, cid, wait in (((src.state_dict(), opt_src.state_dict(), 7.5), 1, 7.5),
                               ((src.state_dict(), opt_src.state_dict()), 2, 0.0)):
        dst = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(dst.parameters(), lr=0.5, momentum=0.9)
        rule.take(central)
        rule.on_activate(cid, SimpleNamespace(module=dst, optimizer=opt))
        assert waits[-1] == (cid, wait)
        assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), src.state_dict().values()))
        assert opt.param_groups[0]["lr"] == 0.5  # the round's rate, not the handed-out optimizer's
        assert len(opt.state) == 2 and all("momentum_buffer" in s for s in opt.state.values())
