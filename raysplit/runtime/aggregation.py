"""Weighted averaging of model and optimizer states: FedAvg of client parts (as partial sums on the hosting
workers, summed on the server), merging per-client server copies, averaging Hydra's heads. Pure torch/numpy (no
Ray); tested on their own in tests/test_aggregation.py."""

from __future__ import annotations

import copy

import numpy as np
import torch


def average_states(states: list[dict], weights: list[float]) -> dict[str, torch.Tensor]:
    """Weighted average of state dicts (integer buffers such as num_batches_tracked are rounded back)."""
    total = float(sum(weights))
    out = {}
    for k in states[0]:
        acc = sum(torch.as_tensor(s[k]).double() * (w / total) for s, w in zip(states, weights))
        ref = torch.as_tensor(states[0][k])
        out[k] = acc.round().to(ref.dtype) if not ref.is_floating_point() else acc.to(ref.dtype)
    return out


def average_optimizer_states(opt_states: list[dict], weights: list[float]) -> dict | None:
    """Weighted average of optimizer state dicts of identical parameter layouts (momentum buffers, Adam moments);
    None when the optimizer keeps no state (plain SGD)."""
    if not opt_states[0]["state"]:
        return None
    merged = copy.deepcopy(opt_states[0])
    for pid in merged["state"]:
        merged["state"][pid] = average_states([o["state"][pid] for o in opt_states], weights)
    return merged


def weighted_sum(states: list[dict], weights: list[float]) -> dict[str, torch.Tensor]:
    """sum_i w_i * state_i in float64 (one worker's partial sum of a FedAvg; divided by the total weight once
    every worker's part has arrived, in :func:`finish_average`)."""
    acc = None
    for st, w in zip(states, weights):
        term = {k: v.detach().double() * w for k, v in st.items()}
        acc = term if acc is None else {k: acc[k] + term[k] for k in acc}
    return acc


def finish_average(partials: list[dict], total_weight: float, like: dict) -> dict[str, torch.Tensor]:
    """Sum packed partial sums (numpy, float64), divide by the total weight and cast each entry back to the dtype
    of ``like`` (integer buffers rounded)."""
    keys = partials[0].keys()
    # torch.as_tensor, not from_numpy: a 0-d entry (BatchNorm's num_batches_tracked) sums to a numpy scalar
    avg = {k: torch.as_tensor(sum(np.asarray(p[k], dtype=np.float64) for p in partials) / total_weight)
           for k in keys}
    return {k: (v if like[k].is_floating_point() else v.round()).to(like[k].dtype) for k, v in avg.items()}
