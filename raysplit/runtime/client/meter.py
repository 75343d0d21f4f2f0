"""A client host's cost meter: each hosted client's simulated clock and its counters (FLOPs, bytes by kind,
steps, losses), charged by what the client computes and sends with the one clock arithmetic of
:class:`~raysplit.clock.ClientProfile` (which the event loop also predicts with)."""

from __future__ import annotations

from collections import defaultdict

import torch

from raysplit.clock import ClientProfile
from raysplit.runtime import transport


class Counters:
    """Named sums (``add(steps=1, flops=...)``); ``v`` holds them. A 0-d tensor added (a loss on the device) waits,
    with whatever is added to its name after it, until :func:`settle` reads every waiting value at once; the sums
    are then made in the order of the adds, as if each had been a float."""

    def __init__(self):
        self.v = defaultdict(float)
        self.waiting: dict[str, list] = {}

    def add(self, **kw):
        for k, x in kw.items():
            if k in self.waiting or isinstance(x, torch.Tensor):
                self.waiting.setdefault(k, []).append(x)
            else:
                self.v[k] += x


def settle(counters) -> None:
    """The waiting values of ``counters`` read (one read of the device) and summed in order."""
    counters = [c for c in counters if c.waiting]
    items = [(c, k, x) for c in counters for k, xs in c.waiting.items() for x in xs]
    for (c, k, _), v in zip(items, transport.read_floats([x for _, _, x in items])):
        c.v[k] += v
    for c in counters:
        c.waiting = {}


class CostMeter:
    """Per hosted client: its profile (speeds), its clock, this round's counters (``round_stats``), the counters
    summed over its rounds (``totals``) and its clock at the end of its last round (``last_active``).
    ``charge_server`` off (GAS's code): a download takes no time. Every charge adds the client to ``changed``."""

    client_fields = ("profiles", "clock", "totals", "last_active")  # per-client state that moves with a client

    def __init__(self, profiles: dict[int, ClientProfile], clients, *, charge_server: bool, changed: set[int]):
        self.profiles = {int(c): p for c, p in profiles.items()}
        self.clock: dict[int, float] = {int(c): 0.0 for c in clients}
        self.round_stats: dict[int, Counters] = defaultdict(Counters)
        self.totals: dict[int, Counters] = defaultdict(Counters)
        self.last_active: dict[int, float] = {}
        self.charge_server = charge_server
        self.changed = changed

    def start_round(self, cids: list[int], t0: float) -> None:
        """A synchronous round begins at ``t0`` for the hosted clients among ``cids``."""
        self.round_stats.clear()
        for c in cids:
            if c in self.clock:
                self.start(int(c), t0)

    def start(self, cid: int, t0: float) -> None:
        """Client ``cid``'s clock set to ``t0`` (a round or an asynchronous job begins)."""
        self.clock[cid] = t0
        self.changed.add(cid)

    def now(self, cid: int) -> float:
        """Client ``cid``'s simulated clock."""
        return self.clock.get(cid, 0.0)

    def wait_until(self, cid: int, t: float) -> float:
        """Client ``cid`` cannot go on before ``t`` (e.g. the moment a message it waits for was sent)."""
        return self.set_clock(cid, max(self.clock[cid], t))

    def set_clock(self, cid: int, t: float) -> float:
        """Replace client ``cid``'s clock by a timing model's result (PiPar's pipelined step takes less than the sum
        of the charges made during it)."""
        self.changed.add(cid)
        self.clock[cid] = t
        return t

    def count(self, cid: int, **kw: float) -> None:
        """Add to client ``cid``'s counters of this round (``steps``, ``loss_sum``, ``loss_n``, ``dropped``)."""
        self.round_stats[cid].add(**kw)

    def counted(self, cid: int, name: str) -> float:
        """Client ``cid``'s counter ``name`` so far this round (a read of the device if values of it wait)."""
        if cid not in self.round_stats:
            return 0.0
        cnt = self.round_stats[cid]
        if name in cnt.waiting:
            settle([cnt])
        return cnt.v.get(name, 0.0)

    def charge_compute(self, cid: int, flops: float) -> float:
        self.changed.add(cid)
        self.clock[cid] = self.profiles[cid].after_compute(self.clock[cid], flops)
        self.round_stats[cid].add(flops=flops)
        return self.clock[cid]

    def charge_upload(self, cid: int, nbytes: int, kind: str) -> float:
        """Client ``cid`` sends ``nbytes`` of ``kind`` (activations, model, labels): counted in total and by kind."""
        self.changed.add(cid)
        self.clock[cid] = self.profiles[cid].after_upload(self.clock[cid], nbytes)
        self.round_stats[cid].add(bytes_up=nbytes, **{f"bytes_up_{kind}": nbytes})
        return self.clock[cid]

    def charge_download(self, cid: int, nbytes: int, t_sent: float, kind: str) -> float:
        """A message of ``nbytes`` of ``kind`` (gradients, model) sent at ``t_sent`` reaches client ``cid`` (which
        may still be busy); with ``charge_server`` off (GAS's code) the transfer takes no time."""
        self.changed.add(cid)
        self.clock[cid] = self.profiles[cid].after_download(self.clock[cid], t_sent, nbytes, self.charge_server)
        self.round_stats[cid].add(bytes_down=nbytes, **{f"bytes_down_{kind}": nbytes})
        return self.clock[cid]

    def upload_seconds(self, cid: int, nbytes: float) -> float:
        """How long client ``cid`` takes to send ``nbytes`` (a timing model's term: PiPar)."""
        return self.profiles[cid].after_upload(0.0, nbytes)

    def download_seconds(self, cid: int, nbytes: float) -> float:
        """How long ``nbytes`` take to reach client ``cid`` (0 with ``charge_server`` off)."""
        return self.profiles[cid].after_download(0.0, 0.0, nbytes, self.charge_server)

    def close_round(self) -> dict[int, dict]:
        """This round's counters per client that took part, with ``t_end`` (its clock); added to its totals."""
        out = {}
        self.changed.update(self.round_stats)
        settle(self.round_stats.values())
        for c, cnt in self.round_stats.items():
            out[c] = dict(cnt.v, t_end=self.clock[c])
            self.totals[c].add(**cnt.v, rounds=1)
            self.last_active[c] = self.clock[c]
        return out

    def client_totals(self) -> dict[int, dict]:
        """Per hosted client: counters summed over the rounds, and ``t_last``, its clock at the end of the last
        round it took part in (its participation time: every client starts at 0)."""
        return {c: dict(v.v, t_last=self.last_active.get(c, 0.0)) for c, v in self.totals.items()}
