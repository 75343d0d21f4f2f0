"""GAS and its baselines: statistics merges by hand, generation tops labels up exactly, logit adjustment equals
the client's label frequencies, GAS without generation equals MiniBatch-SFL, the asynchronous FL rules by hand,
S2FL's grouping, bad input, and every new algorithm through Ray with its MLflow run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from helpers import make_config
from raysplit.errors import ConfigError
from raysplit.experiment import prepare, run_experiment
from raysplit.gaussian import LabelGaussian
from raysplit.runtime import Runtime, StateMsg, make_backend, transport
from raysplit.runtime.messages import Activation, Tag


def gas_cfg(tmp_path, mlflow_uri, **over):
    base = {"algorithm": {"name": "gas"}, "data.num_clients": 6, "train.participation.count": 3,
            "train.local_steps": 4, "train.rounds": 2, "clock.profile": "uniform", "runtime.backend": "local",
            "tracking.experiment": "gas", "data.partition.name": "shards", "data.partition.per_client": 2,
            "data.test_fraction": 0.0}
    base.update(over)
    return make_config(tmp_path, mlflow_uri, **base)


# ---- statistics -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["full", "diagonal", "lowrank"])
def test_merged_statistics_equal_those_of_all_data_seen(kind):
    rng = np.random.default_rng(0)
    dim = 9
    bufs = [(rng.normal(size=(n, dim)) @ rng.normal(size=(dim, dim)) + 2.0, rng.uniform(1, 5, n))
            for n in (6, 4, 8, 5, 7)]
    g = LabelGaussian(dim, kind, rank=dim, fold_columns=7)  # folds in the middle of the merges
    for a, w in bufs:
        g.merge(a, w)
    a = np.concatenate([b[0] for b in bufs])
    w = np.concatenate([b[1] for b in bufs])
    mu = (w[:, None] * a).sum(0) / w.sum()
    cov = ((a - mu) * w[:, None]).T @ (a - mu) / w.sum()
    np.testing.assert_allclose(g.mean, mu, rtol=1e-10)
    want = np.diag(np.diag(cov)) if kind == "diagonal" else cov
    np.testing.assert_allclose(g.scatter(), want, atol=1e-4 * np.abs(cov).max())  # R is float32
    assert g.weight == pytest.approx(w.sum())
    # the code's eps I per merge after the first: c = d c + eps, with d = W_old / W
    c, wsum = 0.0, bufs[0][1].sum()
    for _, wb in bufs[1:]:
        c = wsum / (wsum + wb.sum()) * c + 1e-5
        wsum += wb.sum()
    assert g.jitter == pytest.approx(c)
    x = g.sample(200_000, np.random.default_rng(1))
    np.testing.assert_allclose(np.cov(x.T), g.covariance(), atol=0.03 * np.abs(cov).max())


def test_unknown_covariance_kind_is_refused():
    with pytest.raises(ValueError, match="unknown covariance kind"):
        LabelGaussian(4, "sparse")


# ---- the GAS server ---------------------------------------------------------------------------------------------
def _gas_server(tmp_path, mlflow_uri, **over):
    cfg = gas_cfg(tmp_path, mlflow_uri, **over)
    p = prepare(cfg)
    rt = Runtime(make_backend(cfg.runtime), p.inputs)
    return cfg, p, rt, rt.backend.server


def _activation(server, client, labels, rng):
    """A client's batch as the server's rule gets it (decoded by the host)."""
    x = rng.normal(size=(len(labels), *server.rule.act_shape)).astype(np.float32)
    return server.decode(Activation(Tag(client, 0, 0), x, np.asarray(labels, dtype=np.int64), 0.0))


def test_generation_tops_every_label_up_exactly(tmp_path, mlflow_uri):
    cfg, p, rt, server = _gas_server(tmp_path, mlflow_uri, **{"algorithm": {"name": "gas", "min_per_label": 5,
                                                                             "buffer_size": 2}})
    rng = np.random.default_rng(0)
    seen = []
    orig = server.trainer.step

    def spy(x, y, *a, **k):
        seen.append(y.clone())
        return orig(x, y, *a, **k)

    server.trainer.step = spy
    for c in range(3):
        server.rule.on_job_start(c, None)
    server.begin_round(0, 0.0)
    # first flushes give every label statistics (no generation until all labels have them)
    for labels in ([0, 1, 2, 3, 4] * 2, [5, 6, 7, 8, 9] * 2):
        server.rule.on_arrival(_activation(server, 0, labels, rng))
    assert server.rule.should_flush()
    server.rule.flush()
    assert all(st.merges for st in server.rule.stats)
    assert np.bincount(seen[-1].numpy(), minlength=10).tolist() == [5] * 10  # 2 real + 3 generated per label
    seen.clear()
    before = server.rule.generated
    # now a skewed buffer: label 0 x7, label 1 x3, nothing else
    server.rule.on_arrival(_activation(server, 1, [0] * 7, rng))
    server.rule.on_arrival(_activation(server, 2, [1] * 3, rng))
    server.rule.flush()
    counts = np.bincount(seen[-1].numpy(), minlength=10)
    assert counts.tolist() == [7, 5] + [5] * 8  # label 0 keeps its 7 real ones, every other label is topped to 5
    assert server.rule.generated - before == 2 + 8 * 5
    rt.shutdown()


def test_gradient_dissimilarity_is_zero_on_the_test_batches_themselves(tmp_path, mlflow_uri):
    """With an evaluation batch at least the test set, every reference batch is the whole test set: the
    dissimilarity of the server gradient on the test set's own activations (through the global client model) is
    zero, and with the labels permuted it is not. A global round logs it."""
    cfg, p, rt, server = _gas_server(tmp_path, mlflow_uri, **{
        "algorithm": {"name": "gas", "dissimilarity_batches": 3, "buffer_size": 1, "model_buffer_size": 1},
        "eval.batch_size": 100_000})
    from raysplit.data import to_tensor
    from raysplit.runtime.server.events import Job

    server.begin_round(0, 0.0)
    server.rule.on_job_start(0, Job(0, 0, 0, 0.0))
    server.rule.on_arrival(_activation(server, 0, list(range(10)), np.random.default_rng(0)))
    server.rule.flush()
    model = server.global_model.current()
    assert server.rule.on_model_upload(0, model, Job(0, 0, 0, 0.0))  # model buffer of 1: a global round
    assert server.round_metrics()["grad_dissimilarity"] > 0  # the buffer was random activations
    model = server.global_model.current()
    client = server.evaluation.client
    client.load_state_dict(transport.unpack_state(model.state))
    with torch.no_grad():
        x = client.eval()(to_tensor(np.asarray(server.evaluation.x), server.plan.model.inputs))
    y = torch.as_tensor(np.asarray(server.evaluation.y), dtype=torch.long)
    assert server.rule.gradient_dissimilarity(model, x, y) < 1e-10
    shuffled = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))]
    assert server.rule.gradient_dissimilarity(model, x, shuffled) > 1e-6
    rt.shutdown()
    final = run_experiment(gas_cfg(tmp_path, mlflow_uri, **{
        "algorithm": {"name": "gas", "dissimilarity_batches": 2}, "tracking.experiment": "gas-v"}))
    hist = MlflowClient(mlflow_uri).get_metric_history(final["run_id"], "method/grad_dissimilarity")
    assert [h.step for h in hist] == [0, 1] and all(h.value > 0 for h in hist)


def test_logit_adjustment_is_the_clients_label_frequencies(tmp_path, mlflow_uri):
    cfg, p, rt, server = _gas_server(tmp_path, mlflow_uri, **{"algorithm": {"name": "gas", "tau": 1.0}})
    pi = p.partition_counts / p.partition_counts.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(np.exp(server.rule.adjustment.numpy()), pi + 1e-12, rtol=1e-5, atol=1e-7)
    assert (pi == 0).any()  # shards: absent labels get log(1e-12), a strong push away from them
    rt.shutdown()
    cfg, p, rt, server = _gas_server(tmp_path, mlflow_uri, **{"algorithm": {"name": "gas", "tau": 0.5}})
    np.testing.assert_allclose(server.rule.adjustment.numpy(), np.log(pi ** 0.5 + 1e-12), rtol=1e-5, atol=1e-6)
    rt.shutdown()


def test_gas_without_generation_equals_minibatch_sfl(tmp_path, mlflow_uri):
    """Homogeneous clients, all of them active (N = M), one batch per client in each activation buffer, no
    generation and no logit adjustment: GAS's server updates are MiniBatch-SFL's and its first global model is
    MiniBatch-SFL's first FedAvg."""
    over = {"data.num_clients": 3, "train.participation.count": 3, "data.partition": {"name": "iid"},
            "data.max_train_samples": 300, "clock.profile": "homogeneous", "train.rounds": 1, "train.local_steps": 4,
            "train.optimizer.momentum": 0.9}
    from helpers import run_rounds

    g_client, g_server, _, g_stats = run_rounds(gas_cfg(tmp_path, mlflow_uri, **{
        **over, "algorithm": {"name": "gas", "generate": False, "logit_adjustment": False}}))
    m_client, m_server, _, m_stats = run_rounds(gas_cfg(tmp_path, mlflow_uri, **{
        **over, "algorithm": {"name": "minibatch_sfl", "client_batch": "equal"}}))
    for got, want in ((g_server, m_server), (g_client, m_client)):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)
    np.testing.assert_allclose(g_stats[0].server["losses"], m_stats[0].server["losses"], rtol=1e-5)
    assert len(g_stats[0].server["losses"]) == 4  # one server update per iteration


# ---- asynchronous FL rules by hand ---------------------------------------------------------------------------------
def _fl_server(tmp_path, mlflow_uri, algorithm):
    cfg = gas_cfg(tmp_path, mlflow_uri, **{"algorithm": algorithm})
    p = prepare(cfg)
    rt = Runtime(make_backend(cfg.runtime), p.inputs)
    return rt, rt.backend.server


def _state(server, value):
    ref = transport.unpack_state(server.global_model.current().state)
    return {k: np.full(v.shape, value, dtype=np.float32) for k, v in ref.items()}


def test_fedbuff_moves_by_server_lr_times_the_mean_update(tmp_path, mlflow_uri):
    rt, server = _fl_server(tmp_path, mlflow_uri, {"name": "fedbuff", "buffer_size": 2, "server_lr": 0.5})
    server.global_model.publish(StateMsg(_state(server, 1.0)))
    from raysplit.runtime.server.events import Job

    for c in (0, 1):
        server.rule.on_job_start(c, Job(c, server.global_model.version, 0, 0.0))
    assert not server.rule.on_model_upload(0, StateMsg(_state(server, 3.0)), Job(0, 1, 0, 0.0))  # update +2
    assert server.rule.on_model_upload(1, StateMsg(_state(server, 5.0)), Job(1, 1, 0, 0.0))  # update +4
    got = transport.unpack_state(server.global_model.current().state)
    assert all(torch.allclose(v, torch.full_like(v, 1.0 + 0.5 * 3.0)) for v in got.values())
    rt.shutdown()


def test_ca2fl_calibrates_with_every_clients_cached_update(tmp_path, mlflow_uri):
    from raysplit.runtime.server.events import Job

    rt, server = _fl_server(tmp_path, mlflow_uri, {"name": "ca2fl", "buffer_size": 1})
    n = len(server.plan.events.client_sizes)
    server.global_model.publish(StateMsg(_state(server, 0.0)))
    server.rule.on_job_start(0, Job(0, 1, 0, 0.0))
    server.rule.on_model_upload(0, StateMsg(_state(server, 2.0)), Job(0, 1, 0, 0.0))  # v = 0 + (2 - 0) = 2
    server.rule.on_job_start(1, Job(1, 2, 0, 0.0))
    server.rule.on_model_upload(1, StateMsg(_state(server, 2.0 + 4.0)), Job(1, 2, 0, 0.0))  # v = 2/n + (4 - 0)
    server.rule.on_job_start(0, Job(0, 3, 0, 0.0))
    x = 2.0 + 2.0 / n + 4.0
    server.rule.on_model_upload(0, StateMsg(_state(server, x + 1.0)), Job(0, 3, 0, 0.0))  # v = (2+4)/n + (1 - 2)
    want = x + 6.0 / n - 1.0
    got = transport.unpack_state(server.global_model.current().state)
    assert all(torch.allclose(v, torch.full_like(v, want)) for v in got.values())
    rt.shutdown()


def test_fedasync_mixes_by_staleness(tmp_path, mlflow_uri):
    from raysplit.runtime.server.events import Job

    rt, server = _fl_server(tmp_path, mlflow_uri, {"name": "fedasync", "alpha": 0.5, "staleness_power": 1.0})
    server.global_model.publish(StateMsg(_state(server, 0.0)))  # version 1
    server.global_model.version = 3
    assert server.rule.on_model_upload(0, StateMsg(_state(server, 8.0)), Job(0, 1, 0, 0.0))  # staleness 2: a = 0.5/3
    got = transport.unpack_state(server.global_model.current().state)
    assert all(torch.allclose(v, torch.full_like(v, 8.0 * 0.5 / 3)) for v in got.values())
    rt.shutdown()


def test_s2fl_groups_balance_labels():
    from raysplit.algorithms.minibatch import balanced_groups, group_l2

    counts = np.array([[10, 0], [10, 0], [0, 10], [0, 10]])
    groups = balanced_groups([0, 1, 2, 3], counts, 2)  # starts as {0,1} / {2,3}: each group one label only
    assert sorted(sorted(g) for g in groups) in ([[0, 2], [1, 3]], [[0, 3], [1, 2]])
    assert all(group_l2(counts, g) == 0.0 for g in groups)


# ---- bad input and failures ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm,match", [
    ({"name": "gas", "buffer_size": 0}, "algorithm.buffer_size"),
    ({"name": "gas", "buffer_size": 13}, "algorithm.buffer_size=13 exceeds the 12 batches"),
    ({"name": "gas", "model_buffer_size": 7}, "algorithm.model_buffer_size=7 exceeds the 6 clients"),
    ({"name": "gas", "min_per_label": -1}, "algorithm.min_per_label"),
    ({"name": "gas", "covariance": "sparse"}, "algorithm.covariance"),
    ({"name": "gas", "tau": -1}, "algorithm.tau"),
    ({"name": "fedbuff", "buffer_size": 20}, "algorithm.buffer_size=20 exceeds"),
])
def test_bad_gas_input_names_the_key_before_any_actor(tmp_path, mlflow_uri, monkeypatch, algorithm, match):
    import raysplit.runtime.driver.api as api

    def no_actors(*a, **k):
        raise AssertionError("runtime started despite a bad config")

    monkeypatch.setattr(api.Runtime, "__init__", no_actors)
    with pytest.raises(ConfigError, match=match):
        run_experiment(gas_cfg(tmp_path, mlflow_uri, **{"algorithm": algorithm, "train.participation.count": 3,
                                                       "train.local_steps": 4}))


def test_nonfinite_statistics_fail_naming_label_and_server_update(tmp_path, mlflow_uri):
    cfg = gas_cfg(tmp_path, mlflow_uri, **{"train.optimizer.lr": 1e12, "train.rounds": 5,
                                           "train.stop_on_nonfinite": False, "tracking.experiment": "gas-nan"})
    with pytest.raises(FloatingPointError, match=r"label \d+ became non-finite at server update \d+"):
        run_experiment(cfg)
    client = MlflowClient(mlflow_uri)
    run = client.search_runs([client.get_experiment_by_name("gas-nan").experiment_id])[0]
    assert run.info.status == "FAILED" and "non-finite" in run.data.tags["raysplit.error"]


# ---- end to end with MLflow (local backend; tests/test_golden.py holds the Ray backend to the same numbers) ------
@pytest.mark.parametrize("algorithm", ["gas", "fedbuff", "ca2fl", "fedasync", "minibatch_sfl", "s2fl"])
def test_new_algorithms_two_rounds_with_mlflow(tmp_path, mlflow_uri, algorithm):
    cfg = gas_cfg(tmp_path, mlflow_uri, **{"algorithm": {"name": algorithm}, "runtime.backend": "local",
                                           "tracking.experiment": "gas-family", "train.local_steps": 6,
                                           "clock.profile": "gas_cell"})
    final = run_experiment(cfg)
    client = MlflowClient(mlflow_uri)
    run = client.get_run(final["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["algorithm.name"] == algorithm
    hist = client.get_metric_history(final["run_id"], "eval/accuracy")
    assert [h.step for h in hist] == [0, 1]
    for key in ("time/sim", "comm/bytes_up", "compute/client_flops", "train/loss"):
        assert key in run.data.metrics, key
    assert run.data.metrics["time/sim"] > 0 and run.data.metrics["comm/bytes_up"] > 0
    if algorithm in ("gas", "fedbuff", "ca2fl", "fedasync"):
        assert "method/staleness_mean" in run.data.metrics
    if algorithm == "gas":
        assert run.data.metrics["method/server_updates"] >= 1
    arts = {a.path for a in client.list_artifacts(final["run_id"])}
    assert {"client_accounting.csv", "client_rounds.csv", "curves.png"} <= arts


@pytest.mark.slow  # the shipped sizes (fmnist ~10 s); every algorithm's logic runs small in the fast tier
@pytest.mark.parametrize("name", ["fmnist"])
def test_shipped_gas_configs_run_a_round(tmp_path, mlflow_uri, name):
    """configs/gas/fmnist.yaml resolves (model, cut, partition, clock) and runs a global round on synthetic data of
    Fashion-MNIST's shape (configs/gas/cifar10.yaml: tests/test_paper_configs.py, on fake CIFAR-10 pickles)."""
    from pathlib import Path

    from raysplit.config import load_config

    over = {"train.rounds": 1, "train.local_steps": 2, "runtime.backend": "local", "tracking.uri": mlflow_uri,
            "tracking.output_dir": str(tmp_path / "out"), "tracking.progress": False, "eval.every": 1}
    over.update({"data.dataset": "synthetic", "data.options": {"num_samples": 400, "shape": [1, 28, 28]}})
    cfg = load_config(Path(__file__).parent.parent / f"configs/gas/{name}.yaml", over)
    p = prepare(cfg)
    assert p.cut_name == "conv2" and p.inputs.plan.sections.train.clip_grad_norm == 10.0
    final = run_experiment(cfg)
    assert final["method/server_updates"] >= 1 and final["time/sim"] > 0
