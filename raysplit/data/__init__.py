"""Data building blocks: datasets (local files only, never downloaded), partitioners,
per-client splits and partition statistics.  No Ray / MLflow imports here."""

from .datasets import (
    DATASETS,
    LEAF_ALL_LETTERS,
    DataSpec,
    DatasetBundle,
    DatasetNotFoundError,
    default_data_root,
    files_digest,
    load_dataset,
    read_idx,
    to_tensor,
)
from .partition import (
    PARTITIONERS,
    client_train_test_split,
    labeled_split,
    natural_partition,
    partition,
    partition_counts,
    partition_summary,
    plot_partition,
)
from .split import load_partitioned, provenance

__all__ = [
    "DATASETS",
    "LEAF_ALL_LETTERS",
    "DataSpec",
    "DatasetBundle",
    "DatasetNotFoundError",
    "default_data_root",
    "files_digest",
    "load_dataset",
    "read_idx",
    "to_tensor",
    "PARTITIONERS",
    "client_train_test_split",
    "labeled_split",
    "load_partitioned",
    "provenance",
    "natural_partition",
    "partition",
    "partition_counts",
    "partition_summary",
    "plot_partition",
]
