"""MergeSFL (issue 16): feature merging against a concatenated forward, merged training against large-batch SGD,
one client against SFLV2, batch-size regulation (by hand and on the virtual clock), through Ray and MLflow."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from helpers import make_config, run_rounds
from raysplit.algorithms.mergesfl import regulated_batch_sizes
from raysplit.cli import main
from raysplit.config import ConfigError
from raysplit.data import to_tensor
from raysplit.experiment import prepare, run_experiment
from raysplit.models import build_model
from raysplit.runtime import Runtime, make_backend
from raysplit.runtime.messages import Tag


def merge_cfg(tmp_path, mlflow_uri, algorithm=None, **over):
    """Digits, 3 clients of different speeds (clock.profile uniform), every client every round, plain SGD."""
    base = {"algorithm": {"name": "mergesfl", **(algorithm or {})}, "runtime.backend": "local",
            "runtime.num_workers": 1, "data.num_clients": 3, "data.test_fraction": 0.0, "clock.profile": "uniform",
            "train.local_steps": 1, "train.rounds": 1, "train.batch_size": 16}
    base.update(over)
    return make_config(tmp_path, mlflow_uri, **base)


# ---- batch-size regulation ---------------------------------------------------------------------------------------
def test_regulated_batch_sizes_by_hand():
    assert regulated_batch_sizes([1, 2, 4, 1], 16).tolist() == [2, 4, 8, 2]  # proportional to speed
    assert regulated_batch_sizes([1, 1, 1], 10).tolist() == [4, 3, 3]  # remainder to the earlier client on ties
    # a client cannot send more than it holds: client 2 is capped at 5, the others share the rest (9.5 each)
    assert regulated_batch_sizes([1, 1, 10], 24, caps=[100, 100, 5]).tolist() == [10, 9, 5]
    assert regulated_batch_sizes([1, 1000], 10).tolist() == [1, 9]  # every client sends at least one sample
    assert regulated_batch_sizes([1, 2], 20, caps=[3, 4]).tolist() == [3, 4]  # all their data, less than asked
    rng = np.random.default_rng(0)
    for _ in range(50):
        speeds, total = rng.uniform(0.1, 10, 7), int(rng.integers(7, 500))
        sizes = regulated_batch_sizes(speeds, total)
        assert sizes.sum() == total and sizes.min() >= 1
        order = np.argsort(speeds)
        assert (np.diff(sizes[order]) >= -1).all()  # faster clients get larger batches (up to rounding)
    with pytest.raises(ValueError, match="each of the 3 clients"):
        regulated_batch_sizes([1, 1, 1], 2)


def test_regulation_follows_the_clock_profiles_and_sums_to_the_total(tmp_path, mlflow_uri):
    cfg = merge_cfg(tmp_path, mlflow_uri, {"total_batch_size": 60}, **{"data.num_clients": 6})
    p = prepare(cfg)
    rt = Runtime(make_backend(cfg.runtime), p.inputs)
    alg = p.algorithm
    sizes = alg.batch_sizes(rt, list(range(6)))
    assert sum(sizes.values()) == 60 and len(set(sizes.values())) > 1
    # the time a client needs per sample is the profile's: compute, upload (activation + label), download
    prof = p.inputs.profiles
    per = [alg.flops_per_sample / pr.flops + (alg.bytes_per_sample + 8) / pr.up + alg.bytes_per_sample / pr.down
           for pr in prof]
    np.testing.assert_allclose(alg.seconds_per_sample, per)
    by_speed = sorted(range(6), key=lambda c: per[c])
    assert [sizes[c] for c in by_speed] == sorted(sizes.values(), reverse=True)  # faster: larger batch
    step_time = [sizes[c] * per[c] for c in range(6)]
    assert max(step_time) / min(step_time) < 1.2  # every client's step takes about as long
    equal = prepare(merge_cfg(tmp_path, mlflow_uri, {"batch_sizes": "equal"}, **{"data.num_clients": 6}))
    assert set(equal.algorithm.batch_sizes(rt, list(range(6))).values()) == {16}  # the code's choice


def test_regulated_rounds_take_less_simulated_time_than_equal_batches(tmp_path, mlflow_uri):
    over = {"data.num_clients": 4, "train.local_steps": 4}
    times = {}
    for mode in ("regulated", "equal"):
        _, _, _, stats = run_rounds(merge_cfg(tmp_path, mlflow_uri, {"batch_sizes": mode}, **over))
        times[mode] = stats[0].sim_time
        assert sum(st["bytes_up_activations"] for st in stats[0].clients.values()) > 0
    assert times["regulated"] < 0.9 * times["equal"]  # same merged batch, no client waiting on a straggler


# ---- feature merging ---------------------------------------------------------------------------------------------
def test_merged_step_dispatches_slices_of_one_concatenated_forward(tmp_path, mlflow_uri):
    cfg = merge_cfg(tmp_path, mlflow_uri)
    p = prepare(cfg)
    rt = Runtime(make_backend(cfg.runtime), p.inputs)
    server, host = rt.backend.server, rt.backend.workers[0]
    rt.begin_round(0, [0, 1, 2], 0.0)
    sizes = {0: 5, 1: 12, 2: 31}
    acts = [host.steps.forward(Tag(c, 0, 0), d) for c, d in sizes.items()]
    model = server.models["main"].module
    before = [prm.detach().clone() for prm in model.parameters()]
    x = torch.cat([torch.from_numpy(np.array(a.x)) for a in acts]).requires_grad_(True)
    y = torch.cat([torch.from_numpy(np.array(a.y)) for a in acts])
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, [x] + list(model.parameters()))
    out = server.serve("merge_step", *acts)
    lo = 0
    for a, g in zip(acts, out):
        d = len(a.y)
        assert g.tag == a.tag and g.g.shape == a.x.shape
        # the client's slice of the merged gradient times D / d: the gradient of its own batch's mean loss
        torch.testing.assert_close(torch.as_tensor(g.g), grads[0][lo:lo + d] * (48 / d), rtol=1e-5, atol=1e-7)
        lo += d
    lr = cfg.train.optimizer.lr
    for new, old, gr in zip(model.parameters(), before, grads[1:]):  # one SGD step on the merged batch
        torch.testing.assert_close(new.detach(), old - lr * gr, rtol=1e-5, atol=1e-6)
    assert server.rule.label_kls and server.rule.label_kls[0] >= 0


def whole_model_sgd_step(cfg, p, sizes: dict[int, int]):
    """One plain-SGD step of the whole model on the concatenation of each client's first batch of ``sizes[c]``."""
    torch.manual_seed(cfg.seed)
    spec = p.inputs.plan.model
    model = build_model(cfg.model.name, spec.num_classes, spec.input_shape)
    rows = np.concatenate([np.random.default_rng([cfg.seed, c, 0]).permutation(p.inputs.train_idx[c])[:d]
                           for c, d in sizes.items()])
    x = to_tensor(p.inputs.train_data["x"][rows], spec.inputs)
    F.cross_entropy(model(x), torch.as_tensor(p.inputs.train_data["y"][rows])).backward()
    with torch.no_grad():
        for prm in model.parameters():
            prm -= cfg.train.optimizer.lr * prm.grad
    return model.split(p.cut)


def test_one_merged_round_equals_large_batch_sgd_of_the_whole_model(tmp_path, mlflow_uri):
    """D / d_i dispatch + FedAvg weighted by batch size: the client part after aggregation and the server part
    are exactly one SGD step of the whole model on the merged batch, even with unequal batch sizes."""
    cfg = merge_cfg(tmp_path, mlflow_uri)
    client, server, p, _ = run_rounds(cfg)
    rt = Runtime(make_backend(cfg.runtime), p.inputs)
    sizes = p.algorithm.batch_sizes(rt, [int(c) for c in p.sample_stream[0]])
    assert len(set(sizes.values())) == 3 and sum(sizes.values()) == 48
    ref_client, ref_server = whole_model_sgd_step(cfg, p, sizes)
    for got, ref in ((client, ref_client.state_dict()), (server, ref_server.state_dict())):
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6)
    # averaging the client parts by train-set size instead (the weighting matters) is not that step
    other, _, _, _ = run_rounds(merge_cfg(tmp_path, mlflow_uri, {"client_weights": "config"}))
    assert any(not torch.allclose(other[k], ref_client.state_dict()[k], rtol=1e-4, atol=1e-6) for k in other)


def test_one_client_mergesfl_equals_sflv2(tmp_path, mlflow_uri):
    over = {"data.num_clients": 1, "train.local_steps": 5, "train.rounds": 2, "train.optimizer.momentum": 0.9,
            "clock.profile": "homogeneous"}
    c1, s1, _, st1 = run_rounds(merge_cfg(tmp_path, mlflow_uri, **over))
    c2, s2, _, st2 = run_rounds(merge_cfg(tmp_path, mlflow_uri, **over, algorithm={"name": "sflv2"}))
    for got, ref in ((c1, c2), (s1, s2)):
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), k
    assert st1[-1].t_end == pytest.approx(st2[-1].t_end, rel=1e-9)  # and the same simulated time


def test_local_epochs_each_client_one_pass_at_its_own_batch_size(tmp_path, mlflow_uri):
    cfg = merge_cfg(tmp_path, mlflow_uri, **{"train.local_epochs": 1, "data.num_clients": 4,
                                             "data.partition.name": "dirichlet", "data.partition.alpha": 1.0})
    _, _, p, stats = run_rounds(cfg)
    rt = Runtime(make_backend(cfg.runtime), p.inputs)
    sizes = p.algorithm.batch_sizes(rt, [int(c) for c in p.sample_stream[0]])
    steps = {c: math.ceil(len(p.inputs.train_idx[c]) / d) for c, d in sizes.items()}
    assert len(set(steps.values())) > 1  # clients leave the merge at different steps
    for c, st in stats[0].clients.items():
        assert st["steps"] == steps[c]
        per_sample = p.algorithm.bytes_per_sample + 8  # activation + label: exactly one pass over its data
        assert st["bytes_up_activations"] == per_sample * len(p.inputs.train_idx[c])
    assert len(stats[0].server["losses"]) == max(steps.values())  # one server step per merged step


def test_config_and_listing(tmp_path, mlflow_uri, capsys):
    with pytest.raises(ConfigError, match="algorithm.total_batch_size=2 cannot give each of the 3 clients"):
        merge_cfg(tmp_path, mlflow_uri, {"total_batch_size": 2})
    with pytest.raises(ConfigError, match="batch_sizes"):
        merge_cfg(tmp_path, mlflow_uri, {"batch_sizes": "fast"})
    assert main(["list"]) == 0
    assert "  mergesfl" in capsys.readouterr().out
    assert main(["list", "mergesfl"]) == 0
    out = capsys.readouterr().out
    for key in ("batch_sizes", "total_batch_size", "client_weights", "'regulated'"):
        assert key in out


# ---- end to end with MLflow (local backend; tests/test_golden.py holds the Ray backend to the same numbers) -----
def test_mergesfl_end_to_end_with_mlflow(tmp_path, mlflow_uri):
    cfg = make_config(tmp_path, mlflow_uri, **{"runtime.backend": "local",
        "algorithm": {"name": "mergesfl"}, "data.partition.name": "dominant_label", "data.num_clients": 6,
        "clock.profile": "uniform", "train.rounds": 2, "train.local_steps": 15, "eval.mode": "global",
        "data.test_fraction": 0.0, "tracking.experiment": "mergesfl"})
    final = run_experiment(cfg)
    client = MlflowClient(mlflow_uri)
    run = client.get_run(final["run_id"])
    assert run.info.status == "FINISHED"
    assert int(run.data.params["resolved.mergesfl.total_batch_size"]) == 6 * 16
    kl = client.get_metric_history(final["run_id"], "method/label_kl")
    # every client takes part, so the mix is off IID only through the unequal (regulated) batch sizes
    assert len(kl) == 2 and all(0 < m.value < 0.1 for m in kl)
    assert len(client.get_metric_history(final["run_id"], "eval/accuracy")) == 2
    assert final["eval/accuracy"] > 0.3  # digits, 10 classes: 0.39 after 2 rounds of 15 merged steps
