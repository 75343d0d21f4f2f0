"""The actors of the Ray backend: the host actor (a client or server host, its fault injection and driven
loops), the snapshot keeper, and the ports through which a server actor reaches its client actors (actor calls,
Ray Compiled Graphs). With ray_backend.py, the only code that imports Ray."""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import inspect
import math
import os
import signal
import uuid
from collections import deque

import numpy as np
import ray
import threadpoolctl
import torch
from ray.exceptions import RayActorError, RayChannelError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysplit.errors import ActorFailure
from raysplit.runtime.driver import placement
from raysplit.runtime.server import stepping
from raysplit.runtime.state import invoke
from raysplit.runtime.devices import cpu_kind, determinism_state, host_device_of, restore_determinism
from raysplit.runtime.transport import from_tensors, to_tensors
from raysplit.runtime.driver.snapshots import SnapshotStore


def _frozen(obj) -> bool:
    """A frozen dataclass (the host's plan, its progress' records): data, not a component; it takes no fuse."""
    return dataclasses.is_dataclass(obj) and obj.__dataclass_params__.frozen


def fault_targets(host) -> list:
    """What a fault counts entries into: the host, its rule and the host's components (the objects of the runtime
    it holds: its trainer, its client steps, its meter, ...)."""
    parts = [v for v in vars(host).values()
             if type(v).__module__.startswith("raysplit.") and not isinstance(v, (dict, list, set, tuple))
             and not _frozen(v)]
    return [host, *[p for p in parts if p is not host]]


def arm_fault(host, rnd: int, call: int, method: str | None = None) -> None:
    """``runtime.faults.inject_fault`` in this actor: from round ``rnd`` on, the ``call``-th entry into a public method of
    ``host``, its rule or one of its components (``method`` only, if given; from the driver, another actor, the
    server's own driven loop or the host itself) kills this process with SIGKILL, as an out-of-memory kill or a
    crashed machine would, with no chance to clean up. The round is the host's own (``begin_round``), or for a client
    host under the event loop the latest round a client of it joined in."""
    entered = [0]

    def tick(name):
        now = max(getattr(host, "round", -1), max(getattr(host, "job_round", {}).values(), default=-1))
        if now >= rnd and (method is None or name == method):
            entered[0] += 1
            if entered[0] >= call:
                os.kill(os.getpid(), signal.SIGKILL)

    targets = fault_targets(host)
    for target in targets:
        for name in dir(type(target)):
            fn = getattr(type(target), name, None)
            if name.startswith("_") or not inspect.isfunction(fn):
                continue

            def fuse(bound, name=name):
                @functools.wraps(bound)  # inspect.signature still sees the method's own (ServerHost.serve asks)
                def fused(*args, **kwargs):
                    tick(name)
                    return bound(*args, **kwargs)
                return fused

            setattr(target, name, fuse(getattr(target, name)))
    if method is not None and not any(inspect.isfunction(getattr(type(t), method, None)) for t in targets):
        raise ValueError(f"runtime.faults.inject_fault.method={method!r}: {type(host).__name__} has no such method")


@ray.remote(num_cpus=0)
class KeeperActor:
    """Round-boundary snapshots (:class:`~raysplit.runtime.driver.snapshots.SnapshotStore`), one store per run, in a process
    of their own on the driver's node: it outlives the hosts' actors (and their nodes), and the driver never holds
    the state. One keeper serves every run of a driver (:class:`RayKeeper`), each run's store under its own key."""

    def __init__(self):
        self.stores: dict[str, SnapshotStore] = {}

    def add(self, key: str, rnd: int, server, holders, global_msg, *workers) -> int:
        return self.stores.setdefault(key, SnapshotStore()).add(rnd, server, list(workers), holders, global_msg)

    def restore(self, key: str) -> tuple:
        rnd, st, g = self.stores.get(key, SnapshotStore()).restore()
        return (rnd, st["holders"], st["server"], g, *st["workers"])

    def drop(self, key: str) -> None:
        self.stores.pop(key, None)


_keepers: dict[tuple[str, str], ray.actor.ActorHandle] = {}  # (job, node) -> this driver's keeper actor


class RayKeeper:
    """``RoundGuard``'s keeper with the Ray backend: :meth:`add` hands the hosts' state handles to the keeper actor
    (Ray resolves them there, not here) and returns at once; :meth:`restore` fetches only the round and the client
    placement, the states travel from the keeper to the replacement hosts as objects.

    The keeper actor is made once per driver (Ray job) and node and shared by the driver's runs, each under a key of
    its own that :meth:`close` drops: a notebook or a test session running many experiments starts one keeper
    process (which imports torch to hold the states), not one per run. It ends with the driver."""

    def __init__(self):
        ctx = ray.get_runtime_context()
        self.at = (ctx.get_job_id(), ctx.get_node_id())
        if self.at not in _keepers:
            _keepers[self.at] = KeeperActor.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.at[1], soft=False)).remote()
        self.actor, self.key = _keepers[self.at], uuid.uuid4().hex

    def add(self, rnd: int, server, workers: list, holders, global_msg) -> None:
        self.actor.add.remote(self.key, rnd, server, holders, global_msg, *workers)

    def restore(self, num_workers: int) -> tuple:
        refs = self.actor.restore.options(num_returns=4 + num_workers).remote(self.key)
        try:
            rnd, holders = ray.get(refs[:2])
        except RayTaskError as e:
            if isinstance(e.cause, LookupError):
                raise LookupError(str(e.cause)) from None
            raise
        except RayActorError as e:
            if _keepers.get(self.at) is self.actor:  # the next run starts a keeper of its own
                del _keepers[self.at]
            raise LookupError(f"the snapshot keeper actor is gone ({type(e).__name__})") from None
        return rnd, holders, refs[2], list(refs[4:]), refs[3]

    def close(self) -> None:
        try:
            self.actor.drop.remote(self.key)  # after this run's adds: one caller's actor calls run in order
        except Exception:  # noqa: BLE001 - the keeper (or Ray) is already gone
            pass


class HostActor:
    """A thin actor around a host object (``ClientHost`` / ``ServerHost`` or an algorithm's subclass). Made an actor
    class (``ray.remote``) below, after :class:`RdtHostActor` derives from it."""

    def __init__(self, host_cls, *args, fault: tuple | None = None):
        # what a fresh process has, for reset(): a host may set torch's and the BLAS libraries' threads
        self._threads = torch.get_num_threads()
        self._blas = {i["prefix"]: i["num_threads"] for i in threadpoolctl.threadpool_info()
                      if i["user_api"] == "blas"}
        self._kernels = determinism_state()  # set back with the threads for the next run's host
        self._build(host_cls, args, fault)

    def _build(self, host_cls, args: tuple, fault: tuple | None) -> None:
        self.host = host_cls(*args)
        if fault is not None:
            arm_fault(self.host, *fault)

    def reset(self, host_cls, *args, fault: tuple | None = None) -> tuple[str, str]:
        """Host a new run's host in this process, as a fresh actor would (``runtime.keep_actors_s``, ray_pool.py):
        the old host and any compiled graphs of its run are dropped, torch's and the BLAS libraries' thread counts
        set back to this process's first ones; the new host seeds torch itself, as every host does. Returns what
        :meth:`ready` returns (the actor's readiness)."""
        self.host = None
        self._graphs, self._graph_ids = [], None
        gc.collect()
        torch.set_num_threads(self._threads)
        restore_determinism(self._kernels)
        if self._blas:
            threadpoolctl.threadpool_limits(self._blas)
        self._build(host_cls, args, fault)
        return self.ready()

    def call(self, method: str, *args, **kwargs):
        return invoke(self.host, method, *args, **kwargs)

    def call_split(self, method: str, *args, **kwargs):
        """For num_returns=n calls: one object per element of the method's list."""
        out = list(invoke(self.host, method, *args, **kwargs))
        return out[0] if len(out) == 1 else tuple(out)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def device(self) -> str:
        """Where this actor's host computes (``runtime.server.device`` / ``client.device`` as it resolved here)."""
        return host_device_of(self.host)

    def ready(self) -> tuple[str, str, str]:
        """The node this actor runs on, where its host computes and its CPU kind (:func:`cpu_kind`): the first call
        on a new actor, whose answer says the host was built (a constructor's error surfaces here)."""
        return self.node_id(), self.device(), cpu_kind()

    def call_after(self, _barrier, method: str, *args, **kwargs):
        """``call`` once ``_barrier`` (an ObjectRef passed top-level, so Ray resolves it before dispatch and this
        actor stays free for other callers meanwhile) is done: orders the driver's calls after a driven sequence."""
        return self.call(method, *args, **kwargs)

    def call_seq(self, calls: list):
        """Several host calls in one actor call (one message instead of one per call); returns the last result."""
        out = None
        for method, args in calls:
            out = invoke(self.host, method, *args)
        return out

    def drive(self, loop: str, args: tuple, workers: list, before: list, route: dict | None, compiled: bool = False):
        """Run one of ``stepping.LOOPS`` (split steps, pooled steps, a round of events) with this (server) actor in
        charge, calling the client actors directly (``route``: each client's worker; None: at home), through
        compiled graphs (``compiled``, :class:`CompiledPort`) or ordinary actor calls. ``before`` (nested, so not
        fetched) holds the driver's last call on each client actor: those must have run before ours do."""
        if before:
            ray.wait(before, num_returns=len(before), fetch_local=False)
        port = self._compiled_port(workers, route) if compiled else RayPort(workers, route)
        return stepping.LOOPS[loop](self.host, *args, port)

    def set_channel_buffer(self, nbytes: int) -> None:
        """The size of the compiled-graph channels this process writes (Ray 2.60 sizes a channel by its writer's
        ``DAGContext``; ``experimental_compile``'s own setting is ignored for actors' channels)."""
        from ray.dag import DAGContext

        DAGContext.get_current().buffer_size_bytes = int(nbytes)

    def _compiled_port(self, workers: list, route: dict | None) -> "CompiledPort":
        """One compiled graph per client actor on this (server) actor's node (``InputNode -> call_seq``), made the
        first time this server drives these actors and kept for the run: compiling costs about a second, an
        execution about 1 ms. Client actors on other nodes get ordinary actor calls: Ray 2.60's compiled graphs
        across nodes take ~100 ms an execution with one in flight and fail with more
        (benchmarks/cg_crossnode.py)."""
        ids = [w._actor_id for w in workers]
        if getattr(self, "_graph_ids", None) != ids:
            from ray.dag import InputNode

            here = self.node_id()
            local = [n == here for n in ray.get([w.node_id.remote() for w in workers])]
            nbytes = channel_bytes(self.host)
            self.set_channel_buffer(nbytes)  # the server writes the input channels
            ray.get([w.set_channel_buffer.remote(nbytes) for w, ok in zip(workers, local) if ok])  # clients: outputs
            self._graphs = []
            for w, ok in zip(workers, local):
                if not ok:
                    self._graphs.append(None)
                    continue
                with InputNode() as inp:
                    dag = w.call_seq.bind(inp)
                self._graphs.append(dag.experimental_compile(_max_inflight_executions=CompiledPort.CAP))
            self._graph_ids = ids
        return CompiledPort(workers, route, self._graphs)

    def teardown_graphs(self) -> None:
        """End this server's compiled graphs (before its actors are killed, so nothing reports their loss)."""
        import logging

        logging.getLogger("ray.dag.compiled_dag_node").setLevel(logging.WARNING)  # four lines per graph otherwise
        for dag in getattr(self, "_graphs", []):
            if dag is not None:
                dag.teardown()
        self._graphs, self._graph_ids = [], None


class RdtHostActor(HostActor):
    """:class:`HostActor` with :meth:`call_rdt` (``runtime.transport.kind: rdt``): a class of its own because a method
    with a tensor transport makes Ray run every task of the actor on a background thread (Ray 2.60,
    ray/actor.py), which the other transports should not pay for. Its calls take what another actor's ``call_rdt``
    returned, and make the messages again first (:func:`from_tensors`)."""

    def call(self, method: str, *args, **kwargs):
        return super().call(method, *map(from_tensors, args), **kwargs)

    def call_split(self, method: str, *args, **kwargs):
        return super().call_split(method, *map(from_tensors, args), **kwargs)

    @ray.method(tensor_transport="gloo")
    def call_rdt(self, method: str, *args, **kwargs):
        """``call`` whose result's arrays (an activation's features and labels, a gradient) leave this actor by Ray
        Direct Transport over gloo, the rest of the message through the object store."""
        return to_tensors(self.call(method, *args, **kwargs))


HostActor, RdtHostActor = ray.remote(HostActor), ray.remote(RdtHostActor)


def channel_bytes(server_host) -> int:
    """The size of a channel's buffers: the larger of a client model's state and a batch's activations of two
    streams, plus a margin for the rest of the message. A larger message still goes through (the channel grows
    itself); such a channel only cannot be torn down cleanly in Ray 2.60, and raysplit ends its graphs with their
    actors."""
    cuts = server_host.plan.model.cuts  # tiered: the largest of the clients' activations
    forms = [server_host.screen.form(c) for c in sorted(set(cuts))] if cuts else [server_host.screen.form()]
    per_sample = max(int(math.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in forms) + 8
    state = sum(v.nbytes for v in server_host.rule.client_encoder().state_dict().values())
    return int(max(2 * per_sample * server_host.plan.sections.train.batch_size, 2 * state) + (1 << 20))


class RayPort:
    """:class:`stepping.ClientPort` over client actors: one ``call_seq`` message per submission."""

    grouped = True  # a pooled step's calls for a host's clients go as one message (stepping.run_pooled_steps)

    def __init__(self, workers: list, route: dict | None = None):
        self.workers, self.route = workers, route

    def worker(self, cid: int) -> int:
        return self.route[cid] if self.route is not None else placement.home(cid, len(self.workers))

    def submit(self, cid: int, calls: list[tuple[str, tuple]]):
        w = self.workers[self.worker(cid)]
        if len(calls) == 1:
            return w.call.remote(calls[0][0], *calls[0][1])
        return w.call_seq.remote(calls)

    def fetch(self, handle):
        return ray.get(handle)

    def wait(self, handles: list) -> None:
        ray.get(handles)


def _channel_closed(g: int, e: Exception) -> ActorFailure:
    """Client actor ``g`` lost under a compiled graph (raised in the server actor, which does not know the actors'
    nodes): ``worker`` lets the driver's :meth:`RayBackend.get` name the actor and its node."""
    err = ActorFailure(f"client actor {g} is gone (its compiled graph's channel closed: {e})")
    err.worker = g
    return err


class CompiledPort(RayPort):
    """:class:`stepping.ClientPort` over Ray Compiled Graphs: a submission is one execution of the client actor's
    graph (its ``call_seq`` on the calls), its messages travel through shared-memory channels, not Ray's per-call
    task path. An actor's executions complete in submission order, and at most ``CAP`` may be outstanding per
    graph, so results are collected in order (and kept) when a submission would exceed that. What arrives is a
    read-only view of the channel's buffer, which holds the channel until released: it is copied on arrival. A
    client actor without a graph (``None``: on another node) is called as :class:`RayPort` does, its handle an
    ObjectRef."""

    CAP = 4  # executions in flight per graph (each of its two channels holds CAP buffers)

    def __init__(self, workers: list, route: dict | None, graphs: list):
        super().__init__(workers, route)
        self.graphs = graphs
        self.outstanding = [deque() for _ in graphs]  # (handle, CompiledDAGRef) per graph, in submission order
        self.results: dict = {}
        self.count = 0

    def submit(self, cid: int, calls: list[tuple[str, tuple]]):
        g = self.worker(cid)
        if self.graphs[g] is None:  # an actor on another node: actor calls
            return super().submit(cid, calls)
        while len(self.outstanding[g]) >= self.CAP - 1:
            self._collect(g)
        try:
            ref = self.graphs[g].execute(calls)
        except RayChannelError as e:
            raise _channel_closed(g, e) from None
        self.count += 1
        handle = (g, self.count)
        self.outstanding[g].append((handle, ref))
        return handle

    def _collect(self, g: int) -> None:
        handle, ref = self.outstanding[g].popleft()
        try:
            self.results[handle] = copy.deepcopy(ray.get(ref, timeout=-1))
        except RayChannelError as e:
            raise _channel_closed(g, e) from None

    def fetch(self, handle):
        if not isinstance(handle, tuple):
            return super().fetch(handle)
        while handle not in self.results:
            self._collect(handle[0])
        return self.results.pop(handle)

    def wait(self, handles: list) -> None:
        for h in handles:
            self.fetch(h)
