"""Per-client state that may not fit in memory: an LRU store with a memory budget that spills to disk. No Ray here.

A client host keeps, per virtual client, its own model weights (algorithms without a global client model) and its
optimizer state. With thousands of clients keeping a ResNet block each, that outgrows an actor's memory, so these
values live in a :class:`SpillStore`: the most recently used ones in memory up to ``budget_bytes``, the others
in one file each under ``directory`` (written to a temporary name and renamed, read back with
``torch.load(weights_only=True)``), loaded again when used. ``budget_bytes=None`` keeps everything in memory.
Each kind of value is a :class:`StoreView`, a mutable mapping from client id to value, so host code reads
``self.own[c]`` whether the value is in memory or on disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch


def nbytes(value: Any) -> int:
    """Bytes held by the tensors and arrays in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


class SpillStore:
    """Values keyed by ``(kind, client)``, least recently used spilled to disk beyond ``budget_bytes``."""

    def __init__(self, budget_bytes: int | None = None, directory: str | None = None):
        self.budget = budget_bytes
        self._parent = directory
        self._dir: Path | None = None
        self._mem: OrderedDict[tuple, Any] = OrderedDict()  # in memory, least recently used first
        self._size: dict[tuple, int] = {}
        self._disk: set[tuple] = set()
        self.bytes_in_memory = 0
        self.spills = 0  # values written to disk
        self.loads = 0  # values read back

    def view(self, kind: str) -> "StoreView":
        return StoreView(self, kind)

    # ---- the LRU ----------------------------------------------------------------------------------------------
    def _path(self, key: tuple) -> Path:
        if self._dir is None:
            if self._parent:
                Path(self._parent).mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="raysplit-spill-", dir=self._parent))
        return self._dir / f"{key[0]}-{key[1]}.pt"

    def get(self, key: tuple) -> Any:
        """The value (read back into memory if it was spilled, which may spill others)."""
        if key in self._mem:
            self._mem.move_to_end(key)
            return self._mem[key]
        value = self.take(key)
        self._keep(key, value)
        return value

    def peek(self, key: tuple) -> Any:
        """The value, without making it recently used or reading it into the store's memory (a snapshot)."""
        if key in self._mem:
            return self._mem[key]
        if key not in self._disk:
            raise KeyError(key)
        self.loads += 1
        return torch.load(self._path(key), weights_only=True)

    def take(self, key: tuple) -> Any:
        """The value, removed from the store (a client moving to another host)."""
        if key in self._mem:
            self.bytes_in_memory -= self._size.pop(key)
            return self._mem.pop(key)
        value = self.peek(key)
        self._disk.discard(key)
        self._path(key).unlink()
        return value

    def put(self, key: tuple, value: Any) -> None:
        self.discard(key)
        self._keep(key, value)

    def _keep(self, key: tuple, value: Any) -> None:
        self._mem[key] = value
        self._size[key] = nbytes(value)
        self.bytes_in_memory += self._size[key]
        self._evict(keep=key)

    def _evict(self, keep: tuple) -> None:
        if self.budget is None:
            return
        while self.bytes_in_memory > self.budget and len(self._mem) > 1:
            key = next(iter(self._mem))
            if key == keep:  # the value just used stays, even alone over the budget
                break
            value = self._mem.pop(key)
            self.bytes_in_memory -= self._size.pop(key)
            path = self._path(key)
            tmp = path.with_suffix(".tmp")
            torch.save(value, tmp)
            os.replace(tmp, path)
            self._disk.add(key)
            self.spills += 1

    def discard(self, key: tuple) -> None:
        if key in self._mem:
            del self._mem[key]
            self.bytes_in_memory -= self._size.pop(key)
        elif key in self._disk:
            self._disk.discard(key)
            self._path(key).unlink()

    def __contains__(self, key: tuple) -> bool:
        return key in self._mem or key in self._disk

    def keys(self, kind: str) -> list:
        return [k[1] for k in list(self._mem) + sorted(self._disk, key=str) if k[0] == kind]

    def close(self) -> None:
        """Forget everything and remove the spill directory."""
        self._mem.clear()
        self._size.clear()
        self._disk.clear()
        self.bytes_in_memory = 0
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __del__(self):
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class StoreView(MutableMapping):
    """One kind of per-client value in a :class:`SpillStore`, as a mapping from client id."""

    def __init__(self, store: SpillStore, kind: str):
        self.store, self.kind = store, kind

    def __getitem__(self, cid):
        return self.store.get((self.kind, cid))

    def __setitem__(self, cid, value) -> None:
        self.store.put((self.kind, cid), value)

    def __delitem__(self, cid) -> None:
        if (self.kind, cid) not in self.store:
            raise KeyError(cid)
        self.store.discard((self.kind, cid))

    def __contains__(self, cid) -> bool:
        return (self.kind, cid) in self.store

    def peek(self, cid):
        return self.store.peek((self.kind, cid))

    def pop(self, cid, *default):
        if (self.kind, cid) not in self.store:
            if default:
                return default[0]
            raise KeyError(cid)
        return self.store.take((self.kind, cid))

    def __iter__(self) -> Iterator:
        return iter(self.store.keys(self.kind))

    def __len__(self) -> int:
        return len(self.store.keys(self.kind))

    def clear(self) -> None:
        for cid in self.store.keys(self.kind):
            self.store.discard((self.kind, cid))
