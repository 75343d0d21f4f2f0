"""Split steps: the plan of a serving sequence, and the loop that runs it with the server in charge.

A serving sequence lists one entry per split step in the order the server serves them: a client id, or a
``(client, stream)`` pair when a client sends several feature streams (e.g. a student and a teacher stream, each
paired with its own gradient by ``Tag.stream``). :func:`plan_steps` turns it into :class:`Step` records, and
:func:`run_split_steps` runs them where the server host lives (inside the server actor with the Ray backend, in process
with the local backend), talking to the client hosts through a :class:`ClientPort`. No Ray here.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from raysplit.runtime.messages import Tag


@dataclass(frozen=True)
class Step:
    client: int
    key: Any  # which server model serves it (``"main"``, a client id for per-client copies, a Hydra group)
    tag: Tag
    next: Tag | None  # the tag of the same client's next step on the same stream, None after its last


def _entry(e) -> tuple[int, str]:
    if isinstance(e, tuple):
        return int(e[0]), str(e[1])
    return int(e), "main"


def plan_steps(seq: list, rnd: int, keys: dict) -> list[Step]:
    """Steps in serving order; step numbers count per (client, stream); ``keys[c]`` defaults to ``"main"``."""
    entries = [_entry(e) for e in seq]
    count: dict[tuple[int, str], int] = {}
    for e in entries:
        count[e] = count.get(e, 0) + 1
    done: dict[tuple[int, str], int] = {}
    plan = []
    for c, stream in entries:
        s = done.get((c, stream), 0)
        done[(c, stream)] = s + 1
        nxt = Tag(c, rnd, s + 1, stream) if s + 1 < count[(c, stream)] else None
        plan.append(Step(c, keys.get(c, "main"), Tag(c, rnd, s, stream), nxt))
    return plan


def schedule(plan: list[Step], worker: Callable[[int], int], window: int | None) -> list[tuple]:
    """When each forward of a plan is submitted, as a list of actions: ``("fwd", j)`` submits step ``j``'s forward on
    its own; ``("serve", i, bundled)`` serves step ``i`` and sends its gradient back, together with the same
    (client, stream)'s next forward when ``bundled``. At most ``window`` forwards per client worker (``worker(c)``)
    are submitted and not yet served (one more when the step due next had to wait for its forward), taken in
    serving order, so a worker holds O(window) activation graphs however many clients the round has; ``None``:
    every (client, stream)'s first forward at once. The actions are a pure function of the plan, the placement and
    the window, so the server-driven loop and the driver-chained one submit the same calls in the same order."""
    nxt: dict[int, int] = {}
    last: dict[tuple, int] = {}
    heaps: dict[int, list] = defaultdict(list)
    for j, s in enumerate(plan):
        k = (s.client, s.tag.stream)
        if k in last:
            nxt[last[k]] = j
        else:
            heapq.heappush(heaps[worker(s.client)], j)
        last[k] = j
    inflight: Counter = Counter()
    submitted: set[int] = set()
    actions: list[tuple] = []

    def fill(w: int) -> list[int]:
        out = []
        while heaps[w] and (window is None or inflight[w] < window):
            j = heapq.heappop(heaps[w])
            inflight[w] += 1
            submitted.add(j)
            out.append(j)
        return out

    for w in sorted(heaps):
        actions += [("fwd", j) for j in fill(w)]
    for i, s in enumerate(plan):
        w = worker(s.client)
        if i not in submitted:  # the window was full of later steps when this one became ready
            heaps[w].remove(i)
            heapq.heapify(heaps[w])
            inflight[w] += 1
            submitted.add(i)
            actions.append(("fwd", i))
        inflight[w] -= 1
        if i in nxt:
            heapq.heappush(heaps[w], nxt[i])
        more = fill(w)
        bundled = i in nxt and nxt[i] in more
        actions.append(("serve", i, bundled))
        actions += [("fwd", j) for j in more if not (bundled and j == nxt[i])]
    return actions


class ClientPort(Protocol):
    """How the host driving a loop reaches the client hosts."""

    def worker(self, cid: int) -> int:
        """The index of the client host that holds client ``cid``."""

    def submit(self, cid: int, calls: list[tuple[str, tuple]]):
        """Run host methods for client ``cid``'s host, in order, as one message; a handle to the last result."""

    def fetch(self, handle):
        """The value behind a handle (blocks until it is computed)."""

    def wait(self, handles: list) -> None:
        """Block until every handle is computed."""


USHAPED = "u_shaped_step"  # the split step of a U-shaped split (``u_shaped_step``), in place of train_step


def u_shaped_step(server_host, act, s: Step, port: ClientPort):
    """One U-shaped split step after the client's forward (runtime/client/tail.py, runtime/server/middle.py): the middle on the server, the tail
    and the loss on the client, the middle's backward and step on the server; the activation's gradient. Every
    value may be a handle (the driver-chained path): each call takes the one before it as its argument."""
    mid = server_host.serve("middle_forward", act, s.key)
    back = port.fetch(port.submit(s.client, [("tail_step", (mid,))]))
    return server_host.serve("middle_backward", back, s.key)


def u_shaped(method: str, ushape: UShapeSpec | None, pooled: bool = False) -> str:
    """The server step a step loop runs for ``method`` (a name): under a U-shaped split (``ushape``) the plain
    split step becomes the loop's three-exchange step (``stepping.USHAPED``); any other step, and pooled steps,
    have labels at the server and are refused (the config refuses the methods that take them, naming the key)."""
    if ushape is None:
        return method
    if method != "train_step" or pooled:
        raise RuntimeError(f"a U-shaped split runs the plain split step one client at a time (train_step through "
                           f"Runtime.split_steps), not {method}{' as pooled steps' if pooled else ''}")
    return USHAPED


def run_split_steps(server_host, plan: list[Step], method: str, batch_size: int | None, window: int | None,
                port: ClientPort) -> None:
    """Run a plan with the server in charge, following :func:`schedule`: forwards are submitted ahead (up to
    ``window`` per client worker, so the clients compute in parallel), per step the server method
    ``method(activation, key)`` runs here and its gradient goes back, with that client's next forward in the same
    message where the schedule bundles them. Each client host receives the same calls in the same order as the
    driver-chained path (the same loop on the driver: ``ports.DriverPort``), so both give the same results bit for
    bit. Activations reach ``method`` through ``ServerHost.serve`` (screened). ``method`` :data:`USHAPED`: each
    step is :func:`u_shaped_step`."""
    pending = {}
    last = []
    for action in schedule(plan, port.worker, window):
        s = plan[action[1]]
        k = (s.client, s.tag.stream)
        if action[0] == "fwd":
            pending[k] = port.submit(s.client, [("forward", (s.tag, batch_size))])
            continue
        act = port.fetch(pending.pop(k))
        grad = u_shaped_step(server_host, act, s, port) if method == USHAPED else server_host.serve(method, act, s.key)
        if action[2]:
            pending[k] = port.submit(s.client, [("backward", (grad,)), ("forward", (s.next, batch_size))])
        else:
            last.append(port.submit(s.client, [("backward", (grad,))]))
    port.wait(last)  # every gradient applied before the driver's next call on a client host runs


def step_counts(clients: list[int], steps: int | dict) -> dict[int, int]:
    """Pooled steps per client: ``steps`` for every client, or ``steps[c]`` for client ``c``."""
    return {c: int(steps[c]) if isinstance(steps, dict) else int(steps) for c in clients}


def run_pooled_steps(server_host, clients: list[int], streams: tuple[str, ...], steps: int | dict, rnd: int, method: str,
                 batch_sizes: dict, port: ClientPort) -> None:
    """Pooled steps with the server in charge: per step every client that still has steps (``steps``: a count
    for all, or per client: client ``c`` takes part in steps ``0 .. steps[c] - 1``) sends one activation per
    stream, the server method gets all of them at once (clients in the given order, each client's streams in
    order) and returns one gradient per activation, which goes back with the client's next forwards. Where the
    port groups (``port.grouped``: its calls run where the hosts are), each client host gets one message a step
    for all its clients (``ClientHost.backward_clients`` then ``forward_clients``: packed there where
    ``runtime.pack_clients`` is on); else one message per client (``ClientHost.forward_many``; run on the driver,
    ``ports.DriverPort``, it is the driver-chained path). Clients are independent within a step, so both give the
    same results bit for bit unpacked."""

    def serve(*args):
        return server_host.serve(method, *args)

    width = len(streams)
    count = step_counts(clients, steps)
    grouped = getattr(port, "grouped", False)
    groups: dict[int, list[int]] = {}
    for c in clients:
        groups.setdefault(port.worker(c) if grouped else c, []).append(c)

    def forwards(cs, k):
        items = [([Tag(c, rnd, k, s) for s in streams], batch_sizes.get(c)) for c in cs]
        return ("forward_clients", (items,)) if grouped else ("forward_many", items[0])

    def backwards(cs, grads):
        gs = [g for c in cs for g in grads[c]]
        return [("backward_clients", (gs,))] if grouped else [("backward", (g,)) for g in gs]

    def submit(cs, calls, more):  # the calls go to the host of cs; the forwards answered are more's
        return more, port.submit(cs[0], calls)

    pending = [submit(cs, [forwards(cs, 0)], cs) for cs in ([c for c in g if count[c] > 0] for g in groups.values())
               if cs]
    last = []
    for k in range(max(count.values(), default=0)):
        got = {}
        for cs, handle in pending:
            res = port.fetch(handle)
            got.update(zip(cs, res if grouped else [res]))
        here = [c for c in clients if count[c] > k]
        grads = list(serve(*[a for c in here for a in got[c]]))
        grads = {c: grads[i * width:(i + 1) * width] for i, c in enumerate(here)}
        pending = []
        for g in groups.values():
            cs = [c for c in g if count[c] > k]
            more = [c for c in cs if count[c] > k + 1]
            if more:
                pending.append(submit(cs, backwards(cs, grads) + [forwards(more, k + 1)], more))
            elif cs:
                last.append(port.submit(cs[0], backwards(cs, grads)))
    port.wait(last)


def run_events(server_host, rnd: int, port: ClientPort) -> dict:
    """One global round of an asynchronous algorithm (``AsyncServer.run_events``)."""
    return server_host.run_events(rnd, port)


LOOPS = {"steps": run_split_steps, "pooled": run_pooled_steps, "events": run_events}  # what a server host can drive
