"""Ray backend: the server host and the client hosts run in Ray actors; handles are ObjectRefs.

This module, ray_actors.py (the actors and the ports), ray_crew.py (a run's actors: made, named, read when one
fails, kept or killed), ray_pool.py (actors kept for the next run) and ray_resources.py (what a run asks of Ray and
what it gets: the resource check, the automatic transport and threads) are the only code that imports Ray.
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from raysplit.errors import ActorFailure, ResourceError
from raysplit.runtime.driver.api import RuntimeInputs, host_inputs
from raysplit.runtime.ray.actors import HostActor, RayKeeper, RdtHostActor
from raysplit.runtime.ray.crew import Crew
from raysplit.runtime.ray.resources import auto_threads, auto_transport, check_resources, init_ray, usable_cores

__all__ = ["ActorFailure", "RayBackend", "ResourceError", "init_ray"]


class RayBackend:
    transport, transport_reason = "calls", ""  # set per run in __init__ and connect()
    cores = 1.0  # the CPU cores behind the actors (usable_cores), found in connect()

    def __init__(self, rcfg, get_timeout: float | None = 3600.0, restart_timeout: float = 30.0):
        self.rcfg = rcfg
        self.get_timeout = get_timeout
        # Replacement actors (restart) not all placed and constructed within this many seconds: a ResourceError
        # (a lost node leaves no room, other jobs hold it) instead of actors that stay pending for ever.
        self.restart_timeout = restart_timeout
        self.crew = Crew(rcfg)  # the run's actors
        self.started_ray = False
        self.direct_steps = rcfg.transport.direct_steps
        self._last: dict = {}  # client actor id -> ObjectRef of the driver's latest call on it
        self._barrier = None  # ObjectRef of a driven step sequence that later client-actor calls must follow
        self._connected = False
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
    def server(self):
        return self.crew.server

    @property
    def workers(self) -> list:
        return self.crew.workers

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
                "torch_threads_reason": self.threads_reason,
                "cpu": self.crew.cpus, **{f"{role}_device": d for role, d in self.crew.devices.items()}}

    def start(self, inputs: RuntimeInputs, ready_timeout: float | None = None) -> None:
        """Create the server and client actors and wait until they are constructed (``ready_timeout``: at most
        that long, else a ResourceError naming the actors no node took; None: the backend's ``get_timeout``)."""
        self.connect()
        r = self.rcfg
        if r.torch_threads == "auto":  # the run's loop decides whether idle actors poll (compiled) or block
            loop = "events" if inputs.plan.method.asynchronous else "steps"
            self.threads, self.threads_reason = auto_threads(r, self.cores, polling=self.compiled_for(loop),
                                                             concurrent=loop == "events")
        if not self._refs:  # the dataset goes into the object store once, shared by every actor
            self._refs = {k: ray.put(v) for k, v in (("train", inputs.train_data), ("test", inputs.test_data),
                                                      ("client_init", inputs.client_init),
                                                      ("labeled", inputs.labeled_data))}
        f, self._fault = self._fault, None
        fault = {f.actor: (f.round, f.call, f.method)} if f is not None else {}
        client_init = self._refs["client_init"]
        self.crew.start(RdtHostActor if self.rdt else HostActor,
                        (inputs.server_host, self._plan(inputs, "server"), inputs.server_init, client_init,
                         self._refs["test"], self._refs["labeled"]),
                        [(inputs.client_host, self._plan(inputs, "client"), w, self._refs["train"], tr, te, pr,
                          client_init) for w, (tr, te, pr) in enumerate(host_inputs(inputs, self.rcfg.num_workers))],
                        fault, self.get, ready_timeout)

    def _plan(self, inputs: RuntimeInputs, role: str):
        """The HostPlan an actor of ``role`` (server, client) gets: ``runtime.torch_threads: auto`` resolved for it."""
        return inputs.plan.with_threads(self.threads[role]) if self.threads else inputs.plan

    def restart(self, inputs: RuntimeInputs) -> None:
        """Replace every actor of the run (the dead one and the survivors) with fresh ones, wherever the cluster
        has room now; the caller then restores their state. A cluster that can no longer host them (a lost node
        leaves no node offering their resources, or none with room for ``restart_timeout`` seconds) is a
        ResourceError naming what is missing, not actors pending for ever."""
        self.crew.kill()
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
        if actor._actor_id not in self.crew.worker_ids:
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
        except RayTaskError as e:  # the host's own exception, or the death of an actor behind it
            raise self.crew.explain(e) from None
        except RayActorError as e:
            raise self.crew.failure(e) from None
        except GetTimeoutError:
            raise TimeoutError(f"no result from the actors within {timeout or self.get_timeout} s") from None

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

    def shutdown(self) -> None:
        clean = True
        if self.server is not None and self.transport in ("compiled", "compiled-steps"):
            try:  # a clean end of the graphs; a server already gone, or a teardown that hangs, is killed below
                ray.get(self.server.teardown_graphs.remote(), timeout=30)
            except Exception:  # noqa: BLE001
                clean = False
        # this run's actors go to the pool (runtime.keep_actors_s) if no actor call of the run raised, the graphs
        # were torn down cleanly and Ray outlives this run
        if clean and self.rcfg.keep_actors_s > 0 and not (self._failed or self.rdt or self.started_ray):
            self.crew.keep(self.rcfg.keep_actors_s)
        self.crew.kill()
        self._refs = {}
        if self.started_ray and not self.rcfg.address:
            ray.shutdown()
