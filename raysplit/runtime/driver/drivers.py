"""Drivers: the loops that run an algorithm over the runtime, one global round at a time.

- :class:`RoundDriver` (synchronous methods): per round, take the round's clients from the sampling stream,
  ``begin_round``, the algorithm's ``run_round``, ``end_round``.
- :class:`EventDriver` (asynchronous methods) runs the event loop on the virtual clock
  until the next global model exists (``runtime/async_server.py``, ``runtime/events.py``).

A driver knows neither MLflow nor Ray: the experiment hands it a callback that reports (and checkpoints) each
finished round, and it exposes its own state for checkpoints. ``global_handle`` is the handle to the latest global
client model (None for algorithms that keep none).
"""

from __future__ import annotations

from typing import Callable, ClassVar

import numpy as np

from raysplit.errors import ActorFailure, ResourceError
from raysplit.runtime.messages import StateMsg
from raysplit.runtime.server.async_host import AsyncServer
from raysplit.runtime.server.host import ServerHost


class Driver:
    """What every driver shares: the runtime, the algorithm, the seed, the simulated time so far."""

    asynchronous: ClassVar[bool] = False  # hosts run asynchronous jobs (Method.asynchronous)
    server_host: ClassVar[type] = ServerHost  # the server host it drives (the method's server rule inside)

    def __init__(self, rt, algorithm, sample_stream: np.ndarray, seed: int):
        self.rt = rt
        self.algorithm = algorithm
        self.sample_stream = sample_stream
        self.seed = seed
        self.t_sim = 0.0
        self.global_handle = rt.put(StateMsg(rt.inputs.client_init))

    def run(self, start: int, rounds: int, on_round: Callable[[int, object], None], guard=None) -> None:
        """Run global rounds ``start .. rounds-1``, or until the algorithm says it has finished (early stopping);
        ``on_round(rnd, RoundStats)`` after each. With a ``guard`` (:class:`RoundGuard`), a round (with its
        ``on_round``) during which an actor died is redone from the state the guard took before it; so are the
        run's last actor calls, :meth:`client_totals` (fetched here, then kept): an actor that dies after the last
        round (a lost node's workers can answer for a few seconds before Ray declares the node dead) redoes that
        round instead of failing the finished run."""
        self.__dict__.pop("client_totals", None)
        rnd, last, done = start, start - 1, start >= rounds
        while True:
            try:
                if done:
                    if guard is not None:
                        totals = self.client_totals()
                        self.client_totals = lambda: totals  # an instance attribute: a subclass's method too
                    return
                if guard is not None:
                    guard.snapshot(rnd)
                on_round(rnd, self.round(rnd))
            except ActorFailure as e:
                if guard is None:
                    raise
                rnd = guard.recover(e, last if done else rnd)  # the round to redo; raises past the retry budget
                done = False
                continue
            last = rnd
            rnd += 1
            done = rnd >= rounds or self.algorithm.finished()

    def round(self, rnd: int):
        raise NotImplementedError

    def client_totals(self) -> dict[int, dict]:
        """Per-client totals over the run (bytes, FLOPs, steps, rounds) for the accounting artifact."""
        return self.rt.client_totals()

    def state_dict(self) -> dict:
        g = self.global_handle
        return {"t_sim": self.t_sim, "global": self.rt.get(g) if g is not None else None,
                "algorithm": self.algorithm.state_dict()}

    def load_state_dict(self, st: dict) -> None:
        self.t_sim = st["t_sim"]
        self.global_handle = self.rt.put(st["global"]) if st["global"] is not None else None
        self.algorithm.load_state_dict(st.get("algorithm", {}))

    def snapshot(self) -> dict:
        """The driver's own state before a round, for ``RoundGuard``: as :meth:`state_dict`, but the global model
        stays a handle (the guard's keeper takes it over; nothing is fetched here)."""
        return {"t_sim": self.t_sim, "global_handle": self.global_handle, "algorithm": self.algorithm.state_dict()}

    def restore(self, snap: dict, global_handle) -> None:
        self.t_sim = snap["t_sim"]
        self.global_handle = global_handle
        self.algorithm.load_state_dict(snap.get("algorithm", {}))


class RoundGuard:
    """Survives actor deaths (``runtime.faults.max_retries``): before every round it has the state of the runtime's hosts
    kept (by the backend's snapshot keeper, :mod:`raysplit.runtime.driver.snapshots`) and keeps the driver's (algorithm
    included) and whatever ``extra`` snapshots (the reporter); after an actor died it replaces every actor, restores
    the last complete snapshot and lets the driver redo from its round, so the run's metrics equal an uninterrupted
    run's. ``on_restart(count, error)`` is told of each restart (the experiment logs it).

    The hosts' snapshots never pass through the driver: it submits the hosts' ``state_dict`` calls and hands their
    result handles to the keeper (with Ray, an actor of its own on the driver's node) without waiting; on a failure
    the keeper's snapshot goes to the replacement hosts. They are incremental in the virtual clients: the first
    holds every client's state, each later one the server's and only the clients changed since (a round's
    participants, clients that received a model or moved), merged by the keeper. A round therefore costs the
    hosts the serialization of the server's state plus the changed clients', and the driver nothing but the calls.
    ``start``: the run's first round here (0, or the round after a resumed checkpoint)."""

    KEEP = 4  # driver-side snapshots kept: the keeper's last complete round is one of the latest few

    def __init__(self, rt, driver, max_retries: int, extra=None, on_restart=None, start: int = 0):
        self.rt, self.driver, self.max_retries = rt, driver, max_retries
        self.extra, self.on_restart = extra, on_restart
        self.restarts = 0
        self.start = start
        self.keeper = rt.backend.snapshot_keeper() if max_retries > 0 else None
        self.local: dict[int, tuple[dict, object]] = {}  # round -> (driver snapshot, extra snapshot)
        self.based = False  # the keeper was sent a full snapshot of the hosts' current lineage

    def snapshot(self, rnd: int) -> None:
        """Have the state before round ``rnd`` kept (not when no restart is allowed any more)."""
        if self.keeper is None or self.max_retries <= self.restarts:
            return
        server, workers, holders = self.rt.snapshot_parts(changed_only=self.based)
        self.keeper.add(rnd, server, workers, holders, self.driver.global_handle)
        self.based = True
        self.local[rnd] = (self.driver.snapshot(), self.extra.snapshot() if self.extra is not None else None)
        for old in sorted(self.local)[:-self.KEEP]:
            del self.local[old]

    def recover(self, error: ActorFailure, rnd: int) -> int:
        """Replace the actors and restore the last complete snapshot; returns the round to redo (the snapshot's).
        Messages name rounds as everything a user sees does: counted from 0 (MLflow's steps, ``raysplit compare``),
        with how many were done before (what the progress bar counts)."""
        where = f"in round {rnd} ({rnd} done before it; rounds count from 0)"
        if self.keeper is None or self.restarts >= self.max_retries:
            raise ActorFailure(f"{error} {where}; not restarted: the retry budget (runtime.faults.max_retries="
                               f"{self.max_retries}) is spent") from None
        self.restarts += 1
        if self.on_restart is not None:
            self.on_restart(self.restarts, f"{error} {where}")
        try:
            self.rt.restart()
            try:
                redo, holders, server, workers, global_handle = self.keeper.restore(len(self.rt.backend.workers))
            except LookupError:  # no snapshot was complete: only the run's first round, on fresh hosts, is redone
                if self.start != 0 or 0 not in self.local:
                    raise ActorFailure(f"{error} {where}; not restarted: no complete snapshot of the hosts' "
                                       "state was kept") from None
                redo, global_handle = 0, self.local[0][0]["global_handle"]
                self.based = False  # fresh hosts: the next snapshot is a full one
            else:
                if redo not in self.local:
                    raise ActorFailure(f"{error} {where}; not restarted: the keeper's snapshot (round "
                                       f"{redo}) is older than the driver's ({sorted(self.local)})") from None
                self.rt.load_state_parts(server, workers, holders)
        except ResourceError as e:
            raise ActorFailure(f"{error} {where}; the cluster can no longer host the run: {e}") from None
        except ActorFailure as again:  # a replacement died too: another restart, if the budget allows
            if "not restarted" in str(again):
                raise
            return self.recover(again, rnd)
        drv, extra = self.local[redo]
        self.driver.restore(drv, global_handle)
        if self.extra is not None:
            self.extra.restore(extra)
        for later in [r for r in self.local if r > redo]:
            del self.local[later]
        return redo

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.close()


class RoundDriver(Driver):
    """The synchronous round loop."""

    def round(self, rnd: int):
        rt = self.rt
        clients = [int(c) for c in self.sample_stream[rnd]]
        rt.begin_round(rnd, clients, self.t_sim)
        handle = self.algorithm.run_round(rt, rnd, clients, np.random.default_rng([self.seed, rnd, 3]))
        if handle is not None:
            self.global_handle = handle
        stats = rt.end_round()
        self.t_sim = stats.t_end
        return stats


class EventDriver(Driver):
    """Runs an asynchronous algorithm: each global round is the event loop, where the server host lives
    (:class:`~raysplit.runtime.server.async_host.AsyncServer`), up to the next global model."""

    asynchronous = True
    server_host = AsyncServer

    def round(self, rnd: int):
        stats = self.rt.run_events(rnd)
        self.global_handle = self.rt.server.current_global()
        self.t_sim = stats.t_end
        return stats

    def client_totals(self) -> dict[int, dict]:
        return self.rt.get(self.rt.server.event_totals())

