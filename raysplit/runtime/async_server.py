"""The server host of the asynchronous methods (:class:`AsyncServer`: the event loop of :mod:`events` where the
server lives, and the global client model) and the driver that runs them (:class:`EventDriver`)."""

from __future__ import annotations

import time

import numpy as np

from raysplit.runtime import transport
from raysplit.runtime.aggregation import average_states
from raysplit.runtime.drivers import Driver
from raysplit.runtime.events import ClientCosts, EventLoop, EventSetup
from raysplit.runtime.messages import StateMsg, Tag
from raysplit.runtime.server_host import ServerHost


class AsyncServer(ServerHost):
    """Server host of an asynchronous method: the event loop (``events``) and the global client model
    (``version``, ``global_model``, ``set_global``). What the loop calls in simulated-time order (``on_job_start``,
    ``on_arrival``, ``should_flush``, ``flush``, ``on_model_upload``) are the hooks of the method's
    :class:`~raysplit.runtime.rules.AsyncRule` (``self.rule``)."""

    def build(self) -> None:
        setup: EventSetup = self.spec.host_setup
        self.setup = setup
        self.version = 0
        self._global = StateMsg(self.client_init.state, t_sent=0.0, weight=1.0)
        self.uploads: list[StateMsg] = []
        spec, priv = self.spec, self.spec.privacy
        costs = ClientCosts(self.eval_client, setup, spec.batch_size, spec.input_shape,
                            transport.state_nbytes(self.client_init.state), spec.charge_server,
                            act_bits=priv.defence.bits if priv is not None and priv.defence.kind == "quantize" else None,
                            drop_last=spec.drop_last)
        self.events = EventLoop(setup, costs, spec.seed)

    def expected_round(self, tag: Tag) -> int | None:
        """An activation carries the round its client's job began in (``Job.round``)."""
        job = self.events.jobs.get(tag.client)
        return job.round if job is not None else self.round

    @staticmethod
    def average(msgs: list[StateMsg], weights: list[float]) -> StateMsg:
        """Weighted average of uploaded client models (``aggregation.average_states``)."""
        state = average_states([transport.unpack_state(m.state) for m in msgs], weights)
        return StateMsg(transport.pack_state(state), t_sent=max(m.t_sent for m in msgs), weight=float(sum(weights)))

    # ---- the global client model ------------------------------------------------------------------------------
    def global_model(self) -> StateMsg:
        return self._global

    def set_global(self, msg: StateMsg) -> None:
        """A new global client model, made now: ``version`` counts them."""
        self._global = StateMsg(msg.state, t_sent=max(self.clock, self.events.t_now), weight=msg.weight)
        self.version += 1

    # ---- driving ----------------------------------------------------------------------------------------------
    def reset_round(self):
        super().reset_round()
        self.staleness: list[int] = []  # global models made while each uploaded job ran

    def round_metrics(self) -> dict:
        st = self.staleness
        return {"staleness_mean": float(np.mean(st)) if st else 0.0, "staleness_max": float(max(st, default=0)),
                **self.rule.round_metrics()}

    def run_events(self, rnd: int, port) -> dict:
        """One global round of the event loop (``EventLoop.run``), with the server's per-round counters."""
        t_wall = time.perf_counter()
        self.begin_round(rnd, 0.0)
        out = self.events.run(self, rnd, port)
        out["server"] = self.end_round()
        out["wall"] = time.perf_counter() - t_wall
        return out

    def event_totals(self) -> dict[int, dict]:
        return {c: dict(v, t_last=v.get("t_end", 0.0)) for c, v in self.events.totals.items()}

    checkpointed = ("events", "version", "_global", "uploads")


class EventDriver(Driver):
    """Runs an asynchronous algorithm: each global round is the event loop up to the next global model."""

    asynchronous = True
    server_host = AsyncServer

    def round(self, rnd: int):
        stats = self.rt.run_events(rnd)
        self.global_handle = self.rt.server.global_model()
        self.t_sim = stats.t_end
        return stats

    def client_totals(self) -> dict[int, dict]:
        return self.rt.get(self.rt.server.event_totals())
