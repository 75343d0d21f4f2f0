"""Per-hop latency client -> server -> client through raysplit's Ray runtime, activation sizes 1 KB to 16 MB.

A hop is one split step with no model: the client host sends an activation of N bytes (``Activation`` carrying a
numpy array, as ``ClientHost.forward`` does), the server host turns it into a gradient of the same size
(``Gradient``, as ``ServerHost.train_step`` does: writable copy of the activation in, gradient out), and the
client host reads the gradient. The in-process time of exactly these host calls (same packing, no Ray) is the
"compute"; the overhead is the Ray time per hop minus that. Effective bandwidth = 2 N bytes (activation up and
gradient down) / Ray time per hop. Three transports are measured in the same run, interleaved:

* ``compiled`` (default runtime path): the server actor drives the steps (``HostActor.drive``) through Ray
  Compiled Graphs, one per client actor (``runtime.transport.kind: compiled``): shared-memory channels;
* ``calls``    (``runtime.transport.kind: calls``): the server actor drives the steps with ordinary actor calls;
* ``chained``  (``runtime.transport.direct_steps=false``): the driver chains forward -> train_step -> backward ObjectRefs;
* ``rdt``      (``runtime.transport.kind: rdt``, driver-chained): as ``chained``, the activation and the gradient
  moving by Ray Direct Transport over a gloo group (``RdtHostActor.call_rdt``) instead of the object store.

    python benchmarks/hop.py [--repeats 7] [--steps 20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from common import fmt, load, log_mlflow, mmm, save

from raysplit.runtime.server import stepping
from raysplit.runtime import transport
from raysplit.runtime.messages import Activation, Gradient, Tag

SIZES = [1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


class EchoClient:
    """A client host whose 'model' emits an N-byte activation and reads the gradient."""

    def __init__(self, nbytes: int):
        self.a = np.ones(nbytes // 4, dtype=np.float32)
        self.y = np.zeros(1, dtype=np.int64)
        self.sum = 0.0

    def set_size(self, nbytes: int) -> None:
        self.a = np.ones(nbytes // 4, dtype=np.float32)

    def forward(self, tag, batch_size=None) -> Activation:
        import torch

        return Activation(tag, transport.pack(torch.from_numpy(self.a)), self.y, 0.0)

    def backward(self, grad: Gradient) -> float:
        g = transport.unpack(grad.g)
        self.sum += float(g[-1])
        return 0.0


class EchoServer:
    """The server host of a hop; sized for the largest activation (the compiled graphs' channels)."""

    class spec:
        batch_size = 1

    def train_step(self, act: Activation, key="main") -> Gradient:
        x = transport.unpack(act.x, writable=True)  # as ServerHost.train_step
        return Gradient(act.tag, transport.pack(x), 0.0, 0.0)

    def serve(self, method, *args):
        return getattr(self, method)(*args)

    def activation_form(self):
        return (max(SIZES) // 4,), np.float32

    def client_encoder(self):
        import torch

        return torch.nn.Identity()

    def begin_round(self, *a):
        return None


def inprocess(nbytes: int, steps: int) -> float:
    c, s = EchoClient(nbytes), EchoServer()
    t0 = time.perf_counter()
    for i in range(steps):
        c.backward(s.train_step(c.forward(Tag(0, 0, i))))
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20, help="hops per timed sequence")
    ap.add_argument("--inline-bytes", type=int, default=None,
                    help="Ray's max_direct_call_object_size (objects up to this size travel inside the RPC, not plasma)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-mlflow", action="store_true")
    a = ap.parse_args()
    import ray

    from raysplit.runtime.ray.actors import HostActor

    sysc = {"max_direct_call_object_size": a.inline_bytes} if a.inline_bytes else None
    ray.init(num_cpus=4, object_store_memory=1024**3, include_dashboard=False, log_to_driver=True, _system_config=sysc)
    client = HostActor.options(num_cpus=0).remote(EchoClient, 1024)
    server = HostActor.options(num_cpus=1).remote(EchoServer)
    ray.get([client.node_id.remote(), server.node_id.remote()])
    # rdt on actors of its own: a gloo transfer into an actor that also runs a compiled graph hung here (Ray
    # killed both actors after its 60 s RDT timeout), so the two are never mixed
    from ray.experimental.collective import create_collective_group

    from raysplit.runtime.ray.actors import RdtHostActor

    client_rdt = RdtHostActor.options(num_cpus=0).remote(EchoClient, 1024)
    server_rdt = RdtHostActor.options(num_cpus=1).remote(EchoServer)
    create_collective_group([client_rdt, server_rdt], backend="torch_gloo")
    print(f"load {load()}")

    def ping_loop(host_actor, other, n):  # runs inside the server actor: the floor of one actor-to-actor call
        t0 = time.perf_counter()
        for _ in range(n):
            ray.get(other.node_id.remote())
        return (time.perf_counter() - t0) / n

    pings = [ray.get(server.__ray_call__.remote(ping_loop, client, 200)) for _ in range(a.repeats)]
    print(f"empty actor-to-actor call (server -> client actor, reply): {fmt(mmm(pings), 1e3)} ms")
    print("| activation | in-process ms/hop | compiled ms/hop | **compiled overhead ms** | compiled MB/s | "
          "calls ms/hop | calls overhead ms | chained ms/hop | chained overhead ms | rdt ms/hop | rdt overhead ms |")
    print("|---" * 11 + "|")
    results = {}
    variants = ("compiled", "calls", "chained", "rdt")
    for nbytes in SIZES:
        ray.get([client.call.remote("set_size", nbytes), client_rdt.call.remote("set_size", nbytes)])
        tags = [Tag(0, 0, i) for i in range(a.steps)]
        plan = stepping.plan_steps([0] * a.steps, 0, {})
        res = {k: [] for k in ("inproc", *variants)}
        for rep in range(a.repeats + 1):  # first repetition warms up (and compiles the graphs)
            t = {"inproc": inprocess(nbytes, a.steps)}
            for v in ("compiled", "calls"):
                t0 = time.perf_counter()
                ray.get(server.drive.remote("steps", (plan, "train_step", None, None), [client], [], None,
                                            v == "compiled"))
                t[v] = (time.perf_counter() - t0) / a.steps
            t0 = time.perf_counter()
            last = None
            for tag in tags:
                last = client.call.remote("backward", server.call.remote("train_step", client.call.remote("forward",
                                                                                                         tag)))
            ray.get(last)
            t["chained"] = (time.perf_counter() - t0) / a.steps
            t0 = time.perf_counter()
            for tag in tags:
                last = client_rdt.call.remote("backward", server_rdt.call_rdt.remote(
                    "train_step", client_rdt.call_rdt.remote("forward", tag)))
            ray.get(last)
            t["rdt"] = (time.perf_counter() - t0) / a.steps
            if rep:
                for k, x in t.items():
                    res[k].append(x)
        r = {k: mmm(v) for k, v in res.items()}
        for v in variants:
            r[f"{v}_overhead"] = mmm([d - i for d, i in zip(res[v], res["inproc"])])
        r["compiled_MBps"] = 2 * nbytes / r["compiled"]["median"] / 1e6
        label = f"{nbytes >> 10} KB" if nbytes < (1 << 20) else f"{nbytes >> 20} MB"
        results[label] = r
        print(f"| {label} | {r['inproc']['median'] * 1e3:.2f} | {fmt(r['compiled'], 1e3)} | "
              f"{fmt(r['compiled_overhead'], 1e3)} | {r['compiled_MBps']:.0f} | {fmt(r['calls'], 1e3)} | "
              f"{fmt(r['calls_overhead'], 1e3)} | {fmt(r['chained'], 1e3)} | {fmt(r['chained_overhead'], 1e3)} | "
              f"{fmt(r['rdt'], 1e3)} | {fmt(r['rdt_overhead'], 1e3)} |", flush=True)
    ray.get(server.teardown_graphs.remote())
    ray.shutdown()
    name = "hop" + (f"-{a.tag}" if a.tag else "")
    path = save(name, {"args": vars(a), "results": results, "empty_call_s": mmm(pings), "load_at_end": load()})
    if not a.no_mlflow:
        m = {"empty_call_ms": mmm(pings)["median"] * 1e3}
        for label, r in results.items():
            k = label.replace(" ", "")
            for v in variants:
                m[f"{v}_overhead_ms_{k}"] = r[f"{v}_overhead"]["median"] * 1e3
            m[f"compiled_MBps_{k}"] = r["compiled_MBps"]
        log_mlflow(name, {**vars(a), "load": load()}, m, path)


if __name__ == "__main__":
    main()
