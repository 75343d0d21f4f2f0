"""The Flower half of benchmarks/flower.py; runs in benchmarks/.flower-venv (flwr[simulation] pins its own Ray).

FedAvg with Flower's Ray simulation (``flwr.simulation.start_simulation``, its Ray backend): the same model
(raysplit's cnn_small), the same data (Fashion-MNIST IDX files through raysplit.data, IID over the same clients with
raysplit's partition RNG), the same participation and the same local work (``steps`` SGD batches of ``batch``
images per sampled client). The client data is loaded once per Flower actor process and cached. Prints one JSON
line with the wall time of every round (configure_fit -> aggregate_fit done).

    .flower-venv/bin/python -c "import flower_side; flower_side.main()" --rounds 8   (cwd: benchmarks/)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # raysplit's data and model code (plain numpy/torch, no Ray imported)

SEED = 0


@functools.lru_cache(maxsize=4)
def client_data(num_clients: int):
    """(x, y, per-client train indices): raysplit.experiment.prepare's partition for data.partition.name=iid,
    data.test_fraction=0 (same RNG stream)."""
    import numpy as np

    from raysplit.data import client_train_test_split, load_dataset, partition

    b = load_dataset("fashion_mnist")
    rng = np.random.default_rng([SEED, 1])
    parts = partition("iid", np.asarray(b.y_train), num_clients, rng)
    train_idx, _ = client_train_test_split(parts, 0.0, rng)
    return b.x_train, np.asarray(b.y_train, dtype=np.int64), train_idx, b.spec


def build():
    import torch

    from raysplit.models import build_model

    torch.manual_seed(SEED)
    return build_model("cnn_small", 10, (1, 28, 28))


def make_client_fn(num_clients: int, steps: int, batch: int, lr: float):
    from flwr.client import NumPyClient

    class FedAvgClient(NumPyClient):
        def __init__(self, cid: int):
            self.cid = cid

        def fit(self, parameters, config):
            import numpy as np
            import torch
            import torch.nn.functional as F

            from raysplit.data import to_tensor

            torch.set_num_threads(1)
            x_all, y_all, idx, spec = client_data(num_clients)
            model = build()
            model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in
                                   zip(model.state_dict().keys(), parameters)})
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            mine = idx[self.cid]
            perm = np.random.default_rng([SEED, self.cid, int(config.get("round", 0))]).permutation(mine)
            for s in range(steps):
                b = perm[(s * batch) % len(perm):][:batch]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(to_tensor(x_all[b], spec)), torch.as_tensor(y_all[b])).backward()
                opt.step()
            return [v.detach().numpy() for v in model.state_dict().values()], len(mine), {}

    def client_fn(context):
        return FedAvgClient(int(context.node_config["partition-id"])).to_client()

    return client_fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--actors", type=int, default=2, help="concurrent Flower client actors (num_cpus each 1)")
    a = ap.parse_args(sys.argv[1:])
    import flwr as fl
    from flwr.common import ndarrays_to_parameters
    from flwr.server.strategy import FedAvg

    marks: list[tuple[str, float]] = []

    class TimedFedAvg(FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):
            marks.append(("start", time.perf_counter()))
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):
            out = super().aggregate_fit(server_round, results, failures)
            marks.append(("end", time.perf_counter()))
            if failures:
                print(f"round {server_round}: {len(failures)} failures: {failures[:1]}", file=sys.stderr)
            return out

    per_round = max(1, int(round(a.fraction * a.clients)))
    init = [v.detach().numpy() for v in build().state_dict().values()]
    strategy = TimedFedAvg(fraction_fit=a.fraction, fraction_evaluate=0.0, min_fit_clients=per_round,
                           min_evaluate_clients=0, min_available_clients=a.clients,
                           initial_parameters=ndarrays_to_parameters(init),
                           on_fit_config_fn=lambda r: {"round": r})
    t0 = time.perf_counter()
    fl.simulation.start_simulation(
        client_fn=make_client_fn(a.clients, a.steps, a.batch, a.lr), num_clients=a.clients,
        config=fl.server.ServerConfig(num_rounds=a.rounds), strategy=strategy,
        client_resources={"num_cpus": 1, "num_gpus": 0.0},
        ray_init_args={"num_cpus": a.actors, "include_dashboard": False, "log_to_driver": False,
                       "runtime_env": {"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"),
                                                                                   str(ROOT)])}}},
    )
    total = time.perf_counter() - t0
    starts = [t for k, t in marks if k == "start"]
    ends = [t for k, t in marks if k == "end"]
    rounds = [e - s for s, e in zip(starts, ends)]
    print("FLOWER_RESULT " + json.dumps({"round_s": rounds, "total_s": total, "flwr": fl.__version__,
                                         "clients_per_round": per_round}))


if __name__ == "__main__":
    main()
