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
import copy
import time

import numpy as np
import torch
import torch.nn.functional as F

from common import fmt, load, log_mlflow, mmm, save

import raysplit
from raysplit.config import load_config
from raysplit.data import to_tensor
from raysplit.experiment import prepare
from raysplit.models import build_model
from raysplit.runtime import Runtime, make_backend
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
             threads: int, direct: bool = True):
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
        "runtime.direct_steps": direct,
        **m["data"],
    }
    return load_config(None, over)


class Reference:
    """Plain PyTorch: one process, no actors, no hosts. SFLV2 (sequential, one server model) or SFLV1 (per-client
    server copies averaged) with FedAvg of the client models."""

    def __init__(self, p, algorithm: str):
        spec = p.inputs.spec
        self.algorithm = algorithm
        self.spec = spec
        self.x, self.y = p.inputs.train_data["x"], p.inputs.train_data["y"]
        self.idx = [np.asarray(ix) for ix in p.inputs.train_idx]
        self.sizes = [float(len(ix)) for ix in self.idx]
        self.cursor = [(0, 0)] * len(self.idx)
        self.perm: dict[int, tuple[int, np.ndarray]] = {}
        client, server = build_model(spec.model, spec.num_classes, spec.input_shape).split(spec.cut)
        client.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in p.inputs.client_init.items()})
        server.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in p.inputs.server_init.items()})
        self.client_global = {k: v.clone() for k, v in client.state_dict().items()}
        self.client = client
        self.server = server
        o = spec.client_optimizer
        self.opt_args = dict(lr=o["lr"], momentum=o["momentum"])
        self.server_opt = torch.optim.SGD(server.parameters(), **self.opt_args)
        self.client_opt_state: dict[int, dict] = {}
        self.bs = spec.batch_size

    def batch(self, c: int):
        epoch, pos = self.cursor[c]
        if pos >= len(self.idx[c]):
            epoch, pos = epoch + 1, 0
        if c not in self.perm or self.perm[c][0] != epoch:
            self.perm[c] = (epoch, np.random.default_rng([self.spec.seed, c, epoch]).permutation(self.idx[c]))
        b = self.perm[c][1][pos:pos + self.bs]
        self.cursor[c] = (epoch, pos + len(b))
        return to_tensor(self.x[b], self.spec.data_spec), torch.as_tensor(self.y[b], dtype=torch.long)

    def round(self, clients: list[int], steps: int) -> None:
        states, weights = [], []
        copies = {}
        if self.algorithm == "sflv1":  # per-client server copies, forked from the server model
            for c in clients:
                m = copy.deepcopy(self.server)
                o = torch.optim.SGD(m.parameters(), **self.opt_args)
                o.load_state_dict(copy.deepcopy(self.server_opt.state_dict()))  # its own state, as ServerHost.fork
                copies[c] = (m, o)
        for c in clients:
            model = self.client
            model.load_state_dict(self.client_global)
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
        if copies:
            ws = [self.sizes[c] for c in clients]
            self.server.load_state_dict(average_states([copies[c][0].state_dict() for c in clients], ws))
            merged = copy.deepcopy(copies[clients[0]][1].state_dict())
            for pid in merged["state"]:
                merged["state"][pid] = average_states([copies[c][1].state_dict()["state"][pid] for c in clients], ws)
            self.server_opt.load_state_dict(merged)
        self.client_global = average_states(states, weights)


class RaysplitRounds:
    """raysplit's own round loop (as experiment.py runs it, minus MLflow and evaluation)."""

    def __init__(self, cfg):
        self.p = prepare(cfg)
        self.cfg = cfg
        self.rt = Runtime(make_backend(cfg.runtime), self.p.inputs, cfg.runtime.max_in_flight)
        self.r = 0
        self.t = 0.0

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
    ray_cfg = make_cfg(model, algorithm, clients, "ray", a.steps, a.batch, a.workers, 1)
    chained_cfg = make_cfg(model, algorithm, clients, "ray", a.steps, a.batch, a.workers, 1, direct=False)
    local_cfg = make_cfg(model, algorithm, clients, "local", a.steps, a.batch, a.workers, 1)
    p = prepare(local_cfg)
    ref = Reference(p, algorithm)
    local = RaysplitRounds(local_cfg)
    ray_rt = RaysplitRounds(ray_cfg)
    chained = RaysplitRounds(chained_cfg) if a.chained else None

    def order(r: int) -> list[int]:  # the clients of round r in the order the algorithm serves them
        cl = [int(c) for c in p.sample_stream[r]]
        return sorted(cl) if algorithm == "sflv2" else cl  # sflv2 runs with order=fixed

    ref_round = [0]

    def ref_step():
        ref.round(order(ref_round[0]), a.steps)
        ref_round[0] += 1
    n_threads = torch.get_num_threads()
    times = {"ref_1thread": [], "ref_all_threads": [], "local": [], "ray": []}
    if chained:
        times["ray_chained"] = []
    try:
        for w in range(a.warmup):  # first rounds count FLOPs, build modules, warm caches
            torch.set_num_threads(1)
            ref_step()
            local.round()
            ray_rt.round()
            if chained:
                chained.round()
        for i in range(a.rounds):
            torch.set_num_threads(1)
            times["ref_1thread"].append(timed(ref_step))
            times["local"].append(timed(local.round))
            torch.set_num_threads(n_threads)
            times["ref_all_threads"].append(timed(ref_step))
            times["ray"].append(timed(ray_rt.round))
            if chained:
                times["ray_chained"].append(timed(chained.round))
        torch.set_num_threads(n_threads)
        # same computation: the reference has now run warmup + 2*rounds rounds, local warmup + rounds; compare
        # after bringing local level with the reference
        for _ in range(a.rounds):
            local.round()
        srv_local = local.server_state()
        diff = max(float((srv_local[k].double() - v.double()).abs().max()) for k, v in ref.server.state_dict().items())
        if chained:  # both Ray paths ran the same rounds: their server weights must agree bit for bit
            s_d, s_c = ray_rt.server_state(), chained.server_state()
            chained_diff = max(float((s_d[k].double() - s_c[k].double()).abs().max()) for k in s_d)
    finally:
        local.rt.shutdown()
        ray_rt.rt.shutdown()
        if chained:
            chained.rt.shutdown()
    steps_per_round = clients * a.steps
    ratio = [r / min(a1, b1) for r, a1, b1 in zip(times["ray"], times["ref_1thread"], times["ref_all_threads"])]
    out = {k: mmm(v) for k, v in times.items()}
    out["ratio_ray_vs_best_ref"] = mmm(ratio)
    out["ratio_ray_vs_ref_1thread"] = mmm([r / b for r, b in zip(times["ray"], times["ref_1thread"])])
    out["ratio_local_vs_ref_1thread"] = mmm([r / b for r, b in zip(times["local"], times["ref_1thread"])])
    out["ms_per_step"] = {k: 1e3 * out[k]["median"] / steps_per_round for k in times}
    out["max_abs_weight_diff_ref_vs_local"] = diff
    if chained:
        out["max_abs_weight_diff_direct_vs_chained"] = chained_diff
        out["ratio_chained_vs_best_ref"] = mmm([r / min(a1, b1) for r, a1, b1 in zip(
            times["ray_chained"], times["ref_1thread"], times["ref_all_threads"])])
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
                    help="also time the driver-chained Ray path (runtime.direct_steps=false) in the same run")
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-mlflow", action="store_true")
    a = ap.parse_args()
    import ray

    ray.init(num_cpus=4, object_store_memory=1024**3, include_dashboard=False, log_to_driver=True)
    results = {}
    print(f"raysplit from {raysplit.__file__}; load {load()}")
    print("| model | algorithm | clients | ref 1 thread s/round | ref all threads | LocalBackend | Ray runtime | "
          "Ray / best ref | ms/step ray vs ref | weight diff | Ray chained | chained / best ref |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in a.model:
        for alg in a.algorithm:
            for n in a.clients:
                r = run_case(model, alg, n, a)
                r["load_after"] = load()
                results[f"{model}/{alg}/{n}"] = r
                ms = r["ms_per_step"]
                print(f"| {model} | {alg} | {n} | {fmt(r['ref_1thread'], 1, 3)} | {fmt(r['ref_all_threads'], 1, 3)} | "
                      f"{fmt(r['local'], 1, 3)} | {fmt(r['ray'], 1, 3)} | {fmt(r['ratio_ray_vs_best_ref'])} | "
                      f"{ms['ray']:.1f} vs {min(ms['ref_1thread'], ms['ref_all_threads']):.1f} | "
                      f"{r['max_abs_weight_diff_ref_vs_local']:.1e} | "
                      + (f"{fmt(r['ray_chained'], 1, 3)} | {fmt(r['ratio_chained_vs_best_ref'])} |" if a.chained
                         else "- | - |"), flush=True)
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
            if "ratio_chained_vs_best_ref" in r:
                metrics[f"{k}_chained_ratio_median"] = r["ratio_chained_vs_best_ref"]["median"]
        log_mlflow(name, {**vars(a), "load": load()}, metrics, path)


if __name__ == "__main__":
    main()
