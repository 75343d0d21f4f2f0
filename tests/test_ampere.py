"""Ampere and its baselines: the auxiliary-net generator on every zoo model and cut, the store and its loader,
device training without gradients, the analytic byte count, PiPar/SplitGP/SCAFFOLD reducing to SplitFed where
they must, bad input, and every new algorithm through Ray with MLflow."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from helpers import make_config, run_rounds
from raysplit.data.store import ActivationStore, IncompleteStore, ShuffledLoader
from raysplit.errors import ConfigError
from raysplit.experiment import prepare, run_experiment
from raysplit.models import MODELS, build_model
from raysplit.models.auxiliary import UnsupportedLayer, auxiliary_net, first_layer


def amp_cfg(tmp_path, mlflow_uri, root, **over):
    base = {"algorithm": {"name": "ampere", "device_rounds": 2, "server_epochs": 2, "patience": 5,
                          "server_batch_size": 16, "chunk_rows": 20, "cache_mb": 1.0,
                          "store_path": str(tmp_path / "store")},
            "data.dataset": "fashion_mnist", "data.root": str(root), "data.options": {"search_system": False},
            "data.num_clients": 4, "data.partition.name": "iid", "data.test_fraction": 0.2,
            "model.name": "cnn_small", "model.cut": "conv1", "train.rounds": 6, "train.batch_size": 16,
            "train.local_steps": 3, "train.participation.count": 4, "runtime.backend": "local",
            "tracking.experiment": "ampere", "eval.every": 1}
    base.update(over)
    return make_config(tmp_path, mlflow_uri, **base)


def _out_dim(t: torch.Tensor) -> int:
    return t.shape[-1] if t.dim() == 3 else t.shape[1]  # tokens: width; maps: channels; vectors: features


@pytest.mark.parametrize("name", sorted(MODELS))
def test_auxiliary_net_scales_the_server_blocks_first_layer_for_every_cut(name):
    """For every zoo model and cut: the auxiliary net runs on the device block's output, and its first layer's
    output is ``ratio`` x as wide as the server block's first layer's (measured by running both)."""
    info = MODELS[name]
    shape = tuple(info.default_input_shape)
    model = build_model(name, 10, shape).eval()
    x = torch.zeros(2, *shape, dtype=torch.long) if info.input_kind == "tokens" else torch.zeros(2, *shape)
    outputs = [x]  # the device block's output at every cut, from one pass through the blocks
    with torch.no_grad():
        for block in model.blocks:
            outputs.append(block(outputs[-1]))
    for cut in sorted(set(model.cut_points().values())):
        if cut >= len(model.blocks):
            continue
        _, server = model.split(cut)
        a = outputs[cut]
        with torch.no_grad():
            prefix, layer = first_layer(server)
            if hasattr(layer, "body"):  # a residual block with an equal-width skip: its first conv block
                layer = first_layer(layer.body)[1]
            original = torch.nn.Sequential(*prefix, layer).eval()(a)
        for ratio in (0.5, 0.25):
            aux = auxiliary_net(server, tuple(a.shape[1:]), 10, ratio).eval()
            with torch.no_grad():
                assert aux(a).shape == (2, 10), (name, cut)
                replica = aux[0](a)
            if isinstance(layer, torch.nn.LayerNorm):  # a head-only server block: nothing to scale
                assert _out_dim(replica) == _out_dim(original)
                continue
            assert _out_dim(replica) == max(1, round(_out_dim(original) * ratio)), (name, cut, ratio)


def test_unknown_first_layer_names_its_type_and_the_known_ones():
    with pytest.raises(UnsupportedLayer, match="GRU.*knows: Conv2d, .*EncoderBlock"):
        auxiliary_net(torch.nn.Sequential(torch.nn.GRU(4, 4)), (3, 4), 10)
    with pytest.raises(ValueError, match="ratio"):
        auxiliary_net(torch.nn.Sequential(torch.nn.Linear(4, 4)), (4,), 10, ratio=1.5)


# ---- the store -----------------------------------------------------------------------------------------------------
def _fill(path, sizes, dim=6):
    store, start = ActivationStore(path), 0
    for k, n in enumerate(sizes):
        ids = np.arange(start, start + n)
        store.append(np.repeat(ids[:, None], dim, axis=1).astype(np.float32), ids % 10, k % 3)
        start += n
    return store, start


def test_store_gives_every_row_once_per_epoch_in_a_seeded_order_within_its_cache(tmp_path):
    store, rows = _fill(tmp_path / "s", [30 + k for k in range(12)])
    with pytest.raises(IncompleteStore, match="not sealed"):
        ActivationStore.open(tmp_path / "s")  # a writer that stopped before sealing leaves an unreadable store
    store.seal()
    store = ActivationStore.open(tmp_path / "s")
    total = sum(s["nbytes"] for s in store.shards)
    cache = total // 4
    loader = ShuffledLoader(store, 16, cache, seed=3)
    orders = []
    for e in range(2):
        batches = list(loader.epoch(e))
        ids = np.concatenate([x[:, 0] for x, _ in batches]).astype(int)
        assert sorted(ids.tolist()) == list(range(rows))  # exactly once
        assert all(len(b[1]) == 16 for b in batches[:-1])
        assert all((y == x[:, 0].astype(int) % 10).all() for x, y in batches)  # labels stay with their rows
        orders.append(ids)
    assert not np.array_equal(orders[0], orders[1])
    again = np.concatenate([x[:, 0] for x, _ in ShuffledLoader(store, 16, cache, seed=3).epoch(1)]).astype(int)
    assert np.array_equal(again, orders[1])  # seed-determined
    assert loader.peak_bytes <= cache < total


def test_training_on_the_store_equals_training_on_the_activations_in_memory(tmp_path):
    """One device, the loader's batches against the same rows taken from memory: the same server weights."""
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(200, 8)).astype(np.float32)
    labels = rng.integers(0, 4, 200)
    store = ActivationStore(tmp_path / "s")
    for k in range(0, 200, 37):
        ids = np.arange(k, min(k + 37, 200), dtype=np.float32)[:, None]
        store.append(np.concatenate([feats[k:k + 37], ids], 1), labels[k:k + 37], 0)
    store.seal()

    def train(batches):
        torch.manual_seed(0)
        net = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(net(torch.as_tensor(x)), torch.as_tensor(y)).backward()
            opt.step()
        return net.weight.detach()

    loaded = list(ShuffledLoader(store, 16, 4000, seed=1).epoch(0))
    for x, y in loaded:  # the rows come back bit for bit, labels with them
        ids = x[:, 8].astype(int)
        assert np.array_equal(x[:, :8], feats[ids]) and np.array_equal(y, labels[ids])
    from_store = train((np.ascontiguousarray(x[:, :8]), y) for x, y in loaded)
    in_memory = train((feats[x[:, 8].astype(int)], labels[x[:, 8].astype(int)]) for x, _ in loaded)
    assert torch.equal(from_store, in_memory)


# ---- Ampere ---------------------------------------------------------------------------------------------------------
def test_ampere_device_phase_sends_no_gradient_and_the_bytes_match_the_analytic_count(tmp_path, mlflow_uri,
                                                                                      fmnist_root):
    hist = []
    cfg = amp_cfg(tmp_path, mlflow_uri, fmnist_root)
    final = run_experiment(cfg, on_round=lambda r, m: hist.append(m))
    assert [m["method/server_epochs"] for m in hist] == [0, 0, 1, 2]  # 2 device rounds, then 2 server epochs
    assert all(m["comm/bytes_down_gradients"] == 0 for m in hist)  # no gradient ever goes down
    assert sum(m["comm/bytes_up_activations"] for m in hist) == sum(m["comm/bytes_up_activations"] for m in hist[1:2])
    p = prepare(cfg)
    model_bytes = sum(v.nbytes for v in p.inputs.client_init.values())  # device block + auxiliary net
    rows = sum(len(i) for i in p.inputs.train_idx) + sum(len(i) for i in p.inputs.test_idx)
    row_bytes = p.algorithm.activation_row_bytes  # 16x14x14 float32 features + an int64 label
    assert row_bytes == 16 * 14 * 14 * 4 + 8
    devices = 4
    want_up = 2 * devices * model_bytes + rows * row_bytes  # two rounds of uploads, one activation set
    want_down = 2 * devices * model_bytes + devices * model_bytes  # two rounds of downloads, the final block
    assert sum(m["comm/bytes_up"] for m in hist) == want_up
    assert sum(m["comm/bytes_down"] for m in hist) == want_down
    assert hist[-1]["eval/accuracy"] > 0.3 and final["method/cache_peak_mb"] <= 1.0 < rows * row_bytes / 2**20


def test_ampere_stops_each_phase_on_patience(tmp_path, mlflow_uri, fmnist_root):
    hist = []
    cfg = amp_cfg(tmp_path, mlflow_uri, fmnist_root, **{"algorithm": {
        "name": "ampere", "device_rounds": 50, "server_epochs": 50, "patience": 1, "server_batch_size": 16,
        "store_path": str(tmp_path / "st")}, "train.rounds": 100, "train.optimizer.lr": 1e-9})
    run_experiment(cfg, on_round=lambda r, m: hist.append(m))
    # lr ~ 0: validation accuracy never improves after the first round of a phase, so each phase lasts 2
    assert [m["method/server_epochs"] for m in hist] == [0, 0, 1, 2]
    assert (tmp_path / "st" / "train" / "manifest.json").is_file()  # a store the user named is kept


def test_a_temporary_store_is_removed_after_the_run(tmp_path, mlflow_uri, fmnist_root, monkeypatch):
    temp = tmp_path / "system-temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    seen = []
    cfg = amp_cfg(tmp_path, mlflow_uri, fmnist_root, **{"algorithm.store_path": None})
    run_experiment(cfg, on_round=lambda r, m: seen.extend(p.name for p in temp.glob("raysplit-ampere-*/train")))
    assert seen  # the store lived in the system temp folder during the run
    assert list(temp.iterdir()) == []  # and is gone after it


def test_ampere_no_consolidation_ablation_trains_per_device_blocks(tmp_path, mlflow_uri, fmnist_root):
    a = run_experiment(amp_cfg(tmp_path / "a", mlflow_uri, fmnist_root))
    b = run_experiment(amp_cfg(tmp_path / "b", mlflow_uri, fmnist_root, **{"algorithm.consolidate": False}))
    assert a["eval/accuracy"] != b["eval/accuracy"] and b["method/server_epochs"] == 2


@pytest.mark.parametrize("over,match", [
    ({"algorithm.ratio": 0}, "algorithm.ratio"),
    ({"algorithm.ratio": 1.5}, "algorithm.ratio"),
    ({"algorithm.patience": 0}, "algorithm.patience"),
    ({"data.test_fraction": 0.0}, "data.test_fraction > 0"),
    ({"algorithm.cache_mb": 0.1}, "algorithm.cache_mb=0.1 is too small"),
    ({"algorithm.store_path": "/proc/raysplit-store"}, "algorithm.store_path /proc/raysplit-store is not writable"),
])
def test_bad_ampere_input_names_the_key(tmp_path, mlflow_uri, fmnist_root, over, match):
    with pytest.raises(ConfigError, match=match):
        run_experiment(amp_cfg(tmp_path, mlflow_uri, fmnist_root, **over))


# ---- the baselines reduce to SplitFed where they must ----------------------------------------------------------------
def _states(cfg):
    client, server, _, stats = run_rounds(cfg)
    return client, server, stats


def _base(tmp_path, mlflow_uri, root, alg):
    return amp_cfg(tmp_path, mlflow_uri, root, **{"algorithm": alg, "train.rounds": 2, "data.num_clients": 3,
                                                  "train.participation.count": 3})


def test_pipar_makes_splitfeds_updates_in_less_time(tmp_path, mlflow_uri, fmnist_root):
    c0, s0, st0 = _states(_base(tmp_path, mlflow_uri, fmnist_root, {"name": "sflv1"}))
    c1, s1, st1 = _states(_base(tmp_path, mlflow_uri, fmnist_root, {"name": "pipar", "micro_batches": 1}))
    c4, s4, st4 = _states(_base(tmp_path, mlflow_uri, fmnist_root, {"name": "pipar", "micro_batches": 4}))
    for got in ((c1, s1), (c4, s4)):
        for ref, other in zip((c0, s0), got):
            assert all(torch.equal(ref[k], other[k]) for k in ref)  # the same updates
    assert [s.t_end for s in st1] == pytest.approx([s.t_end for s in st0], rel=1e-12)  # m = 1: SplitFed's clock
    assert all(a.t_end < b.t_end for a, b in zip(st4, st0))  # pipelined: less simulated time


def test_splitgp_without_local_loss_is_splitfed(tmp_path, mlflow_uri, fmnist_root):
    c0, s0, _ = _states(_base(tmp_path, mlflow_uri, fmnist_root, {"name": "sflv1"}))
    c1, s1, _ = _states(_base(tmp_path, mlflow_uri, fmnist_root, {"name": "splitgp", "lambda_local": 0.0}))
    for k in s0:
        torch.testing.assert_close(s1[k], s0[k])
    for k in c0:  # SplitGP's client model is (device block, local head): compare the device block
        torch.testing.assert_close(c1[f"0.{k}"], c0[k])
    c2, _, _ = _states(_base(tmp_path, mlflow_uri, fmnist_root, {"name": "splitgp", "lambda_local": 0.5}))
    assert any(not torch.allclose(c2[f"0.{k}"], c0[k]) for k in c0)


def test_scaffold_with_one_client_is_splitfed(tmp_path, mlflow_uri, fmnist_root):
    """With one client c = c_1 after every round, so the correction g - c_1 + c vanishes; with several it does
    not (plain SGD, as SCAFFOLD assumes)."""
    over = {"data.num_clients": 1, "train.participation.count": 1, "train.rounds": 3, "train.optimizer.momentum": 0}
    c0, s0, _ = _states(amp_cfg(tmp_path, mlflow_uri, fmnist_root, **{"algorithm": {"name": "sflv1"}, **over}))
    for alg in ({"name": "sflv1_scaffold"}, {"name": "sflv1_scaffold", "server_controls": True}):
        c1, s1, _ = _states(amp_cfg(tmp_path, mlflow_uri, fmnist_root, **{"algorithm": alg, **over}))
        for a, b in ((c0, c1), (s0, s1)):
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    over["data.num_clients"] = over["train.participation.count"] = 3
    c0, _, _ = _states(amp_cfg(tmp_path, mlflow_uri, fmnist_root, **{"algorithm": {"name": "sflv1"}, **over}))
    c1, _, _ = _states(amp_cfg(tmp_path, mlflow_uri, fmnist_root, **{"algorithm": {"name": "sflv1_scaffold"}, **over}))
    assert any(not torch.allclose(c0[k], c1[k]) for k in c0)


def _scaffold_digits(tmp_path, mlflow_uri, name, **over):
    """Digits over 4 clients of 2 label shards each (each client sees about 2 of the 10 labels), cut after fc1 so
    the device block is most of the model, plain SGD at a constant rate, 10 local steps a round."""
    base = {"algorithm.name": name, "runtime.backend": "local", "runtime.num_workers": 2, "data.num_clients": 4,
            "data.partition": {"name": "shards", "per_client": 2}, "model.cut": "fc1", "train.local_steps": 10,
            "train.optimizer.lr": 0.05, "train.optimizer.momentum": 0, "train.participation.count": 4}
    return make_config(tmp_path, mlflow_uri, **{**base, **over})


def test_scaffold_control_variates_follow_option_ii(tmp_path, mlflow_uri, monkeypatch):
    """SCAFFOLD's algebra, round by round: a client steps with g - c_i + c, then option II sets
    c_i <- c_i - c + (x - y_i) / (K lr), which with plain SGD at a constant rate is exactly the mean of the K raw
    gradients the client computed this round; and the server's c stays the mean of the c_i (every client in
    every round). A correction applied with the wrong sign, to the wrong step, or from a stale start point breaks
    the first; a wrong server update breaks the second."""
    from raysplit.algorithms.sflvariants import ScaffoldRule
    from raysplit.experiment import prepare
    from raysplit.runtime import runtime_for

    raw: dict[int, list] = {}
    correct = ScaffoldRule.before_step

    def spy(self, cid, slot):  # the raw gradients, before SCAFFOLD's correction
        raw.setdefault(cid, []).append([p.grad.detach().clone() for p in slot.module.parameters()])
        correct(self, cid, slot)

    monkeypatch.setattr(ScaffoldRule, "before_step", spy)
    cfg = _scaffold_digits(tmp_path, mlflow_uri, "sflv1_scaffold", **{"train.local_steps": 5, "train.rounds": 3})
    p = prepare(cfg)
    rt = runtime_for(cfg.runtime, p.inputs)
    try:
        driver = p.algorithm.driver(rt, p.algorithm, p.sample_stream, cfg.seed)
        corrected = 0.0
        for r in range(3):
            raw.clear()
            driver.run(r, r + 1, lambda *a: None)
            own = {c: ci for host in rt.backend.workers for c, ci in host.rule.c_own.items()}
            assert sorted(own) == sorted(raw) == [0, 1, 2, 3]
            for c, grads in raw.items():
                assert len(grads) == 5
                for ci, g in zip(own[c], zip(*grads)):
                    torch.testing.assert_close(ci, torch.stack(g).mean(0), rtol=1e-4, atol=1e-6)
            control = rt.backend.server.rule.control
            for i, cis in enumerate(zip(*own.values())):
                torch.testing.assert_close(control[str(i)], torch.stack(cis).mean(0), rtol=1e-5, atol=1e-8)
            if r:
                corrected = max(corrected, max(float((c_ - ci).abs().max()) for host in rt.backend.workers
                                               for cid in host.rule.c_own for c_, ci in
                                               zip(host.rule.c_global, own[cid])))
        assert corrected > 1e-3  # from round 2 on the correction c - c_i is not zero
    finally:
        rt.shutdown()


def test_scaffold_lowers_the_client_drift(tmp_path, mlflow_uri, monkeypatch):
    """SCAFFOLD's purpose: on clients with disjoint labels, the device blocks the clients bring to aggregation
    drift apart far less than SplitFed's (mean squared distance to their mean, rounds 3-5, from the same start and
    batches). Measured: SplitFed 0.16-0.19, SCAFFOLD 0.02-0.03 on 3 seeds; round 1 (no control yet) is equal."""
    from raysplit.runtime.client.host import ClientHost
    from raysplit.runtime.client.transfers import ModelTransfers

    brought: dict[int, dict] = {}  # round -> client -> the device block it brings to aggregation
    partial_sum, begin_round, now = ModelTransfers.partial_sum, ClientHost.begin_round, [-1]

    def spy(self, weights):
        brought.setdefault(now[0], {}).update({int(c): {k: v.clone() for k, v in self.states.state_of(int(c)).items()}
                                               for c in weights if int(c) in self.data})
        return partial_sum(self, weights)

    def begin(self, rnd, *args):
        now[0] = rnd
        return begin_round(self, rnd, *args)

    monkeypatch.setattr(ModelTransfers, "partial_sum", spy)
    monkeypatch.setattr(ClientHost, "begin_round", begin)

    def drift(states):
        keys = next(iter(states.values()))
        return sum(float(((s - s.mean(0)) ** 2).sum()) for s in
                   (torch.stack([st[k].float() for st in states.values()]) for k in keys)) / len(states)

    spread = {}
    for name in ("sflv1", "sflv1_scaffold"):
        brought.clear()
        run_rounds(_scaffold_digits(tmp_path, mlflow_uri, name, **{"train.rounds": 5}))
        assert sorted(brought) == list(range(5)) and all(len(b) == 4 for b in brought.values())
        spread[name] = [drift(brought[r]) for r in range(5)]
    assert spread["sflv1_scaffold"][0] == pytest.approx(spread["sflv1"][0], rel=1e-5)
    assert all(s < 0.4 * f for s, f in zip(spread["sflv1_scaffold"][2:], spread["sflv1"][2:])), spread


def test_scaffold_server_controls_follow_option_ii_on_the_server_copies(tmp_path, mlflow_uri, monkeypatch):
    """``server_controls``: each client's server copy steps with g - c_i + c too, and after the round its server
    c_i is the mean of the raw gradients that copy computed (option II with plain SGD at a constant rate), and the
    server block's c the mean of the c_i, round by round. The cut after conv1 leaves most of the model on the
    server, where the default corrects nothing."""
    from raysplit.algorithms.sflvariants import ScaffoldServer
    from raysplit.experiment import prepare
    from raysplit.runtime import runtime_for

    raw: dict[int, list] = {}
    before_step = ScaffoldServer.before_step

    def spy(self, module, optimizers, tag):  # the raw gradients, before the correction
        if tag.client in self.ctx.models and module is self.ctx.models[tag.client].module:
            raw.setdefault(tag.client, []).append([p.grad.detach().clone() for p in module.parameters()])
        return before_step(self, module, optimizers, tag)

    monkeypatch.setattr(ScaffoldServer, "before_step", spy)
    cfg = _scaffold_digits(tmp_path, mlflow_uri, "sflv1_scaffold", **{
        "algorithm.server_controls": True, "model.cut": "conv1", "train.local_steps": 5, "train.rounds": 3})
    p = prepare(cfg)
    rt = runtime_for(cfg.runtime, p.inputs)
    try:
        driver = p.algorithm.driver(rt, p.algorithm, p.sample_stream, cfg.seed)
        server = rt.backend.server.rule
        for r in range(3):
            raw.clear()
            before = [t.clone() for t in server.server_control] if server.server_control else None
            driver.run(r, r + 1, lambda *a: None)
            assert sorted(raw) == sorted(server.server_own) == [0, 1, 2, 3]
            for c, grads in raw.items():
                assert len(grads) == 5
                for ci, g in zip(server.server_own[c], zip(*grads)):
                    torch.testing.assert_close(ci, torch.stack(g).mean(0), rtol=1e-4, atol=1e-6)
            for i, cis in enumerate(zip(*server.server_own.values())):
                torch.testing.assert_close(server.server_control[i], torch.stack(cis).mean(0), rtol=1e-5, atol=1e-7)
            if before is not None:  # the round's steps were corrected with the c_i of the round before
                assert max(float((a - b).abs().max()) for a, b in zip(before, server.server_control)) > 1e-4
    finally:
        rt.shutdown()


def test_scaffold_server_controls_lower_the_server_copies_drift(tmp_path, mlflow_uri, monkeypatch):
    """With ``server_controls`` the server copies the clients bring to the merge drift apart far less than without
    (the device blocks' correction alone leaves them as SplitFed's), from the same start and batches. Measured
    (digits, 4 clients of 2 label shards, cut conv1, rounds 3-5, seeds 0-2): 0.30-0.32 without, 0.08-0.12 with,
    a ratio of 0.26-0.38."""
    from raysplit.algorithms.sflvariants import ScaffoldServer

    brought: dict[int, list] = {}
    before_merge = ScaffoldServer.before_merge

    def spy(self, weights):
        brought[len(brought)] = [{k: v.clone() for k, v in self.ctx.models[c].module.state_dict().items()}
                                 for c in weights]
        return before_merge(self, weights)

    monkeypatch.setattr(ScaffoldServer, "before_merge", spy)

    def drift(states):
        return sum(float(((s - s.mean(0)) ** 2).sum()) for s in
                   (torch.stack([st[k].float() for st in states]) for k in states[0])) / len(states)

    spread = {}
    for on in (False, True):
        brought.clear()
        run_rounds(_scaffold_digits(tmp_path, mlflow_uri, "sflv1_scaffold", **{
            "algorithm.server_controls": on, "model.cut": "conv1", "train.rounds": 5}))
        assert sorted(brought) == list(range(5)) and all(len(b) == 4 for b in brought.values())
        spread[on] = [drift(brought[r]) for r in range(5)]
    assert spread[True][0] == pytest.approx(spread[False][0], rel=1e-5)
    assert all(s < 0.5 * f for s, f in zip(spread[True][2:], spread[False][2:])), spread


@pytest.mark.parametrize("algorithm", ["ampere", "pipar", "splitgp", "sflv1_scaffold"])
def test_ampere_family_with_mlflow(tmp_path, mlflow_uri, fmnist_root, algorithm):
    """Local backend (tests/test_golden.py holds the Ray backend to the same numbers)."""
    alg = {"name": algorithm} if algorithm != "ampere" else None
    over = {"runtime.backend": "local", "tracking.experiment": "ampere-family"}
    if alg:
        over["algorithm"] = alg
    final = run_experiment(amp_cfg(tmp_path, mlflow_uri, fmnist_root, **over))
    client = MlflowClient(mlflow_uri)
    run = client.get_run(final["run_id"])
    assert run.info.status == "FINISHED"
    assert any(h.value > 0 for h in client.get_metric_history(final["run_id"], "compute/client_flops"))
    arts = {a.path for a in client.list_artifacts(final["run_id"])}
    assert "client_accounting.csv" in arts
    if algorithm == "ampere":
        assert run.data.metrics["method/server_epochs"] == 2


def test_the_server_phase_ends_with_its_best_validated_block(tmp_path, mlflow_uri, fmnist_root):
    """restore_best: the last round's test accuracy is the one of the server epoch with the best validation
    accuracy, as logged by the same run without the restore (identical up to that point)."""
    if not Path("/usr/share/datasets/fashion-mnist").is_dir():
        pytest.skip("needs the dataset-fashion-mnist package")
    # server epochs at lr 0.3 go up and down; where they go down first depends on the CPU's float rounding (the
    # sixth of six on an AVX2 machine, the second on an AVX-512 one), so the restored run stops at the first
    # epoch that is worse than an earlier one: its best epoch is then never its last, and the restore shows
    alg = {"name": "ampere", "device_rounds": 2, "server_epochs": 6, "patience": 5, "server_batch_size": 16,
           "chunk_rows": 64, "cache_mb": 4.0}
    over = {"data.root": None, "data.options": {}, "data.max_train_samples": 800, "data.max_test_samples": 1000,
            "train.optimizer.lr": 0.3}

    def run(restore: bool, epochs: int) -> list[dict]:
        cfg = amp_cfg(tmp_path / str(restore), mlflow_uri, fmnist_root, **over,
                      **{"algorithm": {**alg, "server_epochs": epochs, "restore_best": restore,
                                       "store_path": str(tmp_path / f"s{restore}")}, "train.rounds": 2 + epochs})
        hist = []
        run_experiment(cfg, on_round=lambda r, m: hist.append(m))
        return hist

    last = run(False, 6)
    server = [m for m in last if m.get("method/server_epochs", 0) > 0 and "method/server_val_accuracy" in m]
    assert len(last) == 8 and len(server) == 6
    val = [m["method/server_val_accuracy"] for m in server]
    drop = next((i for i in range(1, len(val)) if val[i] < max(val[:i])), None)
    assert drop is not None, f"validation accuracy never fell in six epochs: {val}"
    best = run(True, drop + 1)
    assert len(best) == drop + 3
    top = max(server[:drop + 1], key=lambda m: m["method/server_val_accuracy"])  # the first epoch reaching the best
    assert top is not server[drop]
    assert best[-1]["eval/accuracy"] == pytest.approx(top["eval/accuracy"])
    assert [m["eval/accuracy"] for m in best[:-1]] == pytest.approx([m["eval/accuracy"] for m in last[:len(best) - 1]])
