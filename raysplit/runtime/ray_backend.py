"""Ray backend: the server host and the client hosts run in Ray actors; handles are ObjectRefs.

This module, ray_actors.py (the actors and the ports), ray_pool.py (actors kept for the next run) and
ray_resources.py (what a run asks of Ray and what it gets: the resource check, the automatic transport and threads)
are the only code that imports Ray.
"""

from __future__ import annotations

from collections import Counter

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from raysplit.errors import ActorFailure, ResourceError
from raysplit.runtime.api import RuntimeInputs, host_inputs, with_threads
from raysplit.runtime.ray_actors import HostActor, RayKeeper, RdtHostActor
from raysplit.runtime.ray_pool import POOL, answering, pool_key
from raysplit.runtime.ray_resources import (auto_threads, auto_transport, bundle, check_resources, init_ray,
                                            placed_node, usable_cores, visible)

__all__ = ["ActorFailure", "RayBackend", "ResourceError", "init_ray"]


class RayBackend:
    _group = None  # runtime.transport.kind rdt's gloo group over the run's actors
    transport, transport_reason = "calls", ""  # set per run in __init__ and connect()
    cores = 1.0  # the CPU cores behind the actors (usable_cores), found in connect()

    def __init__(self, rcfg, get_timeout: float | None = 3600.0, restart_timeout: float = 30.0):
        self.rcfg = rcfg
        self.get_timeout = get_timeout
        # Replacement actors (restart) not all placed and constructed within this many seconds: a ResourceError
        # (a lost node leaves no room, other jobs hold it) instead of actors that stay pending for ever.
        self.restart_timeout = restart_timeout
        self.workers: list = []
        self.server = None
        self.started_ray = False
        self.roles: dict[str, str] = {}
        self.direct_steps = rcfg.transport.direct_steps
        self._worker_ids: set = set()
        self._last: dict = {}  # client actor id -> ObjectRef of the driver's latest call on it
        self._barrier = None  # ObjectRef of a driven step sequence that later client-actor calls must follow
        self._connected = False
        self._made_with: dict = {}  # role (server, client) -> what its actors were made with (ray_pool.pool_key)
        self._failed = False  # an actor call of this run raised (get): its actors are killed, not kept
        self._refs: dict = {}  # the run's inputs in the object store, put once (they outlive restarted actors)
        self._fault = rcfg.faults.inject_fault  # armed in the run's first actors only, not in their replacements
        # the transport in use: the configured kind, or what ``auto`` resolves to in connect()
        self.transport = rcfg.transport.kind
        self.transport_reason = "runtime.transport.kind"
        # torch threads per actor role: runtime.torch_threads, or what ``auto`` resolves to in start()
        t = rcfg.torch_threads
        self.threads = None if t is None else {"server": t, "client": t}
        self.threads_reason = "runtime.torch_threads"

    def connect(self) -> None:
        """Join or start Ray and check that the requested actors fit the cluster: before any MLflow run or
        actor exists, so an impossible request costs nothing but its error."""
        if not self._connected:
            self.started_ray = init_ray(self.rcfg)
            self._connected = True
        check_resources(self.rcfg)
        self.cores = usable_cores(self.rcfg)
        if self.rcfg.transport.kind == "auto" and not self.direct_steps:
            self.transport, self.transport_reason = "calls", "runtime.transport.direct_steps is false: the driver " \
                "chains every call"
        elif self.rcfg.transport.kind == "auto":
            self.transport, self.transport_reason = auto_transport(self.cores, self.rcfg.num_workers)

    @property
    def rdt(self) -> bool:
        """runtime.transport.kind: rdt (driver-chained): activations and gradients by Ray Direct Transport over
        gloo."""
        return self.transport == "rdt"

    def resolved(self) -> dict:
        """What the run's config left to the backend, logged as ``resolved.*`` params (after start)."""
        threads = self.threads if self.threads is None or self.threads["server"] != self.threads["client"] else \
            self.threads["server"]
        return {"transport": self.transport, "transport_reason": self.transport_reason, "torch_threads": threads,
                "torch_threads_reason": self.threads_reason}

    def start(self, inputs: RuntimeInputs, ready_timeout: float | None = None) -> None:
        """Create the server and client actors and wait until they are constructed (``ready_timeout``: at most
        that long, else a ResourceError naming the actors no node took; None: the backend's ``get_timeout``)."""
        self.connect()
        r = self.rcfg
        if r.torch_threads == "auto":  # the run's loop decides whether idle actors poll (compiled) or block
            loop = "events" if inputs.spec.asynchronous else "steps"
            self.threads, self.threads_reason = auto_threads(r, self.cores, polling=self.compiled_for(loop),
                                                             concurrent=loop == "events")
        if not self._refs:  # the dataset goes into the object store once, shared by every actor
            self._refs = {k: ray.put(v) for k, v in (("train", inputs.train_data), ("test", inputs.test_data),
                                                      ("client_init", inputs.client_init),
                                                      ("labeled", inputs.labeled_data))}
        train_ref, test_ref, client_init = self._refs["train"], self._refs["test"], self._refs["client_init"]
        f, self._fault = self._fault, None
        fault = {f.actor: (f.round, f.call, f.method)} if f is not None else {}
        actor_cls = RdtHostActor if self.rdt else HostActor
        server_opts = dict(num_cpus=r.server.num_cpus, num_gpus=r.server.num_gpus,
                           resources=r.server.resources or None, memory=r.server.memory)
        opts = dict(num_cpus=r.client.num_cpus, num_gpus=r.client.num_gpus, resources=r.client.resources or None,
                    memory=r.client.memory)
        if r.placement.spread_clients:
            opts["scheduling_strategy"] = "SPREAD"
        # actors a finished run of this driver left (runtime.keep_actors_s; not for rdt, whose actors are in a
        # collective group); every other idle one is killed first, so that the new ones find room
        self._made_with = {"server": pool_key(actor_cls, server_opts), "client": pool_key(actor_cls, opts)}
        needs = Counter({self._made_with["server"]: 1})
        needs[self._made_with["client"]] += r.num_workers
        pooled = POOL.take(needs if actor_cls is HostActor else Counter())
        built: dict = {}  # actor id -> the ObjectRef that is ready when its host is built

        def make(role, options, args, fault):
            if pooled.get(self._made_with[role]):
                a = pooled[self._made_with[role]].pop()
                built[a._actor_id] = a.reset.remote(*args, fault=fault)
            else:
                a = actor_cls.options(**options).remote(*args, fault=fault)
                built[a._actor_id] = a.node_id.remote()
            return a

        self.server = make("server", {**server_opts, "name": None},
                           (inputs.server_host, self._spec(inputs, "server"), inputs.server_init, client_init,
                            test_ref, self._refs["labeled"]), fault.get("server"))
        self.workers = [
            make("client", opts, (inputs.client_host, self._spec(inputs, "client"), w, train_ref, tr, te, pr,
                                  client_init), fault.get(f"client{w}"))
            for w, (tr, te, pr) in enumerate(host_inputs(inputs, r.num_workers))
        ]
        self._worker_ids = {w._actor_id for w in self.workers}
        self.roles = {self.server._actor_id.hex(): "the server actor"}
        n = r.num_workers
        self.roles.update({w._actor_id.hex(): f"client actor {i} (home of clients {i}, {i + n}, {i + 2 * n}, ...)"
                           for i, w in enumerate(self.workers)})
        # Constructors raise here (bad data, model errors) rather than at the first round.
        actors = [self.server, *self.workers]
        refs = [built[a._actor_id] for a in actors]
        if ready_timeout is not None:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ready_timeout, fetch_local=False)
            pending = [a for a, r in zip(actors, refs) if r not in set(ready)]
            if any(placed_node(a) is None for a in pending):  # no node took them: the cluster has no room
                raise ResourceError(self._unplaced(pending, ready_timeout))
            # every one placed, some still constructing (a loaded node): get() below waits up to get_timeout
        nodes = self.get(refs)
        for a, node in zip(actors, nodes):
            self.roles[a._actor_id.hex()] += f" on node {node}"
        if self.rdt:  # one gloo group over the run's actors (replacement actors get a new one)
            from ray.experimental.collective import create_collective_group

            self._group = create_collective_group(actors, backend="torch_gloo")

    def _spec(self, inputs: RuntimeInputs, role: str):
        """The HostSpec an actor of ``role`` (server, client) gets: ``torch_threads: auto`` resolved for it."""
        return with_threads(inputs.spec, self.threads[role]) if self.threads else inputs.spec

    def _unplaced(self, pending: list, waited: float) -> str:
        """What to say about replacement actors still not constructed after ``waited`` seconds: those no node took
        (and what they need), apart from those placed whose constructor is still running."""
        r = self.rcfg
        name = {a._actor_id: self.roles[a._actor_id.hex()].split(" (")[0] for a in pending}
        where = {a._actor_id: placed_node(a) for a in pending}
        placed = [a for a in pending if where[a._actor_id]]
        unplaced = [a for a in pending if not where[a._actor_id]]
        parts = []
        if unplaced:
            bundles = "; ".join(f"{name[a._actor_id]} {bundle(r.server if a is self.server else r.client)}"
                                for a in unplaced)
            nodes = {n["NodeID"]: visible(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")}
            parts.append(f"{', '.join(name[a._actor_id] for a in unplaced)} not placed within {waited:g} s: no live "
                         f"node had room for {bundles} (live nodes {nodes}; free now "
                         f"{visible(ray.available_resources())})")
        if placed:
            parts.append(", ".join(f"{name[a._actor_id]} placed on node {where[a._actor_id]}" for a in placed)
                         + f" but not constructed within {waited:g} s")
        return "; ".join(parts)

    def restart(self, inputs: RuntimeInputs) -> None:
        """Replace every actor of the run (the dead one and the survivors) with fresh ones, wherever the cluster
        has room now; the caller then restores their state. A cluster that can no longer host them (a lost node
        leaves no node offering their resources, or none with room for ``restart_timeout`` seconds) is a
        ResourceError naming what is missing, not actors pending for ever."""
        self._kill_actors()
        self._failed = False  # what raised was the old actors'; the replacements start clean
        self._barrier = None
        self._last.clear()
        # The inputs are put again: the old objects have copies on the nodes of the old actors, and when one of those
        # nodes crashed, the replacements' pulls of their arguments keep trying it until Ray declares it dead
        # (measured with Ray 2.60 on ray.cluster_utils: replacements constructed after 13-33 s instead of 3 s).
        self._refs = {}
        self.start(inputs, ready_timeout=self.restart_timeout)

    def hop(self, actor, method, *args):
        """A call whose result another actor takes as an argument (a client's activation, the server's gradient):
        with ``runtime.transport.kind: rdt`` its tensors travel by Ray Direct Transport, else as :meth:`call`."""
        return self.call(actor, method, *args, _rdt=self.rdt)

    def call(self, actor, method, *args, _rdt: bool = False, **kwargs):
        call = actor.call_rdt if _rdt else actor.call
        if actor._actor_id not in self._worker_ids:
            return call.remote(method, *args, **kwargs)
        if self._barrier is not None:
            ref = actor.call_after.remote(self._barrier, method, *args, **kwargs)
        else:
            ref = call.remote(method, *args, **kwargs)
        self._last[actor._actor_id] = ref
        return ref

    def drive(self, loop: str, route: dict | None, *args):
        """Hand a loop (``stepping.LOOPS``) to the server actor (``HostActor.drive``); the driver submits one call
        and does not wait. Client-actor calls the driver submits afterwards wait for it (``call_after``)."""
        before = [self._last[w._actor_id] for w in self.workers if w._actor_id in self._last]
        self._barrier = self.server.drive.remote(loop, args, self.workers, before, route, self.compiled_for(loop))
        return self._barrier

    def compiled_for(self, loop: str) -> bool:
        """Whether a driven ``loop`` (``stepping.LOOPS``) reaches the client actors over compiled graphs."""
        return self.transport == "compiled" or (self.transport == "compiled-steps" and loop != "events")

    def round_done(self) -> None:
        """Everything submitted so far has been fetched: no ordering to enforce any more."""
        self._barrier = None
        self._last.clear()

    def call_n(self, actor, n, method, *args, **kwargs):
        refs = actor.call_split.options(num_returns=n).remote(method, *args, **kwargs)
        return [refs] if n == 1 else list(refs)

    def put(self, value):
        return ray.put(value)

    def get(self, handles, timeout: float | None = None):
        try:
            return self._get(handles, timeout)
        except BaseException:
            self._failed = True  # an actor's error, death or silence: its actors are not kept (ActorPool)
            raise

    def _get(self, handles, timeout: float | None = None):
        try:
            if self.rdt:  # the driver is outside the gloo group: what it reads comes through the object store
                return ray.get(handles, timeout=timeout or self.get_timeout, _use_object_store=True)
            return ray.get(handles, timeout=timeout or self.get_timeout)
        except RayTaskError as e:  # re-raise the host's own exception (NonFiniteLossError, KeyError, ...)
            cause = e
            while isinstance(cause, RayTaskError) and getattr(cause, "cause", None) is not None:
                cause = cause.cause  # a driven step sequence nests the client actor's error in the server's
            if isinstance(cause, RayActorError):  # a client actor died under the server's driven loop
                raise self._actor_failure(cause) from None
            g = getattr(cause, "worker", None)
            if isinstance(cause, ActorFailure) and g is not None and g < len(self.workers):
                role = self.roles.get(self.workers[g]._actor_id.hex(), f"client actor {g}")
                raise ActorFailure(f"{role} is gone (its compiled graph's channel closed)") from None
            dead = self._dead_actor()
            if dead is not None:  # the host's error is what a dead peer left behind (its activations, its channel)
                raise dead from None
            raise cause from None
        except RayActorError as e:
            raise self._actor_failure(e) from None
        except GetTimeoutError:
            raise TimeoutError(f"no result from the actors within {timeout or self.get_timeout} s") from None

    def _dead_actor(self, timeout: float = 5.0) -> ActorFailure | None:
        """The death of one of the run's actors, if one has died: a host's own error can be its consequence (a
        client actor 0 whose round ended with activations the dead client actor 1's turn never let the server
        answer), and which of the two surfaces first is a race. An actor that is busy past ``timeout`` counts as
        alive."""
        actors = [a for a in [self.server, *self.workers] if a is not None]
        refs = [a.node_id.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as e:
                return self._actor_failure(e)
            except Exception:  # noqa: BLE001 - anything else: not a death
                continue
        return None

    def _actor_failure(self, e: RayActorError) -> ActorFailure:
        role = self.roles.get(getattr(e, "actor_id", None) or "", "an actor of this run")
        why = str(e).strip().splitlines()
        detail = "; ".join(ln.strip() for ln in why if "died because" in ln or "node" in ln.lower()
                           or "killed" in ln)[:500]
        return ActorFailure(f"{role} died ({type(e).__name__}): {detail or why[0]}")

    def wait(self, handles: list, num_ready: int) -> list:
        """Block until ``num_ready`` of ``handles`` are done; return the ones still pending."""
        _, pending = ray.wait(handles, num_returns=max(1, min(num_ready, len(handles))), fetch_local=False)
        return pending

    def node_ids(self) -> dict[str, list[str]]:
        return {"server": self.get([self.server.node_id.remote()]),
                "workers": self.get([w.node_id.remote() for w in self.workers])}

    def snapshot_keeper(self) -> RayKeeper:
        """Where ``RoundGuard`` keeps its snapshots: a keeper actor on this (the driver's) node."""
        return RayKeeper()

    def _keep_actors(self, clean: bool) -> None:
        """Give this run's actors to the pool (``runtime.keep_actors_s``) if no actor call of the run raised, the
        graphs were torn down cleanly, each actor is alive and idle (answers within a few seconds), and Ray
        outlives this run."""
        seconds = self.rcfg.keep_actors_s
        actors = [a for a in [self.server, *self.workers] if a is not None]
        if not (clean and seconds > 0 and actors and not self._failed and not self.rdt and not self.started_ray):
            return
        if len(answering(actors)) < len(actors):
            return
        POOL.give([(self._made_with["server"], self.server), *((self._made_with["client"], w) for w in self.workers)],
                  seconds)
        self.workers, self.server = [], None

    def _kill_actors(self) -> None:
        if self._group is not None:
            from ray.experimental.collective import destroy_collective_group

            try:
                destroy_collective_group(self._group)
            except Exception:  # noqa: BLE001 - a member is gone: the group goes with the actors
                pass
            self._group = None
        for a in [self.server, *self.workers]:
            if a is not None:
                try:
                    ray.kill(a)
                except Exception:  # noqa: BLE001 - already dead
                    pass
        self.workers, self.server = [], None

    def shutdown(self) -> None:
        clean = True
        if self.server is not None and self.transport in ("compiled", "compiled-steps"):
            try:  # a clean end of the graphs; a server already gone, or a teardown that hangs, is killed below
                ray.get(self.server.teardown_graphs.remote(), timeout=30)
            except Exception:  # noqa: BLE001
                clean = False
        self._keep_actors(clean)
        self._kill_actors()
        self._refs = {}
        if self.started_ray and not self.rcfg.address:
            ray.shutdown()
