"""SplitFed V1 + FedProx (raysplit/algorithms/sflprox.py, the worked example of docs/extending.md)."""

from __future__ import annotations

import torch

from helpers import assert_identical_runs, make_config, run_rounds
from raysplit.runtime import StateMsg

LOCAL = {"runtime.backend": "local", "train.rounds": 2, "train.local_steps": 3, "data.num_clients": 4,
         "train.optimizer.momentum": 0.9}


def test_mu_zero_is_splitfed_v1_bit_for_bit(tmp_path, mlflow_uri):
    v1 = run_rounds(make_config(tmp_path, mlflow_uri, **LOCAL, **{"algorithm": {"name": "sflv1"}}))
    prox = run_rounds(make_config(tmp_path, mlflow_uri, **LOCAL, **{"algorithm": {"name": "sflv1_prox", "mu": 0.0}}))
    assert_identical_runs(v1, prox)


def _drift(tmp_path, mlflow_uri, algorithm: dict) -> float:
    """How far one client's part moves in one round of 12 plain-SGD steps (one client: the FedAvg is its model)."""
    over = {**LOCAL, "algorithm": algorithm, "data.num_clients": 1, "train.rounds": 1, "train.local_steps": 12,
            "train.optimizer.momentum": 0.0, "train.optimizer.lr": 0.05}
    client, _, p, _ = run_rounds(make_config(tmp_path, mlflow_uri, **over))
    start = StateMsg(p.inputs.client_init).tensors()
    return float(torch.sqrt(sum(((client[k].double() - start[k].double()) ** 2).sum()
                                for k in client if client[k].is_floating_point())))


def test_the_proximal_term_holds_the_client_part_near_the_rounds_start(tmp_path, mlflow_uri):
    free = _drift(tmp_path, mlflow_uri, {"name": "sflv1"})
    held = [_drift(tmp_path, mlflow_uri, {"name": "sflv1_prox", "mu": mu}) for mu in (1.0, 5.0)]
    assert free > held[0] > held[1] > 0, (free, held)


def test_a_step_adds_mu_times_the_distance_to_the_rounds_start(tmp_path, mlflow_uri):
    from raysplit.experiment import prepare
    from raysplit.runtime import LocalBackend, Runtime

    p = prepare(make_config(tmp_path, mlflow_uri, **LOCAL, **{"algorithm": {"name": "sflv1_prox", "mu": 0.5},
                                                              "train.clip_grad_norm": None}))
    rt = Runtime(LocalBackend(1), p.inputs)
    host = rt.backend.workers[0]
    slot = host.slots.activate(0)
    params = list(slot.module.parameters())
    start = [q.detach().clone() for q in params]
    with torch.no_grad():
        for q in params:
            q.add_(torch.full_like(q, 0.1))  # the client has moved by 0.1 in every weight
    for q in params:
        q.grad = torch.ones_like(q)
    host.rule.before_step(0, slot)
    for q, s in zip(params, start):
        torch.testing.assert_close(q.grad, torch.ones_like(q) + 0.5 * (q.detach() - s))
    host.slots.release(0)
    assert 0 not in host.rule.anchor
