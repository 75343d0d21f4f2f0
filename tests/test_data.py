"""Tests for raysplit.data: partitioners, splits, loaders on fake files, to_tensor."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import Touch
from raysplit.data import (
    DATASETS,
    LEAF_ALL_LETTERS,
    PARTITIONERS,
    DataSpec,
    DatasetNotFoundError,
    client_train_test_split,
    default_data_root,
    labeled_split,
    load_dataset,
    natural_partition,
    partition,
    partition_counts,
    partition_summary,
    plot_partition,
    to_tensor,
)

REAL_FMNIST = Path("/usr/share/datasets/fashion-mnist")

# ----------------------------------------------------------------------------- helpers


def _labels(n_per_class=100, num_classes=10, seed=0):
    y = np.repeat(np.arange(num_classes), n_per_class)
    return np.random.default_rng(seed).permutation(y).astype(np.int64)


def _assert_exact_cover(parts, n, num_clients):
    assert len(parts) == num_clients
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "indices must be sorted and unique within a client"
    allidx = np.concatenate(parts)
    assert len(allidx) == n, "sum of sizes must equal N"
    assert np.array_equal(np.sort(allidx), np.arange(n)), "every index exactly once"


PARAMS = {
    "iid": {},
    "dirichlet": {"alpha": 0.5, "min_size": 10},
    "shards": {"per_client": 2},
    "dominant_label": {"ratio": 0.8},
}


def test_registry_names():
    assert set(PARTITIONERS) == {"iid", "dirichlet", "shards", "dominant_label", "device_dirichlet"}
    assert set(DATASETS) == {
        "fashion_mnist", "digits", "cifar10", "cifar100", "svhn", "femnist", "shakespeare", "synthetic"
    }


# ----------------------------------------------------------------------------- partitioners


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("num_clients", [7, 20])
def test_partition_exact_cover_and_deterministic(name, num_clients):
    y = _labels(101, 10)  # 1010 samples, sizes not divisible by everything
    parts = partition(name, y, num_clients, np.random.default_rng(3), **PARAMS[name])
    _assert_exact_cover(parts, len(y), num_clients)
    again = partition(name, y, num_clients, np.random.default_rng(3), **PARAMS[name])
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition(name, y, num_clients, np.random.default_rng(4), **PARAMS[name])
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other))


def test_partition_unknown_name_and_param():
    y = _labels(10)
    with pytest.raises(ValueError, match="nope"):
        partition("nope", y, 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="beta"):
        partition("dirichlet", y, 2, np.random.default_rng(0), alpha=1.0, beta=2)
    with pytest.raises(ValueError, match="alpha must be a positive number"):
        partition("dirichlet", y, 2, np.random.default_rng(0), alpha=-1.0)
    with pytest.raises(ValueError, match="natural_partition"):
        partition("natural", y, 2, np.random.default_rng(0))


def test_iid_sizes_near_equal():
    y = _labels(101, 10)
    sizes = [len(p) for p in partition("iid", y, 7, np.random.default_rng(0))]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_skew_grows_as_alpha_falls():
    y = _labels(600, 10)  # 6000 samples
    stats = {}
    for alpha in (0.1, 1.0, 100.0):
        shares, emds = [], []
        for seed in range(3):
            parts = partition("dirichlet", y, 20, np.random.default_rng(seed), alpha=alpha, min_size=10)
            _assert_exact_cover(parts, len(y), 20)
            assert min(len(p) for p in parts) >= 10
            s = partition_summary(partition_counts(parts, y, 10))
            shares.append(s["dominant_label_share_mean"])
            emds.append(s["emd_to_global_mean"])
        stats[alpha] = (np.mean(shares), np.mean(emds))
    assert stats[0.1][0] > stats[1.0][0] > stats[100.0][0]
    assert stats[0.1][1] > stats[1.0][1] > stats[100.0][1]
    assert stats[100.0][1] < 0.3 and stats[0.1][1] > 0.8


def test_dirichlet_min_size_respected_and_impossible_raises():
    y = _labels(30, 10)  # 300 samples
    parts = partition("dirichlet", y, 10, np.random.default_rng(0), alpha=0.3, min_size=20)
    assert min(len(p) for p in parts) >= 20
    with pytest.raises(ValueError, match="min_size"):
        partition("dirichlet", y, 10, np.random.default_rng(0), alpha=0.3, min_size=31)
    with pytest.raises(ValueError, match="alpha=0.001"):
        # tiny alpha puts each class on one client, so 10 of 20 clients stay empty
        partition("dirichlet", y, 20, np.random.default_rng(0), alpha=0.001, min_size=15, max_tries=5)


def test_shards_at_most_per_client_labels_when_aligned():
    y = _labels(100, 10)  # 1000 samples, 100 per class
    # shard size divides the class size (50, 25, 20) -> no shard straddles two classes
    for per_client, num_clients in ((1, 20), (2, 20), (5, 10)):
        parts = partition("shards", y, num_clients, np.random.default_rng(1), per_client=per_client)
        _assert_exact_cover(parts, len(y), num_clients)
        counts = partition_counts(parts, y, 10)
        assert ((counts > 0).sum(axis=1) <= per_client).all()
        assert all(len(p) == len(y) // num_clients for p in parts)
    # with 2 shards per client, some client must hold 2 labels over a few seeds (not all 1)
    multi = [
        ((partition_counts(partition("shards", y, 20, np.random.default_rng(s)), y, 10) > 0).sum(1) == 2).any()
        for s in range(5)
    ]
    assert any(multi)


def test_dominant_label_exact_counts():
    n_per_class = np.array([100, 90, 81, 77, 60, 55, 50, 45, 40, 37])
    y = np.random.default_rng(0).permutation(np.repeat(np.arange(10), n_per_class))
    parts = partition("dominant_label", y, 10, np.random.default_rng(0), ratio=0.8)
    _assert_exact_cover(parts, len(y), 10)
    counts = partition_counts(parts, y, 10)
    for c in range(10):
        n_dom = int(np.floor(0.8 * n_per_class[c] + 0.5))
        assert counts[c, c] == n_dom
        rest = np.delete(counts[:, c], c)
        assert rest.sum() == n_per_class[c] - n_dom
        assert rest.max() - rest.min() <= 1  # split equally among the other 9
        expected = sorted(len(a) for a in np.array_split(np.arange(n_per_class[c] - n_dom), 9))
        assert sorted(rest.tolist()) == expected
    # ~80% of class c on client c
    assert np.allclose(np.diag(counts) / n_per_class, 0.8, atol=0.015)


def test_dominant_label_more_clients_and_fewer_clients():
    y = _labels(120, 10)
    # 20 clients: clients c and c+10 share the 80% of class c equally
    counts = partition_counts(partition("dominant_label", y, 20, np.random.default_rng(0)), y, 10)
    for c in range(10):
        assert counts[c, c] == counts[c + 10, c] == 48
        assert counts[:, c].sum() == 120
    # 4 clients: classes 4..9 have no dominant client -> split equally among all 4
    counts = partition_counts(partition("dominant_label", y, 4, np.random.default_rng(0)), y, 10)
    assert (counts[:, 4:] == 30).all()
    assert all(counts[c, c] == 96 for c in range(4))


def test_labeled_split_balanced_and_disjoint():
    y = _labels(50, 10)
    lab, rest = labeled_split(y, 205, np.random.default_rng(0))
    assert np.array_equal(np.bincount(y[lab], minlength=10), np.full(10, 20))
    assert len(np.intersect1d(lab, rest)) == 0
    assert np.array_equal(np.sort(np.concatenate([lab, rest])), np.arange(len(y)))
    small = np.concatenate([y, np.full(5, 10)])  # class 10 has only 5 samples
    with pytest.raises(ValueError, match="class 10"):
        labeled_split(small, 11 * 6, np.random.default_rng(0))
    lab, _ = labeled_split(small, 11 * 5, np.random.default_rng(0))
    assert np.array_equal(np.bincount(small[lab]), np.full(11, 5))
    lab0, rest0 = labeled_split(y, 0, np.random.default_rng(0))
    assert len(lab0) == 0 and len(rest0) == len(y)


def test_client_train_test_split_proportions():
    rng = np.random.default_rng(0)
    parts = [np.arange(0, 100), np.arange(100, 120), np.arange(120, 121), np.arange(121, 123)]
    train, test = client_train_test_split(parts, 0.1, rng)
    assert [len(t) for t in test] == [10, 2, 0, 0]
    assert [len(t) for t in train] == [90, 18, 1, 2]
    for p, a, b in zip(parts, train, test):
        assert len(np.intersect1d(a, b)) == 0
        assert np.array_equal(np.sort(np.concatenate([a, b])), p)
    train, test = client_train_test_split([np.arange(2)], 0.9, rng)
    assert len(train[0]) == 1 and len(test[0]) == 1  # at least one training sample


def test_partition_summary_and_plot(tmp_path):
    counts = np.array([[10, 0, 0], [0, 5, 5], [3, 3, 4]])
    s = partition_summary(counts)
    assert all(isinstance(v, float) for v in s.values())
    assert s["clients"] == 3 and s["samples_min"] == 10 and s["samples_max"] == 10
    assert s["labels_per_client_mean"] == pytest.approx((1 + 2 + 3) / 3)
    assert s["dominant_label_share_mean"] == pytest.approx((1.0 + 0.5 + 0.4) / 3)
    glob = np.array([13, 8, 9]) / 30
    emd = np.mean([np.abs(r / r.sum() - glob).sum() for r in counts])
    assert s["emd_to_global_mean"] == pytest.approx(emd)
    path = tmp_path / "sub" / "p.png"
    plot_partition(counts, str(path), "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    big = np.random.default_rng(0).integers(0, 20, size=(250, 100))
    plot_partition(big, str(tmp_path / "big.png"))
    assert (tmp_path / "big.png").stat().st_size > 1000


# ----------------------------------------------------------------------------- fake files


def _write_idx(path: Path, arr: np.ndarray, gz: bool):
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    data = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + b"".join(struct.pack(">I", d) for d in arr.shape)
    data += arr.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def _fake_mnist(d: Path, gz: bool, n_train=12, n_test=5, seed=0):
    rng = np.random.default_rng(seed)
    xtr = rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)
    ytr = rng.integers(0, 10, n_train, dtype=np.uint8)
    xte = rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8)
    yte = rng.integers(0, 10, n_test, dtype=np.uint8)
    _write_idx(d / "train-images-idx3-ubyte", xtr, gz)
    _write_idx(d / "train-labels-idx1-ubyte", ytr, gz)
    _write_idx(d / "t10k-images-idx3-ubyte", xte, gz)
    _write_idx(d / "t10k-labels-idx1-ubyte", yte, gz)
    return xtr, ytr, xte, yte


@pytest.mark.parametrize("gz,sub", [(True, "fashion_mnist"), (False, "FashionMNIST/raw")])
def test_fashion_mnist_fake_idx(tmp_path, gz, sub):
    xtr, ytr, xte, yte = _fake_mnist(tmp_path / sub, gz)
    b = load_dataset("fashion_mnist", root=str(tmp_path), search_system=False)
    assert b.spec.input_shape == (1, 28, 28) and b.spec.kind == "image" and b.spec.num_classes == 10
    assert b.x_train.shape == (12, 1, 28, 28) and b.x_train.dtype == np.uint8
    assert b.x_test.shape == (5, 1, 28, 28)
    assert b.y_train.dtype == np.int64
    assert np.array_equal(b.x_train[:, 0], xtr) and np.array_equal(b.y_train, ytr)
    assert np.array_equal(b.x_test[:, 0], xte) and np.array_equal(b.y_test, yte)


def test_fashion_mnist_env_default_root(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPLIT_DATA", str(tmp_path))
    assert default_data_root() == str(tmp_path)
    _, ytr, _, _ = _fake_mnist(tmp_path / "fashion_mnist", True, n_train=7)
    b = load_dataset("fashion_mnist")  # root taken from $RAYSPLIT_DATA, before the system dir
    assert np.array_equal(b.y_train, ytr)
    monkeypatch.delenv("RAYSPLIT_DATA")
    assert default_data_root() == os.path.expanduser("~/.cache/raysplit/data")


def test_missing_dataset_error_lists_paths(tmp_path):
    with pytest.raises(DatasetNotFoundError) as ei:
        load_dataset("fashion_mnist", root=str(tmp_path), search_system=False)
    msg = str(ei.value)
    assert str(tmp_path / "fashion_mnist") in msg and str(tmp_path / "FashionMNIST" / "raw") in msg
    assert "dataset-fashion-mnist" in msg and "download=True" in msg
    assert isinstance(ei.value, FileNotFoundError)
    for name in ("cifar10", "cifar100", "svhn", "femnist", "shakespeare"):
        with pytest.raises(DatasetNotFoundError) as ei:
            load_dataset(name, root=str(tmp_path))
        assert str(tmp_path) in str(ei.value) and name in str(ei.value)
    e = pickle.loads(pickle.dumps(ei.value))
    assert str(e) == str(ei.value)


def test_unknown_dataset_and_option():
    with pytest.raises(ValueError, match="fashion_mnist"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="bogus"):
        load_dataset("digits", bogus=1)


def _cifar_batch(rng, n, fine=False):
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    if fine:
        return {b"data": data, b"fine_labels": rng.integers(0, 100, n).tolist(),
                b"coarse_labels": rng.integers(0, 20, n).tolist(), b"filenames": [b"x"] * n}
    return {b"data": data, b"labels": rng.integers(0, 10, n).tolist(), b"batch_label": b"b"}


def test_cifar10_fake_pickles(tmp_path):
    rng = np.random.default_rng(0)
    d = tmp_path / "cifar10" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    batches = [_cifar_batch(rng, 4) for _ in range(5)] + [_cifar_batch(rng, 3)]
    for name, b in zip([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], batches):
        with open(d / name, "wb") as f:
            pickle.dump(b, f)
    b = load_dataset("cifar10", root=str(tmp_path))
    assert b.x_train.shape == (20, 3, 32, 32) and b.x_train.dtype == np.uint8
    assert b.x_test.shape == (3, 3, 32, 32) and b.spec.num_classes == 10
    assert np.array_equal(b.y_train, np.concatenate([bb[b"labels"] for bb in batches[:5]]))
    assert np.array_equal(b.x_train[4], batches[1][b"data"][0].reshape(3, 32, 32))
    assert b.y_train.dtype == np.int64 and len(b.spec.mean) == 3


def test_cifar100_fake_pickles(tmp_path):
    rng = np.random.default_rng(1)
    d = tmp_path / "cifar-100-python"
    d.mkdir()
    tr, te = _cifar_batch(rng, 6, fine=True), _cifar_batch(rng, 2, fine=True)
    for name, blob in (("train", tr), ("test", te)):
        with open(d / name, "wb") as f:
            pickle.dump(blob, f)
    fine = load_dataset("cifar100", root=str(tmp_path))
    coarse = load_dataset("cifar100", root=str(tmp_path), label="coarse")
    assert fine.spec.num_classes == 100 and coarse.spec.num_classes == 20
    assert np.array_equal(fine.y_train, tr[b"fine_labels"]) and np.array_equal(coarse.y_test, te[b"coarse_labels"])
    assert fine.x_train.shape == (6, 3, 32, 32) and fine.x_test.shape == (2, 3, 32, 32)
    with pytest.raises(ValueError, match="label"):
        load_dataset("cifar100", root=str(tmp_path), label="medium")


def test_svhn_fake_mat(tmp_path):
    from scipy.io import savemat

    rng = np.random.default_rng(2)
    d = tmp_path / "svhn"
    d.mkdir()
    xs = {}
    for split, n in (("train", 5), ("test", 3)):
        x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        y = np.array([10, 1, 2, 9, 5][:n], dtype=np.uint8).reshape(n, 1)
        savemat(d / f"{split}_32x32.mat", {"X": x, "y": y})
        xs[split] = x
    b = load_dataset("svhn", root=str(tmp_path))
    assert b.x_train.shape == (5, 3, 32, 32) and b.x_train.dtype == np.uint8
    assert b.y_train.tolist() == [0, 1, 2, 9, 5] and b.y_test.tolist() == [0, 1, 2]
    # pixel (h=3, w=7, c=1) of sample 2 lands at [2, 1, 3, 7]
    assert b.x_train[2, 1, 3, 7] == xs["train"][3, 7, 1, 2]


def _write_leaf(root: Path, name: str, split: str, files: list[dict]):
    d = root / name / "data" / split
    d.mkdir(parents=True, exist_ok=True)
    for i, user_data in enumerate(files):
        blob = {"users": list(user_data), "num_samples": [len(v["y"]) for v in user_data.values()],
                "user_data": user_data}
        (d / f"all_data_{i}_niid_{split}.json").write_text(json.dumps(blob))


def test_femnist_fake_leaf(tmp_path):
    rng = np.random.default_rng(3)

    def samples(n):
        return {"x": (rng.integers(0, 256, (n, 784)) / 255.0).tolist(), "y": rng.integers(0, 62, n).tolist()}

    train = [{"f0001": samples(3), "f0002": samples(2)}, {"f0003": samples(4)}]
    test = [{"f0002": samples(1), "f0001": samples(2)}]  # f0003 has no test data; order differs
    _write_leaf(tmp_path, "femnist", "train", train)
    _write_leaf(tmp_path, "femnist", "test", test)
    b = load_dataset("femnist", root=str(tmp_path))
    assert b.spec.num_classes == 62 and b.spec.input_shape == (1, 28, 28)
    assert b.x_train.shape == (9, 1, 28, 28) and b.x_test.shape == (3, 1, 28, 28)
    assert b.natural_users == ["f0001", "f0002", "f0003"]
    assert [len(p) for p in b.natural_train] == [3, 2, 4] and [len(p) for p in b.natural_test] == [2, 1, 0]
    # round trip of pixels and labels per user
    for u, i in (("f0001", 0), ("f0003", 2)):
        src = train[0][u] if u in train[0] else train[1][u]
        got = b.x_train[b.natural_train[i]].reshape(-1, 784)
        assert np.array_equal(got, np.rint(np.array(src["x"]) * 255).astype(np.uint8))
        assert b.y_train[b.natural_train[i]].tolist() == src["y"]
    assert b.y_test[b.natural_test[0]].tolist() == test[0]["f0001"]["y"]
    parts = natural_partition(b)
    _assert_exact_cover(parts, 9, 3)
    tr2, te2 = natural_partition(b, 2, return_test=True)
    assert len(tr2) == 2 and [len(t) for t in te2] == [2, 1]
    t = to_tensor(b.x_train[:2], b.spec)
    assert t.dtype == torch.float32 and t.shape == (2, 1, 28, 28)


def test_shakespeare_fake_leaf(tmp_path):
    rng = np.random.default_rng(4)
    letters = LEAF_ALL_LETTERS

    def samples(n):
        xs = ["".join(rng.choice(list(letters), 80)) for _ in range(n)]
        return {"x": xs, "y": [str(rng.choice(list(letters))) for _ in range(n)]}

    train = [{"HAMLET": samples(3), "OPHELIA": samples(2)}]
    test = [{"HAMLET": samples(1), "OPHELIA": samples(1)}]
    _write_leaf(tmp_path, "shakespeare", "train", train)
    _write_leaf(tmp_path, "shakespeare", "test", test)
    b = load_dataset("shakespeare", root=str(tmp_path))
    assert b.spec.kind == "tokens" and b.spec.num_classes == 80 and b.spec.input_shape == (80,)
    assert b.x_train.shape == (5, 80) and b.x_train.dtype == np.int64 and b.x_test.shape == (2, 80)
    decoded = "".join(letters[i] for i in b.x_train[b.natural_train[1][0]])
    assert decoded == train[0]["OPHELIA"]["x"][0]
    assert [letters[i] for i in b.y_train[b.natural_train[0]]] == train[0]["HAMLET"]["y"]
    t = to_tensor(b.x_train, b.spec)
    assert t.dtype == torch.long and torch.equal(t, torch.from_numpy(b.x_train))


# ----------------------------------------------------------------------------- tensors / bundled


def test_to_tensor_image_normalisation():
    spec = DataSpec("t", "image", (2, 2, 2), 3, mean=(0.5, 0.25), std=(0.5, 0.25))
    x = np.zeros((3, 2, 2, 2), dtype=np.uint8)
    x[:, 0] = 255
    x[:, 1] = 51  # 0.2
    t = to_tensor(x, spec)
    assert t.dtype == torch.float32 and t.shape == x.shape
    assert torch.allclose(t[:, 0], torch.full((3, 2, 2), 1.0))           # (1 - 0.5) / 0.5
    assert torch.allclose(t[:, 1], torch.full((3, 2, 2), (0.2 - 0.25) / 0.25))
    single = to_tensor(x[0], spec)  # a single (C, H, W) sample
    assert torch.allclose(single, t[0])
    fspec = DataSpec("f", "float", (4,), 2)
    xf = np.arange(8, dtype=np.float64).reshape(2, 4)
    tf = to_tensor(xf, fspec)
    assert tf.dtype == torch.float32 and torch.equal(tf, torch.arange(8.0).reshape(2, 4))


def test_dataspec_picklable():
    spec = DataSpec("x", "image", [1, 28, 28], 10, [0.28], [0.35])
    assert spec.input_shape == (1, 28, 28)
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(ValueError):
        DataSpec("x", "audio", (1,), 2)


def test_digits_loader():
    b = load_dataset("digits")
    assert b.spec.num_classes == 10 and b.spec.input_shape == (1, 8, 8) and b.spec.kind == "float"
    assert b.x_train.shape[1:] == (1, 8, 8) and b.x_train.dtype == np.float32
    assert len(b.x_train) + len(b.x_test) == 1797 and len(b.x_test) == 360
    assert set(np.unique(b.y_train)) == set(range(10)) and b.y_train.dtype == np.int64
    assert abs(b.x_train.mean()) < 1e-4 and abs(b.x_train.std() - 1) < 1e-3
    b2 = load_dataset("digits")
    assert np.array_equal(b.y_test, b2.y_test) and np.array_equal(b.x_test, b2.x_test)


def test_synthetic_deterministic_and_learnable():
    from sklearn.linear_model import LogisticRegression

    b = load_dataset("synthetic", seed=1)
    b2 = load_dataset("synthetic", seed=1)
    b3 = load_dataset("synthetic", seed=2)
    assert np.array_equal(b.x_train, b2.x_train) and not np.array_equal(b.x_train, b3.x_train)
    assert b.x_train.shape == (1600, 1, 8, 8) and b.x_test.shape == (400, 1, 8, 8)
    assert b.x_train.dtype == np.float32 and b.spec.kind == "float"
    clf = LogisticRegression(max_iter=500).fit(b.x_train.reshape(1600, -1), b.y_train)
    assert clf.score(b.x_test.reshape(400, -1), b.y_test) > 0.8
    s = load_dataset("synthetic", num_samples=100, num_classes=3, shape=(5,), seed=0)
    assert s.spec.input_shape == (5,) and s.spec.num_classes == 3 and len(s.y_train) == 80


@pytest.mark.skipif(not REAL_FMNIST.is_dir(), reason="Debian dataset-fashion-mnist not installed")
def test_real_fashion_mnist(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSPLIT_DATA", str(tmp_path))  # no root given, an empty default root -> the system dir
    b = load_dataset("fashion_mnist")
    assert b.x_train.shape == (60000, 1, 28, 28) and b.x_test.shape == (10000, 1, 28, 28)
    assert np.array_equal(np.bincount(b.y_train), np.full(10, 6000))
    assert np.array_equal(np.bincount(b.y_test), np.full(10, 1000))
    t = to_tensor(b.x_train[:2000], b.spec)
    assert abs(float(t.mean())) < 0.05 and abs(float(t.std()) - 1) < 0.05


# ----------------------------------------------------------------------------- untrusted input files
def _write_cifar10(tmp_path, rng, edit=None):
    d = tmp_path / "cifar10" / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        b = _cifar_batch(rng, 4)
        if edit is not None and name == "data_batch_3":
            b = edit(b)
        with open(d / name, "wb") as f:
            pickle.dump(b, f)
    return d / "data_batch_3"


def test_a_malicious_cifar_pickle_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    bad = _write_cifar10(tmp_path, np.random.default_rng(0), lambda b: {**b, b"batch_label": Touch(marker)})
    with pytest.raises(ValueError, match="refused to load") as e:
        load_dataset("cifar10", root=str(tmp_path))
    assert str(bad) in str(e.value) and not marker.exists()
    pickle.loads(pickle.dumps(Touch(marker)))  # the same object through the plain unpickler does run: the test bites
    assert marker.exists()


@pytest.mark.parametrize("edit, what", [
    (lambda b: {**b, b"labels": [0, 1, 2, 10]}, "labels must lie in 0..9"),
    (lambda b: {**b, b"labels": [0, 1, 2]}, "3 labels for 4 images"),
    (lambda b: {**b, b"data": b[b"data"][:, :3000]}, "3072"),
    (lambda b: {b"labels": b[b"labels"]}, "no 'data'"),
])
def test_a_bad_cifar_batch_names_the_file_and_the_fault(tmp_path, edit, what):
    bad = _write_cifar10(tmp_path, np.random.default_rng(0), edit)
    with pytest.raises(ValueError, match=what) as e:
        load_dataset("cifar10", root=str(tmp_path))
    assert str(bad) in str(e.value)


def test_a_truncated_cifar_batch_names_the_file(tmp_path):
    bad = _write_cifar10(tmp_path, np.random.default_rng(0))
    bad.write_bytes(bad.read_bytes()[:500])
    with pytest.raises(ValueError, match="not a readable CIFAR batch") as e:
        load_dataset("cifar10", root=str(tmp_path))
    assert str(bad) in str(e.value)


def test_truncated_or_mislabelled_idx_files_name_the_file(tmp_path):
    src = Path("/usr/share/datasets/fashion-mnist")
    if not (src / "t10k-labels-idx1-ubyte.gz").is_file():
        pytest.skip("needs the dataset-fashion-mnist package")
    d = tmp_path / "fashion_mnist"
    d.mkdir()
    for f in src.glob("*-ubyte.gz"):
        (d / f.name).write_bytes(f.read_bytes())
    labels = d / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(labels.read_bytes()))
    raw[8] = 12  # one label out of 0..9
    labels.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(ValueError, match=r"labels must lie in 0\.\.9") as e:
        load_dataset("fashion_mnist", root=str(tmp_path), search_system=False)
    assert str(labels) in str(e.value)
    labels.write_bytes(gzip.compress(bytes(raw))[:200])  # a truncated download
    with pytest.raises(ValueError, match="unreadable IDX file") as e:
        load_dataset("fashion_mnist", root=str(tmp_path), search_system=False)
    assert str(labels) in str(e.value)


def _good_femnist(tmp_path, rng, edit=None):
    """A fake FEMNIST tree whose first train file goes through ``edit(blob) -> blob | bytes``; returns that file."""
    def samples(n):
        return {"x": (rng.integers(0, 256, (n, 784)) / 255.0).tolist(), "y": rng.integers(0, 62, n).tolist()}

    _write_leaf(tmp_path, "femnist", "train", [{"f1": samples(2), "f2": samples(2)}])
    _write_leaf(tmp_path, "femnist", "test", [{"f1": samples(1)}])
    bad = tmp_path / "femnist" / "data" / "train" / "all_data_0_niid_train.json"
    if edit is not None:
        out = edit(json.loads(bad.read_text()))
        bad.write_bytes(out if isinstance(out, bytes) else json.dumps(out).encode())
    return bad


def _user(blob, **fields):
    return {**blob, "user_data": {**blob["user_data"], "f2": {**blob["user_data"]["f2"], **fields}}}


@pytest.mark.parametrize("edit, what", [
    (lambda b: json.dumps(b).encode()[:300], "not a readable LEAF JSON file"),
    (lambda b: {"users": b["users"]}, "'user_data' object"),
    (lambda b: _user(b, y=[1]), "2 x but 1 y"),
    (lambda b: _user(b, y=[1, 62]), "sample 1: label 62 is not an integer in 0..61"),
    (lambda b: _user(b, y=[1, -1]), "sample 1: label -1"),
    (lambda b: _user(b, x=[[0.5] * 784, [0.5] * 783]), "sample 1: x must be a list of 784 pixel values"),
    (lambda b: _user(b, x=[[0.5] * 784, [2.0] * 784]), r"pixel values must lie in \[0, 1\]"),
    (lambda b: _user(b, x=[[0.5] * 784, ["a"] * 784]), "pixel values are not numbers"),
])
def test_a_bad_leaf_file_names_the_file_and_the_fault(tmp_path, edit, what):
    bad = _good_femnist(tmp_path, np.random.default_rng(0), edit)
    with pytest.raises(ValueError, match=what) as e:
        load_dataset("femnist", root=str(tmp_path))
    assert str(bad) in str(e.value)
    assert ("LEAF user 'f2'" in str(e.value)) == ("sample" in what or "pixel" in what or " y" in what)


def test_a_bad_shakespeare_sample_names_the_file_user_and_sample(tmp_path):
    blob = {"ROMEO": {"x": ["a" * 80, 7], "y": ["b", "c"]}}
    _write_leaf(tmp_path, "shakespeare", "train", [blob])
    _write_leaf(tmp_path, "shakespeare", "test", [{"ROMEO": {"x": ["a" * 80], "y": ["bc"]}}])
    with pytest.raises(ValueError, match="user 'ROMEO', sample 1: x must be a string") as e:
        load_dataset("shakespeare", root=str(tmp_path))
    assert "all_data_0_niid_train.json" in str(e.value)


def test_a_partitioners_defaults_are_its_config_models():
    """Issue 52: a parameter not given takes the default of the config's ``data.partition`` model, the one place
    defaults are written (the functions have none)."""
    import importlib
    import inspect

    from raysplit.config import DataConfig

    module = importlib.import_module("raysplit.data.partition")
    y = _labels(200, 10)
    for name, model in module.PARTITION_PARAMS.items():
        if name == "natural":
            continue
        fn = module.PARTITIONERS[name]
        tunable = [k for k, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
        assert all(inspect.signature(fn).parameters[k].default is inspect.Parameter.empty
                   for k in model.model_fields if k != "name"), name
        defaults = model(name=name).params()
        assert set(defaults) <= set(tunable), name
        got = partition(name, y, 4, np.random.default_rng(3))
        want = partition(name, y, 4, np.random.default_rng(3), **defaults)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), name
    assert DataConfig().partition.params() == {"alpha": 0.5, "min_size": 10}
