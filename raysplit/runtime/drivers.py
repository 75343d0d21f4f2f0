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

    def run(self, start: int, rounds: int, on_round: Callable[[int, object], None]) -> None:
        """Run global rounds ``start .. rounds-1``, or until the algorithm says it has finished (early stopping);
        ``on_round(rnd, RoundStats)`` after each."""
        for rnd in range(start, rounds):
            on_round(rnd, self.round(rnd))
            if self.algorithm.finished():
                break

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
