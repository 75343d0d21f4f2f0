"""Asynchronous mode: a discrete-event loop on the virtual clock (GAS, FedBuff, CA2FL, FedAsync).

M clients are active at a time out of N. An active client runs a *job* of ``local_steps`` iterations that starts
from the latest global client model: split iterations (forward, the server's gradient, backward — GAS) or local
SGD steps (asynchronous FL), then it uploads its model and frees its slot, which a newly sampled client takes at
once (GAS's ``replace_user``). Two kinds of event reach the server, each at a simulated time:

- an *arrival*: a client's activation has reached the server; the server's hooks ``on_arrival`` (returns the
  client's gradient), ``should_flush`` and ``flush`` run;
- an *upload*: a client's model has reached the server; ``on_model_upload`` runs and says whether a new global
  model now exists, which ends a global round (the MLflow step).

**Order is simulated, compute is real.** The loop always takes the event with the smallest simulated time (ties:
lower client id, then the order of scheduling). A client's next event time is known *before* its compute runs:
:class:`ClientCosts` predicts it from the client's profile, the FLOPs of its part for the batch shape (counted once
per shape on a copy of the client part) and the message sizes, with exactly the arithmetic the client hosts
apply, and the loop checks every prediction against the time the host reports. So the order of events is a pure
function of the seed — not of the machine, the number of client actors or which actor finished first — while the
clients compute ahead in parallel: once the server has served a client, that client's backward and next forward
are submitted at once (one message) and the server goes on with the next event.

The loop runs where the server host lives (inside the server actor with Ray, driving the client actors directly
through a :class:`~raysplit.runtime.server.stepping.ClientPort`; in process with the local backend). At the end of each
global round it waits for the work it has submitted (so a checkpoint sees quiet client hosts) and keeps the
results; the loop's state pickles with the server host. No Ray here.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from raysplit.clock import ClientProfile
from raysplit.errors import BadClientInput
from raysplit.privacy import quantized_nbytes
from raysplit.runtime.client.data import advance_cursor
from raysplit.runtime.devices import counting_copy
from raysplit.runtime.messages import Activation, StateMsg, Tag

ARRIVAL, UPLOAD = "arrival", "upload"


@dataclass(frozen=True)
class EventPlan:
    """The event loop's plan of an asynchronous run (prepared on the driver from the config and the partition):
    ``active`` (``train.participation``), ``local_steps`` (``train.local_steps``), the clients' sizes and clock
    profiles, and whether a job's iterations are split steps (the method's ``split``)."""

    active: int  # M: clients training at a time
    local_steps: int  # iterations of a job before the client uploads its model
    client_sizes: tuple[int, ...]  # train samples per client (for the data-cursor mirror)
    profiles: tuple[ClientProfile, ...]  # every client's FLOP/s and bandwidths
    split: bool = True  # split iterations (arrival events) or local SGD steps (asynchronous FL)


@dataclass
class Job:
    client: int
    version: int  # number of global models before the one the job started from
    round: int  # global round the job started in
    t_start: float
    done: int = 0  # iterations served


@dataclass
class Ready:
    """A result the loop already holds (after settling), in place of a handle."""

    value: Any


class ClientCosts:
    """Predicts client clocks with the client hosts' own arithmetic (``ClientProfile.after_*``, which
    ``ClientHost.charge_*`` applies), on FLOPs counted once per input shape on a copy of the client part and on
    message sizes derived from the shapes."""

    def __init__(self, client_part: torch.nn.Module, setup: EventPlan, batch_size: int, input_shape: tuple,
                 model_nbytes: int, charge_downloads: bool, act_bits: int | None = None, drop_last: bool = False,
                 tokens: bool = False, loss=F.cross_entropy):
        self.part = counting_copy(client_part).train()  # on the CPU, whatever device the server computes on
        # a language model's inputs are token ids and its labels the block itself (``tokens``); ``loss``: the
        # model's training loss, as the client hosts' local steps compute it
        self.tokens, self.loss = tokens, loss
        self.input_dtype = torch.long if tokens else torch.float32
        self.act_bits = act_bits  # privacy.defence quantize: activations sent at this many bits (privacy.quantize)
        self.setup = setup
        self.batch_size, self.drop_last = batch_size, drop_last
        self.input_shape = tuple(input_shape)
        self.model_nbytes = model_nbytes
        self.charge_downloads = charge_downloads
        self._flops: dict[tuple, int] = {}
        with torch.no_grad():
            out = self.part.eval()(torch.zeros(1, *self.input_shape, dtype=self.input_dtype))
        self.part.train()
        self.act_shape, self.act_itemsize = tuple(out.shape[1:]), out.element_size()

    def _count(self, key: tuple) -> int:
        if key not in self._flops:
            kind, n = key
            x = torch.zeros(n, *self.input_shape, dtype=self.input_dtype)
            if kind == "bwd":
                out = self.part(x)
                with FlopCounterMode(display=False) as fc:
                    out.backward(torch.ones_like(out))
            else:
                with FlopCounterMode(display=False) as fc:
                    out = self.part(x)
                    if kind == "train":
                        self.loss(out, x if self.tokens else torch.zeros(n, dtype=torch.long)).backward()
            self.part.zero_grad(set_to_none=True)
            self._flops[key] = int(fc.get_total_flops())
        return self._flops[key]

    def act_nbytes(self, n: int) -> int:
        """An activation message of ``n`` samples: the features plus int64 labels (``Activation.nbytes``); quantized,
        ``privacy.quantized_nbytes``)."""
        numel = n * int(np.prod(self.act_shape))
        if self.act_bits is not None:
            return quantized_nbytes(numel, self.act_bits) + n * 8
        return numel * self.act_itemsize + n * 8

    def grad_nbytes(self, n: int) -> int:
        return n * int(np.prod(self.act_shape)) * self.act_itemsize

    def next_size(self, cid: int, cursor: tuple[int, int]) -> tuple[int, tuple[int, int]]:
        epoch, start, stop = advance_cursor(self.setup.client_sizes[cid], self.batch_size, cursor, self.drop_last)
        return stop - start, (epoch, stop)

    # the steps of a client's job, timed with the client hosts' own arithmetic (ClientProfile.after_*): join
    # (a download), forward (compute, then the activation's upload), backward, local steps, leave (the model's upload)
    def download(self, cid: int, t: float, t_sent: float, nbytes: int) -> float:
        return self.setup.profiles[cid].after_download(t, t_sent, nbytes, self.charge_downloads)

    def forward(self, cid: int, t: float, n: int) -> float:
        p = self.setup.profiles[cid]
        return p.after_upload(p.after_compute(t, self._count(("fwd", n))), self.act_nbytes(n))

    def backward(self, cid: int, t: float, n: int) -> float:
        return self.setup.profiles[cid].after_compute(t, self._count(("bwd", n)))

    def local_step(self, cid: int, t: float, n: int) -> float:
        return self.setup.profiles[cid].after_compute(t, self._count(("train", n)))

    def upload_model(self, cid: int, t: float) -> float:
        return self.setup.profiles[cid].after_upload(t, self.model_nbytes)

    def flops(self, kind: str, n: int) -> int:
        return self._count((kind, n))


class EventLoop:
    """The scheduling state of the asynchronous mode (see the module docstring); owned by an :class:`AsyncServer`."""

    def __init__(self, setup: EventPlan, costs: ClientCosts, seed: int):
        self.setup = setup
        self.costs = costs
        self.rng = np.random.default_rng([seed, 0xA5C])
        self.queue: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.jobs: dict[int, Job] = {}
        self.ignored = 0  # model uploads in a row from dropped clients (runtime.faults.on_bad_client: drop)
        self.pending: dict[int, Any] = {}  # client -> handle (or Ready) of its computation in flight
        self.cursor = {c: (0, 0) for c in range(len(setup.client_sizes))}
        self.t_now = 0.0
        self.round = -1
        self.tally: dict[int, dict] = {}
        self.totals: dict[int, dict] = {}
        self.participants: list[int] = []

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def _push(self, t: float, cid: int, kind: str) -> None:
        heapq.heappush(self.queue, (float(t), int(cid), self.seq, kind))
        self.seq += 1

    def _count(self, cid: int, **kw) -> None:
        for book in (self.tally, self.totals):
            row = book.setdefault(cid, {})
            for k, v in kw.items():
                row[k] = row.get(k, 0.0) + v

    def _draw(self, cid: int) -> int:
        n, self.cursor[cid] = self.costs.next_size(cid, self.cursor[cid])
        return n

    def _replacement(self, leaving: int) -> int:
        """A uniformly random client that is not active (and not the one leaving, unless no other is free)."""
        free = [c for c in range(len(self.setup.client_sizes)) if c not in self.jobs and c != leaving]
        if not free:
            return leaving
        return int(free[int(self.rng.integers(len(free)))])

    @staticmethod
    def _fetch(port, handle):
        return handle.value if isinstance(handle, Ready) else port.fetch(handle)

    # ---- the loop ---------------------------------------------------------------------------------------------
    def run(self, server, rnd: int, port) -> dict:
        """Serve events until ``on_model_upload`` reports a new global model (``server``: the
        :class:`~raysplit.runtime.server.async_host.AsyncServer` this loop belongs to); returns the round's stats."""
        self.round, self.tally, self.participants = rnd, {}, []
        t_start = self.t_now
        if not self.jobs:  # the first round: M clients drawn at random, all starting at time 0
            first = self.rng.choice(len(self.setup.client_sizes), self.setup.active, replace=False)
            for c in sorted(int(c) for c in first):
                self._start(server, port, c, self.t_now)
        while True:
            if not self.queue:
                raise RuntimeError("the event queue ran empty before a global model was produced")
            t, cid, _, kind = heapq.heappop(self.queue)
            self.t_now = t
            if kind == ARRIVAL:
                self._arrival(server, port, cid, t)
            elif self._upload(server, port, cid, t):
                break
        for c, h in list(self.pending.items()):  # settle: every submitted computation is done before we return
            if not isinstance(h, Ready):
                self.pending[c] = Ready(port.fetch(h))
        for c, row in self.tally.items():
            row["t_end"] = self.totals[c].get("t_end", 0.0)
        return {"t_start": t_start, "t_end": self.t_now, "clients": self.tally, "participants": self.participants}

    def _start(self, server, port, cid: int, t: float) -> None:
        """Client ``cid`` takes a slot at ``t`` from the latest global model; its first computation is submitted."""
        msg = server.global_model.current()
        job = Job(cid, server.global_model.version, self.round, t)
        self.jobs[cid] = job
        server.screen.dropped.pop(cid, None)  # a new job: a client dropped in its last one may contribute again
        server.rule.on_job_start(cid, job)
        t = self.costs.download(cid, t, msg.t_sent, self.costs.model_nbytes)
        self._count(cid, bytes_down=self.costs.model_nbytes, bytes_down_model=self.costs.model_nbytes)
        calls = [("join", (cid, msg, job.t_start, self.round))]
        if self.setup.split:
            n = self._draw(cid)
            calls.append(("forward", (Tag(cid, self.round, 0), None)))
            self.pending[cid] = port.submit(cid, calls)
            self._push(self.costs.forward(cid, t, n), cid, ARRIVAL)
        else:
            fl = 0
            for _ in range(self.setup.local_steps):
                n = self._draw(cid)
                t = self.costs.local_step(cid, t, n)
                fl += self.costs.flops("train", n)
            calls += [("local_job", (cid, self.setup.local_steps)), ("leave", (cid,))]
            self.pending[cid] = port.submit(cid, calls)
            self._count(cid, flops=fl, steps=self.setup.local_steps)
            self._push(self.costs.upload_model(cid, t), cid, UPLOAD)

    def _arrival(self, server, port, cid: int, t: float) -> None:
        act: Activation = self._fetch(port, self.pending.pop(cid))
        if act.t_sent != t:
            raise RuntimeError(f"client {cid}: its activation {act.tag} reached the server at {act.t_sent!r}, the "
                               f"event loop predicted {t!r} (client host and ClientCosts disagree)")
        n = len(act.y)
        grad = server.screened("on_arrival", server.rule.on_arrival, act, batches=True)  # screened first (on_bad_client)
        if server.rule.should_flush():
            with server.trainer.serving("flush"):
                server.rule.flush()
        job = self.jobs[cid]
        job.done += 1
        self._count(cid, bytes_up=act.nbytes, bytes_down=grad.nbytes, steps=1, bytes_up_activations=act.nbytes,
                    bytes_down_gradients=grad.nbytes, flops=self.costs.flops("fwd", n) + self.costs.flops("bwd", n))
        t_back = self.costs.download(cid, t, grad.t_sent, grad.nbytes)
        if not grad.rejected:  # a withheld activation gets no gradient to back-propagate
            t_back = self.costs.backward(cid, t_back, n)
        if job.done < self.setup.local_steps:
            n_next = self._draw(cid)
            self.pending[cid] = port.submit(cid, [("backward", (grad,)),
                                                  ("forward", (Tag(cid, job.round, job.done), None))])
            self._push(self.costs.forward(cid, t_back, n_next), cid, ARRIVAL)
        else:
            self.pending[cid] = port.submit(cid, [("backward", (grad,)), ("leave", (cid,))])
            self._push(self.costs.upload_model(cid, t_back), cid, UPLOAD)
        self.totals[cid]["t_end"] = t_back

    def _upload(self, server, port, cid: int, t: float) -> bool:
        msg: StateMsg = self._fetch(port, self.pending.pop(cid))
        if msg.t_sent != t:
            raise RuntimeError(f"client {cid}: its model reached the server at {msg.t_sent!r}, the event loop "
                               f"predicted {t!r} (client host and ClientCosts disagree)")
        job = self.jobs.pop(cid)
        self._count(cid, bytes_up=self.costs.model_nbytes, bytes_up_model=self.costs.model_nbytes)
        if np.isfinite(msg.loss):  # a local job's training loss (asynchronous FL)
            self._count(cid, loss_sum=msg.loss * self.setup.local_steps, loss_n=self.setup.local_steps)
        self.totals[cid]["t_end"] = t
        if msg.epsilon is not None:  # privacy.defence noise: the client's budget spent, as of this upload
            self.tally.setdefault(cid, {})["dp_epsilon"] = msg.epsilon
        self.participants.append(cid)
        if msg.rejected and cid not in server.screen.dropped:  # the client rejected a gradient during this job
            server.screen.dropped[cid] = msg.rejected
            server.screen.drops[cid] = f"client {cid}, job of round {job.round}: {msg.rejected}"
        if cid in server.screen.dropped:  # a dropped client's model is not used (runtime.faults.on_bad_client: drop)
            self._count(cid, dropped=1)
            self.ignored += 1
            if self.ignored > 2 * len(self.setup.client_sizes):
                raise BadClientInput(f"round {self.round}: the last {self.ignored} model uploads all came from "
                                     f"dropped clients (runtime.faults.on_bad_client: drop); no global model can be made: "
                                     f"{list(server.screen.drops.values())[:3]}")
            self._start(server, port, self._replacement(cid), t)
            return False
        self.ignored = 0
        server.staleness.append(server.global_model.version - job.version)
        done = server.rule.on_model_upload(cid, msg, job)
        self._start(server, port, self._replacement(cid), t)
        return done
