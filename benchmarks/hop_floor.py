"""Where a 1 MB hop's milliseconds go (issue 29 item 4): the parts of raysplit's compiled-graph hop measured apart,
with plain Ray (no raysplit code) for everything Ray does.

    .venv/bin/python benchmarks/hop_floor.py [--repeats 7] [--steps 50] [--mb 1]

A raysplit hop over compiled graphs (benchmarks/hop.py) is one execution of a graph ``InputNode -> client.call_seq``
driven from the server actor: N bytes of gradient in, N bytes of activation out. Measured here, in one run:

* ``memcpy``: copying N bytes once in this process (numpy), times 4 (each direction is written into a channel
  and read out of it): the floor of the copies;
* ``pickle``: pickling and unpickling an N-byte numpy array with protocol 5 (what Ray's serializer does around the
  out-of-band buffer), both directions;
* ``plain Ray, compiled``: the same shape of graph with plain Ray actors, driven from an actor as raysplit drives
  it: an echo actor that gets an N-byte array and answers with a new N-byte array; Ray's own cost per hop here;
* ``plain Ray, compiled, + K idle graphs``: the same while K other compiled graphs wait for input (their actors
  poll their channels, as raysplit's idle client actors do): what busy-waiting costs on this machine;
* ``plain Ray, actor calls``: the echo by ordinary actor calls from the driving actor.

raysplit's own hop (benchmarks/hop.py, ``compiled`` column) minus ``plain Ray, compiled`` is what raysplit adds.
Writes benchmarks/out/hop_floor.json.
"""

from __future__ import annotations

import argparse
import os
import pickle
import time

import numpy as np

from common import fmt, load, mmm, save


class Echo:
    """A client actor without raysplit: reads the gradient, answers with an activation of the same size."""

    def __init__(self, nbytes: int):
        self.a = np.ones(nbytes // 4, dtype=np.float32)

    def step(self, g: np.ndarray) -> np.ndarray:
        self.a[0] = g[-1]  # read what came in; the answer is a fresh array, as an activation is
        return self.a.copy()


class Driver:
    """The server actor's role: compiles the graphs and drives the hops (raysplit drives from the server actor)."""

    def __init__(self, nbytes: int):
        from ray.dag import DAGContext

        self.buffer = 2 * nbytes + (1 << 20)  # every channel, both directions: the writer sizes it
        DAGContext.get_current().buffer_size_bytes = self.buffer
        self.g = np.ones(nbytes // 4, dtype=np.float32)
        self.graphs = []

    def compile(self, echoes: list) -> int:
        import ray
        from ray.dag import InputNode

        ray.get([e.__ray_call__.remote(_buffer, self.buffer) for e in echoes])
        for e in echoes:
            with InputNode() as inp:
                dag = e.step.bind(inp)
            self.graphs.append(dag.experimental_compile())
        return len(self.graphs)

    def compiled(self, steps: int) -> float:
        graph = self.graphs[0]  # the others stay idle: their actors poll their input channels
        t0 = time.perf_counter()
        for _ in range(steps):
            a = graph.execute(self.g).get()
            self.g[0] = a[-1]
        return (time.perf_counter() - t0) / steps

    def calls(self, echo, steps: int) -> float:
        import ray

        t0 = time.perf_counter()
        for _ in range(steps):
            a = ray.get(echo.step.remote(self.g))
            self.g[0] = a[-1]
        return (time.perf_counter() - t0) / steps

    def teardown(self) -> None:
        for g in self.graphs:
            g.teardown()
        self.graphs = []


def _buffer(_self, nbytes: int) -> None:  # an echo actor writes its output channel: size it as the writer
    from ray.dag import DAGContext

    DAGContext.get_current().buffer_size_bytes = nbytes


def in_process(nbytes: int, steps: int) -> tuple[float, float]:
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    t0 = time.perf_counter()
    for _ in range(steps):
        np.copyto(b, a)
    memcpy = 4 * (time.perf_counter() - t0) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        bufs: list = []
        head = pickle.dumps(a, protocol=5, buffer_callback=bufs.append)
        pickle.loads(head, buffers=[bytes(x.raw()) for x in bufs])  # the out-of-band buffer copied, as into shm
    return memcpy, 2 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--mb", type=float, default=1.0, help="activation (and gradient) size in MB")
    ap.add_argument("--idle", type=int, default=2, help="idle compiled graphs beside the timed one")
    a = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_CGRAPH_get_timeout", "120")  # Ray workers run niced: a busy machine starves them
    import ray

    nbytes = int(a.mb * (1 << 20))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
    print(f"load before: {load()}; {os.cpu_count()} CPUs; {nbytes} bytes each way", flush=True)
    echo_cls, driver_cls = ray.remote(num_cpus=0)(Echo), ray.remote(num_cpus=1)(Driver)
    rows: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        fn()  # warm-up
        rows[name] = [fn() for _ in range(a.repeats)]

    mem, pick = zip(*[in_process(nbytes, a.steps) for _ in range(a.repeats)])
    rows["memcpy x4 (in process)"], rows["pickle + unpickle, both ways (in process)"] = list(mem), list(pick)
    for idle in (0, a.idle):
        driver = driver_cls.remote(nbytes)
        echoes = [echo_cls.remote(nbytes) for _ in range(1 + idle)]
        ray.get(driver.compile.remote(echoes), timeout=120)
        timed(f"plain Ray, compiled graph{'' if not idle else f', + {idle} idle graphs'}",
              lambda: ray.get(driver.compiled.remote(a.steps), timeout=300))
        if not idle:
            timed("plain Ray, actor calls", lambda: ray.get(driver.calls.remote(echoes[0], a.steps), timeout=300))
        ray.get(driver.teardown.remote(), timeout=120)
        for x in (driver, *echoes):
            ray.kill(x)
    ray.shutdown()
    print(f"load after: {load()}\n\n| part | ms per hop, min/median/max over {a.repeats} repeats of {a.steps} |")
    print("|---|---|")
    out = {}
    for name, xs in rows.items():
        out[name] = mmm(xs)
        print(f"| {name} | {fmt(out[name], 1e3)} |")
    save("hop_floor", {"args": vars(a), "results": out, "load_at_end": load()})


if __name__ == "__main__":
    main()
