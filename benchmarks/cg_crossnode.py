"""Ray 2.60 Compiled Graphs within one node and across two (the limitation behind raysplit's per-actor fallback).

A server actor compiles one graph per client actor (``InputNode -> f``, as raysplit's CompiledPort does) and runs
20 rounds of ``--inflight`` executions per graph, each sending and returning ``--nbytes`` bytes. ``--mode same``
puts server and clients on one node, ``multi`` on two (``ray.cluster_utils.Cluster``, one process tree here).
Prints one line: ``RESULT ok <ms per execution>`` or ``RESULT ERR <exception>``. ``--all`` runs the four cases
(same/multi x 1/3 in flight), each in its own process, and prints a table.

    PYTHONPATH=. RAY_AUTH_MODE=disabled python benchmarks/cg_crossnode.py --all
"""
import argparse
import os
import subprocess
import sys
import time

ROUNDS = 20


def one(mode: str, inflight: int, nbytes: int, buf: int) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import numpy as np
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"server": 1, "client": 4} if mode == "same" else {"server": 1})
    if mode != "same":
        cluster.add_node(num_cpus=1, resources={"client": 4})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)

    @ray.remote
    class Client:
        def f(self, x):
            return np.zeros(nbytes, np.uint8)

        def buf(self, n):
            from ray.dag import DAGContext

            DAGContext.get_current().buffer_size_bytes = n

    @ray.remote
    class Server:
        def run(self, workers):
            from ray.dag import DAGContext, InputNode

            DAGContext.get_current().buffer_size_bytes = buf
            ray.get([w.buf.remote(buf) for w in workers])
            graphs = []
            for w in workers:
                with InputNode() as inp:
                    dag = w.f.bind(inp)
                graphs.append(dag.experimental_compile(_max_inflight_executions=4))
            t = time.perf_counter()
            for _ in range(ROUNDS):
                refs = [[g.execute(np.zeros(nbytes, np.uint8)) for _ in range(inflight)] for g in graphs]
                for rs in refs:
                    for r in rs:
                        ray.get(r, timeout=20)
            dt = time.perf_counter() - t
            for g in graphs:
                g.teardown()
            return 1000 * dt / (ROUNDS * inflight * len(workers))

    server = Server.options(num_cpus=0.5, resources={"server": 1}).remote()
    clients = [Client.options(num_cpus=0.25, resources={"client": 1}).remote() for _ in range(2)]
    try:
        print(f"RESULT ok {ray.get(server.run.remote(clients), timeout=90):.2f}")
    except Exception as e:  # the failure is the measurement
        print("RESULT ERR", type(e).__name__, str(e).splitlines()[0][:200])
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["same", "multi"], default="multi")
    ap.add_argument("--inflight", type=int, default=1)
    ap.add_argument("--nbytes", type=int, default=100_000)
    ap.add_argument("--buf", type=int, default=1 << 20)
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args()
    if not a.all:
        return one(a.mode, a.inflight, a.nbytes, a.buf)
    print("| nodes | in flight per graph | result (ms per execution) |\n|---|---|---|")
    for mode in ("same", "multi"):
        for inflight in (1, 3):
            cmd = [sys.executable, __file__, "--mode", mode, "--inflight", str(inflight),
                   "--nbytes", str(a.nbytes), "--buf", str(a.buf)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=240).stdout
                line = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), "RESULT no result")
            except subprocess.TimeoutExpired:
                line = "RESULT ERR hung past 240 s"
            print(f"| {'one' if mode == 'same' else 'two'} | {inflight} | {line[len('RESULT '):]} |", flush=True)


if __name__ == "__main__":
    main()
