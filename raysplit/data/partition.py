"""Client partitioners, server/client splits, and partition statistics/plots.

Every partitioner takes ``(labels, num_clients, rng, **params)`` and returns
``num_clients`` sorted ``int64`` index arrays that together hold every index of
``labels`` exactly once.  All randomness comes from the ``numpy.random.Generator``
passed in, so the same seed gives the same partition.

Partitioners (``PARTITIONERS`` / :func:`partition`):

``iid``
    Global shuffle, then near-equal contiguous slices (GAS ``IID``).
``dirichlet(alpha, min_size=10, max_tries=1000)``
    NIID-Bench / GAS: for every class ``p ~ Dir(alpha * 1_N)``; clients already holding
    ``>= N_total / num_clients`` samples get probability 0; renormalise; cut the
    shuffled class indices at the cumulative proportions.  The whole draw is repeated
    until every client holds ``>= min_size`` samples (``ValueError`` after ``max_tries``).
``shards(per_client=2)``
    GAS/FedAvg shards: shuffle within class, sort by label, cut into
    ``per_client * num_clients`` near-equal shards, shuffle the shards, client ``i``
    gets shards ``order[per_client*i : per_client*(i+1)]``.  When every class size is
    a multiple of the shard size no shard straddles two classes, so each client holds
    at most ``per_client`` labels.
``dominant_label(ratio=0.8)``
    Hydra/MergeSFL's dominant-label scheme generalised to N clients: client ``k``'s
    dominant label is ``k % C``.  For each class ``c`` (shuffled), the first
    ``floor(ratio * n_c + 0.5)`` samples are split equally among the clients whose
    dominant label is ``c`` (in client order), and the rest equally among all other
    clients, taken in cyclic order ``c+1, c+2, ...`` so that the remainders of
    different classes land on different clients.  "Equally" is ``np.array_split``:
    sizes differ by at most one, the first clients in the order get the extra sample.
    If no client has ``c`` as dominant label (``num_clients < C``), class ``c`` is
    split equally among all clients (cyclic order from ``c+1``); if every client has
    it, they share all of it.  With
    ``N == C`` this is Hydra's matrix ``ratio`` on the diagonal and
    ``(1 - ratio) / (N - 1)`` elsewhere.

``device_dirichlet(alpha)``
    Ampere's scheme (../shared/papers/ampere.txt §5.1): every client draws a class distribution
    ``p_k ~ Dir(beta * 1_C)`` with ``beta = alpha / (1 - alpha + 1e-9)`` (``alpha`` in (0, 1]; 1 is about IID),
    and gets ``n / N`` samples (the first ``n mod N`` clients one more), each of a class drawn from ``p_k``
    among the classes that still have unassigned samples.

LEAF's natural per-writer split is not label-based; use :func:`natural_partition`.
"""

from __future__ import annotations

import inspect
import os
import typing
from typing import Annotated, Any, Callable, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "PARTITIONERS",
    "PARTITION_MODELS",
    "PartitionConfig",
    "partition",
    "iid_partition",
    "dirichlet_partition",
    "shards_partition",
    "dominant_label_partition",
    "natural_partition",
    "labeled_split",
    "client_train_test_split",
    "partition_counts",
    "partition_summary",
    "plot_partition",
]


# --------------------------------------------------------------------------- parameters (the config's
# ``data.partition`` section: each partitioner's parameters and their defaults, written only here)


class PartitionParams(BaseModel):
    """A partitioner's parameters: one model per partitioner, picked by ``name`` (a key another partitioner takes
    is an error naming it)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    KIND: typing.ClassVar[str] = "partitioner"  # what an error calls the member that ``name`` picked

    def params(self) -> dict[str, Any]:
        """The keyword arguments of the partitioner (everything but ``name``)."""
        return self.model_dump(exclude={"name"})


class IidPartition(PartitionParams):
    name: Literal["iid"] = Field(description="iid: each client an equal random share")


class DirichletPartition(PartitionParams):
    name: Literal["dirichlet"] = Field(default="dirichlet", description="dirichlet: per label, client shares drawn "
                                       "from Dirichlet(alpha)")
    alpha: float = Field(default=0.5, gt=0, description="Dirichlet concentration: smaller is more skewed")
    min_size: int = Field(default=10, ge=1, description="redraw until every client has this many samples")


class ShardsPartition(PartitionParams):
    name: Literal["shards"] = Field(description="shards: the label-sorted set cut into shards, per_client each")
    per_client: int = Field(default=2, ge=1, description="label shards per client")


class DominantLabelPartition(PartitionParams):
    name: Literal["dominant_label"] = Field(description="dominant_label: each client's samples mostly of one label "
                                            "(Hydra's setting)")
    ratio: float = Field(default=0.8, gt=0, le=1, description="share of a client's samples from its dominant label")


class DeviceDirichletPartition(PartitionParams):
    name: Literal["device_dirichlet"] = Field(description="device_dirichlet: Ampere's scheme, per device label "
                                              "proportions drawn from Dirichlet(alpha)")
    alpha: float = Field(default=0.5, gt=0, description="Dirichlet concentration: smaller is more skewed")


class NaturalPartition(PartitionParams):
    name: Literal["natural"] = Field(description="natural: the dataset's own users (LEAF), one per client")


PARTITION_MODELS: tuple[type[PartitionParams], ...] = (IidPartition, DirichletPartition, ShardsPartition,
                                                    DominantLabelPartition, DeviceDirichletPartition, NaturalPartition)
PartitionConfig = Annotated[Union[PARTITION_MODELS], Field(discriminator="name")]  # noqa: UP007
PARTITION_PARAMS: dict[str, type[PartitionParams]] = {m.model_fields["name"].annotation.__args__[0]: m
                                                      for m in PARTITION_MODELS}


# --------------------------------------------------------------------------- helpers


def _check_labels(labels) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    if y.size and y.min() < 0:
        raise ValueError("labels must be non-negative")
    return y.astype(np.int64, copy=False)


def _check_clients(num_clients, n: int) -> int:
    if isinstance(num_clients, bool) or int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    num_clients = int(num_clients)
    if num_clients > n:
        raise ValueError(f"num_clients={num_clients} exceeds the number of samples ({n})")
    return num_clients


def _finish(parts) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


# --------------------------------------------------------------------------- partitioners


def iid_partition(labels, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    y = _check_labels(labels)
    num_clients = _check_clients(num_clients, len(y))
    perm = rng.permutation(len(y)).astype(np.int64)
    return _finish(np.array_split(perm, num_clients))


def dirichlet_partition(
    labels,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float,
    min_size: int,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    y = _check_labels(labels)
    n = len(y)
    num_clients = _check_clients(num_clients, n)
    alpha = float(alpha)
    if not alpha > 0 or not np.isfinite(alpha):
        raise ValueError(f"dirichlet: alpha must be a positive number, got {alpha}")
    min_size = int(min_size)
    if min_size < 0:
        raise ValueError(f"dirichlet: min_size must be >= 0, got {min_size}")
    if min_size * num_clients > n:
        raise ValueError(
            f"dirichlet: min_size={min_size} x num_clients={num_clients} exceeds the {n} samples"
        )
    classes = np.unique(y)
    class_idx = [np.flatnonzero(y == k) for k in classes]
    cap = n / num_clients
    for _ in range(int(max_tries)):
        batches: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx_k in class_idx:
            idx_k = rng.permutation(idx_k)
            p = rng.dirichlet(np.full(num_clients, alpha))
            p = np.where(sizes < cap, p, 0.0)
            total = p.sum()
            if not np.isfinite(total) or total <= 0:
                # numerical underflow at tiny alpha: give the class to one open client
                open_clients = np.flatnonzero(sizes < cap)
                p = np.zeros(num_clients)
                p[rng.choice(open_clients)] = 1.0
            else:
                p = p / total
            cuts = (np.cumsum(p) * len(idx_k)).astype(np.int64)[:-1]
            for j, chunk in enumerate(np.split(idx_k, cuts)):
                batches[j].append(chunk)
                sizes[j] += len(chunk)
        if sizes.min() >= min_size:
            return _finish(np.concatenate(b) if b else np.zeros(0, np.int64) for b in batches)
    raise ValueError(
        f"dirichlet: could not give every client >= min_size={min_size} samples in {max_tries} "
        f"draws (alpha={alpha}, num_clients={num_clients}, samples={n}); raise alpha or lower "
        "min_size/num_clients"
    )


def shards_partition(
    labels, num_clients: int, rng: np.random.Generator, *, per_client: int
) -> list[np.ndarray]:
    y = _check_labels(labels)
    num_clients = _check_clients(num_clients, len(y))
    per_client = int(per_client)
    num_shards = per_client * num_clients
    if per_client < 1 or num_shards > len(y):
        raise ValueError(
            f"shards: per_client={per_client} x num_clients={num_clients} shards need 1..{len(y)} shards"
        )
    perm = rng.permutation(len(y))
    order = perm[np.argsort(y[perm], kind="stable")].astype(np.int64)  # by label, random within class
    shards = np.array_split(order, num_shards)
    shard_order = rng.permutation(num_shards)
    return _finish(
        np.concatenate([shards[s] for s in shard_order[per_client * i : per_client * (i + 1)]])
        for i in range(num_clients)
    )


def dominant_label_partition(
    labels, num_clients: int, rng: np.random.Generator, *, ratio: float
) -> list[np.ndarray]:
    y = _check_labels(labels)
    num_clients = _check_clients(num_clients, len(y))
    ratio = float(ratio)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"dominant_label: ratio must be in [0, 1], got {ratio}")
    num_classes = int(y.max()) + 1 if len(y) else 0
    dominant = np.arange(num_clients) % max(num_classes, 1)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    everyone = np.arange(num_clients)
    for c in range(num_classes):
        idx_c = rng.permutation(np.flatnonzero(y == c)).astype(np.int64)
        cyclic = everyone[np.argsort((everyone - c - 1) % num_clients, kind="stable")]  # c+1, c+2, ...
        owners = everyone[dominant == c]
        others = cyclic[dominant[cyclic] != c]
        if len(owners) == 0:
            groups = [(cyclic, idx_c)]
        elif len(others) == 0:
            groups = [(owners, idx_c)]
        else:
            n_dom = int(np.floor(ratio * len(idx_c) + 0.5))
            groups = [(owners, idx_c[:n_dom]), (others, idx_c[n_dom:])]
        for clients, idx in groups:
            for k, chunk in zip(clients, np.array_split(idx, len(clients))):
                parts[k].append(chunk)
    return _finish(np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts)


def device_dirichlet_partition(labels, num_clients: int, rng: np.random.Generator, *, alpha: float) -> list[np.ndarray]:
    y = _check_labels(labels)
    n = len(y)
    num_clients = _check_clients(num_clients, n)
    if not 0 < float(alpha) <= 1:
        raise ValueError(f"device_dirichlet: alpha must lie in (0, 1], got {alpha}")
    classes = np.unique(y)
    beta = float(alpha) / (1 - float(alpha) + 1e-9)
    pools = [list(rng.permutation(np.flatnonzero(y == c))) for c in classes]
    left = np.array([len(p) for p in pools], dtype=float)
    sizes = np.full(num_clients, n // num_clients) + (np.arange(num_clients) < n % num_clients)
    parts = []
    for k in range(num_clients):
        p = rng.dirichlet(np.full(len(classes), beta))
        mine = []
        for _ in range(sizes[k]):
            q = p * (left > 0)
            q = q / q.sum() if q.sum() > 0 else (left > 0) / (left > 0).sum()
            c = int(rng.choice(len(classes), p=q))
            mine.append(pools[c].pop())
            left[c] -= 1
        parts.append(np.asarray(mine, dtype=np.int64))
    return _finish(parts)


PARTITIONERS: dict[str, Callable[..., list[np.ndarray]]] = {
    "device_dirichlet": device_dirichlet_partition,
    "iid": iid_partition,
    "dirichlet": dirichlet_partition,
    "shards": shards_partition,
    "dominant_label": dominant_label_partition,
}


def partition(
    name: str, labels, num_clients: int, rng: np.random.Generator, **params
) -> list[np.ndarray]:
    """Split sample indices over ``num_clients`` with the named partitioner; a parameter not given takes its
    default from the partitioner's parameters model (:data:`PARTITION_MODELS`, the config's ``data.partition``).

    Unknown partitioner names, unknown parameters and missing required parameters raise
    ``ValueError`` naming them.
    """
    if name == "natural":
        raise ValueError(
            "partitioner 'natural' is not label-based: use natural_partition(bundle, num_clients)"
        )
    if name not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {name!r}; known: {', '.join(sorted(PARTITIONERS))} (+ natural)")
    fn = PARTITIONERS[name]
    params = {**PARTITION_PARAMS[name](name=name).params(), **params}  # the config's defaults (one place)
    sig = inspect.signature(fn).parameters
    allowed = [k for k, p in sig.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    bad = sorted(set(params) - set(allowed))
    if bad:
        raise ValueError(f"unknown parameter(s) {bad} for partitioner {name!r}; allowed: {allowed or 'none'}")
    missing = [k for k in allowed if sig[k].default is inspect.Parameter.empty and k not in params]
    if missing:
        raise ValueError(f"partitioner {name!r} needs parameter(s) {missing}")
    if not isinstance(rng, np.random.Generator):
        raise ValueError("rng must be a numpy.random.Generator (np.random.default_rng(seed))")
    return fn(labels, num_clients, rng, **params)


def natural_partition(bundle, num_clients: int | None = None, rng: np.random.Generator | None = None,
                      *, return_test: bool = False):
    """LEAF's natural split: one client per user (writer / speaking role).

    Users without training samples are dropped.  ``num_clients=None`` keeps every user;
    otherwise ``num_clients`` users are kept: the first ones in file order, or a random
    subset (kept in file order) if ``rng`` is given.  Indices of users not kept are not
    assigned to anyone.  Returns the train index arrays, or ``(train, test)`` aligned by
    user if ``return_test``.
    """
    if bundle.natural_train is None:
        raise ValueError(f"dataset {bundle.spec.name!r} has no natural (per-user) partition")
    users = [i for i, p in enumerate(bundle.natural_train) if len(p) > 0]
    if num_clients is not None:
        num_clients = int(num_clients)
        if not 1 <= num_clients <= len(users):
            raise ValueError(
                f"natural: num_clients={num_clients} but the dataset has {len(users)} users with data"
            )
        if rng is not None:
            users = sorted(rng.choice(np.asarray(users), size=num_clients, replace=False).tolist())
        else:
            users = users[:num_clients]
    train = _finish(bundle.natural_train[i] for i in users)
    if not return_test:
        return train
    nat_test = bundle.natural_test
    test = _finish(
        (nat_test[i] if nat_test is not None and i < len(nat_test) else np.zeros(0, np.int64)) for i in users
    )
    return train, test


# --------------------------------------------------------------------------- splits


def labeled_split(labels, num_labeled: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Class-balanced labelled (server) set and the remaining indices.

    Takes ``num_labeled // C`` random samples of every class present in ``labels``
    (``C`` = number of distinct labels; a remainder of ``num_labeled % C`` is dropped).
    Raises ``ValueError`` if a class has fewer samples than that.
    """
    y = _check_labels(labels)
    num_labeled = int(num_labeled)
    if num_labeled < 0 or num_labeled > len(y):
        raise ValueError(f"labeled_split: num_labeled={num_labeled} not in [0, {len(y)}]")
    classes = np.unique(y)
    if num_labeled == 0:
        return np.zeros(0, np.int64), np.arange(len(y), dtype=np.int64)
    per_class = num_labeled // len(classes)
    if per_class == 0:
        raise ValueError(
            f"labeled_split: num_labeled={num_labeled} is fewer than the {len(classes)} classes"
        )
    chosen = []
    for c in classes:
        idx = np.flatnonzero(y == c)
        if len(idx) < per_class:
            raise ValueError(
                f"labeled_split: class {int(c)} has {len(idx)} samples, fewer than the "
                f"{per_class} per class needed for num_labeled={num_labeled}"
            )
        chosen.append(rng.choice(idx, size=per_class, replace=False))
    labeled = np.sort(np.concatenate(chosen).astype(np.int64))
    mask = np.ones(len(y), dtype=bool)
    mask[labeled] = False
    return labeled, np.flatnonzero(mask).astype(np.int64)


def client_train_test_split(
    parts: list[np.ndarray], test_fraction: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Sample-wise per-client split (LEAF ``-t sample``; CycleSL uses 0.1).

    Each client keeps ``round(test_fraction * n)`` random samples for test, but at
    least one for training.  Returns ``(train_parts, test_parts)``.
    """
    test_fraction = float(test_fraction)
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    train, test = [], []
    for i, p in enumerate(parts):
        p = np.asarray(p, dtype=np.int64)
        if len(p) == 0:
            raise ValueError(f"client_train_test_split: client {i} has no samples")
        perm = rng.permutation(p)
        n_test = min(len(p) - 1, int(np.floor(test_fraction * len(p) + 0.5)))
        test.append(np.sort(perm[:n_test]))
        train.append(np.sort(perm[n_test:]))
    return train, test


# --------------------------------------------------------------------------- statistics


def partition_counts(parts, labels, num_classes: int) -> np.ndarray:
    """``(clients, classes)`` int64 matrix of label counts per client."""
    y = _check_labels(labels)
    if len(y) and y.max() >= num_classes:
        raise ValueError(f"label {int(y.max())} >= num_classes={num_classes}")
    return np.stack(
        [np.bincount(y[np.asarray(p, dtype=np.int64)], minlength=num_classes) for p in parts]
    ).astype(np.int64) if len(parts) else np.zeros((0, num_classes), np.int64)


def partition_summary(counts) -> dict[str, float]:
    """Flat float statistics of a counts matrix.

    ``emd_to_global_mean`` is the mean over clients of ``sum_k |p_client(k) - p_global(k)|``
    (Zhao et al. 2018's "EMD"; twice the total-variation distance, range [0, 2]).
    ``labels_per_client_mean`` counts labels with at least one sample;
    ``dominant_label_share_mean`` is the mean of ``max_k count / total``.
    Clients without samples are left out of the label statistics.
    """
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] == 0:
        raise ValueError(f"counts must be a non-empty (clients, classes) matrix, got shape {c.shape}")
    sizes = c.sum(axis=1)
    nz = sizes > 0
    glob = c.sum(axis=0)
    glob = glob / glob.sum() if glob.sum() > 0 else glob
    if nz.any():
        dist = c[nz] / sizes[nz, None]
        labels_per_client = float((c[nz] > 0).sum(axis=1).mean())
        dominant = float(dist.max(axis=1).mean())
        emd = float(np.abs(dist - glob[None]).sum(axis=1).mean())
    else:
        labels_per_client = dominant = emd = 0.0
    return {
        "clients": float(c.shape[0]),
        "samples_mean": float(sizes.mean()),
        "samples_std": float(sizes.std()),
        "samples_min": float(sizes.min()),
        "samples_max": float(sizes.max()),
        "labels_per_client_mean": labels_per_client,
        "dominant_label_share_mean": dominant,
        "emd_to_global_mean": emd,
    }


def plot_partition(counts, path: str, title: str = "", max_clients: int = 100) -> None:
    """Stacked horizontal bar per client (segments = labels) written as a PNG.

    Uses the Agg canvas directly (no pyplot, no global backend change).  At most
    ``max_clients`` clients are drawn (evenly spaced ones if there are more; the
    title says so).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    import matplotlib

    c = np.asarray(counts)
    if c.ndim != 2:
        raise ValueError(f"counts must be 2-D, got shape {c.shape}")
    n_clients, n_classes = c.shape
    shown = np.arange(n_clients)
    note = ""
    if n_clients > max_clients:
        shown = np.unique(np.linspace(0, n_clients - 1, max_clients).round().astype(int))
        note = f" ({len(shown)} of {n_clients} clients shown)"
    sub = c[shown]
    height = min(2.0 + 0.18 * len(shown), 24.0)
    fig = Figure(figsize=(9, height))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cmap = matplotlib.colormaps["tab10" if n_classes <= 10 else "tab20" if n_classes <= 20 else "viridis"]
    colors = [cmap(k) if n_classes <= 20 else cmap(k / max(n_classes - 1, 1)) for k in range(n_classes)]
    # one PolyCollection of rectangles (fast even for 100 clients x 100 labels)
    from matplotlib.collections import PolyCollection

    ypos = np.arange(len(shown))
    right = np.cumsum(sub, axis=1).astype(np.float64)
    left = right - sub
    rows, cols = np.nonzero(sub > 0)
    h = 0.85 / 2
    verts = [
        ((left[r, k], ypos[r] - h), (right[r, k], ypos[r] - h), (right[r, k], ypos[r] + h), (left[r, k], ypos[r] + h))
        for r, k in zip(rows, cols)
    ]
    ax.add_collection(PolyCollection(verts, facecolors=[colors[k] for k in cols], linewidths=0))
    ax.set_xlim(0, max(float(right[:, -1].max()) if right.size else 0.0, 1.0) * 1.02)
    ax.set_ylim(-0.6, len(shown) - 0.4)
    if n_classes <= 20:
        from matplotlib.patches import Patch

        handles = [Patch(color=colors[k], label=str(k)) for k in range(n_classes)]
        ax.legend(handles=handles, title="label", loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    ax.set_yticks(ypos)
    ax.set_yticklabels([str(i) for i in shown], fontsize=6 if len(shown) > 30 else 8)
    ax.invert_yaxis()
    ax.set_xlabel("samples")
    ax.set_ylabel("client")
    ax.set_title((title or "partition") + note)
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
