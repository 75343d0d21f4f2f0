"""Runtime at scale (issue 15): placement by load, forwards bounded per client actor, client state spilled to disk.
Each changes where or when work runs, never what it computes: results are checked equal, bit for bit."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from helpers import assert_identical_runs, make_config, run_rounds
from raysplit.runtime.driver import placement
from raysplit.runtime.server import stepping
from raysplit.runtime.spill import SpillStore, nbytes


# ---- placement ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_assign_is_balanced_sticky_and_deterministic(seed):
    rng = np.random.default_rng(seed)
    v, w = int(rng.integers(5, 200)), int(rng.integers(1, 7))
    holders = rng.integers(0, w, v)
    clients = rng.choice(v, int(rng.integers(1, v + 1)), replace=False).tolist()
    out = placement.assign(clients, w, holders)
    assert sorted(out) == sorted(clients)
    load = Counter(out.values())
    share = len(clients) / w
    assert all(abs(load.get(k, 0) - share) < 1 for k in range(w)), (load, share)
    assert out == placement.assign(list(reversed(clients)), w, holders.copy())  # order of the sample is irrelevant
    # a client leaves its holder only when its holder has more of the round's clients than its share allows
    by_holder = Counter(int(holders[c]) for c in clients)
    for c, k in out.items():
        if k != holders[c]:
            assert by_holder[int(holders[c])] > int(np.floor(share)), (c, by_holder)


def test_assign_keeps_a_balanced_round_where_it_is():
    holders = np.array([0, 1, 0, 1, 0, 1])
    assert placement.assign([0, 1, 2, 3], 2, holders) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert placement.assign([0, 2, 4, 1], 2, holders) == {0: 0, 2: 0, 4: 1, 1: 1}  # 4 moves: worker 0 had three


# ---- the forward window ------------------------------------------------------------------------------------------
def _in_flight(plan, route, window):
    """The peak number of forwards submitted and not yet served, per worker, under stepping.schedule."""
    live, peak = Counter(), Counter()
    for a in stepping.schedule(plan, route.__getitem__, window):
        s = plan[a[1]]
        w = route[s.client]
        if a[0] == "fwd":
            live[w] += 1
        else:
            live[w] -= 1
            live[w] += a[2]
        peak[w] = max(peak[w], live[w])
    return peak


@pytest.mark.parametrize("order", ["consecutive", "interleaved"])
def test_schedule_bounds_forwards_per_worker_by_the_window(order):
    clients = list(range(40))
    seq = [c for c in clients for _ in range(3)] if order == "consecutive" else clients * 3
    plan = stepping.plan_steps(seq, 0, {})
    route = {c: c % 2 for c in clients}
    unbounded = _in_flight(plan, route, None)
    assert unbounded[0] == 20  # every client's first forward at once: O(clients per round)
    for window in (1, 2, 4):
        peak = _in_flight(plan, route, window)
        assert max(peak.values()) <= window + 1, (window, peak)
    # every step served once, in plan order, each after its forward
    acts = stepping.schedule(plan, route.__getitem__, 2)
    served = [a[1] for a in acts if a[0] == "serve"]
    assert served == list(range(len(plan)))
    submitted = {a[1] for a in acts if a[0] == "fwd"} | {plan_next for a in acts if a[0] == "serve" and a[2]
                                                           for plan_next in [_next_index(plan, a[1])]}
    assert submitted == set(range(len(plan)))


def _next_index(plan, i):
    k = (plan[i].client, plan[i].tag.stream)
    return next(j for j in range(i + 1, len(plan)) if (plan[j].client, plan[j].tag.stream) == k)


def test_unbounded_schedule_is_the_old_one():
    """window None: every first forward up front, then each gradient with its client's next forward."""
    plan = stepping.plan_steps([0, 1, 0, 2, 1, 2], 0, {})
    acts = stepping.schedule(plan, lambda c: c % 2, None)
    assert acts == [("fwd", 0), ("fwd", 3), ("fwd", 1), ("serve", 0, True), ("serve", 1, True), ("serve", 2, False),
                    ("serve", 3, True), ("serve", 4, False), ("serve", 5, False)]


# ---- results do not depend on where or when clients run ----------------------------------------------------------
@pytest.mark.parametrize("algorithm", [{"name": "psl"}, {"name": "sflv2", "order": "random"}, {"name": "fedavg"}],
                         ids=lambda a: "-".join(a.values()))
def test_results_do_not_depend_on_the_number_of_workers_the_placement_or_the_window(tmp_path, mlflow_uri, algorithm):
    over = {"algorithm": algorithm, "train.rounds": 3, "train.local_steps": 3, "data.num_clients": 9,
            "train.participation": {"fraction": 0.67}, "train.optimizer.momentum": 0.9, "runtime.backend": "local"}
    ref = run_rounds(make_config(tmp_path, mlflow_uri, **over, **{"runtime.num_workers": 1}))
    for extra in ({"runtime.num_workers": 2}, {"runtime.num_workers": 3, "runtime.transport.window": 1},
                  {"runtime.num_workers": 4, "runtime.placement.strategy": "home", "runtime.transport.window": None}):
        assert_identical_runs(ref, run_rounds(make_config(tmp_path, mlflow_uri, **over, **extra)))


def test_through_ray_placement_moves_client_state_and_results_equal_one_local_worker(ray_session, tmp_path,
                                                                                     mlflow_uri):
    """PSL keeps every client's own model and optimizer state: under balanced placement they move between client
    actors (checked: some do), and the run equals a single in-process worker's bit for bit."""
    over = {"algorithm.name": "psl", "train.rounds": 3, "train.local_steps": 2, "data.num_clients": 8,
            "train.participation": {"fraction": 0.5}, "train.optimizer.momentum": 0.9}
    ref = run_rounds(make_config(tmp_path, mlflow_uri, **over, **{"runtime.backend": "local",
                                                                   "runtime.num_workers": 1}))
    moved = []
    orig = placement.assign

    def spy(clients, w, holders):
        out = orig(clients, w, holders)
        moved.extend(c for c, k in out.items() if k != holders[c])
        return out

    placement.assign = spy
    try:
        got = run_rounds(make_config(tmp_path, mlflow_uri, **over, **{"runtime.transport.window": 1}))
    finally:
        placement.assign = orig
    assert moved, "no client moved: the test does not exercise moving state"
    assert_identical_runs(ref, got)


# ---- spilled client state ----------------------------------------------------------------------------------------
def _value(seed, n=1000):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "state": {0: {"momentum_buffer": torch.randn(n, generator=g)}},
            "step": seed}


def test_spill_store_keeps_the_budget_and_gives_back_what_it_spilled(tmp_path):
    one = nbytes(_value(0))
    store = SpillStore(budget_bytes=3 * one, directory=str(tmp_path))
    own = store.view("own")
    for c in range(10):
        own[c] = _value(c)
        assert store.bytes_in_memory <= 3 * one
    assert store.spills == 7 and len(own) == 10 and set(own) == set(range(10))
    assert len(list(tmp_path.glob("raysplit-spill-*/own-*.pt"))) == 7
    for c in (0, 5, 9, 2):  # spilled and in-memory values alike come back equal
        v = own[c]
        ref = _value(c)
        assert torch.equal(v["w"], ref["w"]) and v["step"] == c
        assert torch.equal(v["state"][0]["momentum_buffer"], ref["state"][0]["momentum_buffer"])
        assert store.bytes_in_memory <= 3 * one
    before = store.loads
    assert torch.equal(own.peek(7)["w"], _value(7)["w"])  # a snapshot reads it without taking it into memory
    assert store.loads == before + 1 and ("own", 7) not in store._mem
    assert torch.equal(own.pop(7)["w"], _value(7)["w"]) and 7 not in own and len(own) == 9
    own.clear()
    assert len(own) == 0 and not list(tmp_path.glob("raysplit-spill-*/*.pt"))
    store.close()
    assert not list(tmp_path.glob("raysplit-spill-*"))


def test_spilled_client_state_changes_nothing_but_memory(tmp_path, mlflow_uri):
    """PSL with momentum keeps a model and an optimizer state per client; with a budget of a few clients' worth the
    rest goes to disk and back, and the run is bit for bit the unlimited one."""
    over = {"algorithm.name": "psl", "train.rounds": 6, "train.local_steps": 2, "data.num_clients": 10,
            "train.participation": {"fraction": 0.6}, "train.optimizer.momentum": 0.9, "runtime.backend": "local"}
    ref = run_rounds(make_config(tmp_path, mlflow_uri, **over))
    stores = []
    from raysplit.runtime.client import states as hosts

    orig = hosts.SpillStore

    def spy(*a, **k):
        stores.append(orig(*a, **k))
        return stores[-1]

    hosts.SpillStore = spy
    try:
        got = run_rounds(make_config(tmp_path, mlflow_uri, **over, **{"runtime.placement.client_state_mb": 0.004,
                                                                       "runtime.placement.spill_dir": str(tmp_path / "spill")}))
    finally:
        hosts.SpillStore = orig
    assert sum(s.spills for s in stores) > 0 and sum(s.loads for s in stores) > 0
    assert all(s.bytes_in_memory <= 0.004 * 2**20 + 3_000 for s in stores)  # budget + the value in use
    assert_identical_runs(ref, got)
