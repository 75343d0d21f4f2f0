"""Batched per-client server copies (``algorithm.batched_copies``): the server's per-round work of PSL with one
batched computation over the round's copies vs one copy after another.

Server side, in process (no Ray, no clients): two ``ServerHost``s built from the same PSL config, one per-copy and
one batched, are given the same activations (each client's first batch through the initial client part). A round
is what the server does in PSL with one step per client: ``fork`` a copy per client, ``train_copies`` on every
client's activation (timed alone too: "step"), ``merge``. Repetitions interleave the two hosts (which goes first
alternates), so each ratio comes from the same moment's load. After the repetitions both hosts have trained the
same rounds on the same activations; the largest difference of their server weights is reported.

End to end: one PSL round through the local backend (clients' forward and backward included) with
``algorithm.batched_copies`` off and on, interleaved the same way.

    python benchmarks/batched_copies.py --model cnn_small resnet18 --clients 10 50 --reps 5
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from common import fmt, load, log_mlflow, mmm, save
from overhead import RaysplitRounds, timed

import raysplit
from raysplit.config import load_config
from raysplit.data import to_tensor
from raysplit.experiment import prepare
from raysplit.runtime import Activation, ServerHost, Tag, transport

FMNIST = Path("/usr/share/datasets/fashion-mnist")
MODELS = {
    # model, cut, dataset overrides, batch size
    "cnn_small": dict(model="cnn_small", cut="conv1",
                      data={"data.dataset": "fashion_mnist" if FMNIST.is_dir() else "digits"}, batch=32),
    "resnet18": dict(model="resnet18", cut="layer1",
                     data={"data.dataset": "synthetic",
                           "data.options": {"num_samples": 2000, "shape": [3, 32, 32], "test_fraction": 0.05}},
                     batch=8),
}


def make_cfg(model: str, clients: int, batched: bool, batch: int | None, threads: int, device: str):
    m = MODELS[model]
    return load_config(None, {
        "name": f"batched-copies-{model}-{clients}", "seed": 0, "algorithm": {"name": "psl"},
        "data.num_clients": clients, "data.partition.name": "iid", "data.test_fraction": 0.05,
        "data.max_test_samples": 100, "model.name": m["model"], "model.cut": m["cut"],
        "train.rounds": 1000, "train.batch_size": batch or m["batch"], "train.local_steps": 1,
        "train.optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "runtime.backend": "local", "runtime.num_workers": 1, "runtime.torch_threads": threads,
        "runtime.server.device": device, "algorithm.batched_copies": batched,
        "tracking.enabled": False, "tracking.progress": False, **m["data"]})


def first_batches(p) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """Every client's first batch through the initial client part: (activation, labels, weight)."""
    i, plan = p.inputs, p.inputs.plan
    client, _ = plan.parts()
    client.load_state_dict(transport.unpack_state(i.client_init))
    out = []
    with torch.no_grad():
        for idx in i.train_idx:
            b = np.asarray(idx)[:plan.sections.train.batch_size]
            x = client(to_tensor(i.train_data["x"][b], plan.model.inputs))
            out.append((transport.pack(x), np.asarray(i.train_data["y"][b]), float(len(idx))))
    return out


class ServerRounds:
    """The server's part of PSL rounds with one step per client, on one host."""

    def __init__(self, p, batched: bool, batches):
        i = p.inputs
        self.host = ServerHost(i.plan, i.server_init, i.client_init, i.test_data)  # algorithm.batched_copies: batched
        self.batches = batches
        self.clients = list(range(len(batches)))
        self.r = 0

    def round(self) -> float:
        """One round; returns the seconds of the ``train_copies`` call alone."""
        h = self.host
        h.begin_round(self.r, 0.0)
        h.fork(self.clients)
        acts = [Activation(Tag(c, self.r, 0), x, y, 0.0, w) for c, (x, y, w) in enumerate(self.batches)]
        step = timed(lambda: h.serve("train_copies", *acts))
        h.merge({c: w for c, (_, _, w) in enumerate(self.batches)})
        self.r += 1
        return step


def interleaved(a, b, reps: int, threads: int) -> tuple[list, list]:
    """``reps`` timings of ``a()`` and ``b()`` each, alternating which runs first."""
    ta, tb = [], []
    for k in range(reps):
        for f, out in ((a, ta), (b, tb)) if k % 2 == 0 else ((b, tb), (a, ta)):
            torch.set_num_threads(threads)  # building a host sets the process's threads
            out.append(f())
    return ta, tb


def run_case(model: str, clients: int, threads: int, a) -> dict:
    p = prepare(make_cfg(model, clients, False, a.batch, threads, a.device))
    batches = first_batches(p)
    per, bat = ServerRounds(p, False, batches), ServerRounds(p, True, batches)
    steps = {"per_copy": [], "batched": []}

    def server_round(rounds, key):
        def go():
            t0 = time.perf_counter()
            steps[key].append(rounds.round())
            return time.perf_counter() - t0
        return go

    for _ in range(a.warmup):  # FLOP counts, allocator, first vmap trace
        torch.set_num_threads(threads)
        per.round(), bat.round()
    t_per, t_bat = interleaved(server_round(per, "per_copy"), server_round(bat, "batched"), a.reps, threads)
    sp, sb = (r.host.models["main"].module.state_dict() for r in (per, bat))
    diff = max(float((sp[k].double() - sb[k].double()).abs().max()) for k in sp)
    out = {"server_per_copy": mmm(t_per), "server_batched": mmm(t_bat),
           "server_speedup": mmm([x / y for x, y in zip(t_per, t_bat)]),
           "step_per_copy": mmm(steps["per_copy"]), "step_batched": mmm(steps["batched"]),
           "step_speedup": mmm([x / y for x, y in zip(steps["per_copy"], steps["batched"])]),
           "max_abs_weight_diff": diff, "batch": p.inputs.plan.sections.train.batch_size, "dataset": p.cfg.data.dataset,
           "fell_back": bat.host._unbatched, "raw": {"server": [t_per, t_bat], "step": steps}}
    if a.e2e_reps:
        e_per = RaysplitRounds(make_cfg(model, clients, False, a.batch, threads, a.device))
        e_bat = RaysplitRounds(make_cfg(model, clients, True, a.batch, threads, a.device))
        try:
            torch.set_num_threads(threads)
            e_per.round(), e_bat.round()  # warm-up
            r_per, r_bat = interleaved(lambda: timed(e_per.round), lambda: timed(e_bat.round), a.e2e_reps, threads)
        finally:
            e_per.rt.shutdown(), e_bat.rt.shutdown()
        out.update(e2e_per_copy=mmm(r_per), e2e_batched=mmm(r_bat),
                   e2e_speedup=mmm([x / y for x, y in zip(r_per, r_bat)]))
        out["raw"]["e2e"] = [r_per, r_bat]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["cnn_small", "resnet18"], choices=list(MODELS))
    ap.add_argument("--clients", nargs="+", type=int, default=[10, 50], help="clients per round")
    ap.add_argument("--threads", nargs="+", type=int, default=[1], help="torch threads (the server actor has 1)")
    ap.add_argument("--batch", type=int, default=None, help="per-client batch (default: per model)")
    ap.add_argument("--reps", type=int, default=5, help="timed server rounds per variant")
    ap.add_argument("--e2e-reps", type=int, default=3, help="timed local-backend rounds per variant (0: none)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-mlflow", action="store_true")
    a = ap.parse_args()
    print(f"raysplit from {raysplit.__file__}; load {load()}")
    print("| model (batch) | clients | threads | server s/round per-copy | batched | speed-up | step only: per-copy "
          "| batched | speed-up | local e2e s/round per-copy | batched | speed-up | max abs weight diff | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = {}
    for model in a.model:
        for n in a.clients:
            for t in a.threads:
                r = run_case(model, n, t, a)
                r["load_after"] = load()
                results[f"{model}/{n}/{t}"] = r
                e2e = (f"{fmt(r['e2e_per_copy'], 1, 3)} | {fmt(r['e2e_batched'], 1, 3)} | {fmt(r['e2e_speedup'])}"
                       if a.e2e_reps else "- | - | -")
                print(f"| {model} ({r['batch']}, {r['dataset']}) | {n} | {t} | {fmt(r['server_per_copy'], 1, 3)} | "
                      f"{fmt(r['server_batched'], 1, 3)} | {fmt(r['server_speedup'])} | "
                      f"{fmt(r['step_per_copy'], 1, 3)} | {fmt(r['step_batched'], 1, 3)} | {fmt(r['step_speedup'])} | "
                      f"{e2e} | {r['max_abs_weight_diff']:.1e} | {r['load_after']} |"
                      + (f" fell back: {r['fell_back']}" if r["fell_back"] else ""), flush=True)
    name = "batched_copies" + (f"-{a.tag}" if a.tag else "")
    path = save(name, {"args": vars(a), "results": results, "load_at_end": load()})
    if not a.no_mlflow:
        metrics = {}
        for key, r in results.items():
            k = key.replace("/", "_")
            for m in ("server_speedup", "step_speedup", "e2e_speedup"):
                if m in r:
                    metrics[f"{k}_{m}_median"] = r[m]["median"]
            metrics[f"{k}_server_per_copy_s_median"] = r["server_per_copy"]["median"]
            metrics[f"{k}_server_batched_s_median"] = r["server_batched"]["median"]
            metrics[f"{k}_max_abs_weight_diff"] = r["max_abs_weight_diff"]
        log_mlflow(name, {**vars(a), "load": load()}, metrics, path)


if __name__ == "__main__":
    main()
