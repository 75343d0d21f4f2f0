"""Which client actor hosts which virtual client: placement by load, deterministic, sticky. No Ray here.

Every virtual client's state (cursor, clock, counters, its own model and optimizer state where the algorithm keeps
them) is held by exactly one client host, its *holder*; a client starts at its home worker ``c mod W``. Before a
synchronous round, :func:`assign` spreads the round's sampled clients over the ``W`` workers so each gets
``floor(n / W)`` or ``ceil(n / W)`` of them, keeping a client on its holder where that fits (no state moves) and
moving the others to the workers with room, lowest index first; the runtime then moves those clients' state from
their old holder to the new one. The mapping is a pure function of the round's clients and the holders, both
determined by the seed, so it is reproducible; and since a client's computation depends only on its own state and
its own random stream, results do not depend on the number of workers or on where a client runs.
"""

from __future__ import annotations

import numpy as np


def home(cid: int, num_workers: int) -> int:
    """Where client ``cid`` starts (and stays under the event driver, which moves no client)."""
    return int(cid) % num_workers


def assign(clients: list[int], num_workers: int, holders: np.ndarray) -> dict[int, int]:
    """Worker per client of the round: balanced (every worker ``floor(n/W)`` or ``ceil(n/W)`` clients), clients
    kept on their holder (``holders[c]``) where the balance allows, the rest placed in ascending client id on the
    workers with room (lowest worker index first)."""
    clients = sorted({int(c) for c in clients})
    n, w = len(clients), num_workers
    low, extra = divmod(n, w)  # ``extra`` workers may take low + 1
    load = np.zeros(w, dtype=np.int64)
    over = 0  # workers already at low + 1

    def room(k: int) -> bool:
        return load[k] < low or (load[k] == low and over < extra)

    out: dict[int, int] = {}
    for c in clients:  # stay where the state is
        k = int(holders[c])
        if room(k):
            over += int(load[k] == low)
            load[k] += 1
            out[c] = k
    for c in clients:  # the rest where there is room
        if c in out:
            continue
        k = next(k for k in range(w) if load[k] < low) if (load < low).any() else \
            next(k for k in range(w) if room(k))
        over += int(load[k] == low)
        load[k] += 1
        out[c] = k
    return out


def move_clients(backend, holders: np.ndarray, clients: list[int]) -> None:
    """Spread the round's clients over the backend's workers (:func:`assign`) and move the state of those that
    change worker from their old holder to the new one (``holders`` updated; handles chained: nothing passes through
    the caller)."""
    workers = backend.workers
    moves: dict[int, dict[int, list[int]]] = {}
    for c, w in assign(clients, len(workers), holders).items():
        if holders[c] != w:
            moves.setdefault(w, {}).setdefault(int(holders[c]), []).append(c)
    for dst, srcs in sorted(moves.items()):
        bundles = [backend.call(workers[src], "export_clients", cids) for src, cids in sorted(srcs.items())]
        backend.call(workers[dst], "import_clients", *bundles)
        for cids in srcs.values():
            holders[cids] = dst
