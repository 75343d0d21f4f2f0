"""Clients with their own cut points (issue 72): one tier is today's run bit for bit; two tiers on a tiny model give
the models a hand computation gives; the aggregation by block on hand-made weights; each client's FLOPs and bytes
from its own cut; the budget rule; a bad tier config refused before any actor starts."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import counting_syncs, load_script, make_config, run_rounds
from torch.utils.flop_counter import FlopCounterMode

from raysplit import experiment
from raysplit.config import ModelConfig
from raysplit.data import to_tensor
from raysplit.errors import ConfigError
from raysplit.models import build_model
from raysplit.models.tiers import AtCuts, client_cuts, cut_flops
from raysplit.runtime import tiered, transport

golden = load_script("golden")
TWO_TIERS = [{"cut": "conv1", "clients": [0]}, {"cut": "conv2", "clients": [1]}]


@pytest.mark.parametrize("name", ["sflv2", "psl"])
def test_one_tier_is_todays_run_bit_for_bit(name):
    got = golden.run(name, **{"model.cut": None, "model.tiers": [{"cut": "conv1", "share": 1.0}]})
    assert not golden.differences(golden.load(name), got)


@pytest.mark.parametrize("name", ["splitnn", "sflv1", "sflv2", "minibatch_sfl", "cyclesfl"])
def test_a_tiered_step_path_makes_no_host_synchronisation(name):
    """Entering the server at each client's cut, pooling by cut and the per-cut FLOP keys read nothing back from
    the device within the steps (tests/test_golden.py's budgets: none for these families)."""
    with counting_syncs() as syncs:
        golden.run(name, **{"model.cut": None, "model.tiers": [{"cut": "conv1", "share": 0.5},
                                                               {"cut": "conv2", "share": 0.5}]})
    assert syncs.steps > 0 and syncs.total == 0, f"{syncs.total} synchronisations in {syncs.steps} steps"


def tiny(tmp_path, name: str, **over):
    """Two clients (client 0 cut after conv1, client 1 after conv2), one round of one batch each, plain SGD."""
    return make_config(tmp_path, f"sqlite:///{tmp_path}/m.db", **{
        "runtime.backend": "local", "algorithm.name": name, "data.num_clients": 2, "train.participation.count": 2,
        "train.local_steps": 1, "train.rounds": 1, "model.cut": None, "model.tiers": TWO_TIERS, **over})


def first_batch(p, cid: int):
    """Client ``cid``'s first batch as its host draws it: a permutation of its indices from (seed, client, epoch)."""
    idx = p.inputs.train_idx[cid]
    perm = np.random.default_rng([p.cfg.seed, cid, 0]).permutation(idx)[:p.cfg.train.batch_size]
    spec = p.inputs.plan.model.inputs
    return (to_tensor(p.inputs.train_data["x"][perm], spec),
            torch.as_tensor(p.inputs.train_data["y"][perm], dtype=torch.long))


def initial(p):
    model = p.inputs.plan.model.build()
    state = {f"blocks.{k.removeprefix('head.').removeprefix('tail.')}": v  # a U-shaped part's head and tail
             for k, v in transport.unpack_state(p.inputs.client_init).items()}
    state.update({f"blocks.{k}": v for k, v in transport.unpack_state(p.inputs.server_init).items()})
    model.load_state_dict(state)
    return model


def descend(params, loss, lr: float) -> None:
    """Plain SGD on ``params`` down the gradient of ``loss``, by hand."""
    params = list(params)
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for q, g in zip(params, grads):
            q -= lr * g


def sgd_step(blocks, x, y, lr: float) -> None:
    """One step of plain SGD of ``blocks`` (run in order) on the batch, by hand."""
    out = x
    for b in blocks:
        out = b(out)
    descend([q for b in blocks for q in b.parameters()], F.cross_entropy(out, y), lr)


def two_tier_start(p):
    """The learning rate, the clients' sample counts, the initial model, each client's part (copies: client 0's
    blocks[:1], client 1's blocks[:2]), the server's blocks 1-3 (the model's own) and each client's first batch."""
    ref, seq = initial(p), torch.nn.Sequential
    parts = {0: copy.deepcopy(seq(*ref.blocks[:1])), 1: copy.deepcopy(seq(*ref.blocks[:2]))}
    return (p.cfg.train.optimizer.lr, [len(p.inputs.train_idx[c]) for c in (0, 1)], ref, parts,
            seq(*ref.blocks[1:]), {c: first_batch(p, c) for c in (0, 1)})


def by_block(n, shallow, deep, srv) -> dict:
    """The two-tier aggregate by hand: block 0 over client 0's part (``shallow``) and client 1's (``deep``), block 1
    over client 1's and the server's, blocks 2-3 the server's (``srv``: blocks 1-3), by the clients' samples."""
    w0, w1 = n[0] / sum(n), n[1] / sum(n)
    want = {f"0.{k}": w0 * v + w1 * deep[0].state_dict()[k] for k, v in shallow[0].state_dict().items()}
    want.update({f"1.{k}": w0 * v + w1 * deep[1].state_dict()[k] for k, v in srv[0].state_dict().items()})
    for i, b in enumerate(srv[1:], start=2):
        want.update({f"{i}.{k}": v for k, v in b.state_dict().items()})
    return want


def check(got: dict, want: dict, keys) -> None:
    for k in keys:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_two_tiers_sflv2_equal_a_hand_reference(tmp_path):
    """SFLV2 in fixed order: client 0 (blocks[:1]) then client 1 (blocks[:2]) through one server model entered at
    their cuts; then block 0 averaged over both clients, block 1 over client 1 and the server (which trained it for
    client 0), blocks 2-3 the server's."""
    client, server, p, _ = run_rounds(tiny(tmp_path, "sflv2", **{"algorithm.order": "fixed"}))
    lr, n = p.cfg.train.optimizer.lr, [len(p.inputs.train_idx[c]) for c in (0, 1)]
    ref = initial(p)
    c0, c1 = copy.deepcopy(ref.blocks[0]), copy.deepcopy(ref.blocks[:2])
    srv = ref.blocks[1:]  # the server's blocks (trained in place)
    x0, y0 = first_batch(p, 0)
    sgd_step([c0, *srv], x0, y0, lr)
    x1, y1 = first_batch(p, 1)
    sgd_step([c1[0], c1[1], *srv[1:]], x1, y1, lr)
    want = by_block(n, [c0], c1, srv)
    check(client, want, client)  # the aggregate every client gets: blocks 0-1
    check(server, want, server)  # the server: block 1 (the overlap, the same aggregate) and blocks 2-3


def test_two_tiers_sflv1_equal_a_hand_reference(tmp_path):
    """SFLV1: each client against its own server copy entered at its cut; the copies merge by block (block 1 from
    client 0's copy only: client 1 holds it itself), then client parts and the server's overlap by block."""
    client, server, p, _ = run_rounds(tiny(tmp_path, "sflv1"))
    lr, n = p.cfg.train.optimizer.lr, [len(p.inputs.train_idx[c]) for c in (0, 1)]
    ref = initial(p)
    own = {c: copy.deepcopy(ref.blocks) for c in (0, 1)}  # each client's whole model: its part and its copy
    for c, cut in ((0, 1), (1, 2)):
        x, y = first_batch(p, c)
        sgd_step(list(own[c]), x, y, lr)
    w = [n[0] / sum(n), n[1] / sum(n)]
    want = {}
    for i in range(4):  # every block: client i's version (its part or its copy), weighted by samples
        for k, v in own[0][i].state_dict().items():
            want[f"{i}.{k}"] = w[0] * v + w[1] * own[1][i].state_dict()[k]
    check(client, want, client)
    check(server, want, server)


def test_two_tiers_splitnn_equal_one_model_trained_client_after_client(tmp_path):
    """SplitNN hands its model on through the server: client 0 (blocks[:1]) then client 1 (blocks[:2]) train what
    one whole model trained on client 0's batch and then on client 1's would be."""
    client, server, p, stats = run_rounds(tiny(tmp_path, "splitnn", **{"algorithm.order": "fixed"}))
    ref = initial(p)
    for c in (0, 1):
        x, y = first_batch(p, c)
        sgd_step(list(ref.blocks), x, y, p.cfg.train.optimizer.lr)
    want = {k[len("blocks."):]: v for k, v in ref.state_dict().items()}
    check(client, want, client)
    check(server, want, server)
    # the hand-over: client 0 uploads its block, client 1 downloads its two (the server's block 1 among them)
    rows = stats[0].clients
    assert rows[0]["bytes_up_model"] == sum(v.numel() * 4 for k, v in want.items() if k.startswith("0."))
    assert rows[1]["bytes_down_model"] == sum(v.numel() * 4 for k, v in want.items() if k[0] in "01")


def test_the_server_part_enters_at_each_cut_and_slices_as_a_plain_part():
    model = build_model("cnn_small", 10, (1, 8, 8))
    server = AtCuts(model.segment(1, len(model)), 1)
    x = model.example_input(2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(server(model.blocks[0](x)), model(x))
        with server.entered(2):
            assert torch.equal(server(model.segment(0, 2)(x)), model(x))
        assert server.entry == 1
        with pytest.raises(ValueError, match="outside the server's blocks"):
            with server.entered(0):
                pass
    tail = server[1:]
    assert type(tail) is torch.nn.Sequential and list(tail.state_dict()) == list(model.segment(2, 4).state_dict())


def test_aggregation_by_block_on_hand_made_weights():
    """A holds block 0 (weight 1), B blocks 0-1 (weight 3), the server blocks 1-2: block 0 = (1*1 + 3*5)/4, block
    1 = (3*2 + 1*10)/4 (the server holds it for A), block 2 the server's alone, not sent back."""
    t = torch.tensor
    a, b = {"0.w": t(1.0)}, {"0.w": t(5.0), "1.w": t(2.0)}
    parts = [tiered.partial_sum([a], [1.0]), tiered.partial_sum([b], [3.0])]
    packed = [({k: v.numpy() for k, v in s.items()}, h) for s, h in parts]
    state, update = tiered.finish(packed, 4.0, {"1.w": t(10.0), "2.w": t(7.0)}, {"0.w": t(0.0), "1.w": t(0.0)})
    assert state == {"0.w": t(4.0), "1.w": t(4.0)} and update == {"1.w": t(4.0)}
    # copies merge by block: block 1 only A's copy trained (B cuts after it), block 2 both, by weight
    main = AtCuts(torch.nn.Sequential(), 1)
    main.add_module("1", torch.nn.Linear(1, 1, bias=False))
    main.add_module("2", torch.nn.Linear(1, 1, bias=False))
    copies = {}
    for cid, (v1, v2) in {0: (2.0, 4.0), 1: (6.0, 8.0)}.items():
        copies[cid] = copy.deepcopy(main)
        copies[cid].load_state_dict({"1.weight": t([[v1]]), "2.weight": t([[v2]])})
    merged = tiered.merge_copies(main, copies, {0: 1.0, 1: 3.0}, cuts=[1, 2])
    assert merged["1.weight"].item() == 2.0 and merged["2.weight"].item() == (4.0 + 3 * 8.0) / 4


def test_each_client_counts_flops_and_bytes_from_its_own_cut(tmp_path):
    _, _, p, stats = run_rounds(tiny(tmp_path, "sflv2"))
    rows, model = stats[0].clients, p.inputs.plan.model.build()
    bs = p.cfg.train.batch_size
    for cid, cut in ((0, 1), (1, 2)):
        part = model.segment(0, cut)
        x, y = first_batch(p, cid)
        with FlopCounterMode(display=False) as fwd:
            out = part(x)
        with FlopCounterMode(display=False) as bwd:
            out.backward(torch.ones_like(out))
        assert rows[cid]["flops"] == fwd.get_total_flops() + bwd.get_total_flops()
        act = int(np.prod(model.activation_shape(cut)))
        assert rows[cid]["bytes_up_activations"] == bs * act * 4 + bs * 8  # float32 features, int64 labels
        assert rows[cid]["bytes_up_model"] == sum(v.numel() * 4 for v in part.state_dict().values())
        profile = p.inputs.profiles[cid]  # its clock: its own FLOPs, upload and download on its own link
        assert rows[cid]["t_end"] >= rows[cid]["flops"] / profile.flops + rows[cid]["bytes_up"] / profile.up
    assert rows[0]["flops"] < rows[1]["flops"] and rows[0]["bytes_up_activations"] > rows[1]["bytes_up_activations"]


def test_the_budget_rule_gives_each_client_the_deepest_cut_it_affords():
    model = build_model("cnn_small", 10, (1, 8, 8))
    fl = cut_flops(model, [1, 2, 3], 16)
    assert fl[1] < fl[2] < fl[3]
    speeds = [fl[1] / 1.0, fl[2] / 1.0, fl[3] / 1.0, fl[1] / 2.0]  # afford exactly cut 1, 2, 3; the last none
    cfg = ModelConfig(name="cnn_small", cut_budget={"seconds": 1.0})
    assert client_cuts(model, cfg, 4, speeds, 0, 16) == (1, 2, 3, 1)  # none affordable: the shallowest
    cfg = ModelConfig(name="cnn_small", cut_budget={"seconds": 1.0, "cuts": ["conv1", "fc1"]})
    assert client_cuts(model, cfg, 4, speeds, 0, 16) == (1, 1, 3, 1)
    shares = ModelConfig(name="cnn_small", tiers=[{"cut": 1, "share": 0.5}, {"cut": 3, "share": 0.5}],
                         tier_order="speed")
    assert client_cuts(model, shares, 4, speeds, 0, 16) == (1, 3, 3, 1)  # the fastest two deepest


@pytest.mark.parametrize("over, words", [
    ({"model.tiers": [{"cut": "conv1", "clients": [0, 1]}, {"cut": 9, "clients": [2, 3]}]}, "model.tiers[1].cut"),
    ({"model.tiers": [{"cut": "conv1", "clients": [0]}, {"cut": "conv2", "clients": [1, 2]}]}, "in no tier"),
    ({"model.tiers": [{"cut": "conv1", "clients": [0, 1]}, {"cut": "conv2", "clients": [1, 2, 3]}]},
     "client 1 is in two tiers"),
    ({"model.tiers": [{"cut": "conv1", "share": 0.5}, {"cut": "conv2", "share": 0.3}]}, "sum to 0.8"),
    ({"model.cut": "conv1", "model.tiers": TWO_TIERS}, "model.cut must then be left out"),
    ({"model.tail_cut": "conv2", "model.tiers": [{"cut": 1, "share": 0.5}, {"cut": 2, "share": 0.5}]},
     "model.tail_cut='conv2' .after block 2. does not come after"),
    ({"algorithm.name": "cyclesglr", "model.tiers": [{"cut": 1, "share": 0.5}, {"cut": 2, "share": 0.5}]},
     "cyclesglr cannot take clients with their own cuts: it shares one gradient"),
    ({"algorithm.name": "psl", "algorithm.batched_copies": True,
      "model.tiers": [{"cut": 1, "share": 0.5}, {"cut": 2, "share": 0.5}]}, "algorithm.batched_copies"),
    ({"algorithm.name": "gas", "model.tiers": [{"cut": 1, "share": 0.5}, {"cut": 2, "share": 0.5}]},
     "gas cannot take clients with their own cuts"),
])
def test_a_bad_tier_config_is_refused_before_any_actor(tmp_path, monkeypatch, over, words):
    def no_actor(*a, **kw):
        raise AssertionError("an actor was asked for")

    monkeypatch.setattr(experiment, "runtime_for", no_actor)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        cfg = make_config(tmp_path, f"sqlite:///{tmp_path}/m.db", **{"runtime.backend": "local",
                                                                      "model.cut": None, **over})
        experiment.run_experiment(cfg)


def test_each_tier_logs_its_accuracy_bytes_flops_and_time():
    got = golden.run("psl", **{"model.cut": None, "model.tiers": [{"cut": "conv1", "share": 0.5},
                                                                   {"cut": "conv2", "share": 0.5}]})
    last = got["rounds"][-1]
    for k in (0, 1):
        assert 0.0 <= last[f"eval/tier{k}/accuracy"] <= 1.0 and last[f"time/tier{k}/sim_time"] > 0
    assert last["comm/tier0/bytes_up"] + last["comm/tier1/bytes_up"] == last["comm/bytes_up"]
    assert last["compute/tier0/client_flops"] < last["compute/tier1/client_flops"]


@pytest.mark.parametrize("over, tiers", [({}, {1: 10, 2: 10}),
                                         ({"model.tiers": None, "model.cut_budget": {"seconds": 0.04,
                                                                                     "cuts": ["conv1", "conv2"]}},
                                          None)])
def test_the_documented_config_prepares_its_tiers(tmp_path, over, tiers):
    """configs/tiers/fmnist.yaml (docs/usage.md) as it is, and with the budget rule its comment gives."""
    from helpers import write_fake_fashion_mnist

    from raysplit.config import load_config

    write_fake_fashion_mnist(tmp_path / "data")
    cfg = load_config(golden.ROOT / "configs" / "tiers" / "fmnist.yaml",
                      {"data.root": str(tmp_path / "data"), "runtime.backend": "local", **over})
    p = experiment.prepare(cfg)
    cuts = p.inputs.plan.model.cuts
    got = {c: cuts.count(c) for c in sorted(set(cuts))}
    speeds = [q.flops for q in p.inputs.profiles]
    if tiers is not None:
        assert got == tiers
        assert min(speeds[c] for c in range(20) if cuts[c] == 2) >= max(speeds[c] for c in range(20) if cuts[c] == 1)
    else:  # the deepest cut each affords: conv2 for the clients fast enough for it
        fl = cut_flops(p.inputs.plan.model.build(), [1, 2], 32)
        assert all(cuts[c] == (2 if fl[2] / speeds[c] <= 0.04 else 1) for c in range(20)) and len(got) == 2


def run_keeping_clients(cfg):
    """``run_rounds``, with each client's own model at the end."""
    from helpers import GET_TIMEOUT

    from raysplit.runtime import runtime_for

    p = experiment.prepare(cfg)
    rt = runtime_for(cfg.runtime, p.inputs)
    try:
        stats = []
        p.algorithm.driver(rt, p.algorithm, p.sample_stream, cfg.seed).run(0, cfg.train.rounds,
                                                                          lambda r, st: stats.append(st))
        own = {c: transport.unpack_state(rt.get(rt.client(c).get_state(), timeout=GET_TIMEOUT).state)
               for c in range(cfg.data.num_clients)}
        server = transport.unpack_state(rt.get(rt.server.get_state(), timeout=GET_TIMEOUT).state)
        return own, server, stats
    finally:
        rt.shutdown()


def test_a_packed_run_with_two_tiers_equals_one_client_after_another(tmp_path, monkeypatch):
    """PSL with four clients on one host, two at each cut: packed, a step's clients of one cut forward and take
    their gradients back as one computation (two packs a step, one per cut); the same models and counters within
    float rounding as one client after another."""
    from raysplit.runtime.client.executor import Executor

    packs = []
    together = Executor.forward_together

    def counted(self, modules, xs, key_suffix=()):
        packs.append((len(modules), key_suffix))
        return together(self, modules, xs, key_suffix)

    monkeypatch.setattr(Executor, "forward_together", counted)
    over = {"data.num_clients": 4, "train.participation.count": 4, "train.local_steps": 2, "runtime.num_workers": 1,
            "model.tiers": [{"cut": "conv1", "clients": [0, 2]}, {"cut": "conv2", "clients": [1, 3]}]}
    runs = {pack: run_keeping_clients(tiny(tmp_path / str(pack), "psl", **over, **{"runtime.pack_clients": pack}))
            for pack in (False, True)}
    assert sorted(set(packs)) == [(2, (1,)), (2, (2,))] and len(packs) == 4  # 2 steps x 2 cuts, only when packed
    (own0, s0, st0), (own1, s1, st1) = runs[False], runs[True]
    for got, want in [(s1, s0)] + [(own1[c], own0[c]) for c in range(4)]:
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    for c in range(4):
        for key in ("flops", "bytes_up", "bytes_down"):
            assert st1[0].clients[c][key] == st0[0].clients[c][key], (c, key)


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["compiled", "calls"])
@pytest.mark.parametrize("name, extra", [("sflv1", {}), ("sflv2", {"model.tail_cut": "fc1"})],
                         ids=["sflv1", "sflv2-u-shaped"])
def test_a_tiered_run_through_ray_actors_equals_the_local_one(ray_session, transport, name, extra):
    """Two client actors, the compiled graphs' channels sized for the largest tier's activations; U-shaped too."""
    tiers = {"model.cut": None, "model.tiers": [{"cut": "conv1", "share": 0.5}, {"cut": "conv2", "share": 0.5}],
             **extra}
    want = golden.run(name, **tiers)
    got = golden.run(name, **tiers, **{"runtime.backend": "ray", "runtime.server.num_cpus": 0.5,
                                          "runtime.client.num_cpus": 0.5, "runtime.keep_actors_s": 30,
                                          "runtime.transport.kind": transport, "runtime.num_workers": 2})
    assert not golden.differences(want, got)


def test_two_tiers_minibatch_sfl_equal_a_hand_reference(tmp_path):
    """MiniBatch-SFL: each client's gradient from the server model before the step (entered at its cut), then one
    server step on both batches, each from its cut, the loss the mean over all samples; then block by block."""
    client, server, p, _ = run_rounds(tiny(tmp_path, "minibatch_sfl", **{"algorithm.client_batch": "equal"}))
    lr, n, ref, parts, srv, batches = two_tier_start(p)
    seq = torch.nn.Sequential
    # the clients' steps: through the server as it was (frozen), their own parameters only
    for c, part in parts.items():
        x, y = batches[c]
        out = part(x)
        for b in srv[len(part) - 1:]:
            out = b(out)
        descend(part.parameters(), F.cross_entropy(out, y), lr)
    # the server's step on the clients' activations (from their parts before their steps: what they sent)
    sent = {0: seq(*ref.blocks[:1])(batches[0][0]).detach(), 1: seq(*ref.blocks[:2])(batches[1][0]).detach()}
    loss = (F.cross_entropy(srv(sent[0]), batches[0][1], reduction="sum")
            + F.cross_entropy(srv[1:](sent[1]), batches[1][1], reduction="sum")) / (len(sent[0]) + len(sent[1]))
    descend(srv.parameters(), loss, lr)
    want = by_block(n, parts[0], parts[1], srv)
    check(client, want, client)
    check(server, want, server)


def test_two_tiers_sflv3_train_as_psl_and_pair_each_part_with_the_server_at_its_cut(tmp_path):
    """SFLV3 trains as PSL does (copies merged by block, client parts kept) and evaluates every client's own part
    with the server model entered at that client's cut (most confident pair)."""
    over = {"eval.mode": "global"}
    got = run_keeping_clients(tiny(tmp_path / "v3", "sflv3", **over))
    want = run_keeping_clients(tiny(tmp_path / "psl", "psl"))
    for g, w in [(got[1], want[1])] + [(got[0][c], want[0][c]) for c in (0, 1)]:
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)
    res = experiment.run_experiment(tiny(tmp_path / "run", "sflv3", **over, **{"tracking.enabled": False}))
    p = experiment.prepare(tiny(tmp_path / "p", "sflv3", **over))
    model = p.inputs.plan.model.build()
    server = AtCuts(model.segment(1, len(model)), 1)
    server.load_state_dict(got[1])
    x = to_tensor(p.inputs.test_data["x"], p.inputs.plan.model.inputs)
    logits = []
    with torch.no_grad():
        for c, cut in ((0, 1), (1, 2)):
            part = model.segment(0, cut)
            part.load_state_dict(got[0][c])
            with server.entered(cut):
                logits.append(server.eval()(part.eval()(x)))
    stacked = torch.stack(logits)
    best = stacked.max(dim=2).values.argmax(dim=0)
    pred = stacked[best, torch.arange(len(x))].argmax(1).numpy()
    assert res["eval/accuracy"] == pytest.approx(float(np.mean(pred == p.inputs.test_data["y"])))


def test_two_tiers_cyclesfl_equal_a_hand_reference(tmp_path):
    """CycleSFL: the round's features pooled (client 0's from blocks[:1], client 1's from blocks[:2]), two resampled
    steps of the server, each sample entering at its cut with its client's size as weight; the clients' gradients
    from the updated server, frozen; then block by block."""
    client, server, p, _ = run_rounds(tiny(tmp_path, "cyclesfl"))
    lr, n, ref, parts, srv, batches = two_tier_start(p)
    feats = {c: parts[c](batches[c][0]).detach() for c in (0, 1)}
    bs = p.cfg.train.batch_size
    cut_of = torch.tensor([1] * bs + [2] * bs)
    x_row = torch.cat([torch.arange(bs), torch.arange(bs)])
    w_all = torch.tensor([float(n[0])] * bs + [float(n[1])] * bs)
    y_all = torch.cat([batches[0][1], batches[1][1]])
    perm = torch.randperm(2 * bs, generator=torch.Generator().manual_seed(p.cfg.seed * 100003))
    for i in range(0, 2 * bs, bs):
        idx = perm[i:i + bs]
        total = 0.0
        for c, cut in ((0, 1), (1, 2)):
            sel = idx[cut_of[idx] == cut]
            out = srv[cut - 1:](feats[c][x_row[sel]])
            total = total + (w_all[sel] * F.cross_entropy(out, y_all[sel], reduction="none")).sum()
        descend(srv.parameters(), total / w_all[idx].sum(), lr)
    for c, part in parts.items():  # each client's gradient from the updated server, frozen; its own step
        x, y = batches[c]
        descend(part.parameters(), F.cross_entropy(srv[len(part) - 1:](part(x)), y), lr)
    want = by_block(n, parts[0], parts[1], srv)
    check(client, want, client)
    check(server, want, server)


def test_sweep_presets_over_tiers_and_budgets_and_compare_shows_the_tiers(tmp_path):
    """The ``tiers`` preset: two tiers over every pair of cuts, a quarter to three quarters of the clients deep;
    ``cut_budget``: one budget per cut; every trial valid before any starts. A tiered run's cut column in
    ``raysplit compare`` names its tiers."""
    import yaml

    from raysplit.comparison import runs_table
    from raysplit.tuning import load_sweep, space_spec, validate_trials

    def sweep(presets):
        path = tmp_path / "sweep.yaml"
        path.write_text(yaml.safe_dump({"base": str(golden.ROOT / "configs" / "digits.yaml"),
                                        "overrides": {"train.rounds": 1}, "presets": presets,
                                        "storage_path": str(tmp_path / "tune")}))
        spec, raw, cfg0 = load_sweep(str(path))
        return raw, space_spec(spec, cfg0)

    raw, space = sweep(["tiers"])
    assert space["model.cut"] == {"grid": [None]} and len(space["model.tiers"]["grid"]) == 9  # 3 pairs x 3 shares
    assert space["model.tiers"]["grid"][0] == [{"cut": "conv1", "share": 0.75}, {"cut": "conv2", "share": 0.25}]
    assert validate_trials(raw, space) == 9
    raw, space = sweep([{"tiers": [[{"cut": "conv1", "share": 0.5}, {"cut": "fc1", "share": 0.5}]]}])
    assert validate_trials(raw, space) == 1
    raw, space = sweep(["cut_budget"])
    budgets = [b["seconds"] for b in space["model.cut_budget"]["grid"]]
    assert len(budgets) == 3 and budgets == sorted(budgets) and validate_trials(raw, space) == 3
    raw, space = sweep([{"cut_budget": [0.01, 0.02]}])
    assert space["model.cut_budget"]["grid"] == [{"seconds": 0.01}, {"seconds": 0.02}]
    uri = f"sqlite:///{tmp_path}/c.db"
    cfg = make_config(tmp_path, uri, **{"runtime.backend": "local", "train.rounds": 1, "model.cut": None,
                                        "tracking.experiment": "tiers-compare",
                                        "model.tiers": [{"cut": "conv1", "share": 0.5}, {"cut": "conv2", "share": 0.5}]})
    experiment.run_experiment(cfg)
    [row] = runs_table("tiers-compare", uri)
    assert row["cut"] == "conv1:2,conv2:2"


def test_two_tiers_u_shaped_sflv2_equal_a_hand_reference(tmp_path):
    """U-shaped (model.tail_cut fc1: the clients keep fc2 and the loss), two tiers of heads: client 0 blocks[:1],
    client 1 blocks[:2], the server's middle blocks 1-2 entered at each client's cut. Heads and the middle's overlap
    aggregate by block, the tails (every client's) by samples."""
    client, server, p, stats = run_rounds(tiny(tmp_path, "sflv2", **{"algorithm.order": "fixed", "model.tail_cut": "fc1"}))
    lr, n, ref, _, _, batches = two_tier_start(p)
    b = ref.blocks
    head0, tail0 = copy.deepcopy(b[0]), copy.deepcopy(b[3])
    head1, tail1 = copy.deepcopy(b[:2]), copy.deepcopy(b[3])
    sgd_step([head0, b[1], b[2], tail0], *batches[0], lr)  # the middle (b[1], b[2]) trained in place
    sgd_step([head1[0], head1[1], b[2], tail1], *batches[1], lr)
    w0, w1 = n[0] / sum(n), n[1] / sum(n)
    avg = lambda u, v: {k: w0 * x + w1 * v.state_dict()[k] for k, x in u.state_dict().items()}  # noqa: E731
    want = {**{f"head.0.{k}": v for k, v in avg(head0, head1[0]).items()},
            **{f"head.1.{k}": v for k, v in avg(b[1], head1[1]).items()},
            **{f"tail.3.{k}": v for k, v in avg(tail0, tail1).items()}}
    check(client, want, client)
    middle = {**{f"1.{k}": want[f"head.1.{k}"] for k in b[1].state_dict()},
              **{f"2.{k}": v for k, v in b[2].state_dict().items()}}
    check(server, middle, server)
    assert sorted(server) == sorted(middle)
    rows = stats[0].clients  # the middle's output and the tail's gradient: one shape for every tier
    assert rows[0]["bytes_down_middle"] == rows[1]["bytes_down_middle"] > 0


def test_tiered_sflv1_prox_at_mu_zero_is_tiered_sflv1_and_pulls_each_clients_own_blocks(tmp_path):
    """FedProx's term on each client's own blocks: mu = 0 is tiered SFLV1 bit for bit; mu > 0 changes the clients'
    parts, not whether the run holds."""
    want = run_rounds(tiny(tmp_path / "v1", "sflv1"))
    got = run_rounds(tiny(tmp_path / "p0", "sflv1_prox", **{"algorithm.mu": 0.0}))
    for g, w in ((got[0], want[0]), (got[1], want[1])):
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)
    two = {"train.local_steps": 2}  # the term is zero at a round's first step (w = w_t)
    pulled = run_rounds(tiny(tmp_path / "p1", "sflv1_prox", **{"algorithm.mu": 10.0, **two}))[0]
    plain = run_rounds(tiny(tmp_path / "v2", "sflv1", **two))[0]
    assert all(not torch.equal(pulled[k], plain[k]) for k in ("0.0.weight", "1.0.weight"))


def test_a_tiered_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_one(tmp_path):
    """A driver killed after round 1 of a tiered SFLV1 run: resumed from its checkpoint (each client's own blocks,
    the server's from the shallowest cut), it ends with the uninterrupted run's numbers."""
    from helpers import crashed_run

    uri = f"sqlite:///{tmp_path}/r.db"
    over = {"runtime.backend": "local", "algorithm.name": "sflv1", "train.rounds": 3, "model.cut": None,
            "tracking.checkpoint_every": 1, "tracking.experiment": "tiers-resume",
            "model.tiers": [{"cut": "conv1", "share": 0.5}, {"cut": "conv2", "share": 0.5}]}
    full = experiment.run_experiment(make_config(tmp_path / "a", uri, **over))
    run = crashed_run(make_config(tmp_path / "b", uri, **over), uri, at_round=1)
    resumed = experiment.run_experiment(make_config(tmp_path / "b", uri, **over), resume_run_id=run.info.run_id)
    for key in ("eval/accuracy", "train/loss", "time/sim", "comm/tier0/bytes_up", "eval/tier1/accuracy"):
        if key in full:
            assert resumed[key] == full[key], key
    assert "comm/tier0/bytes_up" in full


def test_tiered_pipar_trains_as_tiered_sflv1_on_a_pipelined_clock_per_client(tmp_path):
    """PiPar's updates are SplitFed V1's (by block here), its clock pipelined from each client's own stage times:
    one micro-batch is tiered SFLV1 bit for bit, four shorten every client's round."""
    want = run_rounds(tiny(tmp_path / "v1", "sflv1"))
    one = run_rounds(tiny(tmp_path / "m1", "pipar", **{"algorithm.micro_batches": 1}))
    four = run_rounds(tiny(tmp_path / "m4", "pipar", **{"algorithm.micro_batches": 4}))
    for got in (one, four):
        for g, w in ((got[0], want[0]), (got[1], want[1])):
            assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)
    for c in (0, 1):
        assert one[3][0].clients[c]["t_end"] == want[3][0].clients[c]["t_end"]
        assert four[3][0].clients[c]["t_end"] < want[3][0].clients[c]["t_end"]


def test_the_budget_rule_leaves_the_model_and_the_random_stream_as_they_were():
    """Counting the cuts' FLOPs runs a copy: BatchNorm's statistics and the global random state are untouched, so a
    budget that gives every client one cut is today's run at that cut."""
    torch.manual_seed(0)
    model = build_model("resnet9", 10, (3, 32, 32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    cut_flops(model, [1, 3], 4)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
