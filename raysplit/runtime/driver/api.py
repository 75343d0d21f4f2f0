"""The runtime API that algorithms are written against.

An algorithm sees handles, never Ray: ``forward`` returns a handle to an activation, ``rt.server.<method>(handle)``
returns a handle to the server's answer, ``backward(cid, handle)`` applies it. With the Ray backend a handle is an
ObjectRef and calls chain actor to actor through the object store; the driver blocks only at ``end_round``,
``get`` and evaluation. Actor calls from the driver run in submission order per actor, which is what gives
sequential algorithms (SFLV2, SplitNN) their order; pairing of activations and gradients is still checked by tag.
The local backend runs the same hosts in-process (for debugging and as the plain-loop reference in benchmarks).

Host methods are reached through :class:`HostCalls`: ``rt.server.fork(clients)``, ``rt.client(c).get_state()``
(the client id is bound as the method's first argument), ``rt.workers.partial_sum(weights)`` (every client worker,
a list of handles). A name the host class does not have fails at once, on the driver, naming the class.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from raysplit.runtime.driver import placement
from raysplit.runtime.server import stepping
from raysplit.runtime.driver.calls import HostCalls, step_name
from raysplit.runtime.client.host import ClientHost
from raysplit.runtime.server.host import ServerHost
from raysplit.runtime.state import invoke
from raysplit.runtime.devices import cpu_kind, host_device_of, machine_cores
from raysplit.runtime.plan import HostPlan
from raysplit.runtime.driver.ports import DriverPort, DriverServer, LocalPort
from raysplit.runtime.rules import ServerRule


@dataclass
class RoundStats:
    round: int
    t_start: float
    t_end: float
    wall: float
    clients: dict[int, dict]  # per-client counters of the round (bytes, FLOPs, steps, clock)
    server: dict
    participants: list[int] = field(default_factory=list)  # the round's clients

    @property
    def sim_time(self) -> float:
        return self.t_end - self.t_start


@dataclass
class RuntimeInputs:
    """Everything the runtime needs to build its hosts (prepared by the experiment on the driver)."""

    plan: HostPlan  # what every host is built from (runtime/plan.py)
    client_host: type = ClientHost
    server_host: type = ServerHost
    train_data: dict = field(default_factory=dict)  # {"x", "y"} numpy
    test_data: dict = field(default_factory=dict)
    labeled_data: dict = field(default_factory=dict)  # the server's labelled set {"x", "y"} (data.n_labeled)
    train_idx: list = field(default_factory=list)  # per client
    test_idx: list = field(default_factory=list)
    profiles: list = field(default_factory=list)
    client_init: dict = field(default_factory=dict)  # packed client-part state
    server_init: dict = field(default_factory=dict)  # packed server-part state


def host_inputs(inputs: RuntimeInputs, num_workers: int):
    """Split per-client inputs by home worker (:func:`placement.home`): where every client starts."""
    per = []
    for w in range(num_workers):
        cids = range(w, len(inputs.train_idx), num_workers)
        per.append(({c: inputs.train_idx[c] for c in cids}, {c: inputs.test_idx[c] for c in cids},
                    {c: inputs.profiles[c] for c in cids}))
    return per


class Runtime:
    """Algorithm-facing API over a backend (``LocalBackend`` or ``RayBackend``)."""

    def __init__(self, backend, inputs: RuntimeInputs, max_in_flight: int = 256, window: int | None = 4,
                 placement: str = "balanced"):
        self.backend = backend
        self.max_in_flight = max_in_flight
        self.window = window  # forwards submitted ahead per client worker (stepping.schedule); None: all at once
        self.placement = placement  # "balanced": spread each round's clients evenly (placement.assign); "home"
        self._inflight: list = []
        self.inputs = inputs
        self.num_clients = len(inputs.train_idx)
        self.sizes = np.array([len(ix) for ix in inputs.train_idx], dtype=float)
        self.round = -1
        self._t0 = 0.0
        self._wall0 = 0.0
        self._clients: list[int] = []
        backend.start(inputs)
        # the worker holding each client's state; every client starts at home (placement.home)
        self.holders = np.arange(self.num_clients, dtype=np.int64) % len(backend.workers)
        self.server_rule = inputs.plan.method.server_rule or ServerRule
        self.server = HostCalls(backend, inputs.server_host, "server", lambda: backend.server, rule=self.server_rule)
        self.workers = HostCalls(backend, inputs.client_host, "client", lambda: backend.workers, fan_out=True,
                                 rule=inputs.plan.method.client_rule)

    def client(self, cid: int) -> HostCalls:
        """Calls on the worker hosting client ``cid``, with ``cid`` as the method's first argument."""
        cid = int(cid)
        return HostCalls(self.backend, self.inputs.client_host, "client", lambda: self.worker_of(cid), bind=(cid,),
                         rule=self.inputs.plan.method.client_rule)

    @property
    def packs_clients(self) -> bool:
        return packs_clients(self.inputs.plan.sections.runtime.pack_clients, self.backend.resolved())  # see packs_clients()

    # ---- placement -------------------------------------------------------------------------------------------
    def worker_of(self, cid: int):
        return self.backend.workers[self.holders[int(cid)]]

    def route(self, clients: list[int]) -> dict[int, int]:
        """The worker index of each of ``clients`` (what a loop driven by the server needs to reach them)."""
        return {int(c): int(self.holders[int(c)]) for c in clients}

    # ---- round structure -----------------------------------------------------------------------------------
    def begin_round(self, rnd: int, clients: list[int], t0: float) -> None:
        self.round, self._t0, self._clients = rnd, t0, [int(c) for c in clients]
        self._inflight = []
        self._wall0 = time.perf_counter()
        if self.placement == "balanced":
            placement.move_clients(self.backend, self.holders, self._clients)
        self.server.begin_round(rnd, t0)
        self.workers.begin_round(rnd, self._clients, t0)

    def end_round(self) -> RoundStats:
        """The round's numbers from every host, each judging its deferred checks first (:func:`earliest_failure`)."""
        b, server_ref, refs = self.backend, None, None
        try:
            server_ref = self.server.end_round()  # in process the call itself raises
            refs = self.workers.end_round()
            server = b.get(server_ref)
        except Exception as e:
            if server_ref is not None and refs is None:  # a client host's own, in process
                raise
            raise earliest_failure(self, e, refs) from None
        clients = merged(b.get(refs))
        b.round_done()
        t_end = max([server["t_end"]] + [c["t_end"] for c in clients.values()] + [self._t0])
        return RoundStats(self.round, self._t0, t_end, time.perf_counter() - self._wall0, clients, server,
                          list(self._clients))

    # ---- split-learning steps -------------------------------------------------------------------------------
    def backward(self, cid: int, grad):
        ref = self.backend.call(self.worker_of(cid), "backward", grad)
        self._inflight.append(ref)
        if len(self._inflight) > self.max_in_flight:  # bound the split steps in flight (object-store memory)
            self._inflight = self.backend.wait(self._inflight, len(self._inflight) - self.max_in_flight // 2)
        return ref

    def split_steps(self, seq: list, keys: dict | None = None, method: Callable = ServerHost.train_step,
                    batch_size: int | None = None) -> None:
        """One split step per entry of ``seq`` in serving order: a client id, or ``(client, stream)`` when a
        client sends several feature streams; a client may appear any number of times, interleaved with others.
        Per step the client forwards a batch, the server runs ``method(activation, key)`` (``keys[c]``, default
        ``"main"``; a server host's or rule's method, by reference: :func:`calls.step_name`) and the client applies
        the gradient. Where the backend offers it (in process; Ray with ``runtime.transport.direct_steps``) the
        sequence is one call to the server, which runs :func:`stepping.run_split_steps` and calls the client hosts
        itself; otherwise the same loop chained through the driver, bit-identical (tests/test_direct_steps.py)."""
        method = step_name(method, self.inputs.server_host, self.server_rule, self.inputs.plan.ushape)
        plan = stepping.plan_steps(seq, self.round, keys or {})
        route = self.route([s.client for s in plan])
        if self.backend.direct_steps:
            self.backend.drive("steps", route, plan, method, batch_size, self.window)
            return
        stepping.run_split_steps(DriverServer(self.backend), plan, method, batch_size, self.window, DriverPort(self, route))

    def pooled_steps(self, clients: list[int], steps: int | dict[int, int], method: Callable,
                     streams: tuple[str, ...] = ("main",), batch_sizes: dict | None = None) -> None:
        """Pooled steps of the round's ``clients`` (``steps``: a count for all, or per client; client ``c`` takes
        part in steps ``0 .. steps[c] - 1``): per step each client forwards one batch per stream, the server method
        receives all activations at once (clients in order, streams in order within a client) and returns one
        gradient per activation (CycleSL's pooling, MiniBatch-SFL's groups, Semi-SFL's two streams, batched server
        copies); server-driven (``stepping.run_pooled_steps``) or chained through the driver (:class:`DriverPort`)."""
        method = step_name(method, self.inputs.server_host, self.server_rule, self.inputs.plan.ushape, pooled=True)
        clients = [int(c) for c in clients]
        sizes = {c: (batch_sizes or {}).get(c) for c in clients}
        route = self.route(clients)
        if self.backend.direct_steps:
            self.backend.drive("pooled", route, clients, tuple(streams), steps, self.round, method, sizes)
            return
        stepping.run_pooled_steps(DriverServer(self.backend, many=True), clients, tuple(streams), steps, self.round,
                              method, sizes, DriverPort(self, route))

    def run_events(self, rnd: int) -> RoundStats:
        """One global round of an asynchronous algorithm (one blocking call): the server host's event loop
        (``AsyncServer.run_events``) runs where the server lives, driving the client hosts, until the next model."""
        out = self.backend.get(self.backend.drive("events", None, rnd))  # no client moves under events
        self.backend.round_done()
        self.round = rnd
        return RoundStats(rnd, out["t_start"], out["t_end"], out["wall"], out["clients"], out["server"],
                          out["participants"])

    def weights(self, clients: list[int], mode: str = "samples") -> dict[int, float]:
        return {int(c): 1.0 if mode == "uniform" else float(self.sizes[c]) for c in clients}

    def aggregate_clients(self, weights: dict[int, float], write_to: str = "all"):
        """FedAvg of the clients' current models: partial sums on the hosting workers, the sum on the server,
        the result installed on the workers. Returns a handle to the aggregate (a StateMsg)."""
        agg = self.server.aggregate(*self.workers.partial_sum(weights))
        self.install(agg, receivers=self._clients, only=None if write_to == "all" else list(weights))
        return agg

    def install(self, state_handle, receivers: list[int] | None = None, only: list[int] | None = None) -> None:
        """Install a client-model state on the workers: as everyone's starting model (``only`` None) or as the
        own model of the clients in ``only``; download is charged to ``receivers``."""
        self.workers.set_global(state_handle, receivers or [], only)

    def put(self, value):
        return self.backend.put(value)

    def get(self, handles, timeout: float | None = None):
        return self.backend.get(handles, timeout=timeout)

    # ---- evaluation and checkpoints ------------------------------------------------------------------------
    def evaluate_global(self, client_state_handle):
        return self.backend.get(self.server.evaluate(client_state_handle))

    def evaluate_clients(self, clients: list[int]):
        parts = self.backend.get(self.workers.evaluate_clients(clients, self.server.get_state()))
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                float(sum(p[2] for p in parts)))

    def reconstruction(self, clients: list[int], rnd: int, client_state_handle=None) -> dict[int, dict]:
        """``privacy.attack`` against ``clients`` (``ClientHost.reconstruction``), per client;
        ``client_state_handle``: the averaged client model the inversion attack inverts through."""
        return merged(self.backend.get(self.workers.reconstruction(clients, rnd, client_state_handle)))

    def client_totals(self) -> dict[int, dict]:
        return merged(self.backend.get(self.workers.client_totals()))

    def restart(self) -> None:
        """Fresh hosts for the whole run (an actor died); the caller restores them (``load_state_dict``)."""
        self.backend.restart(self.inputs)
        self._inflight = []

    def state_dict(self, changed_only: bool = False) -> dict:
        """Every host's state (``changed_only``: the client hosts report only the clients changed since the last
        such call, for :class:`~raysplit.runtime.driver.drivers.RoundGuard`'s incremental snapshots)."""
        server, workers, holders = self.snapshot_parts(changed_only)
        states = self.backend.get([server] + workers)
        return {"server": states[0], "workers": states[1:], "holders": holders}

    def snapshot_parts(self, changed_only: bool) -> tuple:
        """The hosts' state as handles, for ``RoundGuard``'s keeper: ``(server, [client hosts], holders)``; the
        calls are submitted, nothing is fetched (``changed_only``: each client host's changed clients only)."""
        b = self.backend
        if changed_only:
            workers = [b.call(w, "state_dict", ch) for w, ch in zip(b.workers, self.workers.changed_clients())]
        else:
            workers = self.workers.state_dict()
        return self.server.state_dict(), workers, self.holders.copy()

    def load_state_parts(self, server, workers: list, holders) -> None:
        """Restore the hosts from a keeper's snapshot (handles: with Ray the states go from the keeper to the
        hosts without passing through here)."""
        b = self.backend
        self.holders = np.asarray(holders, dtype=np.int64).copy()
        b.get([self.server.load_state_dict(server)]
              + [b.call(w, "load_state_dict", s) for w, s in zip(b.workers, workers)])

    def load_state_dict(self, st: dict) -> None:
        if len(st["workers"]) != len(self.backend.workers):
            raise ValueError(f"checkpoint has {len(st['workers'])} workers, runtime has {len(self.backend.workers)}; "
                             "resume with the same runtime.num_workers")
        if "holders" not in st or any("held" not in w for w in st["workers"]):
            raise ValueError("checkpoint from an older raysplit (its client hosts' state has no 'held' clients): "
                             "resume it with the version that wrote it")
        self.load_state_parts(st["server"], st["workers"], st["holders"])

    def shutdown(self) -> None:
        self.backend.shutdown()


def earliest_failure(rt: Runtime, e: Exception, refs) -> Exception:
    """What a failed round end raises. Each host judges its deferred checks at the round's end (the values read
    from its device once a round: :class:`~raysplit.runtime.screening.Deferred`); where the server's failed
    (``e``), the clients' are judged too (``refs``: their end_round calls, if made) and the failure made earliest
    in the round is raised, by its ``order`` (:func:`~raysplit.runtime.screening.ordered`): a gradient that broke
    a client at step s, say, before the server screened that client's activation of step s + 1. Any other error
    of the server is the root cause itself."""
    order = getattr(e, "order", None)
    if order is None:
        return e
    try:
        rt.backend.get(refs if refs is not None else rt.workers.end_round())
    except Exception as c:
        if getattr(c, "order", None) is not None and c.order < order:
            c.add_note(f"the server's check failed too, later in the round: {e}")
            return c
    return e


def packs_clients(pack: bool | str, resolved: dict) -> bool:
    """Whether client hosts train their clients' steps packed: ``runtime.pack_clients``, auto where they compute on
    an accelerator (``resolved``: the backend's, with each client host's device as it resolved it). An algorithm
    that may interleave its clients' steps does so then, for the hosts to pack them (PSL's copies)."""
    if pack != "auto":
        return bool(pack)
    devices = str(resolved.get("client_device", "cpu"))
    return any(d.strip() and not d.strip().startswith("cpu") for d in devices.split(","))


def merged(parts: list[dict]) -> dict:
    """The client hosts' per-client answers as one mapping."""
    return {k: v for part in parts for k, v in part.items()}


