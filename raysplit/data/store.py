"""A disk-backed store of consolidated activations (Ampere's server phase) and a loader that feeds shuffled batches
with bounded memory. Building block: numpy and threads only (no Ray, no MLflow).

Layout: one folder per store; every arriving chunk becomes a shard, two ``.npy`` files (features, labels) written
to a temporary name and renamed, so a shard is either whole or absent. ``seal()`` writes ``manifest.json`` (shards,
rows, the device each came from) the same way, last; a store without a manifest is incomplete and :meth:`open`
refuses it, so a store half-written by a crash is never read as complete. Shards are ``.npy`` files rather than
Parquet: benchmarks/store.py measured both (benchmarks/archive/RESULTS-2026-11-22-to-25.md, "Ampere's activation
store").

:class:`ShuffledLoader` reads an epoch in G groups, G the smallest count for which a group fits half of
``cache_bytes`` (a background thread loads the next group while the current one is consumed, so at most two
groups are in memory). Every shard's rows are permuted and cut into G slices; group g holds slice g of every shard,
read through a memory map, so each group mixes every device's activations (a batch is not drawn from a few
devices' chunks even when the cache is much smaller than the store). Row orders come from ``(seed, epoch)``, every
row appears exactly once per epoch, and rows left over at the end of a group (fewer than a batch) are carried into
the next, so every batch but the epoch's last is full. Batches are gathered row by row from the loaded group,
never from a shuffled copy of it.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np


class IncompleteStore(RuntimeError):
    """The store has no manifest: its writer stopped before sealing it."""


def check_space(path: str | Path, expected_bytes: int, key: str = "store path") -> None:
    """Raise ValueError naming ``key`` unless ``path`` can be created, written to and has room for the bytes."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".write-probe"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{key} {p} is not writable: {e}") from None
    free = shutil.disk_usage(p).free
    if free < expected_bytes:
        raise ValueError(f"{key} {p} has {free / 1e9:.2f} GB free, the activations need {expected_bytes / 1e9:.2f} GB")


def _atomic_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)


class ActivationStore:
    """Shards of (features, labels) on disk, appended as they arrive, sealed by a manifest."""

    def __init__(self, path: str | Path, fresh: bool = True):
        self.path = Path(path)
        if fresh:
            if self.path.exists():
                shutil.rmtree(self.path)
            self.path.mkdir(parents=True)
        self.shards: list[dict] = []  # {"name", "rows", "source", "nbytes"}

    def append(self, x: np.ndarray, y: np.ndarray, source: int) -> None:
        name = f"shard{len(self.shards):06d}"
        _atomic_npy(self.path / f"{name}.x.npy", np.ascontiguousarray(x))
        _atomic_npy(self.path / f"{name}.y.npy", np.asarray(y, dtype=np.int64))
        self.shards.append({"name": name, "rows": int(len(y)), "source": int(source),
                            "nbytes": int(np.asarray(x).nbytes + len(y) * 8)})

    @property
    def rows(self) -> int:
        return sum(s["rows"] for s in self.shards)

    def seal(self) -> None:
        tmp = self.path / "manifest.json.tmp"
        tmp.write_text(json.dumps({"complete": True, "shards": self.shards}))
        os.replace(tmp, self.path / "manifest.json")

    @classmethod
    def open(cls, path: str | Path) -> "ActivationStore":
        p = Path(path)
        manifest = p / "manifest.json"
        if not manifest.is_file():
            raise IncompleteStore(f"activation store {p} has no manifest: it was not sealed (its writer stopped)")
        store = cls(p, fresh=False)
        store.shards = json.loads(manifest.read_text())["shards"]
        return store

    def load(self, shard: dict) -> tuple[np.ndarray, np.ndarray]:
        return (np.load(self.path / f"{shard['name']}.x.npy"), np.load(self.path / f"{shard['name']}.y.npy"))


class ShuffledLoader:
    """Shuffled batches of a store, each row once per epoch, with at most ``cache_bytes`` of rows in memory."""

    def __init__(self, store: ActivationStore, batch_size: int, cache_bytes: int, seed: int,
                 shards: list[dict] | None = None):
        self.store, self.batch_size, self.cache_bytes, self.seed = store, batch_size, cache_bytes, seed
        self.shards = list(store.shards if shards is None else shards)
        self.peak_bytes = 0  # the most row bytes held at once (tests check it against cache_bytes)
        self._held = 0
        self._lock = threading.Lock()

    def _load(self, parts: list[tuple[dict, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, int]:
        """The given rows of the given shards, read through memory maps (only those rows are read)."""
        xs, ys, nbytes = [], [], 0
        for shard, rows in parts:
            x = np.load(self.store.path / f"{shard['name']}.x.npy", mmap_mode="r")
            y = np.load(self.store.path / f"{shard['name']}.y.npy", mmap_mode="r")
            xs.append(np.array(x[rows]))
            ys.append(np.array(y[rows]))
            nbytes += len(rows) * shard["nbytes"] // max(shard["rows"], 1)
            del x, y
        with self._lock:
            self._held += nbytes
            self.peak_bytes = max(self.peak_bytes, self._held)
        return np.concatenate(xs), np.concatenate(ys), nbytes

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes

    def epoch(self, e: int):
        """Yield ``(x, y)`` numpy batches of epoch ``e``."""
        rng = np.random.default_rng([self.seed, 0x570, e])
        total = sum(s["nbytes"] for s in self.shards)
        # two groups in memory at most; a slice may hold one row more than its share, hence the margin
        budget = self.cache_bytes // 2 - sum(-(-s["nbytes"] // max(s["rows"], 1)) for s in self.shards)
        if budget <= 0:
            raise ValueError(f"a cache of {self.cache_bytes} bytes cannot hold a row of each of the "
                             f"{len(self.shards)} shards twice; raise it")
        groups_n = max(1, min(-(-total // budget), max(s["rows"] for s in self.shards)))  # no group left empty
        slices = [np.array_split(rng.permutation(s["rows"]), groups_n) for s in self.shards]
        groups = [[(s, np.sort(slices[i][g])) for i, s in enumerate(self.shards) if len(slices[i][g])]
                  for g in range(groups_n)]
        result: dict = {}

        def prefetch(i):
            try:
                result[i] = self._load(groups[i])
            except BaseException as e:  # noqa: BLE001 - re-raised in the consuming thread
                result[i] = e

        nxt = threading.Thread(target=prefetch, args=(0,))
        nxt.start()
        bs, carry_x, carry_y = self.batch_size, None, None
        for i in range(groups_n):
            nxt.join()
            loaded = result.pop(i)
            if isinstance(loaded, BaseException):
                raise loaded
            x, y, nbytes = loaded
            if i + 1 < groups_n:
                nxt = threading.Thread(target=prefetch, args=(i + 1,))
                nxt.start()
            perm = rng.permutation(len(y))  # rows are gathered per batch: no shuffled copy of the group
            pos = 0
            if carry_y is not None and len(carry_y) + len(y) >= bs:
                pos = bs - len(carry_y)
                yield np.concatenate([carry_x, x[perm[:pos]]]), np.concatenate([carry_y, y[perm[:pos]]])
                carry_x = carry_y = None
            while pos + bs <= len(y):
                idx = perm[pos:pos + bs]
                yield x[idx], y[idx]
                pos += bs
            rest = perm[pos:]  # fewer than a batch: carried into the next group
            carry_x = x[rest] if carry_x is None else np.concatenate([carry_x, x[rest]])
            carry_y = y[rest] if carry_y is None else np.concatenate([carry_y, y[rest]])
            del x, y
            self._release(nbytes)
        if carry_y is not None and len(carry_y):
            yield carry_x, carry_y
