"""A busy GPU server (issue 15 item 6): SFLV2 and SFLV1 with 16 clients, ResNet18 cut after layer1 on 32x32 inputs,
the server actor on the GPU (``runtime.server.num_gpus: 1``, ``runtime.server.device: cuda``) and the client actors on
the CPUs; round time and the GPU's utilisation during the timed rounds (``nvidia-smi`` sampled every 100 ms),
for each transport (compiled graphs, actor calls) in the same run, rounds interleaved.

Needs a machine with a GPU and Ray (``bash scripts/setup.sh`` there; the server actor reserves the GPU):

    python benchmarks/gpu_server.py [--workers 7] [--rounds 5] [--batch 32] [--steps 5]

``--device cpu`` runs the same on a CPU-only machine (no utilisation figure): a check that the command works.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import threading
import time

import numpy as np

from common import fmt, load, log_mlflow, mmm, save

from raysplit.config import load_config
from raysplit.experiment import prepare
from raysplit.runtime import runtime_for


class GpuSampler(threading.Thread):
    """The GPU's utilisation (%) every ``period_ms`` while running: from ``nvidia-smi``, else from NVML
    (``pynvml``, nvidia-ml-py) where it imports; nothing where neither is there (``source`` says which)."""

    def __init__(self, period_ms: int = 100):
        super().__init__(daemon=True)
        self.samples: list[float] = []
        self.period_ms = period_ms
        self.proc = None
        self.done = threading.Event()
        self.cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                    f"-lms={period_ms}"] if shutil.which("nvidia-smi") else None
        self.nvml = None
        if self.cmd is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self.nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
            except Exception:  # no NVML library or no device: no samples
                self.nvml = None
        self.source = "nvidia-smi" if self.cmd else "pynvml" if self.nvml else None

    def run(self) -> None:
        if self.cmd is not None:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
            for line in self.proc.stdout:
                try:
                    self.samples.append(float(line.split(",")[0]))
                except ValueError:
                    pass
        elif self.nvml is not None:
            nvml, handle = self.nvml
            while not self.done.wait(self.period_ms / 1000):
                self.samples.append(float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))

    def stop(self) -> list[float]:
        self.done.set()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.join(timeout=10)
        return self.samples


def make(algorithm: str, transport: str, a):
    cfg = load_config(None, {
        "name": f"gpu-{algorithm}-{transport}", "seed": 0, "algorithm": {"name": algorithm},
        "data.dataset": "synthetic", "data.options": {"num_samples": 16 * a.batch * a.steps * 4,
                                                      "shape": [3, 32, 32], "test_fraction": 0.05},
        "data.num_clients": 16, "data.partition.name": "iid", "data.test_fraction": 0.0,
        "model.name": "resnet18", "model.cut": "layer1", "train.rounds": 1000, "train.batch_size": a.batch,
        "train.local_steps": a.steps, "train.optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "runtime.num_workers": a.workers, "runtime.client.num_cpus": 1, "runtime.server.device": a.device,
        # Both transports' runtimes live side by side (their rounds interleave), so each server takes its share of
        # the one GPU: whole GPUs for both would leave the second server pending for ever.
        "runtime.server": {"num_cpus": 1, "num_gpus": 1 / len(a.transports) if a.device == "cuda" else 0},
        "runtime.transport.kind": transport, "runtime.faults.max_retries": 0,
        "tracking.enabled": False, "tracking.progress": False})
    p = prepare(cfg)
    r = cfg.runtime
    return cfg, p, runtime_for(r, p.inputs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithms", nargs="+", default=["sflv2", "sflv1"])
    ap.add_argument("--transports", nargs="+", default=["compiled", "calls"])
    ap.add_argument("--workers", type=int, default=7)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--no-mlflow", action="store_true")
    a = ap.parse_args()
    import ray
    import torch

    ray.init(include_dashboard=False, log_to_driver=True)
    cpus = ray.cluster_resources().get("CPU", 0)
    need = len(a.transports) * (a.workers + 1)
    if need > cpus:  # every transport's runtime holds its actors for the whole run
        raise SystemExit(f"--workers {a.workers}: {len(a.transports)} runtimes x ({a.workers} client actors + 1 "
                         f"server) need {need} CPUs, this machine has {cpus:g}; lower --workers")
    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "ray": ray.__version__}
    print(info, f"load {load()}")
    print("| algorithm | transport | round s min/med/max | GPU utilisation % mean (samples) | server busy / round |")
    print("|---|---|---|---|---|")
    out = {}
    for alg in a.algorithms:
        t0 = time.perf_counter()
        runs = {t: make(alg, t, a) for t in a.transports}
        print(f"  {alg}: actors of {len(runs)} runtimes ready in {time.perf_counter() - t0:.1f} s", flush=True)
        clock = dict.fromkeys(runs, 0.0)
        times = {t: [] for t in runs}
        util = {t: [] for t in runs}
        busy = {t: [] for t in runs}
        try:
            for r in range(a.warmup + a.rounds):
                for t, (cfg, p, rt) in runs.items():
                    clients = [int(c) for c in p.sample_stream[r]]
                    sampler = GpuSampler()
                    sampler.start()
                    t0 = time.perf_counter()
                    rt.begin_round(r, clients, clock[t])
                    p.algorithm.run_round(rt, r, clients, np.random.default_rng([cfg.seed, r, 3]))
                    st = rt.end_round()
                    dt = time.perf_counter() - t0
                    samples = sampler.stop()
                    clock[t] = st.t_end
                    print(f"  {alg} {t} round {r}{' (warm-up)' if r < a.warmup else ''}: {dt:.2f} s, GPU "
                          f"{np.mean(samples) if samples else float('nan'):.0f} %", flush=True)
                    if r >= a.warmup:
                        times[t].append(dt)
                        util[t] += samples
                        busy[t].append(st.server.get("busy_wall", 0.0) / dt)
        finally:
            for _, _, rt in runs.values():
                rt.shutdown()
        for t in runs:
            u = f"{np.mean(util[t]):.0f} ({len(util[t])})" if util[t] else "- (no nvidia-smi)"
            print(f"| {alg} | {t} | {fmt(mmm(times[t]), 1, 3)} | {u} | {np.mean(busy[t]):.2f} |", flush=True)
            out[f"{alg}/{t}"] = {"round_s": mmm(times[t]), "gpu_util": mmm(util[t]) if util[t] else None,
                                 "server_busy_fraction": float(np.mean(busy[t]))}
    ray.shutdown()
    path = save("gpu-server", {"args": vars(a), "info": info, "results": out, "load_at_end": load()})
    if not a.no_mlflow:
        m = {}
        for k, r in out.items():
            m[f"{k.replace('/', '_')}_round_s_median"] = r["round_s"]["median"]
            if r["gpu_util"]:
                m[f"{k.replace('/', '_')}_gpu_util_mean"] = r["gpu_util"]["median"]
        log_mlflow("gpu-server", {**vars(a), **info, "load": load()}, m, path)


if __name__ == "__main__":
    main()
