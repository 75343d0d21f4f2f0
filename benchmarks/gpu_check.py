"""GPU check of the server host: the same SFLV2 run with the server on CUDA and on the CPU.

Runs the runtime's hosts in-process (local backend) so it needs no Ray on the GPU machine; the Ray actor
placement itself (runtime.server.num_gpus) is exercised by the placement tests. Prints where the server model
lives, the largest weight difference between the two runs, and the test accuracy of each.

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from raysplit import metrics as M  # noqa: E402
from raysplit.config import load_config  # noqa: E402
from raysplit.experiment import prepare  # noqa: E402
from raysplit.runtime import Runtime, make_backend, transport


def run(device: str):
    cfg = load_config(None, {"algorithm.name": "sflv2", "data.dataset": "digits", "data.num_clients": 4,
                             "data.partition.name": "iid", "data.test_fraction": 0.0, "model.cut": "conv1",
                             "train.rounds": 5, "train.local_steps": 10, "train.batch_size": 32,
                             "train.optimizer.lr": 0.1, "runtime.backend": "local", "runtime.server.device": device})
    p = prepare(cfg)
    rt = Runtime(make_backend(cfg.runtime), p.inputs)
    t0 = time.perf_counter()
    for r in range(cfg.train.rounds):
        clients = [int(c) for c in p.sample_stream[r]]
        rt.begin_round(r, clients, 0.0)
        handle = p.algorithm.run_round(rt, r, clients, np.random.default_rng([cfg.seed, r, 3]))
        rt.end_round()
    wall = time.perf_counter() - t0
    server = rt.backend.server
    where = next(server.models["main"].module.parameters()).device
    y, pred, loss = rt.evaluate_global(handle)
    acc = M.classification_metrics(y, pred, p.num_classes)["accuracy"]
    state = transport.unpack_state(rt.get(rt.server.get_state()).state)
    return where, acc, state, wall


def main():
    print("torch", torch.__version__, "cuda available:", torch.cuda.is_available())
    d_gpu, acc_gpu, s_gpu, w_gpu = run("cuda")
    d_cpu, acc_cpu, s_cpu, w_cpu = run("cpu")
    diff = max(float((s_gpu[k].float() - s_cpu[k].float()).abs().max()) for k in s_cpu)
    print(f"server model on: {d_gpu} (requested cuda) / {d_cpu} (requested cpu)")
    print(f"accuracy: cuda {acc_gpu:.4f}  cpu {acc_cpu:.4f}; max |server weight diff| = {diff:.2e}")
    print(f"wall time of 5 rounds: cuda {w_gpu:.2f}s  cpu {w_cpu:.2f}s")
    ok = d_gpu.type == ("cuda" if torch.cuda.is_available() else "cpu") and diff < 1e-3
    print("GPU CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
