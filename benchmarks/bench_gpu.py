"""``make bench-gpu`` (issue 53 item 6): one prepared GPU script, at most about 8 minutes, printing as it goes and
writing benchmarks/out/bench-gpu.json.

(a) SFLV1 and SFLV2, 16 clients, ResNet18 cut after layer1 on CIFAR-shaped synthetic data. Per arm, the round time
(min/median/max over ``--rounds`` after a warm-up round) and the GPU's utilisation during those rounds
(``nvidia-smi`` every 100 ms):

- ``server-gpu``: the layout before issue 53: the server actor on the GPU, the client actors computing on CPUs;
- ``clients-gpu``: every actor on the GPU, the client actors sharing it (``runtime.client.num_gpus`` and
  ``runtime.server.num_gpus`` = 1 / (workers + 1), ``device: cuda``);
- ``local``: the local backend, every host in this process on the GPU (the authors' setting);
- ``plain``: a plain one-process PyTorch loop over the same clients, batches and steps on the same GPU (client
  forward, server step, client backward, one client after another; FedAvg at the end of the round), what the
  authors' scripts do;
- ``packed``: many clients per kernel (``runtime.pack_clients``), in process: SFLV1 with its server copies
  batched (``algorithm.batched_copies``: the clients' steps interleaved, each step's forwards one vmapped
  computation, the copies one batched step, the backwards one); SFLV2 serves its clients one after another on one
  server model, so nothing packs (reported as not applicable); FedAvg on the same model runs in process one client
  at a time (``fedavg/local``) and packed (``fedavg/packed``) beside its plain loop (``fedavg/plain``).

(b) GAS at the CIFAR-10 config (configs/gas/cifar10.yaml's model, cut, clients and steps, on synthetic CIFAR-shaped
data): raysplit's round time in process on the device. With ``--gas-checkout DIR`` (the authors' eejiarong/GAS,
fetched outside the project, its globals edited as a named diff), ``python GAS_main.py`` runs there for
``--gas-seconds`` seconds beside it and the rounds it logs (lines matching ``--gas-round-regex``) give its rate.

``--dry-run`` runs all of it on the CPU at toy size (4 clients, cnn_small for ResNet18, batch 8, one step, one
timed round, Ray on two CPUs); the fast tier runs it (tests/test_bench_gpu.py) so that the script cannot rot. A GPU machine:

    bash scripts/setup.sh && make bench-gpu        # or: python benchmarks/bench_gpu.py [--workers 7] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common import fmt, load, mmm, save
from gpu_server import GpuSampler

from raysplit.config import load_config
from raysplit.data import to_tensor
from raysplit.experiment import prepare
from raysplit.runtime import runtime_for, transport

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("server-gpu", "clients-gpu", "local", "plain", "packed")


def overrides(alg: str, arm: str, a) -> dict:
    """The run of ``alg`` in ``arm`` (a Ray or in-process arm; ``plain`` reads the same config's data and model)."""
    cuda = a.device == "cuda"
    share = 1 / (a.workers + 1)
    over = {
        "name": f"bench-gpu-{alg}-{arm}", "seed": 0, "algorithm": {"name": alg},
        "data.dataset": "synthetic", "data.options": {"num_samples": a.clients * a.batch * a.steps * 2,
                                                      "shape": a.shape, "test_fraction": 0.05},
        "data.num_clients": a.clients, "data.partition.name": "iid", "data.test_fraction": 0.0,
        "model.name": a.model, "model.cut": a.cut, "train.rounds": 100, "train.batch_size": a.batch,
        "train.local_steps": a.steps, "train.optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "runtime.num_workers": a.workers, "runtime.faults.max_retries": 0, "runtime.address": "auto",
        "runtime.pack_clients": arm == "packed",
        **({"algorithm": {"name": alg, "batched_copies": True}} if arm == "packed" and alg == "sflv1" else {}),
        "runtime.keep_actors_s": 120,  # the next arm asking for the same resources takes these actors
        "tracking.enabled": False, "tracking.progress": False,
    }
    if arm == "server-gpu":
        over.update({"runtime.server": {"num_cpus": 1, "num_gpus": 1 if cuda else 0, "device": a.device},
                     "runtime.client": {"num_cpus": a.client_cpus, "device": "cpu"}})
    elif arm == "clients-gpu":
        over.update({"runtime.server": {"num_cpus": 1, "num_gpus": share if cuda else 0, "device": a.device},
                     "runtime.client": {"num_cpus": a.client_cpus, "num_gpus": share if cuda else 0,
                                        "device": a.device}})
    else:  # in process (local, packed)
        over.update({"runtime.backend": "local", "runtime.server.device": a.device,
                     "runtime.client.device": a.device})
    return over


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_rounds(label: str, a, one_round) -> dict:
    """``one_round(r)`` for a warm-up round and ``a.rounds`` timed ones, GPU utilisation sampled during the timed."""
    times, util = [], []
    for r in range(1 + a.rounds):
        sampler = GpuSampler()
        sampler.start()
        t0 = time.perf_counter()
        one_round(r)
        sync(a.device)
        dt = time.perf_counter() - t0
        samples = sampler.stop()
        print(f"  {label} round {r}{' (warm-up)' if r == 0 else ''}: {dt:.2f} s, GPU "
              f"{np.mean(samples) if samples else float('nan'):.0f} %", flush=True)
        if r > 0:
            times.append(dt)
            util += samples
    return {"round_s": mmm(times), "gpu_util": mmm(util) if util else None}


def raysplit_arm(alg: str, arm: str, a) -> dict:
    cfg = load_config(None, overrides(alg, arm, a))
    p = prepare(cfg)
    t0 = time.perf_counter()
    rt = runtime_for(cfg.runtime, p.inputs)
    print(f"  {alg} {arm}: hosts ready in {time.perf_counter() - t0:.1f} s", flush=True)
    clock = [0.0]

    def one_round(r):
        clients = [int(c) for c in p.sample_stream[r]]
        rt.begin_round(r, clients, clock[0])
        p.algorithm.run_round(rt, r, clients, np.random.default_rng([cfg.seed, r, 3]))
        clock[0] = rt.end_round().t_end

    try:
        return timed_rounds(f"{alg} {arm}", a, one_round)
    finally:
        rt.shutdown()


def plain_arm(alg: str, a) -> dict:
    """The same clients, batches and steps as a plain PyTorch loop in this process on ``a.device``."""
    cfg = load_config(None, overrides(alg, "plain", a))
    p = prepare(cfg)
    dev = torch.device(a.device)
    plan, inp = p.inputs.plan, p.inputs
    client, server = (m.to(dev) for m in plan.parts())
    client.load_state_dict(transport.unpack_state(inp.client_init))
    server.load_state_dict(transport.unpack_state(inp.server_init))
    x_all = to_tensor(inp.train_data["x"], plan.model.inputs).to(dev)
    y_all = torch.as_tensor(inp.train_data["y"]).to(dev)
    opt = dict(lr=0.01, momentum=0.9)

    def one_round(r):
        global_client = copy.deepcopy(client.state_dict())
        server_start = copy.deepcopy(server.state_dict())
        client_states, server_states = [], []
        s_opt = torch.optim.SGD(server.parameters(), **opt) if alg != "fedavg" else None
        for c in (int(c) for c in p.sample_stream[r]):
            client.load_state_dict(global_client)
            if alg == "sflv1":  # each client its own copy of the server model, averaged at the end
                server.load_state_dict(server_start)
                s_opt = torch.optim.SGD(server.parameters(), **opt)
            c_opt = torch.optim.SGD(client.parameters(), **opt)
            idx = torch.as_tensor(inp.train_idx[c], device=dev)
            for s in range(a.steps):
                b = idx[s * a.batch:(s + 1) * a.batch]
                if alg == "fedavg":  # the whole model on the client (split_model gives the server nothing)
                    c_opt.zero_grad(set_to_none=True)
                    F.cross_entropy(client(x_all[b]), y_all[b]).backward()
                    c_opt.step()
                    continue
                z = client(x_all[b])
                zd = z.detach().requires_grad_(True)
                loss = F.cross_entropy(server(zd), y_all[b])
                s_opt.zero_grad(set_to_none=True)
                loss.backward()
                s_opt.step()
                c_opt.zero_grad(set_to_none=True)
                z.backward(zd.grad)
                c_opt.step()
            client_states.append(copy.deepcopy(client.state_dict()))
            if alg == "sflv1":
                server_states.append(copy.deepcopy(server.state_dict()))
        for model, states in ((client, client_states), (server, server_states)):
            if states:
                model.load_state_dict({k: sum(st[k].float() for st in states).div(len(states)).to(v.dtype)
                                       for k, v in states[0].items()})

    return timed_rounds(f"{alg} plain", a, one_round)


def gas_arm(a) -> dict:
    """GAS at configs/gas/cifar10.yaml's model, cut, clients and steps on synthetic CIFAR-shaped data, in process."""
    gas = load_config(ROOT / "configs" / "gas" / "cifar10.yaml")
    steps = 1 if a.dry_run else gas.train.local_steps
    toy = {"data.num_clients": 4, "train.participation": {"count": 2}} if a.dry_run else {}
    over = {**toy, "data.dataset": "synthetic",
            "data.options": {"num_samples": gas.data.num_clients * gas.train.batch_size * steps * 2,  # enough
                             "shape": [3, 32, 32], "test_fraction": 0.05},
            "data.partition": {"name": "iid"}, "train.local_steps": steps, "runtime.backend": "local",
            "runtime.server.device": a.device, "runtime.client.device": a.device, "eval.every": 1000,
            "tracking.enabled": False, "tracking.progress": False}
    cfg = load_config(ROOT / "configs" / "gas" / "cifar10.yaml", over)
    p = prepare(cfg)
    rt = runtime_for(cfg.runtime, p.inputs)
    try:
        return timed_rounds("gas raysplit", a, lambda r: rt.run_events(r))
    finally:
        rt.shutdown()


def gas_authors(a) -> dict:
    """The authors' GAS_main.py for ``--gas-seconds`` s in ``--gas-checkout``: the rounds it logged, per second."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "GAS_main.py"], cwd=a.gas_checkout, capture_output=True, text=True,
                             timeout=a.gas_seconds).stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    rounds = len(re.findall(a.gas_round_regex, out))
    dt = time.perf_counter() - t0
    print(f"  gas authors: {rounds} rounds logged in {dt:.0f} s", flush=True)
    return {"rounds": rounds, "seconds": dt, "round_s": dt / rounds if rounds else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the same on the CPU at toy size")
    ap.add_argument("--algorithms", nargs="+", default=["sflv2", "sflv1", "fedavg"])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--cut", default="layer1")
    ap.add_argument("--shape", type=int, nargs=3, default=[3, 32, 32], help="the synthetic inputs' shape")
    ap.add_argument("--workers", type=int, default=7)
    ap.add_argument("--client-cpus", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--gas", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--gas-checkout", type=Path, help="the authors' eejiarong/GAS checkout (outside the project)")
    ap.add_argument("--gas-seconds", type=float, default=120.0)
    ap.add_argument("--gas-round-regex", default=r"(?im)^.*round\b.*$")
    ap.add_argument("--out", default="bench-gpu")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.device, a.clients, a.workers, a.client_cpus, a.batch, a.steps, a.rounds = "cpu", 4, 2, 0.5, 8, 1, 1
        a.model, a.cut, a.shape = "cnn_small", "conv1", [1, 28, 28]
        a.out = f"{a.out}-dry-run"
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here; give --dry-run (or --device cpu)")
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             **({"num_cpus": 2} if a.dry_run else {}))
    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "ray": ray.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpus": ray.cluster_resources().get("CPU"), "load_at_start": load()}
    print(info, flush=True)
    results: dict = {}
    t_start = time.perf_counter()
    try:
        for alg in a.algorithms:
            for arm in a.arms:
                if alg == "fedavg" and arm not in ("local", "packed", "plain"):
                    continue
                if arm == "packed" and alg not in ("fedavg", "sflv1"):
                    results[f"{alg}/{arm}"] = {"not_applicable": f"{alg} serves its clients one after another on "
                                                                 "one server model: nothing to pack"}
                    print(f"  {alg} packed: not applicable", flush=True)
                    continue
                results[f"{alg}/{arm}"] = plain_arm(alg, a) if arm == "plain" else raysplit_arm(alg, arm, a)
        if a.gas:
            results["gas/raysplit"] = gas_arm(a)
            if a.gas_checkout:
                results["gas/authors"] = gas_authors(a)
    finally:
        ray.shutdown()
    print("| run | round s min/median/max | GPU utilisation % (median of samples) |")
    print("|---|---|---|")
    for k, r in results.items():
        if "round_s" in r and isinstance(r["round_s"], dict):
            u = f"{r['gpu_util']['median']:.0f}" if r.get("gpu_util") else "- (no nvidia-smi)"
            print(f"| {k} | {fmt(r['round_s'], 1, 3)} | {u} |")
    path = save(a.out, {"args": {k: str(v) for k, v in vars(a).items()}, "info": info, "results": results,
                        "wall_s": time.perf_counter() - t_start, "load_at_end": load()})
    print(f"{path.name}: {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
