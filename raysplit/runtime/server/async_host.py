"""The server host of the asynchronous methods: a server host with the event loop of :mod:`events` where the server
lives and the global client model (:class:`GlobalModel`). Its driver is ``drivers.EventDriver``."""

from __future__ import annotations

import time

import numpy as np

from raysplit.runtime import transport
from raysplit.runtime.aggregation import average_states
from raysplit.runtime.server.events import ClientCosts, EventLoop, EventPlan
from raysplit.runtime.messages import StateMsg, Tag
from raysplit.runtime.server.host import ServerHost


class GlobalModel:
    """The global client model of an asynchronous run (a component of its server host; a rule's
    ``ctx.global_model``): :meth:`current` (the latest), :meth:`publish` (a new one, made now: ``version`` counts
    them) and :meth:`average` (weighted, of uploaded models). ``now()``: the server's time."""

    def __init__(self, initial: StateMsg, now):
        self._current = StateMsg(initial.state, t_sent=0.0, weight=1.0)
        self.version = 0
        self.now = now

    def current(self) -> StateMsg:
        return self._current

    def publish(self, msg: StateMsg) -> None:
        """A new global client model, made now."""
        self._current = StateMsg(msg.state, t_sent=self.now(), weight=msg.weight)
        self.version += 1

    @staticmethod
    def average(msgs: list[StateMsg], weights: list[float]) -> StateMsg:
        """Weighted average of uploaded client models (``aggregation.average_states``)."""
        state = average_states([transport.unpack_state(m.state) for m in msgs], weights)
        return StateMsg(transport.pack_state(state), t_sent=max(m.t_sent for m in msgs), weight=float(sum(weights)))


class AsyncServer(ServerHost):
    """Server host of an asynchronous method: the event loop (``events``) and the global client model
    (``global_model``). What the loop calls in simulated-time order (``on_job_start``, ``on_arrival``,
    ``should_flush``, ``flush``, ``on_model_upload``) are the hooks of the method's
    :class:`~raysplit.runtime.rules.AsyncRule` (``self.rule``)."""

    CALLS = {**ServerHost.CALLS, "run_events": "run_events", "event_totals": "event_totals",
             "current_global": "global_model.current"}

    def build(self) -> None:
        plan: EventPlan = self.plan.events
        self.global_model = GlobalModel(self.client_init, lambda: max(self.clock, self.events.t_now))
        priv, s = self.plan.privacy, self.plan.sections
        costs = ClientCosts(self.evaluation.client, plan, s.train.batch_size, self.plan.model.input_shape,
                            transport.state_nbytes(self.client_init.state), s.clock.charge_server,
                            act_bits=priv.defence.sent_bits if priv is not None else None,
                            drop_last=s.train.drop_last, tokens=self.plan.model.language_model,
                            loss=self.plan.model.loss)
        self.events = EventLoop(plan, costs, s.seed)

    def context_items(self) -> dict:
        return {"global_model": self.global_model, "events": self.plan.events}

    def expected_round(self, tag: Tag) -> int | None:
        """An activation carries the round its client's job began in (``Job.round``)."""
        job = self.events.jobs.get(tag.client)
        return job.round if job is not None else self.round

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

    # ---- checkpoint: the loop and the global model, beside the models ------------------------------------------
    def own_state(self) -> dict:
        return {"events": self.events, "version": self.global_model.version, "_global": self.global_model._current}

    def load_own_state(self, own: dict) -> None:
        self.events = own["events"]
        self.global_model.version, self.global_model._current = own["version"], own["_global"]
