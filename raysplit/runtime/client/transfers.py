"""A client host's model transfers: its clients' models leaving as messages (FedAvg's partial sums, one client's
model) and models arriving (an aggregate for every client or as some clients' own, a hand-over), each charged on
the cost meter (bytes, and the time it takes on the client's link)."""

from __future__ import annotations

from raysplit.runtime import tiered, transport
from raysplit.runtime.aggregation import weighted_sum
from raysplit.runtime.client.data import ClientData
from raysplit.runtime.client.states import ClientStates
from raysplit.runtime.messages import StateMsg
from raysplit.runtime.client.meter import CostMeter


class ModelTransfers:
    """Models in and out of the clients a host holds (``data``), read from and written to ``states``;
    ``dropped``: the round's dropped clients (the host's mapping), left out of sums."""

    def __init__(self, data: ClientData, states: ClientStates, meter: CostMeter, dropped: dict[int, str]):
        self.data, self.states, self.meter, self.dropped = data, states, meter, dropped

    def partial_sum(self, weights: dict[int, float]) -> StateMsg | None:
        """Weighted sum of the hosted clients' current weights (upload counted per client)."""
        mine = [(int(c), w) for c, w in weights.items() if int(c) in self.data and int(c) not in self.dropped]
        if not mine:
            return None
        states = [self.states.state_of(c) for c, _ in mine]
        t = max(self.meter.charge_upload(c, transport.state_nbytes(st), "model") for (c, _), st in zip(mine, states))
        weights = [w for _, w in mine]
        total = float(sum(weights))
        if self.states.tiered:  # each client's own blocks: summed per key, with the weight holding each
            acc, held = tiered.partial_sum(states, weights)
            return StateMsg(transport.pack_state(acc), t_sent=t, weight=total, held=held)
        return StateMsg(transport.pack_state(weighted_sum(states, weights)), t_sent=t, weight=total)

    def install(self, msg: StateMsg, receivers: list[int] | None = None, only: list[int] | None = None) -> None:
        """Install an aggregate: for all clients (``only`` None) or as the own model of the clients in ``only``.
        Download bytes and time are charged to ``receivers`` (the round's clients) that this host holds."""
        state = transport.unpack_state(msg.state)
        self.states.install(state, None if only is None else [int(c) for c in only if int(c) in self.data])
        nb = transport.state_nbytes(state)
        for c in (int(c) for c in receivers or []):
            if c in self.data:
                if c in self.states.slots:
                    self.states.load(self.states.slots[c].module, state)
                if self.states.tiered:  # a client downloads its own blocks of the aggregate
                    nb = transport.state_nbytes(self.states.held(c, state))
                self.meter.charge_download(c, nb, msg.t_sent, "model")

    def send(self, cid: int) -> StateMsg:
        """Client ``cid`` sends its current model (upload charged)."""
        st = self.states.state_of(cid)
        t = self.meter.charge_upload(cid, transport.state_nbytes(st), "model")
        return StateMsg(transport.pack_state(st), t_sent=t, weight=float(self.data.size(cid)))

    def receive(self, cid: int, msg: StateMsg) -> None:
        """Client ``cid`` receives a model (a hand-over in sequential split learning) as its own."""
        state = transport.unpack_state(msg.state)
        self.states.install(state, [cid])
        if cid in self.states.slots:
            self.states.load(self.states.slots[cid].module, state)
        self.meter.charge_download(cid, transport.state_nbytes(self.states.held(cid, state)), msg.t_sent, "model")
