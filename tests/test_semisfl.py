"""Semi-SFL and its baselines: the queue, the clustering loss and the EMA by hand, each K_s rule on a loss trace,
pseudo-labels above the threshold only, the labelled set, client labels never used, bad input, and every new
algorithm through Ray with its MLflow run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from helpers import make_config
from raysplit.algorithms.semisfl import ema_update, ks_milestones, ks_ratio, milestone_change, pseudo_label_ce
from raysplit.errors import ConfigError
from raysplit.experiment import prepare, run_experiment
from raysplit.losses import FeatureQueue, queue_contrastive_loss


def semi_cfg(tmp_path, mlflow_uri, root, **over):
    base = {"algorithm": {"name": "semisfl", "ks_initial": 3, "queue_size": 64, "server_batch_size": 8},
            "data.dataset": "fashion_mnist", "data.root": str(root), "data.options": {"search_system": False},
            "data.num_clients": 6, "data.n_labeled": 100, "data.partition.name": "iid", "data.test_fraction": 0.0,
            "train.participation.count": 3, "train.batch_size": 8, "train.local_steps": 2, "train.rounds": 2,
            "runtime.backend": "local", "tracking.experiment": "semisfl", "model.name": "semisfl_cnn",
            "model.cut": "features", "train.aggregation.weights": "uniform"}
    base.update(over)
    return make_config(tmp_path, mlflow_uri, **base)


# ---- building blocks by hand ----------------------------------------------------------------------------------------
def test_queue_is_fifo_with_wrap_labels_and_masks():
    q = FeatureQueue(5, 2)
    assert (q.labels == -1).all() and (q.masks == 0).all()
    q.push(torch.tensor([[1.0, 0], [0, 1]]), torch.tensor([3, 4]), torch.tensor([1.0, 0.0]))
    q.push(torch.tensor([[1.0, 1], [2, 2], [3, 3], [4, 4]]), torch.tensor([5, 6, 7, 8]), torch.ones(4))
    # 6 entries into 5 slots: the oldest ([1, 0], label 3) was overwritten by the last one
    assert q.labels.tolist() == [8, 4, 5, 6, 7] and q.masks.tolist() == [1, 0, 1, 1, 1] and q.ptr == 1
    assert torch.equal(q.keys[0], torch.tensor([4.0, 4.0]))
    q.push(torch.zeros(1, 2), torch.tensor([9]), None)  # no masks: the overwritten entry keeps its mask
    assert q.labels[1] == 9 and q.masks[1] == 0
    with pytest.raises(ValueError, match="does not fit"):
        q.push(torch.zeros(6, 2), torch.zeros(6), torch.zeros(6))


def test_clustering_loss_by_hand():
    q = F.normalize(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), dim=1)
    k = F.normalize(torch.tensor([[1.0, 1.0], [0.0, 1.0]]), dim=1)
    queue = FeatureQueue(2, 2)
    queue.keys = F.normalize(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]), dim=1)
    queue.labels = torch.tensor([0, 1])
    queue.masks = torch.tensor([1.0, 0.0])  # the second queued key may not be a positive
    labels, masks, t = torch.tensor([0, 1]), torch.tensor([1.0, 1.0]), 0.5
    got = queue_contrastive_loss(q, k, labels, masks, queue, t, push=False)
    keys = torch.cat([k, queue.keys])
    key_labels, key_masks = torch.tensor([0, 1, 0, 1]), torch.tensor([1.0, 1.0, 1.0, 0.0])
    want = 0.0
    for i in range(2):
        logits = torch.tensor([float(q[i] @ keys[j]) / t for j in range(4)])
        log_p = logits - torch.logsumexp(logits, 0)
        pos = [j for j in range(4) if key_labels[j] == labels[i] and key_masks[j] > 0]
        want += -sum(float(log_p[j]) for j in pos) / len(pos)
    assert float(got) == pytest.approx(want / 2, rel=1e-6)
    # anchor 1 (label 1) has the masked-out queue key as a same-label entry: without masks it becomes a positive
    unmasked = queue_contrastive_loss(q, k, labels, None, queue, t, push=False)
    assert float(unmasked) != pytest.approx(float(got))


def test_ema_update_by_hand_with_warmup():
    teacher, student = torch.nn.BatchNorm1d(2), torch.nn.BatchNorm1d(2)
    with torch.no_grad():
        teacher.weight.fill_(1.0), student.weight.fill_(3.0)
        teacher.running_mean.fill_(0.0), student.running_mean.fill_(2.0)
    student.num_batches_tracked.fill_(7)
    gamma = 0.99
    for step, expected_a in [(0, 0.0), (1, 0.5), (2, 2 / 3)]:  # a = min(1 - 1/(step+1), gamma)
        a = min(1 - 1 / (step + 1), gamma)
        assert a == pytest.approx(expected_a)
        before = teacher.weight.clone()
        ema_update(teacher, student, a)
        torch.testing.assert_close(teacher.weight, a * before + (1 - a) * student.weight)
    assert int(teacher.num_batches_tracked) == 7  # integer buffers are copied
    assert min(1 - 1 / (1000 + 1), gamma) == gamma


def test_pseudo_labels_only_above_the_threshold():
    teacher = torch.tensor([[4.0, 0.0], [0.1, 0.0], [0.0, 5.0]])
    student = torch.randn(3, 2)
    ce, labels, mask = pseudo_label_ce(student, teacher, 0.9)
    assert labels.tolist() == [0, 0, 1] and mask.tolist() == [1.0, 0.0, 1.0]
    per = F.cross_entropy(student, labels, reduction="none")
    assert float(ce) == pytest.approx(float((per[0] + per[2]) / 3))  # averaged over all samples, as the code
    ce_none, _, mask_none = pseudo_label_ce(student, teacher, 1.01)  # nothing is that confident
    assert float(ce_none) == 0.0 and mask_none.sum() == 0


def test_ks_milestones_rule_on_a_loss_trace():
    # flat loss (change 0 < rho1) at milestone 20 halves; a drop of 0.2 (> rho2) at milestone 30 doubles;
    # a change of 0.03 (between) at milestone 40 keeps; no change between milestones
    trace = [1.0] * 20 + [0.8] * 10 + [0.77] * 10
    ks, seq = 16, []
    for r in range(40):
        ks = ks_milestones(ks, r, trace[:r + 1], [20, 30, 40], 10, 0.01, 0.05)
        seq.append(ks)
    assert seq[:19] == [16] * 19 and seq[19:29] == [8] * 10 and seq[29:39] == [16] * 10 and seq[39] == 16
    # what the rule read (logged as method/ks_loss_change): signed, positive while the loss falls
    assert milestone_change(29, trace[:30], [20, 30, 40], 10) == pytest.approx(0.2)
    assert milestone_change(19, trace[:20], [20, 30, 40], 10) == 0.0
    assert milestone_change(24, trace[:25], [20, 30, 40], 10) is None
    assert milestone_change(19, trace[:20], [20], 11) is None  # not two windows of history yet


def test_ks_ratio_rule_on_a_loss_trace():
    ku, share, every, window = 5, 0.02, 20, 2
    r = 21  # decisions after rounds 19, 39, ...: this trace has 22 rounds, enough for 11 windows of 2 at r=21
    flat_x = [1.0] * 22
    falling_u = [2.0 - 0.05 * i for i in range(22)]  # the unsupervised loss keeps falling, the supervised not
    lrs, kss = [0.1] * 22, [40] * 22
    assert ks_ratio(40, r, flat_x, falling_u, lrs, kss, ku, 11, window, 1.5, 8.0, share) == round(40 / 1.5)
    # a floor beta * K_u * share above K_s / alpha: K_s drops only to the floor; never above K_s
    assert ks_ratio(40, r, flat_x, falling_u, lrs, kss, ku, 11, window, 1.5, 8.0, 0.8) == 32
    assert ks_ratio(10, r, flat_x, falling_u, lrs, [10] * 22, ku, 11, window, 1.5, 8.0, 0.8) == 10
    # the supervised loss falling faster: no change; and no decision off the schedule
    assert ks_ratio(40, r, falling_u, flat_x, lrs, kss, ku, 11, window, 1.5, 8.0, share) == 40
    assert ks_ratio(40, r, flat_x, falling_u, lrs, kss, ku, every, window, 1.5, 8.0, share) == 40


def test_ks_ratio_rule_decides_on_the_windows_there_are():
    """The authors' code slices the last 11 windows' rounds, so its first decision (round 100, w = 10) reads the 10
    windows there are. Found running their code beside ours: raysplit waited for 11, skipping the first decision."""
    ku, share, window = 10, 0.0, 5
    falling_u = [2.0 - 0.05 * i for i in range(20)]
    flat_x, lrs, kss = [1.0] * 20, [0.02] * 20, [20] * 20
    # after round 20 (index 19), every 20, 4 windows of 5: it decides, and the unsupervised loss leads
    assert ks_ratio(20, 19, flat_x, falling_u, lrs, kss, ku, 20, window, 1.5, 8.0, share) == round(20 / 1.5)
    # the authors' own scale, first decision: round 100, windows of 10, 10 of them
    u100 = [3.0 - 0.01 * i for i in range(100)]
    assert ks_ratio(50, 99, [1.0] * 100, u100, [0.1] * 100, [50] * 100, ku, 100, 10, 1.5, 8.0, share) == 33
    # one window only is no decision (no rate to compare)
    assert ks_ratio(20, 4, flat_x[:5], falling_u[:5], lrs[:5], kss[:5], ku, 5, window, 1.5, 8.0, share) == 20


# ---- data ---------------------------------------------------------------------------------------------------------
def test_labeled_set_is_class_balanced_and_disjoint_from_the_clients(tmp_path, mlflow_uri, fmnist_root):
    p = prepare(semi_cfg(tmp_path, mlflow_uri, fmnist_root))
    lab = p.inputs.labeled_data
    assert np.bincount(lab["y"], minlength=10).tolist() == [10] * 10
    x = p.inputs.train_data["x"]
    client_rows = np.concatenate(p.inputs.train_idx)
    labeled_rows = {x[i].tobytes() for i in range(len(x))} & {r.tobytes() for r in lab["x"]}
    assert labeled_rows  # the labelled images came from the training set ...
    assert not ({x[i].tobytes() for i in client_rows} & {r.tobytes() for r in lab["x"]})  # ... not the clients'
    assert p.partition_counts.sum() + 100 == len(p.inputs.train_data["y"])


def test_client_labels_never_influence_training(tmp_path, mlflow_uri, fmnist_root):
    from raysplit.runtime import Runtime, make_backend, transport

    def train(shuffle: bool):
        cfg = semi_cfg(tmp_path, mlflow_uri, fmnist_root, **{"train.rounds": 2})
        p = prepare(cfg)
        if shuffle:  # every client's labels scrambled; the server's labelled set untouched
            y = p.inputs.train_data["y"]
            rows = np.concatenate(p.inputs.train_idx)
            y[rows] = np.random.default_rng(1).permutation(y[rows])[::-1] % 10
        rt = Runtime(make_backend(cfg.runtime), p.inputs)
        try:
            driver = p.algorithm.driver(rt, p.algorithm, p.sample_stream, cfg.seed)
            driver.run(0, 2, lambda r, st: None)
            return (transport.unpack_state(rt.get(driver.global_handle).state),
                    transport.unpack_state(rt.get(rt.server.get_state()).state))
        finally:
            rt.shutdown()

    a, b = train(False), train(True)
    for sa, sb in zip(a, b):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


# ---- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("over,match", [
    ({"data.n_labeled": 105}, "data.n_labeled=105 must be a multiple of the 10 classes"),
    ({"data.n_labeled": 100000}, "data.n_labeled=100000"),
    ({"data.n_labeled": 0}, "set data.n_labeled > 0"),
    ({"algorithm": {"name": "semisfl", "tau": 1.5}}, "algorithm.tau"),
    ({"algorithm": {"name": "semisfl", "tau": 0}}, "algorithm.tau"),
    ({"algorithm": {"name": "semisfl", "queue_size": 16}}, "algorithm.queue_size=16 is smaller"),
    ({"algorithm": {"name": "semisfl", "ks": "adaptive"}}, "algorithm.ks"),
    ({"algorithm": {"name": "semisfl", "milestones": [50, 20]}}, "algorithm.milestones must be strictly increasing"),
    ({"algorithm": {"name": "sflv2"}}, "data.n_labeled=100 takes labelled samples away"),
])
def test_bad_semisfl_input_names_the_key_before_any_actor(tmp_path, mlflow_uri, fmnist_root, monkeypatch, over,
                                                         match):
    import raysplit.runtime.driver.api as api

    def no_actors(*a, **k):
        raise AssertionError("runtime started despite a bad config")

    monkeypatch.setattr(api.Runtime, "__init__", no_actors)
    with pytest.raises(ConfigError, match=match):
        run_experiment(semi_cfg(tmp_path, mlflow_uri, fmnist_root, **over))


@pytest.mark.parametrize("where,lr", [
    ("supervised phase, round \\d+, step \\d+", {"train.server_optimizer": {"name": "sgd", "lr": 1e12}}),
    # a diverged client encoder is caught at its activation, before the cross-entity loss (runtime.faults.on_bad_client)
    ("client \\d+, round \\d+, step \\d+, stream (student|teacher): activation rejected by the server: .*NaN or inf",
     {"train.optimizer.lr": 1e30, "train.server_optimizer": {"name": "sgd", "lr": 0.05}})], ids=["server", "client"])
def test_nonfinite_loss_names_the_phase_round_and_step(tmp_path, mlflow_uri, fmnist_root, where, lr):
    from raysplit.runtime import NonFiniteLossError

    cfg = semi_cfg(tmp_path, mlflow_uri, fmnist_root, **{"train.rounds": 6, **lr})
    with pytest.raises(NonFiniteLossError, match=where):
        run_experiment(cfg)


# ---- end to end with MLflow (local backend; tests/test_golden.py holds the Ray backend to the same numbers) ------
@pytest.mark.parametrize("algorithm", ["semisfl", "fedswitch_sl", "supervised_only", "semifl"])
def test_semi_algorithms_two_rounds_with_mlflow(tmp_path, mlflow_uri, fmnist_root, algorithm):
    alg = {"name": algorithm, "ks_initial": 3, "server_batch_size": 8}
    if algorithm != "semifl":
        alg["queue_size"] = 64
    cfg = semi_cfg(tmp_path, mlflow_uri, fmnist_root, **{"algorithm": alg, "runtime.backend": "local",
                                           "tracking.experiment": "semi-family"})
    final = run_experiment(cfg)
    client = MlflowClient(mlflow_uri)
    run = client.get_run(final["run_id"])
    assert run.info.status == "FINISHED"
    assert [h.step for h in client.get_metric_history(final["run_id"], "eval/accuracy")] == [0, 1]
    assert math.isfinite(run.data.metrics["train/loss"]) and run.data.metrics["compute/server_flops"] > 0
    if algorithm in ("semisfl", "fedswitch_sl"):
        assert run.data.metrics["method/ks"] == 3 and 0 <= run.data.metrics["method/mask_rate"] <= 1
        # two streams per client step: the teacher features are counted too (features of both views, no labels)
        assert run.data.metrics["comm/bytes_up"] > 0 and run.data.metrics["compute/client_flops"] > 0
    if algorithm == "supervised_only":
        assert run.data.metrics["comm/bytes_up"] == 0


def test_the_milestone_rule_logs_the_change_it_read(tmp_path, mlflow_uri, fmnist_root):
    """At each milestone the run logs the windowed change of the supervised loss the rule compared with rho1 and
    rho2 (from method/loss_x, as logged) and K_s follows it; nothing is logged off the milestones."""
    alg = {"name": "semisfl", "ks_initial": 2, "server_batch_size": 8, "queue_size": 64, "ks": "milestones",
           "milestones": [2, 3], "window": 1, "rho1": 0.0, "rho2": 1e9}  # every change lands between: K_s kept
    cfg = semi_cfg(tmp_path, mlflow_uri, fmnist_root, **{"algorithm": alg, "train.rounds": 3,
                                                          "runtime.backend": "local"})
    rid = run_experiment(cfg)["run_id"]
    client = MlflowClient(mlflow_uri)
    loss_x = [m.value for m in sorted(client.get_metric_history(rid, "method/loss_x"), key=lambda m: m.step)]
    change = {m.step: m.value for m in client.get_metric_history(rid, "method/ks_loss_change")}
    assert sorted(change) == [1, 2]  # rounds 2 and 3 (steps from 0)
    for step, value in change.items():
        assert value == pytest.approx(loss_x[step - 1] - loss_x[step])
    assert [m.value for m in client.get_metric_history(rid, "method/ks")] == [2, 2, 2]


def test_the_ratio_rule_logs_the_share_it_read(tmp_path, mlflow_uri, fmnist_root):
    """Where the ratio rule decides (every ratio_every rounds, from two windows of history on) the run logs R, the
    share of windows where the unsupervised loss fell faster per step than the supervised one, as logged in
    method/loss_u and method/loss_x; K_s falls by alpha where R >= 0.5 and is kept otherwise."""
    alg = {"name": "semisfl", "ks_initial": 3, "server_batch_size": 8, "queue_size": 64, "ks": "ratio",
           "ratio_every": 2, "window": 1, "alpha": 1.5, "beta": 1e-6}
    cfg = semi_cfg(tmp_path, mlflow_uri, fmnist_root, **{"algorithm": alg, "train.rounds": 4})
    rid = run_experiment(cfg)["run_id"]
    client = MlflowClient(mlflow_uri)

    def hist(key):
        return [m.value for m in sorted(client.get_metric_history(rid, key), key=lambda m: m.step)]

    x, u, ks = hist("method/loss_x"), hist("method/loss_u"), hist("method/ks")
    r = {m.step: m.value for m in client.get_metric_history(rid, "method/ks_ratio_r")}
    assert sorted(r) == [1, 3]  # after rounds 2 and 4 (steps from 0); round 2 holds two windows of one round
    # two windows: one rate each; the lr is positive, so only the signs of the per-step falls decide
    lead = ((u[0] - u[1]) / 2 - (x[0] - x[1]) / ks[0]) > 0  # K_u = train.local_steps = 2
    assert r[1] == float(lead)
    assert ks[2] == (round(ks[1] / 1.5) if r[1] >= 0.5 else ks[1])


@pytest.mark.parametrize("views", [["weak", "weak"], ["strong", "strong"]])
def test_the_supervised_phase_trains_on_the_configured_views(tmp_path, mlflow_uri, fmnist_root, monkeypatch, views):
    """algorithm.server_views decides what the labelled batches look like (semisfl.md: strong views give
    supervised-only the gain the unlabelled clients bring with weak ones, so this key decides the comparison);
    the clients' streams keep FixMatch's pair (strong for the student, weak for the teacher)."""
    from raysplit.data.augment import Augmenter

    seen: list[tuple[int, str]] = []
    real = Augmenter.__call__

    def spy(self, x, view):
        seen.append((len(x), view))
        return real(self, x, view)

    monkeypatch.setattr(Augmenter, "__call__", spy)
    alg = {"name": "supervised_only", "ks_initial": 2, "server_batch_size": 5, "queue_size": 64, "ks": "fixed",
           "server_views": views}  # batch 5 on the server, 8 on the clients: the calls tell the phases apart
    run_experiment(semi_cfg(tmp_path, mlflow_uri, fmnist_root, **{"algorithm": alg, "train.rounds": 1}))
    assert sorted({v for n, v in seen if n == 5}) == sorted(set(views)) and len([1 for n, _ in seen if n == 5]) == 4
    seen.clear()
    run_experiment(semi_cfg(tmp_path, mlflow_uri, fmnist_root, **{"algorithm": {**alg, "name": "semisfl"},
                                                                    "train.rounds": 1}))
    assert sorted({v for n, v in seen if n == 5}) == sorted(set(views))
    assert sorted({v for n, v in seen if n == 8}) == ["strong", "weak"]


@pytest.mark.parametrize("name", ["fmnist", "svhn"])
def test_shipped_semisfl_configs_run_a_round(tmp_path, mlflow_uri, fmnist_root, name):
    """configs/semisfl/{fmnist,svhn}.yaml resolve and run a round, SVHN on small fake files in the real format (no
    download); configs/semisfl/cifar10.yaml: tests/test_paper_configs.py (slow: its model at the paper's size)."""
    from pathlib import Path

    from raysplit.config import load_config

    rng = np.random.default_rng(0)
    over = {"train.rounds": 1, "train.local_steps": 1, "algorithm.ks_initial": 2, "runtime.backend": "local",
            "tracking.uri": mlflow_uri, "tracking.output_dir": str(tmp_path / "out"), "tracking.progress": False,
            "eval.every": 1, "data.root": str(tmp_path), "data.n_labeled": 100}
    if name == "fmnist":
        over.update({"data.root": str(fmnist_root), "data.options": {"search_system": False}})
    else:
        from scipy.io import savemat

        (tmp_path / "svhn").mkdir()
        for split, n in (("train", 700), ("test", 50)):
            savemat(tmp_path / "svhn" / f"{split}_32x32.mat",
                    {"X": rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8),
                     "y": (np.arange(n) % 10 + 1).astype(np.uint8).reshape(n, 1)})
    cfg = load_config(Path(__file__).parent.parent / f"configs/semisfl/{name}.yaml", over)
    final = run_experiment(cfg)
    assert final["method/ks"] == 2 and 0 <= final["eval/accuracy"] <= 1


def test_the_teachers_pseudo_labels_and_keys_come_from_eval_mode():
    """A teacher with dropout gives the same pseudo-labels and keys twice (no dropout sample), and its training
    flags are what they were before (a side-by-side read of the authors' code found raysplit's teacher in train
    mode: dropout noise in every pseudo-label of alexnet2)."""
    from raysplit.algorithms.semisfl import _Heads, _Supervised, teacher_outputs

    torch.manual_seed(0)
    heads = _Heads(torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(8, 4)),
                   torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)))
    e = torch.randn(16, 8)
    a, b = teacher_outputs(heads, e), teacher_outputs(heads, e)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and heads.training
    assert not torch.equal(heads(e)[0], heads(e)[0])  # in train mode the same input gives two dropout samples
    t_encoder = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8))
    student = _Heads(torch.nn.Linear(8, 4), torch.nn.Linear(8, 3))
    sup = _Supervised(torch.nn.Flatten(), student, t_encoder, heads.proj)
    views = torch.randn(2, 16, 8)
    assert torch.equal(sup(views)[2], sup(views)[2]) and t_encoder.training and heads.proj.training
