"""The ports through which a step loop (runtime/stepping.py) reaches the client hosts (:class:`stepping.ClientPort`)
when it runs in this process: on the local backend's hosts (:class:`LocalPort`) or on the driver, every call a
handle (:class:`DriverPort`, with :class:`DriverServer` for the server's side). The Ray backend's ports, from inside
the server actor, are in ray_actors.py."""

from __future__ import annotations

from raysplit.runtime.driver import placement
from raysplit.runtime.state import invoke


class DriverPort:
    """:class:`stepping.ClientPort` of the driver-chained path (``runtime.transport.direct_steps: false``): the step loops of
    runtime/stepping.py run on the driver, every call goes out at once and returns a handle, and nothing blocks
    here (a handle passed as an argument is resolved where the call runs), so forward -> server -> backward are
    chained without the driver waiting. The backward handles are bounded by ``Runtime.max_in_flight`` and awaited
    by ``end_round``. ``forward_many`` goes out as one ``forward`` per stream, each result its own handle."""

    def __init__(self, rt, route: dict[int, int]):  # rt: the api.Runtime
        self.rt, self.route = rt, route

    def worker(self, cid: int) -> int:
        return self.route[cid]

    def submit(self, cid: int, calls: list[tuple[str, tuple]]):
        b, host, out = self.rt.backend, self.rt.worker_of(cid), None
        for method, args in calls:
            if method == "backward":
                out = self.rt.backward(cid, *args)
            elif method == "forward_many":
                tags, batch_size = args
                out = [b.hop(host, "forward", tag, batch_size) for tag in tags]
            else:
                out = (b.hop if method == "forward" else b.call)(host, method, *args)
        return out

    def fetch(self, handle):
        return handle

    def wait(self, handles: list) -> None:
        pass  # Runtime.backward keeps them; end_round awaits them


class DriverServer:
    """The server host as the step loops see it from the driver: ``serve`` returns a handle (``many``: one handle
    per activation it is given, for a method returning one gradient each)."""

    def __init__(self, backend, many: bool = False):
        self.backend, self.many = backend, many

    def serve(self, method: str, *args):
        b = self.backend
        if self.many:
            return b.call_n(b.server, len(args), "serve", method, *args)
        return b.hop(b.server, "serve", method, *args)  # a gradient, for a client's backward


class LocalPort:
    """:class:`stepping.ClientPort` over in-process client hosts: calls run at once, handles are values.
    ``route``: the worker of each client of the loop (None: every client at home)."""

    grouped = True  # a pooled step's calls for a host's clients go as one (stepping.run_pooled_steps)

    def __init__(self, workers: list, route: dict | None = None):
        self.workers, self.route = workers, route

    def worker(self, cid: int) -> int:
        return self.route[cid] if self.route is not None else placement.home(cid, len(self.workers))

    def submit(self, cid: int, calls: list[tuple[str, tuple]]):
        host = self.workers[self.worker(cid)]
        out = None
        for method, args in calls:
            out = invoke(host, method, *args)
        return out

    def fetch(self, handle):
        return handle

    def wait(self, handles: list) -> None:
        pass
