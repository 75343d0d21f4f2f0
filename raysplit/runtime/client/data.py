"""A client host's data component: the samples of the clients it holds and each client's data cursor.

A client's batches come from a permutation of its training indices drawn from (seed, client, epoch), so they do not
depend on which host holds the client or what ran before on it; the cursor is (epoch, position) in that permutation.
:func:`advance_cursor` is the one rule for where the next batch starts; the event loop (runtime/events.py) predicts a
client's batch sizes with the same function."""

from __future__ import annotations

import numpy as np
import torch

from raysplit.data import DataSpec, to_tensor


def advance_cursor(n: int, batch_size: int, cursor: tuple[int, int],
                   drop_last: bool = False) -> tuple[int, int, int]:
    """A client's next batch from its data cursor ``(epoch, position)``: ``(epoch, start, stop)`` in the epoch's
    permutation. A new epoch starts once the last (possibly short) batch is drawn; with ``drop_last``
    (``train.drop_last``) once fewer than ``batch_size`` samples are left, unless the whole pass is one short
    batch (``n < batch_size``)."""
    epoch, pos = cursor
    if pos >= n or (drop_last and pos > 0 and pos + batch_size > n):
        epoch, pos = epoch + 1, 0
    return epoch, pos, min(pos + batch_size, n)


class ClientData:
    """The samples (``x``, ``y``: the worker's copy of the dataset) and, per hosted client, its training and test
    indices and its data cursor. ``changed`` is the host's set of clients whose state changed since its last
    incremental snapshot; drawing a batch adds the client to it."""

    client_fields = ("train_idx", "test_idx", "cursor")  # per-client state that moves with a client

    def __init__(self, data: dict, train_idx: dict, test_idx: dict, spec: DataSpec, *, batch_size: int, seed: int,
                 drop_last: bool, changed: set[int], device: torch.device = torch.device("cpu")):
        self.x, self.y = data["x"], data["y"]
        self.device = device
        # on a GPU the samples are copied there once, as stored (uint8 images stay uint8), and batches are cut and
        # converted there; on the CPU they are read from the worker's copy of the dataset
        self._on_device = None if device.type == "cpu" else (
            torch.from_numpy(np.array(self.x, copy=True)).to(device),
            torch.as_tensor(np.asarray(self.y), dtype=torch.long).to(device))
        self.spec = spec
        self.batch_size, self.seed, self.drop_last = batch_size, seed, drop_last
        self.train_idx = {int(c): np.asarray(v) for c, v in train_idx.items()}
        self.test_idx = {int(c): np.asarray(v) for c, v in test_idx.items()}
        self.cursor: dict[int, tuple[int, int]] = {c: (0, 0) for c in self.train_idx}
        self._perm: dict[int, tuple[int, np.ndarray]] = {}
        self.changed = changed
        self.drawn: dict[int, int] = {}  # samples drawn per client since the last take_drawn (a round's)

    def __contains__(self, cid: int) -> bool:
        return cid in self.train_idx

    def size(self, cid: int) -> int:
        """Client ``cid``'s training samples."""
        return len(self.train_idx[cid])

    def draw(self, cid: int, batch_size: int | None = None) -> np.ndarray:
        """Indices of the client's next batch; advances its cursor (:func:`advance_cursor`)."""
        idx_all = self.train_idx[cid]
        epoch, start, stop = advance_cursor(len(idx_all), batch_size or self.batch_size, self.cursor[cid],
                                            self.drop_last)
        cached = self._perm.get(cid)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.seed, cid, epoch])
            cached = (epoch, rng.permutation(idx_all))
            self._perm[cid] = cached
        self.cursor[cid] = (epoch, stop)
        self.changed.add(cid)
        self.drawn[cid] = self.drawn.get(cid, 0) + (stop - start)
        return cached[1][start:stop]

    def take_drawn(self) -> dict[int, int]:
        """The samples drawn per client since the last call (a round's: a language model's tokens trained are
        these blocks' tokens); the count restarts."""
        out, self.drawn = self.drawn, {}
        return out

    def batch(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples ``idx`` as model input and labels (on the host's device)."""
        if self._on_device is not None:
            at = torch.as_tensor(np.asarray(idx), dtype=torch.long, device=self.device)
            return to_tensor(self._on_device[0][at], self.spec), self._on_device[1][at]
        x = to_tensor(self.x[idx], self.spec)
        y = torch.as_tensor(np.asarray(self.y[idx]), dtype=torch.long)
        return x, y

    def features(self, idx: np.ndarray) -> torch.Tensor:
        """The samples ``idx`` as model input (on the host's device)."""
        if self._on_device is not None:
            at = torch.as_tensor(np.asarray(idx), dtype=torch.long, device=self.device)
            return to_tensor(self._on_device[0][at], self.spec)
        return to_tensor(self.x[idx], self.spec)

    def labels(self, idx: np.ndarray) -> np.ndarray:
        """The labels of ``idx`` as they are stored, in host memory (int64): what an activation carries. Read from
        the worker's copy of the dataset, never back from a device."""
        return np.asarray(self.y[idx], dtype=np.int64)

    def forget(self, cid: int | None = None) -> None:
        """Drop the cached permutation of ``cid`` (of every client: None); it is redrawn from the seed on use."""
        if cid is None:
            self._perm.clear()
        else:
            self._perm.pop(cid, None)
