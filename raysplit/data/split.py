"""A run's data as it trains on it: the dataset of the ``data`` config section, subsampled, the server's labelled
set taken out, the rest partitioned over the clients with their test splits, and its provenance (what MLflow logs
as the run's input)."""

from __future__ import annotations

import os

import numpy as np

from raysplit.errors import ConfigError

from .datasets import load_dataset
from .partition import client_train_test_split, labeled_split, partition


def load_partitioned(data, seed: int):
    """The dataset of the ``data`` config section, subsampled as configured, the server's labelled set taken out
    (``data.n_labeled``), the rest partitioned over the clients (each with a test split): exactly the data a run
    trains on, without training (``seed``: the run's). Returns ``(spec, (x_train, y_train, x_test, y_test),
    train_idx, test_idx, labeled, provenance)``: ``train_idx[c]`` / ``test_idx[c]`` index client ``c``'s samples in
    ``x_train``; ``labeled`` is ``{"x", "y"}`` (empty without ``data.n_labeled``). Runners that give other code the
    same split use it (benchmarks/peers/)."""
    bundle = load_dataset(data.dataset, data.root, **data.options)
    rng = np.random.default_rng([seed, 1])
    x_tr, y_tr, x_te, y_te = bundle.x_train, bundle.y_train, bundle.x_test, bundle.y_test
    if data.partition.name == "natural":
        if bundle.natural_train is None:
            raise ConfigError(f"data.partition.name=natural needs a dataset with natural clients (LEAF); "
                              f"{data.dataset} has none")
        if data.n_labeled:
            raise ConfigError("data.n_labeled takes a labelled set out of the training set before partitioning; "
                              "natural (LEAF) partitions have no such step")
        parts = list(bundle.natural_train)
        if data.num_clients < len(parts):
            parts = parts[:data.num_clients]
    else:
        if data.max_train_samples and data.max_train_samples < len(y_tr):
            keep = np.sort(rng.choice(len(y_tr), data.max_train_samples, replace=False))
            x_tr, y_tr = x_tr[keep], y_tr[keep]
        client_pool = np.arange(len(y_tr))
        if data.n_labeled:
            n, classes = data.n_labeled, bundle.spec.num_classes
            if n % classes or n > len(y_tr):
                raise ConfigError(f"data.n_labeled={n} must be a multiple of the {classes} classes and at most the "
                                  f"{len(y_tr)} training samples (a class-balanced labelled set)")
            try:
                labeled, client_pool = labeled_split(np.asarray(y_tr), n, np.random.default_rng([seed, 4]))
            except ValueError as e:
                raise ConfigError(f"data.n_labeled: {e}") from None
        try:
            parts = partition(data.partition.name, np.asarray(y_tr)[client_pool], data.num_clients, rng,
                              **data.partition.params())
        except ValueError as e:
            raise ConfigError(f"data.partition: {e}") from None
        parts = [client_pool[p] for p in parts]
    if data.max_test_samples and data.max_test_samples < len(y_te):
        keep = np.sort(np.random.default_rng([seed, 3]).choice(len(y_te), data.max_test_samples,
                                                                    replace=False))
        x_te, y_te = x_te[keep], y_te[keep]
    train_idx, test_idx = client_train_test_split(parts, data.test_fraction, rng)
    labeled_data = {}
    if data.n_labeled:
        labeled_data = {"x": np.ascontiguousarray(x_tr[labeled]), "y": np.asarray(y_tr, dtype=np.int64)[labeled]}
    return (bundle.spec, (x_tr, y_tr, x_te, y_te), train_idx, test_idx, labeled_data,
            provenance(data, seed, bundle, y_tr, y_te))


def provenance(data, seed: int, bundle, y_tr, y_te) -> dict:
    """What a run trained on: the dataset, the files it was read from (resolved), the partition and the sizes after
    subsampling (logged as the run's MLflow input, with a digest of the files)."""
    files = list(bundle.files)
    source = os.path.commonpath(files) if len(files) > 1 else (files[0] if files else "")
    part = data.partition
    return {"name": data.dataset, "source": source, "files": files,
            "partition": {"name": part.name, **part.params(), "num_clients": data.num_clients,
                          "test_fraction": data.test_fraction, "n_labeled": data.n_labeled},
            "train_samples": int(len(y_tr)), "test_samples": int(len(y_te)), "seed": seed}
