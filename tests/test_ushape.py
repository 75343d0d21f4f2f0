"""The U-shaped split (``model.tail_cut``, raysplit/runtime/ushape.py) and label privacy (raysplit/label_privacy.py):
the split trains what the unsplit model trains, labels never travel, the extra exchange is charged, the label
attacks score what they should, the defences do what they say, and bad input is refused before any actor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import make_config, run_rounds
from raysplit.errors import ConfigError
from raysplit.label_privacy import LabelMaxNorm, LabelNoise, defend_gradient, leak_scores

ROOT_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
U = {"model.tail_cut": "fc1", "runtime.backend": "local", "tracking.enabled": False}


@pytest.mark.parametrize("alg", ["sflv2", "splitnn", "sflv1"])  # psl keeps no global client model to compare
def test_a_u_shaped_run_trains_the_unsplit_model_with_plain_sgd(tmp_path, alg):
    """One client, full-batch plain SGD: after 2 rounds of 3 steps, head and tail (client) and middle (server)
    equal the unsplit model trained 6 steps on the client's data, to float tolerance."""
    from raysplit.data import to_tensor
    from raysplit.models import build_model
    from raysplit.runtime import transport

    cfg = make_config(tmp_path, None, **{**U, "algorithm.name": alg, "data.num_clients": 1,
                                         "train.batch_size": 4096, "train.local_steps": 3, "train.rounds": 2,
                                         "train.participation.count": 1})
    client, server, p, _ = run_rounds(cfg)
    spec = p.inputs.plan.model
    model = build_model(spec.name, spec.num_classes, spec.input_shape)
    head, middle, tail = model.split3(spec.cut, spec.tail_cut)
    init_c = transport.unpack_state(p.inputs.client_init)
    head.load_state_dict({k[5:]: v for k, v in init_c.items() if k.startswith("head.")})
    tail.load_state_dict({k[5:]: v for k, v in init_c.items() if k.startswith("tail.")})
    middle.load_state_dict(transport.unpack_state(p.inputs.server_init))
    idx = p.inputs.train_idx[0]
    x = to_tensor(p.inputs.train_data["x"][idx], spec.inputs)
    y = torch.as_tensor(p.inputs.train_data["y"][idx])
    opt = torch.optim.SGD(model.parameters(), lr=cfg.train.optimizer.lr)
    for _ in range(6):
        opt.zero_grad()
        F.cross_entropy(tail(middle(head(x))), y).backward()
        opt.step()
    want_c = {**{f"head.{k}": v for k, v in head.state_dict().items()},
              **{f"tail.{k}": v for k, v in tail.state_dict().items()}}
    assert set(want_c) == set(client)
    for k, v in want_c.items():
        torch.testing.assert_close(client[k], v, rtol=1e-5, atol=1e-6, msg=k)
    for k, v in middle.state_dict().items():
        torch.testing.assert_close(server[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_labels_stay_on_the_clients_and_the_extra_exchange_is_charged(tmp_path, monkeypatch):
    """U-shaped SFLV2 with the label attack on: every activation reaches the server with an empty label array, the
    middle's output and the returned gradient are counted as bytes of their own (one batch of the middle's output
    size per step each way), the tail's FLOPs on the clients; the label scores are logged."""
    from raysplit.models import build_model
    from raysplit.runtime.messages import Batch

    seen = []
    decode = Batch.of.__func__
    monkeypatch.setattr(Batch, "of", classmethod(lambda cls, act, device: (seen.append(np.asarray(act.y).size),
                                                                           decode(cls, act, device))[1]))
    over = {**U, "train.rounds": 2, "privacy.label_attack": {"kind": "gradient_scoring"}}
    cfg = make_config(tmp_path, None, **over)
    _, _, p, stats = run_rounds(cfg)
    assert seen and set(seen) == {0}, seen
    spec = p.inputs.plan.model
    model = build_model(spec.name, spec.num_classes, spec.input_shape)
    head, middle, _ = model.split3(spec.cut, spec.tail_cut)
    per_sample = int(np.prod(middle(head(torch.zeros(1, *spec.input_shape))).shape[1:])) * 4
    for st in stats:
        for c, row in st.clients.items():
            samples = row["steps"] * cfg.train.batch_size
            assert row["bytes_down_middle"] == row["bytes_up_tail_gradients"] == samples * per_sample, (c, row)
            assert "label_auc_direction" in row
    plain = run_rounds(make_config(tmp_path, None, **{"runtime.backend": "local", "train.rounds": 2}))[3]
    # the same cut without the tail cut: the clients' FLOPs now include the tail's forward and backward
    assert all(u.clients[c]["flops"] > q.clients[c]["flops"] for u, q in zip(stats, plain) for c in u.clients)


def test_the_u_shaped_run_reports_label_leakage_and_noise_at_scale_0_changes_nothing(tmp_path):
    from raysplit.experiment import run_experiment

    over = {**U, "train.rounds": 2, "eval.every": 1, "privacy.label_attack": {"kind": "gradient_scoring"}}
    got = run_experiment(make_config(tmp_path, None, **over))
    # the tail is one linear layer: a row is W^T (p - e_y), so its direction names the label
    assert got["privacy/label_auc_direction"] > 0.9 and got["privacy/label_acc_direction"] > 0.8, got
    assert 0 <= got["privacy/label_auc_norm"] <= 1 and got["comm/bytes_down_middle"] > 0
    zero = run_experiment(make_config(tmp_path, None, **{**over, "privacy.label_defence": {"kind": "noise",
                                                                                              "scale": 0.0}}))
    assert {k: v for k, v in zero.items() if k not in ("time/wall", "time/wall_round", "summary/wall_time",
                                                         "time/server_busy", "run_id")} == \
        {k: v for k, v in got.items() if k not in ("time/wall", "time/wall_round", "summary/wall_time",
                                                     "time/server_busy", "run_id")}
    noisy = run_experiment(make_config(tmp_path, None, **{**over, "privacy.label_defence": {"kind": "noise",
                                                                                               "scale": 20.0}}))
    assert noisy["privacy/label_auc_direction"] < got["privacy/label_auc_direction"] - 0.1, noisy


def _imbalanced_binary_gradients(seed: int = 0, n: int = 2000):
    """Per-sample gradients of the loss with respect to a middle output, as a client returns them, after the tail
    (one linear layer) learnt an imbalanced binary task (10 % positives) for a few steps: Li et al. 2022's
    setting, where the minority class's gradients are the larger."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) < 0.1).long()
    h = torch.randn(n, 16, generator=g) + y[:, None] * 0.5
    tail = torch.nn.Linear(16, 2)
    opt = torch.optim.SGD(tail.parameters(), lr=0.5)
    for _ in range(20):
        opt.zero_grad()
        F.cross_entropy(tail(h), y).backward()
        opt.step()
    z = h.clone().requires_grad_(True)
    F.cross_entropy(tail(z), y).backward()
    return z.grad, y


def test_the_norm_attack_reads_an_imbalanced_binary_task_and_not_random_labels():
    grad, y = _imbalanced_binary_gradients()
    got = leak_scores(grad.numpy(), y.numpy(), 2)
    assert got["auc_norm"] > 0.95 and got["auc_direction"] > 0.95 and got["acc_norm"] > 0.8, got
    shuffled = np.random.default_rng(0).permutation(y.numpy())  # labels drawn at random: nothing to read
    assert abs(leak_scores(grad.numpy(), shuffled, 2)["auc_norm"] - 0.5) < 0.08
    # max norm (Li et al.'s heuristic) takes the norm's edge away
    torch.manual_seed(0)
    defended = defend_gradient(grad, LabelMaxNorm(kind="max_norm"))
    assert leak_scores(defended.numpy(), y.numpy(), 2)["auc_norm"] < 0.75


def test_label_defences_do_what_they_say():
    grad, _ = _imbalanced_binary_gradients()
    assert defend_gradient(grad, LabelNoise(kind="noise", scale=0.0)) is grad  # bit for bit: the same tensor
    torch.manual_seed(1)
    noised = defend_gradient(grad, LabelNoise(kind="noise", scale=2.0))
    noise = (noised - grad).norm(dim=1)
    assert noise.mean() == pytest.approx(2.0 * float(grad.norm(dim=1).median()), rel=0.1)
    torch.manual_seed(2)
    lifted = defend_gradient(grad, LabelMaxNorm(kind="max_norm")).norm(dim=1) ** 2
    assert float(lifted.mean()) == pytest.approx(float(grad.norm(dim=1).max() ** 2), rel=0.1)


@pytest.mark.parametrize("over, words", [
    ({"model.tail_cut": "conv1"}, ["model.tail_cut='conv1'", "does not come after model.cut", "'conv2'"]),
    ({"model.tail_cut": "fc9"}, ["model.tail_cut", "invalid cut 'fc9'"]),
    ({"model.tail_cut": "fc1", "algorithm.name": "gas"}, ["model.tail_cut='fc1'", "gas's server needs the labels"]),
    ({"model.tail_cut": "fc1", "algorithm.name": "semisfl", "data.n_labeled": 100},
     ["model.tail_cut='fc1'", "semisfl's server trains supervised steps"]),
    ({"model.tail_cut": "fc1", "algorithm.name": "hydra"}, ["model.tail_cut='fc1'", "hydra's server heads"]),
    ({"model.tail_cut": "fc1", "algorithm.name": "cyclesfl"}, ["model.tail_cut='fc1'", "pools every client's"]),
    ({"model.tail_cut": "fc1", "algorithm.name": "fedavg"}, ["model.tail_cut='fc1'", "fedavg has no split"]),
    ({"model.tail_cut": "fc1", "algorithm": {"name": "psl", "batched_copies": True}},
     ["algorithm.batched_copies", "set algorithm.batched_copies=false"]),
    ({"privacy.label_attack": {"kind": "gradient_scoring"}},
     ["privacy.label_attack.kind=gradient_scoring", "sends the labels to the server", "model.tail_cut"]),
    ({"privacy.label_defence": {"kind": "max_norm"}}, ["privacy.label_defence.kind=max_norm", "model.tail_cut"]),
])
def test_bad_u_shapes_are_refused_naming_the_key_before_any_actor(tmp_path, over, words):
    from raysplit.experiment import prepare

    with pytest.raises(ConfigError) as e:
        prepare(make_config(tmp_path, None, **{"runtime.backend": "local", **over}))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_label_defence_strength_out_of_range_names_the_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        make_config(tmp_path, None, **{**U, "privacy.label_defence": {"kind": "noise", "scale": -1}})
    assert "privacy.label_defence.scale" in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        make_config(tmp_path, None, **{**U, "privacy.label_defence": {"kind": "max_norm", "scale": 1}})
    assert "privacy.label_defence" in str(e.value) and "scale" in str(e.value), str(e.value)


PATHS = {  # tests/test_direct_steps.py's paths
    "chained": {"runtime.backend": "ray", "runtime.transport.direct_steps": False, "runtime.transport.kind": "calls"},
    "calls": {"runtime.backend": "ray", "runtime.transport.direct_steps": True, "runtime.transport.kind": "calls"},
    "compiled": {"runtime.backend": "ray", "runtime.transport.direct_steps": True, "runtime.transport.kind": "compiled"},
    "rdt": {"runtime.backend": "ray", "runtime.transport.direct_steps": False, "runtime.transport.kind": "rdt"},
}


@pytest.mark.parametrize("alg,path", [("sflv2", "compiled"), ("sflv2", "chained"), ("psl", "calls"),
                                      ("sflv1", "rdt")])
def test_through_ray_actors_a_u_shaped_run_computes_the_same_bits(ray_session, tmp_path, alg, path):
    """The three exchanges of a U-shaped step on every transport: client and server weights, clocks, losses and
    steps bit for bit those of the local backend (``helpers.assert_identical_runs``)."""
    from helpers import assert_identical_runs

    over = {"algorithm.name": alg, "model.tail_cut": "fc1", "tracking.enabled": False,
            "privacy.label_attack": {"kind": "gradient_scoring"}, "privacy.label_defence": {"kind": "max_norm"}}
    want = run_rounds(make_config(tmp_path, None, **over, **{"runtime.backend": "local"}))
    assert_identical_runs(want, run_rounds(make_config(tmp_path, None, **over, **PATHS[path])))


def test_the_shipped_ushaped_config_runs_its_attack_and_defence_into_mlflow(tmp_path, mlflow_uri, fmnist_root):
    """configs/privacy/fmnist_ushaped.yaml (its method, cuts, attack and defence; one round of two steps on a small
    fake Fashion-MNIST in the real format) logs the label scores and the extra exchange's bytes to MLflow."""
    from mlflow.tracking import MlflowClient

    from raysplit.config import load_config
    from raysplit.experiment import run_experiment

    cfg = load_config(ROOT_CONFIGS / "privacy" / "fmnist_ushaped.yaml", {
        "data.root": str(fmnist_root), "data.options": {"search_system": False}, "train.rounds": 1,
        "train.local_steps": 2, "eval.every": 1, "runtime.backend": "local", "tracking.uri": mlflow_uri,
        "tracking.output_dir": str(tmp_path / "out"), "tracking.progress": False})
    assert cfg.model.tail_cut == "fc1" and cfg.privacy.label_defence.kind == "noise"
    final = run_experiment(cfg)
    logged = MlflowClient(mlflow_uri).get_run(final["run_id"]).data
    assert {"privacy/label_auc_direction", "privacy/label_acc_direction", "comm/bytes_down_middle",
            "comm/bytes_up_tail_gradients"} <= set(logged.metrics), sorted(logged.metrics)
    assert logged.params["privacy.label_defence.scale"] == "1.0" and logged.params["model.tail_cut"] == "fc1"
