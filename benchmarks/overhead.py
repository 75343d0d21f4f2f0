"""Runtime overhead: SFLV2 / SFLV1 round time through the Ray runtime vs a single-process plain-PyTorch loop.

The reference is a hand-written loop (no raysplit runtime, no hosts): the same client part and server part, the same
per-client batches (permutation of the client's indices drawn from (seed, client, epoch), as the client hosts do),
the same SGD with per-client optimizer state kept across rounds, the same server update order, per-client server
copies merged by weighted averaging (SFLV1), and FedAvg of the client models weighted by sample count. It checks
this: after the timed rounds it compares its final server weights with those of the in-process LocalBackend run
(which run the same rounds), so "same computation" is measured, not assumed.

Each repetition times one round of each variant back to back (interleaved), so every ratio comes from the same
run under the same load. The reference runs with 1 torch thread (what each actor gets) and with all cores.

    python benchmarks/overhead.py --model cnn_small --algorithm sflv2 --clients 4 16 --rounds 8
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from common import fmt, load, log_mlflow, mmm, save

import raysplit
from raysplit.config import load_config
from raysplit.data import to_tensor
from raysplit.experiment import prepare
from raysplit.runtime import runtime_for
from raysplit.runtime.aggregation import average_states

MODELS = {
    # model, cut, dataset overrides, batch size
    "cnn_small": dict(model="cnn_small", cut="conv1", data={"data.dataset": "fashion_mnist"}, batch=64),
    "resnet18": dict(model="resnet18", cut="layer1",
                     data={"data.dataset": "synthetic",
                           "data.options": {"num_samples": 4000, "shape": [3, 32, 32], "test_fraction": 0.1}},
                     batch=16),
}


def make_cfg(model: str, algorithm: str, clients: int, backend: str, steps: int, batch: int | None, workers: int,
             threads: int, direct: bool = True, transport: str = "compiled"):
    m = MODELS[model]
    over = {
        "name": f"overhead-{model}-{algorithm}-{clients}", "seed": 0,
        "algorithm": {"name": algorithm, **({"order": "fixed"} if algorithm == "sflv2" else {})},
        "data.num_clients": clients, "data.partition.name": "iid", "data.test_fraction": 0.0,
        "data.max_test_samples": 100,
        "model.name": m["model"], "model.cut": m["cut"],
        "train.rounds": 1000, "train.batch_size": batch or m["batch"], "train.local_steps": steps,
        "train.optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "runtime.backend": backend, "runtime.num_workers": workers, "runtime.torch_threads": threads,
        "runtime.server.num_cpus": 1, "runtime.client.num_cpus": 0,
        "tracking.enabled": False, "tracking.progress": False,
        "runtime.transport.direct_steps": direct, "runtime.transport.kind": transport,
        **m["data"],
    }
    return load_config(None, over)


class Reference:
    """Plain PyTorch: one process, no actors, no hosts. SFLV2 (sequential, one server model) or SFLV1 (per-client
    server copies averaged) with FedAvg of the client models; PSL: SFLV1's copies, every client keeping its own
    model (no FedAvg)."""

    def __init__(self, p, algorithm: str):
        plan = p.inputs.plan
        self.algorithm = algorithm
        self.spec = plan.model.inputs
        self.seed = plan.sections.seed
        self.x, self.y = p.inputs.train_data["x"], p.inputs.train_data["y"]
        self.idx = [np.asarray(ix) for ix in p.inputs.train_idx]
        self.sizes = [float(len(ix)) for ix in self.idx]
        self.cursor = [(0, 0)] * len(self.idx)
        self.perm: dict[int, tuple[int, np.ndarray]] = {}
        client, server = plan.parts()
        client.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in p.inputs.client_init.items()})
        server.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in p.inputs.server_init.items()})
        self.client_global = {k: v.clone() for k, v in client.state_dict().items()}
        self.client = client
        self.server = server
        o = plan.sections.train.optimizer
        self.opt_args = dict(lr=o.lr, momentum=o.momentum)
        self.server_opt = torch.optim.SGD(server.parameters(), **self.opt_args)
        self.client_opt_state: dict[int, dict] = {}
        self.client_own: dict[int, dict] = {}  # PSL: each client's own model
        self.bs = plan.sections.train.batch_size

    def batch(self, c: int):
        epoch, pos = self.cursor[c]
        if pos >= len(self.idx[c]):
            epoch, pos = epoch + 1, 0
        if c not in self.perm or self.perm[c][0] != epoch:
            self.perm[c] = (epoch, np.random.default_rng([self.seed, c, epoch]).permutation(self.idx[c]))
        b = self.perm[c][1][pos:pos + self.bs]
        self.cursor[c] = (epoch, pos + len(b))
        return to_tensor(self.x[b], self.spec), torch.as_tensor(self.y[b], dtype=torch.long)

    def round(self, clients: list[int], steps: int) -> None:
        states, weights = [], []
        copies = {}
        if self.algorithm in ("sflv1", "psl"):  # per-client server copies, forked from the server model
            for c in clients:
                m = copy.deepcopy(self.server)
                o = torch.optim.SGD(m.parameters(), **self.opt_args)
                o.load_state_dict(copy.deepcopy(self.server_opt.state_dict()))  # its own state, as ServerHost.fork
                copies[c] = (m, o)
        for c in clients:
            model = self.client
            own = self.client_own.get(c, self.client_global) if self.algorithm == "psl" else self.client_global
            model.load_state_dict(own)
            opt = torch.optim.SGD(model.parameters(), **self.opt_args)
            if c in self.client_opt_state:
                opt.load_state_dict(self.client_opt_state[c])
            srv, sopt = copies.get(c, (self.server, self.server_opt))
            for _ in range(steps):
                x, y = self.batch(c)
                a = model(x)
                a_in = a.detach().requires_grad_(True)
                sopt.zero_grad(set_to_none=True)
                F.cross_entropy(srv(a_in), y).backward()
                sopt.step()
                opt.zero_grad(set_to_none=True)
                a.backward(a_in.grad)
                opt.step()
            self.client_opt_state[c] = copy.deepcopy(opt.state_dict())
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            weights.append(self.sizes[c])
            if self.algorithm == "psl":
                self.client_own[c] = states[-1]
        if copies:
            ws = [self.sizes[c] for c in clients]
            self.server.load_state_dict(average_states([copies[c][0].state_dict() for c in clients], ws))
            merged = copy.deepcopy(copies[clients[0]][1].state_dict())
            for pid in merged["state"]:
                merged["state"][pid] = average_states([copies[c][1].state_dict()["state"][pid] for c in clients], ws)
            self.server_opt.load_state_dict(merged)
        if self.algorithm != "psl":
            self.client_global = average_states(states, weights)


class RaysplitRounds:
    """raysplit's own round loop (as experiment.py runs it, minus MLflow and evaluation)."""

    def __init__(self, cfg):
        self.p = prepare(cfg)
        self.cfg = cfg
        r = cfg.runtime
        self.rt = runtime_for(r, self.p.inputs)
        self.r = 0
        self.t = 0.0

    @contextlib.contextmanager
    def paused(self):
        """SIGSTOP this runtime's actors (and the compiled graphs' proxy actors) meanwhile: in Ray 2.60 a compiled
        graph's actors busy-wait on their channels while idle, which would slow the other variants timed in
        between (a benchmark artifact; within its own rounds that cost is this runtime's and is timed)."""
        import signal

        import psutil
        import ray

        b = self.rt.backend
        if getattr(b, "rcfg", None) is None or b.rcfg.transport.kind != "compiled" or not b.direct_steps:
            yield
            return
        pids = ray.get([a.__ray_call__.remote(lambda s: os.getpid()) for a in [b.server, *b.workers]])
        pids += [p.pid for p in psutil.process_iter(["cmdline"]) if "DAGDriverProxyActor" in " ".join(
            p.info["cmdline"] or [])]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    def round(self) -> None:
        clients = [int(c) for c in self.p.sample_stream[self.r]]
        self.rt.begin_round(self.r, clients, self.t)
        self.p.algorithm.run_round(self.rt, self.r, clients, np.random.default_rng([self.cfg.seed, self.r, 3]))
        self.t = self.rt.end_round().t_end
        self.r += 1

    def server_state(self):
        from raysplit.runtime import transport

        return transport.unpack_state(self.rt.get(self.rt.server.get_state()).state)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_case(model: str, algorithm: str, clients: int, a) -> dict:
    args = (a.steps, a.batch, a.workers, 1)
    local_cfg = make_cfg(model, algorithm, clients, "local", *args)
    p = prepare(local_cfg)
    ref = Reference(p, algorithm)
    local = RaysplitRounds(local_cfg)
    rays = {"ray": RaysplitRounds(make_cfg(model, algorithm, clients, "ray", *args))}  # compiled graphs
    if a.calls:  # the server actor drives the steps with ordinary actor calls (the transport before issue 15)
        rays["ray_calls"] = RaysplitRounds(make_cfg(model, algorithm, clients, "ray", *args, transport="calls"))
    if a.chained:  # the driver chains every call
        rays["ray_chained"] = RaysplitRounds(make_cfg(model, algorithm, clients, "ray", *args, direct=False))
    compiled = rays["ray"]

    def order(r: int) -> list[int]:  # the clients of round r in the order the algorithm serves them
        cl = [int(c) for c in p.sample_stream[r]]
        return sorted(cl) if algorithm == "sflv2" else cl  # sflv2 runs with order=fixed

    ref_round = [0]

    def ref_step():
        ref.round(order(ref_round[0]), a.steps)
        ref_round[0] += 1

    def other(fn):  # anything but the compiled runtime's own round runs with its spinning actors stopped
        def run():
            with compiled.paused():
                fn()
        return run

    n_threads = torch.get_num_threads()
    times = {"ref_1thread": [], "ref_all_threads": [], "local": [], **{k: [] for k in rays}}
    try:
        for w in range(a.warmup):  # first rounds count FLOPs, build modules, compile the graphs, warm caches
            torch.set_num_threads(1)
            other(ref_step)()
            other(local.round)()
            for k, rr in rays.items():
                (rr.round if k == "ray" else other(rr.round))()
        for i in range(a.rounds):
            torch.set_num_threads(1)
            with compiled.paused():
                times["ref_1thread"].append(timed(ref_step))
                times["local"].append(timed(local.round))
                torch.set_num_threads(n_threads)
                times["ref_all_threads"].append(timed(ref_step))
                for k, rr in rays.items():
                    if k != "ray":
                        times[k].append(timed(rr.round))
            times["ray"].append(timed(compiled.round))
        torch.set_num_threads(n_threads)
        # same computation: the reference has now run warmup + 2*rounds rounds, local warmup + rounds; compare
        # after bringing local level with the reference
        with compiled.paused():
            for _ in range(a.rounds):
                local.round()
        srv_local = local.server_state()
        diff = max(float((srv_local[k].double() - v.double()).abs().max()) for k, v in ref.server.state_dict().items())
        # every Ray variant ran the same rounds: their server weights must agree bit for bit
        s_ray = compiled.server_state()
        other_diff = {k: max(float((s_ray[n].double() - s[n].double()).abs().max()) for n in s_ray)
                      for k, s in ((k, rr.server_state()) for k, rr in rays.items() if k != "ray")}
    finally:
        local.rt.shutdown()
        for rr in rays.values():
            rr.rt.shutdown()
    steps_per_round = clients * a.steps
    best = [min(a1, b1) for a1, b1 in zip(times["ref_1thread"], times["ref_all_threads"])]
    out = {k: mmm(v) for k, v in times.items()}
    for k in rays:
        out[f"ratio_{k}_vs_best_ref"] = mmm([r / b for r, b in zip(times[k], best)])
        if k != "ray":
            out[f"ratio_ray_vs_{k}"] = mmm([r / o for r, o in zip(times["ray"], times[k])])
            out[f"max_abs_weight_diff_ray_vs_{k}"] = other_diff[k]
    out["ratio_ray_vs_ref_1thread"] = mmm([r / b for r, b in zip(times["ray"], times["ref_1thread"])])
    out["ratio_local_vs_ref_1thread"] = mmm([r / b for r, b in zip(times["local"], times["ref_1thread"])])
    out["ms_per_step"] = {k: 1e3 * out[k]["median"] / steps_per_round for k in times}
    out["max_abs_weight_diff_ref_vs_local"] = diff
    out["raw"] = times
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["cnn_small"], choices=list(MODELS))
    ap.add_argument("--algorithm", nargs="+", default=["sflv2", "sflv1"])
    ap.add_argument("--clients", nargs="+", type=int, default=[4, 16])
    ap.add_argument("--steps", type=int, default=5, help="local steps per client per round")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (repetitions)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chained", action="store_true",
                    help="also time the driver-chained Ray path (runtime.transport.direct_steps=false) in the same run")
    ap.add_argument("--calls", action="store_true",
                    help="also time the server-driven path over ordinary actor calls (runtime.transport.kind=calls)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-mlflow", action="store_true")
    a = ap.parse_args()
    import ray

    ray.init(num_cpus=4, object_store_memory=1024**3, include_dashboard=False, log_to_driver=True)
    results = {}
    print(f"raysplit from {raysplit.__file__}; load {load()}")
    print("| model | algorithm | clients | ref 1 thread s/round | ref all threads | LocalBackend | **Ray, compiled** | "
          "**compiled / best ref** | ms/step compiled vs ref | weight diff ref vs local | Ray, actor calls | "
          "calls / best ref | compiled / calls | Ray chained | chained / best ref |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in a.model:
        for alg in a.algorithm:
            for n in a.clients:
                r = run_case(model, alg, n, a)
                r["load_after"] = load()
                results[f"{model}/{alg}/{n}"] = r
                ms = r["ms_per_step"]

                def cols(k):
                    if k not in r:
                        return "- | - |" + (" - |" if k == "ray_calls" else "")
                    extra = f" {fmt(r['ratio_ray_vs_ray_calls'])} |" if k == "ray_calls" else ""
                    return f"{fmt(r[k], 1, 3)} | {fmt(r[f'ratio_{k}_vs_best_ref'])} |{extra}"

                print(f"| {model} | {alg} | {n} | {fmt(r['ref_1thread'], 1, 3)} | {fmt(r['ref_all_threads'], 1, 3)} | "
                      f"{fmt(r['local'], 1, 3)} | {fmt(r['ray'], 1, 3)} | {fmt(r['ratio_ray_vs_best_ref'])} | "
                      f"{ms['ray']:.1f} vs {min(ms['ref_1thread'], ms['ref_all_threads']):.1f} | "
                      f"{r['max_abs_weight_diff_ref_vs_local']:.1e} | {cols('ray_calls')} {cols('ray_chained')}",
                      flush=True)
    ray.shutdown()
    name = "overhead" + (f"-{a.tag}" if a.tag else "")
    path = save(name, {"args": vars(a), "results": results, "load_at_end": load()})
    if not a.no_mlflow:
        metrics = {}
        for key, r in results.items():
            k = key.replace("/", "_")
            metrics[f"{k}_ratio_median"] = r["ratio_ray_vs_best_ref"]["median"]
            metrics[f"{k}_ratio_min"] = r["ratio_ray_vs_best_ref"]["min"]
            metrics[f"{k}_ray_s_median"] = r["ray"]["median"]
            metrics[f"{k}_ref_s_median"] = min(r["ref_1thread"]["median"], r["ref_all_threads"]["median"])
            for v in ("ray_calls", "ray_chained"):
                if f"ratio_{v}_vs_best_ref" in r:
                    metrics[f"{k}_{v}_ratio_median"] = r[f"ratio_{v}_vs_best_ref"]["median"]
        log_mlflow(name, {**vars(a), "load": load()}, metrics, path)


if __name__ == "__main__":
    main()
