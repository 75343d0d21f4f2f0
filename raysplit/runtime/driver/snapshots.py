"""Round-boundary snapshots for surviving a dead actor (``RoundGuard``), kept off the driver's path. No Ray here.

Before every round each host hands in its state (the server's whole state; each client host's own state and only
the virtual clients changed since the last snapshot) together with the global client model. A
:class:`SnapshotStore` merges those parts into one complete snapshot: the latest state of every virtual client and
of every host. With the Ray backend the store lives in a keeper actor of its own on the driver's node
(``RayBackend.snapshot_keeper``): the driver only submits the hosts' ``state_dict`` calls and hands their result
handles to the keeper, without waiting for or receiving any of it, and fetches nothing unless an actor dies. Then
the keeper returns the snapshot as separate objects that go straight to the replacement hosts.

A part only counts once every part of its round has arrived: if a host dies before its state for round ``r`` is
taken, the keeper still holds round ``r - 1``'s complete snapshot, and the guard redoes from there.
"""

from __future__ import annotations

from typing import Any

from raysplit.runtime.state import owned


class SnapshotStore:
    """The latest complete round-boundary snapshot, merged incrementally over the virtual clients."""

    def __init__(self):
        self.round: int | None = None
        self.server: Any = None
        self.workers: list[dict] = []  # each client host's own state, without its clients
        self.holders: Any = None
        self.global_msg: Any = None
        self.clients: dict[int, dict] = {}  # every virtual client's state as of the last snapshot

    def add(self, rnd: int, server: dict, workers: list[dict], holders, global_msg) -> int:
        """Round ``rnd``'s parts (made the store's own: they may be read-only views of shared memory, and are
        kept across rounds); returns ``rnd``."""
        server, workers, global_msg = owned(server), owned(workers), owned(global_msg)
        clients = dict(self.clients)
        for w in workers:
            clients.update(w.pop("clients"))
        self.round, self.server, self.workers, self.holders = rnd, server, workers, owned(holders)
        self.global_msg, self.clients = global_msg, clients
        return rnd

    def restore(self) -> tuple[int, dict, Any]:
        """``(round, runtime state, global model)``: the runtime state as ``Runtime.load_state_dict`` takes it,
        every client host's held clients filled in from the merged copy."""
        if self.round is None:
            raise LookupError("no complete snapshot yet")
        workers = [{**w, "clients": {c: self.clients[c] for c in w["held"]}} for w in self.workers]
        return self.round, {"server": self.server, "workers": workers, "holders": self.holders}, self.global_msg


class LocalKeeper:
    """The keeper of the local backend: the store itself, in process."""

    def __init__(self):
        self.store = SnapshotStore()

    def add(self, rnd: int, server, workers: list, holders, global_msg) -> None:
        self.store.add(rnd, server, list(workers), holders, global_msg)

    def restore(self, num_workers: int) -> tuple[int, Any, Any, list, Any]:
        """``(round, holders, server state, [client host states], global model)``."""
        rnd, st, g = self.store.restore()
        return rnd, st["holders"], st["server"], st["workers"], g

    def close(self) -> None:
        self.store = SnapshotStore()
