"""raysplit's own cost per step (issue 70 item 3): what a training step costs through raysplit beyond the same
arithmetic in a plain PyTorch loop, on a model whose own step is a fraction of a millisecond, so that what is left
is raysplit's (its hosts, messages, screening, clocks, the driver) and, over Ray, the actors and channels.

The setting: scikit-learn's digits (8x8), cnn_small narrowed to channels (4, 8) and hidden 32, cut at conv1, batch 16, 4 clients, ``--steps`` local steps a
client a round (two counts), one torch thread everywhere (what an actor gets). Arms, per method:

- **plain**: one process, no hosts, no runtime: overhead.py's :class:`Reference` (SFLV2: one server model, clients
  in order; SFLV1: per-client server copies averaged, FedAvg of the clients; PSL: the copies averaged, every client
  keeping its own model), the same batches, optimizers and order; after the timed rounds its server weights are
  compared with the local backend's, which ran the same rounds, so "the same arithmetic" is checked, not assumed.
  For GAS (``generate: false``, uniform weights, the statistics still kept) the plain loop is GAS's compute: the
  active clients' iterations round-robin, each a client forward, the frozen server pass with the client's logit
  adjustment, the client's backward and step; every ``buffer`` arrivals the label statistics absorb the buffer
  (raysplit/gaussian.py, the building block GAS uses) and the server steps on it; the uploads averaged.
- **local**: ``runtime.backend: local`` (one process, the hosts handing each other tensors).
- **ray**: ``runtime.backend: ray``, compiled graphs, the server actor driving one client actor.

Every repetition times one round of each arm back to back (interleaved: one load for all; the Ray arm's actors
stopped while the others are timed, since idle compiled-graph actors poll their channels), ``--rounds`` times after
``--warmup`` rounds, at two step counts (``--steps``). An arm's cost over the plain loop is split in two from the
median round excess at each count: per step (the slope: what each split step costs beyond its arithmetic, the
figure the targets are about: local within 0.2 ms, Ray within 1 ms) and per round (the intercept: beginning and
ending the round, aggregation, the clocks).

    .venv/bin/python benchmarks/step_cost.py [--methods sflv2 sflv1 psl gas] [--steps 10 40] [--rounds 7]

Writes benchmarks/out/step_cost.json.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time

import numpy as np
import torch
import torch.nn.functional as F

from common import load, mmm, save
from overhead import RaysplitRounds, Reference, timed

from raysplit.config import load_config
from raysplit.data import to_tensor
from raysplit.experiment import prepare
from raysplit.gaussian import LabelGaussian
from raysplit.runtime import runtime_for

TARGET_MS = {"local": 0.2, "ray": 1.0}


def make_cfg(method: str, backend: str, steps: int, clients: int):
    over = {
        "name": f"step-cost-{method}", "seed": 0,
        "algorithm": {"name": method, **({"order": "fixed"} if method == "sflv2" else {}),
                      **({"generate": False, "weighting": "uniform"} if method == "gas" else {})},
        "data.dataset": "digits", "data.num_clients": clients, "data.partition.name": "iid",
        "data.test_fraction": 0.1, "data.max_test_samples": 100,
        "model.name": "cnn_small", "model.cut": "conv1", "model.options": {"channels": [4, 8], "hidden": 32},
        "train.rounds": 1000, "train.batch_size": 16, "train.local_steps": steps,
        "train.optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "clock.profile": "uniform",
        "runtime.backend": backend, "runtime.num_workers": 1, "runtime.torch_threads": 1,
        "runtime.server.num_cpus": 1, "runtime.client.num_cpus": 0, "runtime.transport.kind": "compiled",
        "tracking.enabled": False, "tracking.progress": False,
    }
    if method == "gas":
        over["train.participation.count"] = clients
    return load_config(None, over)


class PlainGAS:
    """GAS's compute without its runtime (module docstring): the round's active clients round-robin from the global
    model, the frozen server pass with logit adjustment, the buffer's statistics and server step, the average."""

    def __init__(self, p):
        plan = p.inputs.plan
        self.spec = plan.model.inputs
        self.x, self.y = p.inputs.train_data["x"], p.inputs.train_data["y"]
        self.idx = [np.asarray(ix) for ix in p.inputs.train_idx]
        self.client, self.server = plan.parts()
        self.client.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in p.inputs.client_init.items()})
        self.server.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in p.inputs.server_init.items()})
        o = plan.sections.train.optimizer
        self.opt = dict(lr=o.lr, momentum=o.momentum)
        self.server_opt = torch.optim.SGD(self.server.parameters(), **self.opt)
        counts = np.asarray(p.partition_counts, dtype=np.float64)
        self.adjust = torch.as_tensor(np.log(counts / counts.sum(1, keepdims=True) + 1e-12), dtype=torch.float32)
        self.labels = plan.model.num_classes
        self.bs, self.steps = plan.sections.train.batch_size, plan.sections.train.local_steps
        self.stats = None
        self.rng = np.random.default_rng(0)

    def round(self, active: list[int]) -> int:
        models = {c: copy.deepcopy(self.client) for c in active}
        opts = {c: torch.optim.SGD(models[c].parameters(), **self.opt) for c in active}
        buffer, steps = [], 0
        for _ in range(self.steps):
            for c in active:
                b = self.rng.choice(self.idx[c], self.bs, replace=len(self.idx[c]) < self.bs)
                xb, yb = to_tensor(self.x[b], self.spec), torch.as_tensor(self.y[b], dtype=torch.long)
                act = models[c](xb)
                sent = act.detach().requires_grad_(True)
                loss = F.cross_entropy(self.server(sent) + self.adjust[c], yb)
                (g,) = torch.autograd.grad(loss, [sent])  # the input's gradient only: the server is frozen
                opts[c].zero_grad()
                act.backward(g)
                opts[c].step()
                buffer.append((sent.detach(), yb))
                steps += 1
                if len(buffer) == len(active):
                    self.flush(buffer)
                    buffer = []
        states = [models[c].state_dict() for c in active]
        self.client.load_state_dict({k: torch.stack([s[k].float() for s in states]).mean(0).to(v.dtype)
                                     for k, v in self.client.state_dict().items()})
        return steps

    def flush(self, buffer: list) -> None:
        xs, ys = torch.cat([a for a, _ in buffer]), torch.cat([t for _, t in buffer])
        flat, labels = xs.reshape(len(xs), -1).numpy(), ys.numpy()
        if self.stats is None:
            self.stats = [LabelGaussian(flat.shape[1], "full") for _ in range(self.labels)]
        for lab in np.unique(labels):
            self.stats[int(lab)].merge(flat[labels == lab], np.ones(int((labels == lab).sum())))
        self.server_opt.zero_grad()
        F.cross_entropy(self.server(xs), ys).backward()
        self.server_opt.step()


class EventRounds(RaysplitRounds):
    """An asynchronous method's rounds: the event loop up to each global model."""

    def round(self) -> int:
        stats = self.rt.run_events(self.r)
        self.r += 1
        return sum(int(c.get("steps", 0)) for c in stats.clients.values())


def run_method(method: str, a, steps: int) -> dict:
    p = prepare(make_cfg(method, "local", steps, a.clients))
    arms = {"local": (EventRounds if method == "gas" else RaysplitRounds)(make_cfg(method, "local", steps,
                                                                                   a.clients))}
    if not a.no_ray:
        arms["ray"] = (EventRounds if method == "gas" else RaysplitRounds)(make_cfg(method, "ray", steps,
                                                                                     a.clients))
    if method == "gas":
        plain = PlainGAS(p)
        r = [0]

        def plain_round():
            plain.round([int(c) for c in p.sample_stream[r[0]]] if p.sample_stream is not None else
                        list(range(a.clients)))
            r[0] += 1
    else:
        plain = Reference(p, method)
        r = [0]

        def plain_round():
            cl = [int(c) for c in p.sample_stream[r[0]]]
            plain.round(sorted(cl) if method == "sflv2" else cl, steps)
            r[0] += 1

    steps_per_round = a.clients * steps
    times = {"plain": [], **{k: [] for k in arms}}
    torch.set_num_threads(1)
    ray_arm = arms.get("ray")

    def others_paused():  # the compiled graphs' idle actors poll their channels: stopped while the others are timed
        return ray_arm.paused() if ray_arm is not None else contextlib.nullcontext()

    try:
        for _ in range(a.warmup):  # FLOPs counted, modules built, graphs compiled
            with others_paused():
                plain_round()
                arms["local"].round()
            if ray_arm is not None:
                ray_arm.round()
        for _ in range(a.rounds):
            with others_paused():
                times["plain"].append(timed(plain_round))
                times["local"].append(timed(arms["local"].round))
            if ray_arm is not None:
                times["ray"].append(timed(ray_arm.round))
        check = None
        if method != "gas":  # the same arithmetic: the local backend ran the plain loop's rounds
            s = arms["local"].server_state()
            check = max(float((s[k].double() - v.double()).abs().max()) for k, v in plain.server.state_dict().items())
    finally:
        for arm in arms.values():
            arm.rt.shutdown()
    out = {"steps_per_round": steps_per_round, "max_abs_weight_diff_plain_vs_local": check,
           "plain_ms_per_step": mmm([1e3 * t / steps_per_round for t in times["plain"]]), "raw": times}
    for k in arms:
        cost = [1e3 * (t - b) / steps_per_round for t, b in zip(times[k], times["plain"])]
        out[f"{k}_ms_per_step"] = mmm([1e3 * t / steps_per_round for t in times[k]])
        out[f"{k}_cost_ms_per_step"] = mmm(cost)
        out[f"{k}_met"] = bool(np.median(cost) <= TARGET_MS[k])
    return out


def per_step(low: dict, high: dict, arm: str, clients: int) -> dict:
    """An arm's cost over the plain loop split in two, from the rounds at two step counts: per step (the slope of the
    round's excess over the plain loop's, median excess at each count) and per round (what is left at no steps:
    beginning and ending the round, the aggregation, the clocks)."""
    ex = {r["steps_per_round"]: float(np.median(np.subtract(r["raw"][arm], r["raw"]["plain"]))) for r in (low, high)}
    (s1, e1), (s2, e2) = sorted(ex.items())
    slope = (e2 - e1) / (s2 - s1)
    return {"ms_per_step": 1e3 * slope, "ms_per_round": 1e3 * (e1 - slope * s1), "met": bool(1e3 * slope <= TARGET_MS[arm]),
            "excess_s": {str(k): v for k, v in ex.items()}}


def profile(method: str, steps: int, clients: int) -> int:
    """Where the local backend's time per step goes: cProfile over 5 rounds (after 2 to warm up)."""
    import cProfile
    import pstats

    torch.set_num_threads(1)
    arm = (EventRounds if method == "gas" else RaysplitRounds)(make_cfg(method, "local", steps, clients))
    for _ in range(2):
        arm.round()
    prof = cProfile.Profile()
    prof.enable()
    done = sum(int(arm.round() or clients * steps) for _ in range(5))
    prof.disable()
    st = pstats.Stats(prof)
    print(f"{method}: {st.total_calls} function calls in {done} client steps ({st.total_calls / done:.0f} a step), "
          f"{st.total_tt:.2f} s under the profiler")
    st.sort_stats("tottime").print_stats(15)
    arm.rt.shutdown()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["sflv2", "sflv1", "psl", "gas"])
    ap.add_argument("--steps", type=int, nargs=2, default=[10, 40], help="two counts of local steps a client a round")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7, help="timed repetitions")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true", help="the local backend only")
    ap.add_argument("--tag", default="step_cost")
    ap.add_argument("--profile", metavar="METHOD", help="instead: profile the local arm of METHOD (cProfile, the "
                    "larger --steps, 5 rounds after 2) and print its function calls and the top 15 by own time")
    a = ap.parse_args()
    if a.profile:
        return profile(a.profile, max(a.steps), a.clients)
    if not a.no_ray:
        import ray

        ray.init(num_cpus=4, object_store_memory=512 * 2**20, include_dashboard=False)
    load0, results = load(), {}
    arms = ["local"] + ([] if a.no_ray else ["ray"])
    print(f"load {load0}")
    print("| method | plain ms/step | " + " | ".join(f"{k}: ms/step over plain (target <= {TARGET_MS[k]:g}) | "
                                                     f"{k}: ms/round over plain" for k in arms)
          + " | weights plain vs local |")
    print("|---|---|" + "---|---|" * len(arms) + "---|")
    for m in a.methods:
        runs = [run_method(m, a, n) for n in a.steps]
        r = results[m] = {"at_steps": {str(n): run for n, run in zip(a.steps, runs)},
                          **{k: per_step(*runs, k, a.clients) for k in arms}}
        cells = [f"{r[k]['ms_per_step']:.3f} {'met' if r[k]['met'] else 'missed'} | {r[k]['ms_per_round']:.1f}"
                 for k in arms]
        w = [run["max_abs_weight_diff_plain_vs_local"] for run in runs]
        print(f"| {m} | {runs[-1]['plain_ms_per_step']['median']:.3f} | {' | '.join(cells)} | "
              f"{'-' if w[0] is None else f'{max(w):.1e}'} |", flush=True)
    if not a.no_ray:
        ray.shutdown()
    save(a.tag, {"args": vars(a), "results": results, "load_before": load0, "load_at_end": load(),
                 "time": time.strftime("%Y-%m-%d %H:%M")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
