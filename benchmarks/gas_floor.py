"""GAS at its compute floor (issue 29 items 2 and 3): wall seconds per global round of raysplit's GAS, local and
through Ray, against a plain single-process loop doing the same forwards, backwards and steps, and against the
authors' code (eejiarong/GAS), all in one run of this script, every side evaluating on the full test set every
round as the authors' code does.

    .venv/bin/python benchmarks/gas_floor.py --authors /path/to/eejiarong/GAS [--rounds 3] [--tag gas_floor]

The setting is configs/gas/fmnist.yaml (Fashion-MNIST, shards 2, 20 clients, 10 active, 20 local iterations of
32, AlexNet split at L2, full covariance) with ``eval.every=1``. The sides, in this order:

- **floor**: one plain process, no Ray, no raysplit runtime, torch with the machine's cores. One global round is
  GAS's work without generation: 10 clients (the round's sample) take their 20 iterations round-robin (one batch
  of each in turn, as the concurrent clients interleave), each a client forward, the server's forward with the
  client's logit adjustment and the backward to the activation only (the server's parameters frozen), the
  client's backward, clipping at 10 and SGD step; every 10 activations (the buffer) the server takes one step on
  them, topped up to 32 samples per label with random activations of the right shape (the batch GAS's server
  steps on, without the Gaussian statistics and sampling that make the generated ones); the 10 client models are
  averaged; then the test set is evaluated (batches of 1,000).
- **floor1**: the floor with 1 torch thread (what threads are worth to the plain loop).
- **raysplit local**: ``runtime.backend=local`` with the defaults (1 torch thread); **local_auto** with
  ``runtime.torch_threads=auto`` (the machine's cores); **local_nogen** as local_auto with
  ``algorithm.generate=false`` (no Gaussian statistics nor sampling: the server steps on the real activations
  only, a smaller batch than the floor's, so it bounds what generation costs from above).
- **raysplit Ray**: the config as a user runs it (Ray, two client actors, the defaults: 1 thread per actor);
  **ray_auto** with ``runtime.torch_threads=auto``.
- **authors**: GAS_main.py as benchmarks/gas_vs_authors.py prepares it, testing every round
  (``Accu_Test_Frequency = 1``), torch's default threads.

Rounds differ in how many server updates they hold (arrivals differ; the floor's always hold 20), so beside each
side's median round the script reports seconds per server update over rounds 2.. (evaluation included on every
side), and the ratios to the floor and to the authors' code on it. The first round (start-up) is left out.
Writes benchmarks/out/TAG.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import resolved_at_start  # noqa: E402
from gas_vs_authors import prepare_authors, time_authors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs/gas/fmnist.yaml"


def floor(rounds: int, threads: int | None = None) -> tuple[list[float], list[int], list[float]]:
    """The plain loop: per-round wall seconds, server updates and evaluation seconds; torch with ``threads``
    threads (None: the machine's cores)."""
    from raysplit.config import load_config
    from raysplit.data import to_tensor
    from raysplit.experiment import prepare
    from raysplit.runtime.driver.api import machine_cores

    torch.set_num_threads(threads or machine_cores())
    cfg = load_config(CONFIG, {"train.rounds": rounds, "tracking.enabled": False, "tracking.progress": False})
    p = prepare(cfg)
    plan = p.inputs.plan
    spec = plan.model.inputs
    x, y = p.inputs.train_data["x"], p.inputs.train_data["y"]
    xt, yt = p.inputs.test_data["x"], p.inputs.test_data["y"]
    idx = [np.asarray(ix) for ix in p.inputs.train_idx]
    client, server = plan.parts()
    client.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in p.inputs.client_init.items()})
    server.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in p.inputs.server_init.items()})
    o = cfg.train.optimizer
    opt = dict(lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    clip = cfg.train.clip_grad_norm
    server_opt = torch.optim.SGD(server.parameters(), **opt)
    counts = np.asarray(p.partition_counts, dtype=np.float64)
    adjust = torch.as_tensor(np.log(counts / counts.sum(1, keepdims=True) + 1e-12), dtype=torch.float32)
    labels, per_label, bs, steps = plan.model.num_classes, cfg.train.batch_size, cfg.train.batch_size, cfg.train.local_steps
    rng = np.random.default_rng(0)
    times, updates, evals = [], [], []
    for rnd in range(rounds):
        t0 = time.perf_counter()
        active = [int(c) for c in p.sample_stream[rnd]]
        models = {c: copy.deepcopy(client) for c in active}
        opts = {c: torch.optim.SGD(models[c].parameters(), **opt) for c in active}
        buffer, n_updates = [], 0
        for _ in range(steps):
            for c in active:
                b = rng.choice(idx[c], bs, replace=len(idx[c]) < bs)
                xb, yb = to_tensor(x[b], spec), torch.as_tensor(y[b], dtype=torch.long)
                act = models[c](xb)
                sent = act.detach().requires_grad_(True)
                loss = F.cross_entropy(server(sent) + adjust[c], yb)
                (g,) = torch.autograd.grad(loss, [sent])  # the input's gradient only: the server is frozen
                opts[c].zero_grad()
                act.backward(g)
                torch.nn.utils.clip_grad_norm_(models[c].parameters(), clip)
                opts[c].step()
                buffer.append((sent.detach(), yb))
                if len(buffer) == len(active):
                    xs, ys = torch.cat([a for a, _ in buffer]), torch.cat([t for _, t in buffer])
                    need = np.maximum(per_label - np.bincount(ys.numpy(), minlength=labels), 0)
                    if need.sum():
                        xs = torch.cat([xs, torch.randn(int(need.sum()), *xs.shape[1:])])
                        ys = torch.cat([ys, torch.as_tensor(np.repeat(np.arange(labels), need))])
                    server_opt.zero_grad()
                    F.cross_entropy(server(xs), ys).backward()
                    torch.nn.utils.clip_grad_norm_(server.parameters(), clip)
                    server_opt.step()
                    buffer, n_updates = [], n_updates + 1
        states = [models[c].state_dict() for c in active]
        client.load_state_dict({k: torch.stack([s[k].float() for s in states]).mean(0).to(v.dtype)
                                for k, v in client.state_dict().items()})
        te = time.perf_counter()
        with torch.no_grad():
            client.eval(), server.eval()
            correct = sum(int((server(client(to_tensor(xt[i:i + 1000], spec))).argmax(1)
                               == torch.as_tensor(yt[i:i + 1000])).sum()) for i in range(0, len(yt), 1000))
            client.train(), server.train()
        t1 = time.perf_counter()
        times.append(t1 - t0), updates.append(n_updates), evals.append(t1 - te)
        print(f"floor round {rnd}: {t1 - t0:.2f} s ({t1 - te:.2f} s evaluation, accuracy {correct / len(yt):.3f})",
              flush=True)
    return times, updates, evals


def raysplit_side(over: dict, rounds: int, work: Path) -> tuple[list[float], list[int], dict]:
    """A raysplit run of the config (eval every round, ``over`` on top): per-round wall seconds (``on_round``
    marks), server updates, and what the backend resolved."""
    from raysplit.config import load_config
    from raysplit.experiment import run_experiment

    cfg = load_config(CONFIG, {"train.rounds": rounds, "eval.every": 1, "tracking.enabled": False,
                               "tracking.progress": False, "tracking.checkpoint_every": 0,
                               "tracking.output_dir": str(work / "out"), **over})
    marks, ups = [time.perf_counter()], []
    with resolved_at_start() as resolved:
        run_experiment(cfg, on_round=lambda r, m: (marks.append(time.perf_counter()),
                                                   ups.append(int(m.get("method/server_updates", 0)))))
    return [b - a for a, b in zip(marks, marks[1:])], ups, resolved


def summary(times: list[float], updates: list[int]) -> dict:
    rest, ups = (times[1:], updates[1:]) if len(times) > 1 else (times, updates)
    return {"rounds": times, "server_updates": updates, "median_s": statistics.median(rest),
            "s_per_server_update": sum(rest) / max(sum(ups), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--authors", type=Path, help="a checkout of eejiarong/GAS (not part of this repository)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sides", nargs="*", default=["floor", "floor1", "local", "local_auto", "local_nogen", "ray",
                                                   "ray_auto", "authors"])
    ap.add_argument("--tag", default="gas_floor")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    work = Path(tempfile.mkdtemp(prefix="gas-floor-"))
    out: dict = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}, "sides": {}}
    local = {"runtime.backend": "local"}
    sides = {"local": local, "local_auto": {**local, "runtime.torch_threads": "auto"},
             "local_nogen": {**local, "runtime.torch_threads": "auto", "algorithm.generate": False},
             "ray": {}, "ray_auto": {"runtime.torch_threads": "auto"}}
    for side in args.sides:
        if side in ("floor", "floor1"):
            t, u, ev = floor(args.rounds, 1 if side == "floor1" else None)
            out["sides"][side] = {**summary(t, u), "eval_s": ev}
        elif side == "authors":
            if not args.authors:
                continue
            code = prepare_authors(args.authors, args.rounds, work, test_every=1)
            out["sides"]["authors"] = summary(*time_authors(code, 3600.0))
        else:
            t, u, res = raysplit_side(sides[side], args.rounds, work)
            out["sides"][side] = {**summary(t, u), "resolved": res}
        print(side, json.dumps({k: v for k, v in out["sides"].get(side, {}).items()}), flush=True)
    out["machine"]["load_after"] = os.getloadavg()
    s = out["sides"]
    names = {"floor": "plain loop (the floor), the machine's cores", "floor1": "plain loop, 1 torch thread",
             "local": "raysplit, local backend (defaults: 1 thread)",
             "local_auto": "raysplit, local backend, `runtime.torch_threads=auto`",
             "local_nogen": "raysplit, local backend, `auto`, `algorithm.generate=false`",
             "ray": "raysplit, Ray (defaults: 1 thread per actor)", "ray_auto": "raysplit, Ray, `auto`",
             "authors": "authors' GAS_main.py"}
    lines = [f"load average {out['machine']['load_before'][0]:.2f} before, {out['machine']['load_after'][0]:.2f} "
             f"after; {os.cpu_count()} CPUs", "",
             "| side | rounds (s) | median round (s) | s per server update | / floor | authors / side |",
             "|---|---|---|---|---|---|"]
    for k, v in s.items():
        ratio = v["s_per_server_update"] / s["floor"]["s_per_server_update"] if "floor" in s else float("nan")
        vs = s["authors"]["s_per_server_update"] / v["s_per_server_update"] if "authors" in s else float("nan")
        lines.append(f"| {names[k]} | {', '.join(f'{x:.1f}' for x in v['rounds'])} | {v['median_s']:.2f} | "
                     f"{v['s_per_server_update']:.3f} | {ratio:.2f} | {vs:.2f} |")
    print("\n".join(lines))
    dest = ROOT / "benchmarks" / "out"
    dest.mkdir(exist_ok=True)
    (dest / f"{args.tag}.json").write_text(json.dumps(out, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
