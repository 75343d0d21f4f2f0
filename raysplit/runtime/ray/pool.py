"""The actors of a driver's finished runs, kept ``runtime.keep_actors_s`` seconds for its next run (with the
other ray_* files, the only code that imports Ray).

:meth:`HostActor.reset <raysplit.runtime.ray.actors.HostActor.reset>` gives a kept actor a new host: a driver that
runs many small experiments one after another (a notebook on a running cluster, a test session) saves each actor's
process start and imports, about 5 s of CPU. The backend gives back only a run's healthy actors (no actor call
raised, graphs torn down cleanly), and takes them only for a run asking for the same resources on the same Ray
cluster; a run that asks for others first kills the idle ones, so they hold no resources it needs. An idle actor is
killed after its seconds, and at :func:`release_idle_actors` (a sweep, whose trials need the cluster's CPUs)."""

from __future__ import annotations

import threading
from collections import Counter

import ray

__all__ = ["POOL", "ActorPool", "answering", "pool_key", "release_idle_actors"]


def pool_key(actor_cls, options: dict) -> tuple:
    """What an actor was made with: only an actor made the same way serves a run asking for it."""
    return repr(actor_cls), tuple(sorted((k, repr(v)) for k, v in options.items()))


def answering(actors: list, timeout: float = 5.0) -> list:
    """Those of ``actors`` that are alive and idle: they answer a call within ``timeout`` seconds."""
    refs = [a.node_id.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
    out = []
    for a, ref in zip(actors, refs):
        try:
            if ref in ready:
                ray.get(ref, timeout=1)
                out.append(a)
        except Exception:  # noqa: BLE001 - dead
            pass
    return out


def _kill(actor) -> None:
    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 - already dead, or Ray is gone
        pass


def _cluster() -> tuple:
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), ctx.get_job_id()


class ActorPool:
    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list[tuple[tuple, object, threading.Timer]] = []  # (key, actor, its expiry)
        self._cluster = None

    def _this_cluster_locked(self) -> None:
        """Forget actors kept on an earlier Ray (restarted since: their handles lead nowhere)."""
        if self._cluster != _cluster():
            for _, _, timer in self._idle:
                timer.cancel()
            self._idle, self._cluster = [], _cluster()

    def take(self, needs: Counter) -> dict[tuple, list]:
        """Up to ``needs[key]`` live idle actors made with each ``key``; every other idle actor is killed, so that
        the actors still to be made find the resources free."""
        with self._lock:
            self._this_cluster_locked()
            idle, self._idle = self._idle, []
        taken: list = []
        left = Counter(needs)
        for key, a, timer in idle:
            timer.cancel()
            if left[key] > 0:
                left[key] -= 1
                taken.append((key, a))
            else:
                _kill(a)
        # one that died while idle (its node lost) is not handed out
        alive = {id(a) for a in answering([a for _, a in taken])}
        out: dict[tuple, list] = {k: [] for k in needs}
        for key, a in taken:
            if id(a) in alive:
                out[key].append(a)
            else:
                _kill(a)
        return out

    def give(self, kept: list[tuple[tuple, object]], seconds: float) -> None:
        """Keep each (key, actor) of ``kept`` for ``seconds``."""
        with self._lock:
            self._this_cluster_locked()
            for key, a in kept:
                timer = threading.Timer(seconds, self._expire, (a,))
                timer.daemon = True
                self._idle.append((key, a, timer))
                timer.start()

    def drain(self) -> None:
        """Kill the idle actors."""
        with self._lock:
            idle, self._idle = self._idle, []
        for _, a, timer in idle:
            timer.cancel()
            _kill(a)

    def _expire(self, actor) -> None:
        with self._lock:
            mine = any(a is actor for _, a, _ in self._idle)
            self._idle = [e for e in self._idle if e[1] is not actor]
        try:
            current = ray.is_initialized() and self._cluster == _cluster()
        except Exception:  # noqa: BLE001 - Ray is shutting down
            current = False
        if mine and current:
            _kill(actor)


POOL = ActorPool()


def release_idle_actors() -> None:
    """Kill the actors that finished runs left for reuse (``runtime.keep_actors_s``), so that their resources are
    free: before a sweep's trials, which need the cluster's CPUs."""
    if ray.is_initialized():
        POOL.drain()
