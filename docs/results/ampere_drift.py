"""Does SplitFed+SCAFFOLD lower the client drift in ampere.md's setting? (issue 28 item 4; ampere.md, section
"SplitFed+SCAFFOLD with plain SGD at every alpha").

The setting of that section's cut-fc1 arms: configs/ampere/fmnist.yaml at alpha 0.1, cut after fc1 (the devices hold
99.4 % of the model), plain SGD at lr 0.02, one local epoch a round; SplitFed (``sflv1``) and SplitFed+SCAFFOLD
(``sflv1_scaffold``) from the same start, seeds 0-2, the first ``--rounds`` rounds (the page's runs have 60). The
drift of a round is the mean over the 10 devices of the squared distance between the device block a device brings to
aggregation and the mean of those blocks (as tests/test_ampere.py's test_scaffold_lowers_the_client_drift measures
it); the script also prints each arm's test accuracy at its last round. It reads the blocks in the local backend by
wrapping the client host's partial sum, which is why it is a script here and not a runtime metric. Cached per run
under docs/results/.ampere_runs/drift_*.json.

    python docs/results/ampere_drift.py --rounds 60 --seeds 0 1 2     # prints ampere.md's drift table
    python docs/results/ampere_drift.py --correction 5 20 60 --seeds 0 1 2   # what the correction does to a round

``--correction R ...`` asks why less drift buys no accuracy: SplitFed+SCAFFOLD runs to each round R, and round R
is run twice from the same state (the hosts' and the driver's, restored with the runtime's own ``state_dict``):
with the correction, and with it switched off (the server's ``c`` emptied for that round, so every client steps
on its raw gradients: SplitFed's round from SCAFFOLD's point). It prints how far the two rounds' global updates
(the whole model: the averaged device block and the server block) are apart relative to the update, their cosine,
and the drift of each round, per seed; the run then goes on from the restored state with the correction. A third
run of each round with the correction must give the first's model exactly (checked). Cached per seed under
docs/results/.ampere_runs/correction_*.json.

Each run's result is also kept as a committed record (docs/results/records/ampere_runs/, ``_runs.kept``, kind
script: a digest of what makes it), from which a machine without the cache restores it instead of rerunning.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import numpy as np
import torch
from _runs import ROOT, kept, median_range

ARMS = (("SplitFed", "sflv1"), ("SplitFed+SCAFFOLD", "sflv1_scaffold"))
OVERRIDES = {"data.partition.alpha": 0.1, "model.cut": "fc1", "train.optimizer.momentum": 0.0,
             "train.optimizer.lr": 0.02, "runtime.backend": "local", "tracking.progress": False}


def drift(states: dict) -> float:
    keys = next(iter(states.values()))
    stacks = (torch.stack([st[k].float() for st in states.values()]) for k in keys)
    return sum(float(((s - s.mean(0)) ** 2).sum()) for s in stacks) / len(states)


@contextmanager
def spied_run(name: str, seed: int, rounds: int):
    """The page's setting for ``name`` in the local backend, with the client host's partial sum wrapped so that
    ``brought[r][c]`` holds a copy of the device block client ``c`` brings to round ``r``'s aggregation. Yields
    ``(runtime, driver, brought)``; shuts the runtime down and unwraps the host on leaving."""
    from raysplit.config import load_config
    from raysplit.experiment import prepare
    from raysplit.runtime import runtime_for
    from raysplit.runtime.client.host import ClientHost

    brought: dict[int, dict] = {}
    partial_sum = ClientHost.partial_sum

    def spy(self, weights):
        brought.setdefault(self.round, {}).update({int(c): {k: v.clone() for k, v in self.states.state_of(int(c)).items()}
                                                   for c in weights if int(c) in self.data})
        return partial_sum(self, weights)

    ClientHost.partial_sum = spy
    try:
        cfg = load_config(str(ROOT / "configs/ampere/fmnist.yaml"),
                          {**OVERRIDES, "algorithm": {"name": name}, "seed": seed, "train.rounds": rounds})
        p = prepare(cfg)
        rt = runtime_for(cfg.runtime, p.inputs)
        try:
            yield rt, p.algorithm.driver(rt, p.algorithm, p.sample_stream, cfg.seed), brought
        finally:
            rt.shutdown()
    finally:
        ClientHost.partial_sum = partial_sum


def one(name: str, seed: int, rounds: int) -> dict:
    with spied_run(name, seed, rounds) as (rt, driver, brought):
        driver.run(0, rounds, lambda r, st: None)
        y_true, y_pred, _ = rt.evaluate_global(driver.global_handle)
        acc = float(np.mean(np.asarray(y_true) == np.asarray(y_pred)))
    return {"drift": [drift(brought[r]) for r in range(rounds)], "accuracy": acc}


def correction_effect(seed: int, at: list[int]) -> list[dict]:
    """Round ``r`` (0-based: the rounds before it done) of SplitFed+SCAFFOLD, for each ``r`` in ``at``, with and
    without the correction from the same state: the global update's relative difference and cosine, and the
    drift of each (module docstring)."""
    from raysplit.runtime import transport
    from raysplit.runtime.state import owned

    out, done = [], 0
    with spied_run("sflv1_scaffold", seed, max(at) + 1) as (rt, driver, brought):
        server = rt.backend.server

        def model() -> torch.Tensor:  # the global model, flat: device block then server block
            dev = transport.unpack_state(rt.get(driver.global_handle).state)
            srv = transport.unpack_state(rt.get(rt.server.get_state()).state)
            return torch.cat([t.float().flatten() for st in (dev, srv) for t in st.values()])

        def one_round(r: int) -> tuple[torch.Tensor, float]:
            brought.clear()
            driver.run(r, r + 1, lambda *a: None)
            return model(), drift(brought[r])

        for r in sorted(at):
            driver.run(done, r, lambda *a: None)
            hosts, drv, x = owned(rt.state_dict()), owned(driver.state_dict()), model()
            with_c, drift_c = one_round(r)
            rt.load_state_dict(owned(hosts)), driver.load_state_dict(owned(drv))
            server.control = {}  # this round without the correction: c = 0 reaches the clients
            without, drift_0 = one_round(r)
            rt.load_state_dict(owned(hosts)), driver.load_state_dict(owned(drv))
            again, _ = one_round(r)  # the restored state reruns the round exactly; the run goes on from here
            assert torch.equal(again, with_c), f"seed {seed} round {r}: the restored round differs"
            d_c, d_0 = with_c - x, without - x
            out.append({"round": r + 1, "rel": float((d_c - d_0).norm() / d_0.norm()),
                        "cos": float(torch.nn.functional.cosine_similarity(d_c, d_0, dim=0)),
                        "update": float(d_0.norm()), "update_with": float(d_c.norm()),
                        "drift_with": drift_c, "drift_without": drift_0})
            done = r + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--correction", type=int, nargs="*", default=None,
                    help="rounds (1-based) at which to run SCAFFOLD's round with and without its correction")
    a = ap.parse_args()
    cache = ROOT / "docs/results/.ampere_runs"
    cache.mkdir(parents=True, exist_ok=True)
    if a.correction:
        at = sorted(r - 1 for r in a.correction)
        print("| seed | round | global update with minus without the correction, relative to the update | cosine | "
              "update norm without | with | drift without | with |\n|---|---|---|---|---|---|---|---|")
        for s in a.seeds:
            f = cache / f"correction_s{s}_at{'-'.join(str(r + 1) for r in at)}.json"
            spec = {"study": "correction", "seed": s, "at": [r + 1 for r in at], "overrides": OVERRIDES}
            for row in kept(f, "ampere-drift", f"SCAFFOLD's correction seed {s}", spec,
                            lambda: correction_effect(s, at)):
                print(f"| {s} | {row['round']} | {row['rel']:.4f} | {row['cos']:.4f} | {row['update']:.4f} | "
                      f"{row['update_with']:.4f} | {row['drift_without']:.4f} | {row['drift_with']:.4f} |")
        return
    res = {}
    for label, name in ARMS:
        for s in a.seeds:
            f = cache / f"drift_{name}_r{a.rounds}_s{s}.json"
            spec = {"study": "drift", "algorithm": name, "seed": s, "rounds": a.rounds, "overrides": OVERRIDES}
            res[(label, s)] = kept(f, "ampere-drift", f"{label} drift seed {s}", spec,
                                   lambda: one(name, s, a.rounds))
    at = sorted({r for r in (1, 2, 5, 10, 20, a.rounds) if r <= a.rounds})
    print("| arm | " + " | ".join(f"drift at round {r}" for r in at) + f" | accuracy at round {a.rounds} (%) |")
    print("|---" * (len(at) + 2) + "|")
    for label, _ in ARMS:
        cells = [median_range([res[(label, s)]["drift"][r - 1] for s in a.seeds], ".4f") for r in at]
        acc = median_range([100 * res[(label, s)]["accuracy"] for s in a.seeds])
        print(f"| {label} | " + " | ".join(cells) + f" | {acc} |")
    ratio = [np.mean([res[(ARMS[1][0], s)]["drift"][r] / res[(ARMS[0][0], s)]["drift"][r]
                      for r in range(1, a.rounds)]) for s in a.seeds]
    diff = [100 * (res[(ARMS[1][0], s)]["accuracy"] - res[(ARMS[0][0], s)]["accuracy"]) for s in a.seeds]
    print(f"\nSCAFFOLD's drift over SplitFed's, mean over rounds 2-{a.rounds}, per seed: "
          + ", ".join(f"{x:.3f}" for x in ratio) + f"; median {np.median(ratio):.3f}")
    print(f"SCAFFOLD minus SplitFed at round {a.rounds}, paired by seed: {median_range(diff, '+.2f')} "
          f"({', '.join(f'{x:+.2f}' for x in diff)})")


if __name__ == "__main__":
    main()
