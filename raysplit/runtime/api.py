"""The runtime API that algorithms are written against.

An algorithm sees handles, never Ray: ``forward`` returns a handle to an activation, ``server(method, handle)``
returns a handle to the server's answer, ``backward(cid, handle)`` applies it. With the Ray backend a handle is an
ObjectRef and calls chain actor to actor through the object store; the driver blocks only at ``end_round``,
``get`` and evaluation. Actor calls from the driver run in submission order per actor, which is what gives
sequential algorithms (SFLV2, SplitNN) their order; pairing of activations and gradients is still checked by tag.
The local backend runs the same hosts in-process (for debugging and as the plain-loop reference in benchmarks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from raysplit.runtime.hosts import ClientHost, HostSpec, ServerHost
from raysplit.runtime.messages import Tag


@dataclass
class RoundStats:
    round: int
    t_start: float
    t_end: float
    wall: float
    clients: dict[int, dict]
    server: dict

    @property
    def sim_time(self) -> float:
        return self.t_end - self.t_start


@dataclass
class RuntimeInputs:
    """Everything the runtime needs to build its hosts (prepared by the experiment on the driver)."""

    spec: HostSpec
    client_host: type = ClientHost
    server_host: type = ServerHost
    train_data: dict = field(default_factory=dict)  # {"x", "y"} numpy
    test_data: dict = field(default_factory=dict)
    train_idx: list = field(default_factory=list)  # per client
    test_idx: list = field(default_factory=list)
    profiles: list = field(default_factory=list)
    client_init: dict = field(default_factory=dict)  # packed client-part state
    server_init: dict = field(default_factory=dict)  # packed server-part state


class Runtime:
    """Algorithm-facing API over a backend (``LocalBackend`` or ``RayBackend``)."""

    def __init__(self, backend, inputs: RuntimeInputs, max_in_flight: int = 256):
        self.backend = backend
        self.max_in_flight = max_in_flight
        self._inflight: list = []
        self.inputs = inputs
        self.num_clients = len(inputs.train_idx)
        self.sizes = np.array([len(ix) for ix in inputs.train_idx], dtype=float)
        self.round = -1
        self._t0 = 0.0
        self._wall0 = 0.0
        self._clients: list[int] = []
        backend.start(inputs)

    # ---- placement -------------------------------------------------------------------------------------------
    def worker_of(self, cid: int):
        return self.backend.workers[cid % len(self.backend.workers)]

    # ---- round structure -----------------------------------------------------------------------------------
    def begin_round(self, rnd: int, clients: list[int], t0: float) -> None:
        self.round, self._t0, self._clients = rnd, t0, [int(c) for c in clients]
        self._inflight = []
        self._wall0 = time.perf_counter()
        self.backend.call(self.backend.server, "begin_round", rnd, t0)
        for w in self.backend.workers:
            self.backend.call(w, "begin_round", rnd, self._clients, t0)

    def end_round(self) -> RoundStats:
        b = self.backend
        server_ref = b.call(b.server, "end_round")
        refs = [b.call(w, "end_round") for w in b.workers]
        server_out = b.get(server_ref)  # the server's error (e.g. a non-finite loss) is the root cause: first
        out = b.get(refs) + [server_out]
        b.round_done()
        clients: dict[int, dict] = {}
        for part in out[:-1]:
            clients.update(part)
        server = out[-1]
        t_end = max([server["t_end"]] + [c["t_end"] for c in clients.values()] + [self._t0])
        return RoundStats(self.round, self._t0, t_end, time.perf_counter() - self._wall0, clients, server)

    # ---- split-learning steps -------------------------------------------------------------------------------
    def forward(self, cid: int, step: int = 0, stream: str = "main", batch_size: int | None = None):
        tag = Tag(int(cid), self.round, int(step), stream)
        return self.backend.call(self.worker_of(cid), "forward", tag, batch_size)

    def backward(self, cid: int, grad):
        ref = self.backend.call(self.worker_of(cid), "backward", grad)
        self._inflight.append(ref)
        if len(self._inflight) > self.max_in_flight:  # bound the split steps in flight (object-store memory)
            self._inflight = self.backend.wait(self._inflight, len(self._inflight) - self.max_in_flight // 2)
        return ref

    def split_steps(self, seq: list[int], keys: dict | None = None, method: str = "train_step",
                    batch_size: int | None = None) -> None:
        """One split step per entry of ``seq`` (client ids, in serving order; a client may appear any number of
        times, consecutively or interleaved with others): the client forwards a batch, the server runs
        ``method(activation, key)`` (``keys[c]``, default ``"main"``), the client applies the gradient. Every
        client's first forward is submitted at once, so they run in parallel on the client actors; a client's next
        forward is submitted together with its backward, so it is ready by the client's next turn.

        Where the backend offers it (``RayBackend`` with ``runtime.direct_steps``), the whole sequence is one call
        to the server actor, which calls the client actors itself (actor to actor): the driver is off the per-step
        path. Each client actor executes the same calls in the same order as in the driver-chained loop below, and
        the server serves in the same order, so results are bit-identical (tests/test_direct_steps.py)."""
        plan = self._plan(seq, keys or {})
        if self.backend.direct_steps:
            self.backend.drive_steps(plan, method, batch_size)
            return
        pending = {}
        for c, _, tag, _ in plan:
            if c not in pending:
                pending[c] = self.forward(c, tag.step, batch_size=batch_size)
        for c, key, _, nxt in plan:
            self.backward(c, self.server(method, pending.pop(c), key))
            if nxt is not None:
                pending[c] = self.forward(c, nxt.step, batch_size=batch_size)

    def _plan(self, seq: list[int], keys: dict) -> list[tuple]:
        """``[(client, server key, tag, tag of the client's next step or None), ...]`` in serving order."""
        count: dict[int, int] = {}
        for c in seq:
            count[int(c)] = count.get(int(c), 0) + 1
        done: dict[int, int] = {}
        plan = []
        for c in seq:
            c = int(c)
            s = done.get(c, 0)
            done[c] = s + 1
            nxt = Tag(c, self.round, s + 1, "main") if s + 1 < count[c] else None
            plan.append((c, keys.get(c, "main"), Tag(c, self.round, s, "main"), nxt))
        return plan

    def clocks(self, clients: list[int]) -> dict[int, float]:
        """Current simulated time of each client (one driver round trip; for event-driven algorithms)."""
        out: dict[int, float] = {}
        for part in self.backend.get([self.backend.call(w, "clocks", clients) for w in self.backend.workers]):
            out.update(part)
        return out

    def server(self, method: str, *args, **kwargs):
        return self.backend.call(self.backend.server, method, *args, **kwargs)

    def server_each(self, method: str, n: int, *args, **kwargs) -> list:
        """Call a server-host method that returns a list of ``n`` results; one handle per result (so each
        client's gradient travels to its client alone)."""
        return self.backend.call_n(self.backend.server, n, method, *args, **kwargs)

    def client(self, cid: int, method: str, *args, **kwargs):
        return self.backend.call(self.worker_of(cid), method, *args, **kwargs)

    def all_workers(self, method: str, *args, **kwargs) -> list:
        return [self.backend.call(w, method, *args, **kwargs) for w in self.backend.workers]

    def weights(self, clients: list[int], mode: str = "samples") -> dict[int, float]:
        if mode == "uniform":
            return {int(c): 1.0 for c in clients}
        return {int(c): float(self.sizes[c]) for c in clients}

    def aggregate_clients(self, weights: dict[int, float], write_to: str = "all"):
        """FedAvg of the clients' current models: partial sums on the hosting workers, the sum on the server,
        the result installed on the workers. Returns a handle to the aggregate (a StateMsg)."""
        partials = self.all_workers("partial_sum", weights)
        agg = self.server("aggregate", *partials)
        self.install(agg, receivers=self._clients, only=None if write_to == "all" else list(weights))
        return agg

    def install(self, state_handle, receivers: list[int] | None = None, only: list[int] | None = None) -> None:
        """Install a client-model state on the workers: as everyone's starting model (``only`` None) or as the
        own model of the clients in ``only``; download is charged to ``receivers``."""
        for w in self.backend.workers:
            self.backend.call(w, "set_global", state_handle, receivers or [], only)

    def put(self, value):
        return self.backend.put(value)

    def get(self, handles, timeout: float | None = None):
        return self.backend.get(handles, timeout=timeout)

    # ---- evaluation and checkpoints ------------------------------------------------------------------------
    def evaluate_global(self, client_state_handle):
        return self.backend.get(self.server("evaluate", client_state_handle))

    def evaluate_clients(self, clients: list[int]):
        server_state = self.server("get_state")
        refs = [self.backend.call(w, "evaluate_clients", clients, server_state) for w in self.backend.workers]
        parts = self.backend.get(refs)
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                float(sum(p[2] for p in parts)))

    def client_totals(self) -> dict[int, dict]:
        out: dict[int, dict] = {}
        for part in self.backend.get([self.backend.call(w, "client_totals") for w in self.backend.workers]):
            out.update(part)
        return out

    def state_dict(self) -> dict:
        b = self.backend
        states = b.get([b.call(b.server, "state_dict")] + [b.call(w, "state_dict") for w in b.workers])
        return {"server": states[0], "workers": states[1:]}

    def load_state_dict(self, st: dict) -> None:
        b = self.backend
        if len(st["workers"]) != len(b.workers):
            raise ValueError(f"checkpoint has {len(st['workers'])} workers, runtime has {len(b.workers)}; resume "
                             "with the same runtime.num_workers")
        refs = [b.call(b.server, "load_state_dict", st["server"])]
        refs += [b.call(w, "load_state_dict", s) for w, s in zip(b.workers, st["workers"])]
        b.get(refs)

    def shutdown(self) -> None:
        self.backend.shutdown()


def host_inputs(inputs: RuntimeInputs, num_workers: int):
    """Split per-client inputs by hosting worker (client c lives on worker c % W)."""
    per = []
    for w in range(num_workers):
        cids = range(w, len(inputs.train_idx), num_workers)
        per.append(({c: inputs.train_idx[c] for c in cids}, {c: inputs.test_idx[c] for c in cids},
                    {c: inputs.profiles[c] for c in cids}))
    return per


class LocalBackend:
    """Runs the hosts in this process; handles are plain values."""

    def __init__(self, num_workers: int = 1):
        self.num_workers = num_workers
        self.workers: list = []
        self.server = None

    def start(self, inputs: RuntimeInputs) -> None:
        self.server = inputs.server_host(inputs.spec, inputs.server_init, inputs.client_init, inputs.test_data)
        self.workers = [inputs.client_host(inputs.spec, w, inputs.train_data, tr, te, pr, inputs.client_init)
                        for w, (tr, te, pr) in enumerate(host_inputs(inputs, self.num_workers))]

    def call(self, host, method, *args, **kwargs):
        return getattr(host, method)(*args, **kwargs)

    def call_n(self, host, n, method, *args, **kwargs):
        out = list(getattr(host, method)(*args, **kwargs))
        assert len(out) == n, f"{method} returned {len(out)} results, expected {n}"
        return out

    direct_steps = False  # split steps run as the plain loop in Runtime.split_steps

    def round_done(self) -> None:
        pass

    def put(self, value):
        return value

    def get(self, handles, timeout=None):
        return handles

    def wait(self, handles, num_ready):
        return []

    def shutdown(self) -> None:
        self.workers, self.server = [], None
