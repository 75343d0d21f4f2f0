"""Drivers: the loops that run an algorithm over the runtime, one global round at a time.

- :class:`RoundDriver` (synchronous methods): per round, take the round's clients from the sampling stream,
  ``begin_round``, the algorithm's ``run_round``, ``end_round``.
- :class:`~raysplit.runtime.events.EventDriver` (asynchronous methods) runs the event loop on the virtual clock
  until the next global model exists (``runtime/events.py``).

A driver knows neither MLflow nor Ray: the experiment hands it a callback that reports (and checkpoints) each
finished round, and it exposes its own state for checkpoints. ``global_handle`` is the handle to the latest global
client model (None for algorithms that keep none).
"""

from __future__ import annotations

from typing import Callable, ClassVar

import numpy as np

from raysplit.errors import ActorFailure, ResourceError
from raysplit.runtime.messages import StateMsg


class Driver:
    """What every driver shares: the runtime, the algorithm, the seed, the simulated time so far."""

    asynchronous: ClassVar[bool] = False  # hosts run asynchronous jobs (HostSpec.asynchronous)

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


class RoundGuard:
    """Survives actor deaths (``runtime.max_retries``): before every round it keeps the state of the runtime's hosts,
    of the driver (algorithm included) and of whatever ``extra`` snapshots (the reporter); after an actor died it
    replaces every actor, restores that state and lets the driver redo the round, so the run's metrics equal an
    uninterrupted run's. ``on_restart(count, error)`` is told of each restart (the experiment logs it).

    The snapshots are incremental in the virtual clients: the first holds every client's state, each later one
    only the clients changed since (a round's participants, clients that received a model or moved), merged into
    the copy kept here. A snapshot therefore costs the server's state plus the changed clients', not the whole
    population's, each round."""

    def __init__(self, rt, driver, max_retries: int, extra=None, on_restart=None):
        self.rt, self.driver, self.max_retries = rt, driver, max_retries
        self.extra, self.on_restart = extra, on_restart
        self.restarts = 0
        self.last: tuple[int, dict] | None = None
        self.clients: dict[int, dict] = {}  # every client's state as of the last snapshot

    def snapshot(self, rnd: int) -> None:
        """The state before round ``rnd`` (kept only once it is complete; not taken when no restart is allowed)."""
        if self.max_retries <= self.restarts:
            return
        st = self.rt.state_dict(changed_only=self.last is not None)  # the first one: every client
        clients = dict(self.clients)
        for w in st["workers"]:
            clients.update(w.pop("clients"))
        self.clients = clients
        self.last = (rnd, {"runtime": st, "driver": self.driver.state_dict(),
                           "extra": self.extra.snapshot() if self.extra is not None else None})

    def _runtime_state(self, st: dict) -> dict:
        """The last snapshot with every worker's held clients filled in from the merged copy."""
        return {**st, "workers": [{**w, "clients": {c: self.clients[c] for c in w["held"]}} for w in st["workers"]]}

    def recover(self, error: ActorFailure, rnd: int) -> int:
        """Replace the actors and restore the last snapshot; returns the round to redo (the snapshot's)."""
        if self.last is None or self.restarts >= self.max_retries:
            raise ActorFailure(f"{error} in round {rnd}; not restarted: the retry budget (runtime.max_retries="
                               f"{self.max_retries}) is spent") from None
        self.restarts += 1
        if self.on_restart is not None:
            self.on_restart(self.restarts, f"{error} in round {rnd}")
        redo, snap = self.last
        try:
            self.rt.restart()
            self.rt.load_state_dict(self._runtime_state(snap["runtime"]))
        except ResourceError as e:
            raise ActorFailure(f"{error} in round {rnd}; the cluster can no longer host the run: {e}") from None
        except ActorFailure as again:  # a replacement died too: another restart, if the budget allows
            return self.recover(again, rnd)
        self.driver.load_state_dict(snap["driver"])
        if self.extra is not None:
            self.extra.restore(snap["extra"])
        return redo


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
