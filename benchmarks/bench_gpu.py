"""``make bench-gpu`` and the GPU machine's one command (issue 53 item 6, issue 70 item 4): the trimmed GPU
benchmark, about 9 minutes at most, printing as it goes and writing each arm's JSON into ``--out-dir`` as the arm
finishes (``benchmarks/gpu_run.sh OUT`` runs it there from the wheel bundle, ``make rehearse-gpu`` rehearses that here).

(a) SFLV1 and SFLV2 (FedAvg beside them where it applies), 16 clients, ResNet18 cut after layer1 on CIFAR-shaped
synthetic data. Per arm (one file each: ``ARM.json``) and algorithm, the round time (min/median/max over ``--rounds``
after a warm-up round), the GPU's utilisation during those rounds (``nvidia-smi`` every 100 ms, else NVML) and how
the client steps ran (``packed_steps``, ``unpacked_steps``: asked to pack, ran one at a time):

- ``plain``: a plain one-process PyTorch loop over the same clients, batches and steps on the same GPU (client
  forward, server step, client backward, one client after another; FedAvg at the end of the round), what the
  authors' scripts do;
- ``local``: the local backend, every host in this process on the GPU, one client at a time (SFLV1 unpacked);
- ``packed``: many clients per kernel (``runtime.pack_clients``), in process: SFLV1 with its server copies
  batched (``algorithm.batched_copies``: the clients' steps interleaved, each step's forwards one vmapped
  computation, the copies one batched step, the backwards one); SFLV2 serves its clients one after another on one
  server model, so nothing packs (reported as not applicable); FedAvg packed;
- ``clients-gpu``: Ray, every actor on the GPU, the client actors sharing it as fractions
  (``runtime.client.num_gpus`` and ``runtime.server.num_gpus`` = 1 / (workers + 1), ``device: cuda``).
  The server alone on the GPU (client actors on CPUs) was measured once (``make bench-gpu-server``, RESULTS.md)
  and is not repeated.

(b) ``gas``: GAS at the CIFAR-10 config (configs/gas/cifar10.yaml's model, cut, clients and steps, on synthetic
CIFAR-shaped data): raysplit's round time in process on the device. With ``--gas-checkout DIR`` (the authors'
eejiarong/GAS, fetched outside the project, its globals edited as a named diff), ``python GAS_main.py`` runs there
for ``--gas-seconds`` seconds (less when the budget is short) beside it and the rounds it logs (lines matching
``--gas-round-regex``) give its rate.

An arm or algorithm that raises is recorded with its error (``"error"``, the traceback's end) and the next one runs;
one that the time budget (``--budget-s``) leaves no room for is recorded as skipped. ``--preflight`` first writes
``preflight.json``: Python, torch, CUDA (a ``--device cuda`` run stops there with exit 3 when torch sees none), Ray,
pydantic, raysplit and the bundle's manifest, then a one-step round of each layout.

``--dry-run`` runs all of it on the CPU at toy size (4 clients, cnn_small for ResNet18, batch 8, one step, one
timed round, Ray on two CPUs); the fast tier runs it (tests/test_bench_gpu.py) so that the script cannot rot.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common import OUT, fmt, load, mmm
from gpu_server import GpuSampler

from raysplit.config import load_config
from raysplit.data import to_tensor
from raysplit.experiment import prepare
from raysplit.runtime import runtime_for, transport

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("plain", "local", "packed", "clients-gpu", "gas")  # in this order: the in-process arms need no Ray


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
    if arm == "clients-gpu":
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
    times, util, source, warm = [], [], None, None
    for r in range(1 + a.rounds):
        sampler = GpuSampler()
        sampler.start()
        t0 = time.perf_counter()
        one_round(r)
        sync(a.device)
        dt = time.perf_counter() - t0
        samples, source = sampler.stop(), sampler.source
        print(f"  {label} round {r}{' (warm-up)' if r == 0 else ''}: {dt:.2f} s, GPU "
              f"{np.mean(samples) if samples else float('nan'):.0f} %", flush=True)
        if r > 0:
            times.append(dt)
            util += samples
        else:
            warm = dt
    return {"round_s": mmm(times) if times else None, "warmup_s": warm, "gpu_util": mmm(util) if util else None,
            "gpu_util_source": source}


def raysplit_arm(alg: str, arm: str, a) -> dict:
    cfg = load_config(None, overrides(alg, arm, a))
    p = prepare(cfg)
    t0 = time.perf_counter()
    rt = runtime_for(cfg.runtime, p.inputs)
    ready = time.perf_counter() - t0
    print(f"  {alg} {arm}: hosts ready in {ready:.1f} s", flush=True)
    clock = [0.0]

    def one_round(r):
        clients = [int(c) for c in p.sample_stream[r]]
        rt.begin_round(r, clients, clock[0])
        p.algorithm.run_round(rt, r, clients, np.random.default_rng([cfg.seed, r, 3]))
        clock[0] = rt.end_round().t_end

    try:
        out = timed_rounds(f"{alg} {arm}", a, one_round)
        out["hosts_ready_s"] = ready
        out.update(pack_counts(rt))
        return out
    finally:
        rt.shutdown()


def pack_counts(rt) -> dict:
    """How the client hosts' steps ran (summed over them): packed, or one at a time where a pack was asked for."""
    counts = [rt.backend.get(rt.backend.call(w, "pack_counts"), timeout=120) for w in rt.backend.workers]
    return {"packed_steps": sum(c["packed_steps"] for c in counts),
            "unpacked_steps": sum(c["unpacked_steps"] for c in counts),
            "unpackable": sorted({c["unpackable"] for c in counts if c["unpackable"]})}


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
    steps = a.gas_steps or (1 if a.dry_run else gas.train.local_steps)
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
        return {**timed_rounds("gas raysplit", a, lambda r: rt.run_events(r)), **pack_counts(rt)}
    finally:
        rt.shutdown()


def gas_authors(a, seconds: float) -> dict:
    """The authors' GAS_main.py for ``seconds`` s in ``--gas-checkout``: the rounds it logged, per second."""
    def text(x) -> str:
        return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")

    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "GAS_main.py"], cwd=a.gas_checkout, capture_output=True, text=True,
                              timeout=seconds)
        out, err, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:  # the expected end: it ran for its seconds
        out, err, rc = text(e.stdout), text(e.stderr), None
    rounds = len(re.findall(a.gas_round_regex, out))
    dt = time.perf_counter() - t0
    print(f"  gas authors: {rounds} rounds logged in {dt:.0f} s (exit {rc})", flush=True)
    res = {"rounds": rounds, "seconds": dt, "round_s": dt / rounds if rounds else None, "exit": rc}
    if rc not in (None, 0) or not rounds:  # it stopped early, or logged nothing that counts: say why
        res.update({"stdout_tail": out[-1500:], "stderr_tail": err[-1500:]})
    return res


class Recorder:
    """Each arm's results into ``out_dir/ARM.json``, written again as each of its algorithms finishes (so what
    finished survives a run stopped from outside); a failure is recorded with its error, a run the budget leaves
    no room for as skipped, and the caller goes on."""

    def __init__(self, out_dir: Path, budget_s: float):
        self.out_dir, self.budget_s, self.t0 = out_dir, budget_s, time.perf_counter()
        out_dir.mkdir(parents=True, exist_ok=True)
        self.arms: dict[str, dict] = {}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def run(self, arm: str, name: str, fn, *args) -> dict:
        if self.left() <= 0:
            res = {"skipped": f"time budget of {self.budget_s:.0f} s spent before it started"}
        else:
            t0 = time.perf_counter()
            try:
                res = fn(*args)
            except Exception as e:  # recorded, and the next run goes on
                res = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
                print(f"  {arm} {name}: FAILED: {res['error'][:300]}", flush=True)
            res["seconds"] = time.perf_counter() - t0
        return self.put(arm, name, res)

    def put(self, arm: str, name: str, res: dict) -> dict:
        entry = self.arms.setdefault(arm, {"arm": arm, "results": {}})
        entry["results"][name] = res
        entry.update({"elapsed_s": time.perf_counter() - self.t0, "load": load()})
        path = self.out_dir / f"{arm}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(entry, indent=1, default=str))
        tmp.replace(path)
        return res


def versions() -> dict:
    """What runs here: Python, torch and CUDA, Ray, pydantic, raysplit (Ray and pydantic as the bundle brings them)."""
    import platform
    from importlib import metadata

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "torch_cuda": torch.version.cuda, "device_count": torch.cuda.device_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "load": load()}
    for dist in ("ray", "pydantic", "pydantic-core", "raysplit", "numpy", "transformers"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    import raysplit

    info["raysplit_from"] = str(Path(raysplit.__file__).parent)
    manifest = ROOT / os.environ.get("GPU_BUNDLE", ".gpu-bundle/none") / "manifest.json"
    info["bundle"] = json.loads(manifest.read_text()) if manifest.exists() else None
    info["gpu_util_source"] = GpuSampler().source
    return info


def arm_runs(arm: str, a) -> list[tuple[str, object, tuple]]:
    """The (name, function, arguments) runs of ``arm`` for ``a.algorithms``."""
    if arm == "gas":
        return [("raysplit", gas_arm, (a,))] if a.gas else []
    runs = []
    for alg in a.algorithms:
        if alg == "fedavg" and arm not in ("local", "packed", "plain"):
            continue
        if arm == "packed" and alg not in ("fedavg", "sflv1"):
            runs.append((alg, None, ()))  # not applicable
        elif arm == "plain":
            runs.append((alg, plain_arm, (alg, a)))
        else:
            runs.append((alg, raysplit_arm, (alg, arm, a)))
    return runs


class RayOnce:
    """Ray started at the first arm that needs it (the in-process arms never import it), shut down at the end."""

    def __init__(self, a):
        self.a, self.started = a, False

    def __call__(self) -> None:
        if not self.started:
            import ray

            ray.init(address="local", include_dashboard=False, log_to_driver=False,
                     **({"num_cpus": 2} if self.a.dry_run else {}))
            self.started = True

    def shutdown(self) -> None:
        if self.started:
            import ray

            ray.shutdown()


def run_arms(a, rec: Recorder, ray_once: RayOnce, arms) -> None:
    for arm in arms:
        print(f"{arm} ...", flush=True)
        for name, fn, args in arm_runs(arm, a):
            if fn is None:
                rec.put(arm, name, {"not_applicable": f"{name} serves its clients one after another on one server "
                                                      "model: nothing to pack"})
                print(f"  {name} {arm}: not applicable", flush=True)
                continue
            if arm == "clients-gpu":
                ray_once()
            rec.run(arm, name, fn, *args)
        if arm == "gas" and a.gas and a.gas_checkout:
            rec.run(arm, "authors", lambda: gas_authors(a, max(10.0, min(a.gas_seconds, rec.left() - 5))))


def preflight(a, ray_once: RayOnce) -> int:
    """``preflight.json``: versions and the device, then a one-step round (no timed rounds) of each layout."""
    info = versions()
    print("preflight:", {k: v for k, v in info.items() if k != "bundle"}, flush=True)
    rec = Recorder(a.out_dir, a.budget_s)
    rec.arms["preflight"] = {"arm": "preflight", "info": info, "results": {}}
    if a.device == "cuda" and not info["cuda_available"]:
        rec.put("preflight", "cuda", {"error": "torch sees no CUDA device (CUDA_VISIBLE_DEVICES="
                                               f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})"})
        return 3
    one = argparse.Namespace(**{**vars(a), "steps": 1, "rounds": 0, "clients": min(a.clients, a.workers + 1),
                                "gas_steps": 1, "gas_checkout": None})
    layouts = {"plain": "sflv1", "local": "sflv2", "packed": "sflv1", "clients-gpu": "sflv1", "gas": "raysplit"}
    for arm, alg in layouts.items():
        if arm not in a.arms:
            continue
        for name, fn, args in arm_runs(arm, argparse.Namespace(**{**vars(one), "algorithms": [alg]})):
            if arm == "clients-gpu":
                ray_once()
            rec.run("preflight", arm, fn, *args)
    return 0


def check(out_dir: Path, a) -> list[str]:
    """What a finished run's ``out_dir`` lacks: an arm's file or one of its runs missing, a run that failed or was
    skipped, a timed run without a round time, a layout's pre-flight round missing or failed (``make rehearse-gpu``
    fails on any of these)."""
    problems = []

    def runs(arm: str) -> dict:
        path = out_dir / f"{arm}.json"
        if not path.exists():
            problems.append(f"{path.name} missing")
            return {}
        return json.loads(path.read_text()).get("results", {})

    done = runs("preflight")
    for arm in a.arms:
        if arm not in done:
            problems.append(f"preflight: no one-step round of {arm}")
    for name, r in done.items():
        if r.get("error"):
            problems.append(f"preflight {name}: {r['error'][:300]}")
    for arm in a.arms:
        got = runs(arm)
        for name, _, _ in arm_runs(arm, a):
            r = got.get(name)
            if r is None:
                problems.append(f"{arm}/{name}: missing")
            elif r.get("error") or r.get("skipped"):
                problems.append(f"{arm}/{name}: {(r.get('error') or r.get('skipped'))[:300]}")
            elif "not_applicable" not in r and not isinstance(r.get("round_s"), dict):
                problems.append(f"{arm}/{name}: no round time")
    if "gas" in a.arms and a.gas and a.gas_checkout:
        r = runs("gas").get("authors")
        if not r or r.get("error") or not r.get("rounds"):
            problems.append(f"gas/authors: {'missing' if not r else r.get('error') or 'no round logged'}")
    return problems


def summary(out_dir: Path) -> None:
    print("| arm / run | round s min/median/max | GPU utilisation % (median) | packed / unpacked steps |")
    print("|---|---|---|---|")
    for path in sorted(out_dir.glob("*.json")):
        entry = json.loads(path.read_text())
        for name, r in entry.get("results", {}).items():
            if isinstance(r.get("round_s"), dict):
                u = f"{r['gpu_util']['median']:.0f}" if r.get("gpu_util") else "- (no sampler)"
                pk = f"{r.get('packed_steps', '-')} / {r.get('unpacked_steps', '-')}"
                print(f"| {entry['arm']}/{name} | {fmt(r['round_s'], 1, 3)} | {u} | {pk} |")
            elif path.stem != "preflight":
                why = r.get("error") or r.get("skipped") or r.get("not_applicable") or r.get("round_s")
                print(f"| {entry['arm']}/{name} | {str(why)[:80]} | | |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the same on the CPU at toy size")
    ap.add_argument("--algorithms", nargs="+", default=["sflv1", "sflv2", "fedavg"])
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
    ap.add_argument("--gas-steps", type=int, help="GAS's local steps (default: the config's; 1 in a dry run)")
    ap.add_argument("--gas-round-regex", default=r"(?im)^.*round\b.*$")
    ap.add_argument("--out-dir", type=Path, help="where each arm's JSON goes (default benchmarks/out/bench-gpu[-dry-run])")
    ap.add_argument("--budget-s", type=float, default=540.0, help="no run starts after this many seconds")
    ap.add_argument("--preflight", action="store_true", help="first write preflight.json (versions, one-step runs)")
    ap.add_argument("--check", type=Path, metavar="DIR", help="run nothing: check that DIR holds every arm's runs "
                                                               "(with the same arguments), none failed")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.device, a.clients, a.workers, a.client_cpus, a.batch, a.steps, a.rounds = "cpu", 4, 2, 0.5, 8, 1, 1
        a.model, a.cut, a.shape = "cnn_small", "conv1", [1, 28, 28]
        a.gas_seconds = min(a.gas_seconds, 5.0)
    if a.check:
        problems = check(a.check, a)
        print("\n".join(f"check: {p}" for p in problems) or f"check: {a.check} holds every arm's runs", flush=True)
        return 1 if problems else 0
    a.out_dir = a.out_dir or OUT / f"bench-gpu{'-dry-run' if a.dry_run else ''}"
    if a.device == "cuda" and not torch.cuda.is_available() and not a.preflight:
        raise SystemExit("--device cuda: torch sees no CUDA device here; give --dry-run (or --device cpu)")
    ray_once = RayOnce(a)
    t_start = time.perf_counter()
    try:
        if a.preflight and preflight(a, ray_once):
            print("preflight: no CUDA device: stopped (preflight.json says so)", flush=True)
            return 3
        rec = Recorder(a.out_dir, a.budget_s - (time.perf_counter() - t_start))
        run_arms(a, rec, ray_once, a.arms)
    finally:
        ray_once.shutdown()
    summary(a.out_dir)
    print(f"{a.out_dir}: {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
