"""A run's actors: made (or taken from the pool of a finished run's actors), named, waited for, read when one
fails, kept for the next run or killed. The backend (:mod:`raysplit.runtime.ray.backend`) sends them its calls;
this module and the backend's other ray_* files are the only code that imports Ray."""

from __future__ import annotations

import logging
import re
import textwrap
from collections import Counter

import ray
from ray.exceptions import RayActorError, RayTaskError

from raysplit.errors import ActorFailure, ResourceError
from raysplit.runtime.ray.actors import HostActor
from raysplit.runtime.ray.pool import POOL, answering, pool_key
from raysplit.runtime.ray.resources import bundle, placed_node, visible


class _Gone(logging.Filter):
    """Drops Ray's "Unhandled error" reports of calls to actors this driver killed or replaced: the calls a dead
    actor had pending when the run gave it up (80 lines and more after one restart), whose failure the run has
    already handled. Every other unhandled error is still reported. The ids of the last ``KEEP`` actors killed are
    kept (a long-lived driver, a sweep of thousands of runs, does not grow them without end); their reports come
    within seconds of the kill."""

    KEEP = 1024

    def __init__(self):
        super().__init__()
        self.ids: dict[str, None] = {}  # insertion-ordered: the oldest go first

    def add(self, actor_id: str) -> None:
        self.ids[actor_id] = None
        while len(self.ids) > self.KEEP:
            del self.ids[next(iter(self.ids))]

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Unhandled error") and any(i in msg for i in self.ids))


GONE = _Gone()
logging.getLogger("ray._private.worker").addFilter(GONE)


class Crew:
    """The server actor and the client actors of one run, with what each is called in errors (``roles``: "client
    actor 1 (home of clients 1, 3, ...) on node ..."), what each was made with (the pool's key) and, under
    ``runtime.transport.kind: rdt``, their gloo group."""

    def __init__(self, rcfg):
        self.rcfg = rcfg
        self.server = None
        self.workers: list = []
        self.roles: dict[str, str] = {}
        self.worker_ids: set = set()
        self.made_with: dict = {}  # role (server, client) -> what its actors were made with (ray_pool.pool_key)
        self.group = None  # runtime.transport.kind rdt's gloo group over the run's actors
        self.devices: dict[str, str] = {}  # role -> the device(s) its hosts compute on (logged as resolved.*)
        self.cpus = ""

    @property
    def actors(self) -> list:
        return [a for a in [self.server, *self.workers] if a is not None]

    def start(self, actor_cls, server_args: tuple, client_args: list[tuple], fault: dict, get,
              ready_timeout: float | None = None) -> None:
        """Make the server actor (``server_args``) and one client actor per entry of ``client_args``, or take idle
        ones made the same way from the pool (not for rdt, whose actors are in a collective group; every other
        idle one is killed first, so that the new ones find room), and wait with ``get`` until each host is built
        (``ready_timeout``: a ResourceError naming the actors no node took within that long)."""
        r = self.rcfg
        server_opts = dict(num_cpus=r.server.num_cpus, num_gpus=r.server.num_gpus,
                           resources=r.server.resources or None, memory=r.server.memory)
        opts = dict(num_cpus=r.client.num_cpus, num_gpus=r.client.num_gpus, resources=r.client.resources or None,
                    memory=r.client.memory)
        if r.placement.spread_clients:
            opts["scheduling_strategy"] = "SPREAD"
        self.made_with = {"server": pool_key(actor_cls, server_opts), "client": pool_key(actor_cls, opts)}
        needs = Counter({self.made_with["server"]: 1})
        needs[self.made_with["client"]] += len(client_args)
        pooled = POOL.take(needs if actor_cls is HostActor else Counter())
        built: dict = {}  # actor id -> the ObjectRef that is ready when its host is built

        def make(role, options, args, fault):
            if pooled.get(self.made_with[role]):
                a = pooled[self.made_with[role]].pop()
                built[a._actor_id] = a.reset.remote(*args, fault=fault)
            else:
                a = actor_cls.options(**options).remote(*args, fault=fault)
                built[a._actor_id] = a.ready.remote()
            return a

        self.server = make("server", {**server_opts, "name": None}, server_args, fault.get("server"))
        self.workers = [make("client", opts, args, fault.get(f"client{w}")) for w, args in enumerate(client_args)]
        self.worker_ids = {w._actor_id for w in self.workers}
        n = len(self.workers)
        self.roles = {self.server._actor_id.hex(): "the server actor"}
        self.roles.update({w._actor_id.hex(): f"client actor {i} (home of clients {i}, {i + n}, {i + 2 * n}, ...)"
                           for i, w in enumerate(self.workers)})
        # Constructors raise here (bad data, model errors) rather than at the first round.
        actors = self.actors
        refs = [built[a._actor_id] for a in actors]
        if ready_timeout is not None:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ready_timeout, fetch_local=False)
            pending = [a for a, ref in zip(actors, refs) if ref not in set(ready)]
            if any(placed_node(a) is None for a in pending):  # no node took them: the cluster has no room
                raise ResourceError(self.unplaced(pending, ready_timeout))
            # every one placed, some still constructing (a loaded node): get() below waits up to its timeout
        where = get(refs)  # each actor's node, and where its host computes as it resolved there
        for a, (node, *_) in zip(actors, where):
            self.roles[a._actor_id.hex()] += f" on node {node}"
        self.devices = {"server": where[0][1], "client": ",".join(sorted({w[1] for w in where[1:]}))}
        self.cpus = "; ".join(sorted({w[2] for w in where}))  # the actors' CPU kinds (resolved.cpu)
        if actor_cls is not HostActor:  # rdt: one gloo group over the run's actors (replacements get a new one)
            from ray.experimental.collective import create_collective_group

            self.group = create_collective_group(actors, backend="torch_gloo")

    def name(self, actor) -> str:
        return self.roles[actor._actor_id.hex()].split(" (")[0]

    def unplaced(self, pending: list, waited: float) -> str:
        """What to say about actors still not constructed after ``waited`` seconds: those no node took (and what
        they need), apart from those placed whose constructor is still running."""
        where = {a._actor_id: placed_node(a) for a in pending}
        placed = [a for a in pending if where[a._actor_id]]
        unplaced = [a for a in pending if not where[a._actor_id]]
        parts = []
        if unplaced:
            bundles = "; ".join(f"{self.name(a)} {bundle(self.rcfg.server if a is self.server else self.rcfg.client)}"
                                for a in unplaced)
            nodes = {n["NodeID"]: visible(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")}
            parts.append(f"{', '.join(self.name(a) for a in unplaced)} not placed within {waited:g} s: no live "
                         f"node had room for {bundles} (live nodes {nodes}; free now "
                         f"{visible(ray.available_resources())})")
        if placed:
            parts.append(", ".join(f"{self.name(a)} placed on node {where[a._actor_id]}" for a in placed)
                         + f" but not constructed within {waited:g} s")
        return "; ".join(parts)

    # ---- what a failed call means --------------------------------------------------------------------------
    def explain(self, e: RayTaskError) -> BaseException:
        """The exception a failed actor call stands for: the host's own (NonFiniteLossError, KeyError, ...), or
        the death of one of the run's actors when that is what lies behind it."""
        cause = e
        while isinstance(cause, RayTaskError) and getattr(cause, "cause", None) is not None:
            cause = cause.cause  # a driven step sequence nests the client actor's error in the server's
        if isinstance(cause, RayActorError):  # a client actor died under the server's driven loop
            return self.failure(cause)
        g = getattr(cause, "worker", None)
        if isinstance(cause, ActorFailure) and g is not None and g < len(self.workers):
            role = self.roles.get(self.workers[g]._actor_id.hex(), f"client actor {g}")
            return ActorFailure(f"{role} is gone (its compiled graph's channel closed)")
        # the host's error may be what a dead peer left behind (its activations, its channel)
        return self.dead_actor() or cause

    def dead_actor(self, timeout: float = 5.0) -> ActorFailure | None:
        """The death of one of the run's actors, if one has died: a host's own error can be its consequence (a
        client actor 0 whose round ended with activations the dead client actor 1's turn never let the server
        answer), and which of the two surfaces first is a race. An actor that is busy past ``timeout`` counts as
        alive."""
        refs = [a.node_id.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as e:
                return self.failure(e)
            except Exception:  # noqa: BLE001 - anything else: not a death
                continue
        return None

    def failure(self, e: RayActorError) -> ActorFailure:
        """An actor's death as an ActorFailure naming its role and, in one clause, how it died (:func:`why_died`)."""
        role = self.roles.get(getattr(e, "actor_id", None) or "", "an actor of this run")
        return ActorFailure(f"{role} died ({type(e).__name__}): {why_died(str(e))}")

    # ---- the end of a run --------------------------------------------------------------------------------
    def keep(self, seconds: float) -> bool:
        """Give the actors to the pool for ``seconds`` if each is alive and idle (answers within a few
        seconds); whether they went."""
        actors = self.actors
        if not actors or len(answering(actors)) < len(actors):
            return False
        POOL.give([(self.made_with["server"], self.server), *((self.made_with["client"], w) for w in self.workers)],
                  seconds)
        self.workers, self.server = [], None
        return True

    def kill(self) -> None:
        if self.group is not None:
            from ray.experimental.collective import destroy_collective_group

            try:
                destroy_collective_group(self.group)
            except Exception:  # noqa: BLE001 - a member is gone: the group goes with the actors
                pass
            self.group = None
        for a in self.actors:
            GONE.add(a._actor_id.hex())
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.workers, self.server = [], None


def why_died(text: str) -> str:
    """How an actor died, in one clause, from Ray's error text: the sentence that says why ("... because its node
    has died"), the worker's exit type and the first sentence of its exit detail (Ray's list of "potential root
    causes" left out), and the node Ray names, if it names one; never cut in the middle of a word."""
    flat = " ".join(text.split())
    sentences = [x for line in text.splitlines() for x in re.split(r"(?<=\.)\s+", " ".join(line.split())) if x]
    said = (next((x for x in sentences if " because " in x), None)
            or next((x for x in sentences if re.search(r"\b(?:died|dead|killed)\b", x)), sentences[0]))
    why = textwrap.shorten(said.rstrip("."), width=200, placeholder=" ...")
    kind = re.search(r"Worker exit type: (\w+)", flat)
    detail = re.search(r"Worker exit detail: (.+?)(?:\. |$)", flat)
    if kind or detail:
        exit_ = ", ".join(x for x in ((kind and kind.group(1)), (detail and detail.group(1).rstrip("."))) if x)
        why += ": " + textwrap.shorten(exit_, width=200, placeholder=" ...")
    if "potential root causes" in flat:
        why += " (killed, out of memory or crashed: the actor's log says which)"
    node = (re.search(r"node\b.{0,24}?\b([0-9a-f]{56})\b", flat, re.IGNORECASE)
            or re.search(r"\b([0-9a-f]{56})\b", flat))  # a node's id is 56 hex digits (an actor's 32)
    if node and node.group(1) not in why:
        why += f" (node {node.group(1)})"
    return why
