"""Processing orders for a sequential server (SFLV2 family, Hydra's part-2a): which client's batch the server
takes next. A policy turns the round's per-client batch counts into one sequence of client ids, one entry per
batch; the algorithm submits the split steps in that sequence. Pure functions (no Ray, no torch).

Policies (Hydra, ../shared/papers/hydra.txt §3.2 and App. F; seed-code.md §2.3):

- ``shuffled``: a fresh random permutation of the round's clients; each client's batches are consecutive
  (CycleSL's SFLV2 code; raysplit's default).
- ``fixed``: like ``shuffled`` in ascending client id.
- ``random``: every batch comes from a uniformly random client that still has batches this round (Hydra's
  simulation of first-come-first-served), so clients interleave per batch.
- ``cyclic``: clients are grouped by dominant label; the label order is drawn once from the seed and kept for the
  whole run; clients take turns of ``phi`` consecutive batches, cycling over the groups in that order (within a
  group by client id) until every client's batches are used. A client that runs out of batches leaves the cycle.
- ``cyclic_reverse``: ``cyclic``, but the direction flips after every full cycle (forward, backward, forward, ...),
  as Hydra's code does by switching the side of its job buffer it takes from.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

OrderName = Literal["shuffled", "fixed", "random", "cyclic", "cyclic_reverse"]
CYCLIC = ("cyclic", "cyclic_reverse")


def dominant_labels(counts: np.ndarray) -> np.ndarray:
    """Dominant label of each client (argmax of its label counts; ties go to the lower label)."""
    return np.asarray(counts).argmax(axis=1)


def label_order(seed: int, num_labels: int) -> list[int]:
    """The cyclic orders' label sequence: drawn once from the seed (Hydra randomises it per experiment)."""
    return [int(v) for v in np.random.default_rng([seed, 0xC1C]).permutation(num_labels)]


def cycle_clients(clients, dominant: np.ndarray, labels: list[int]) -> list[int]:
    """The round's clients arranged by dominant label in ``labels`` order (by client id within a label). Clients
    whose dominant label is not in ``labels`` go last."""
    pos = {lab: i for i, lab in enumerate(labels)}
    return sorted((int(c) for c in clients), key=lambda c: (pos.get(int(dominant[c]), len(pos)), c))


def client_order(policy: str, clients, rng: np.random.Generator) -> list[int]:
    """The round's clients one after another: ``shuffled`` (a permutation drawn from ``rng``) or ``fixed``
    (ascending id)."""
    clients = [int(c) for c in clients]
    if policy == "shuffled":
        return [int(c) for c in rng.permutation(clients)]
    if policy == "fixed":
        return sorted(clients)
    raise ValueError(f"order {policy!r} does not put whole clients one after another (shuffled | fixed)")


def sequence(policy: str, clients, steps: dict[int, int], rng: np.random.Generator, *, dominant=None,
             labels: list[int] | None = None, phi: int = 1) -> list[int]:
    """One client id per batch, in the order the server processes them. ``steps[c]`` is client c's number of
    batches this round; ``rng`` is the round's generator (``shuffled``/``random`` draw from it)."""
    clients = [int(c) for c in clients]
    if policy in ("shuffled", "fixed"):
        return [c for c in client_order(policy, clients, rng) for _ in range(steps[c])]
    if policy == "random":
        left = {c: steps[c] for c in clients if steps[c] > 0}
        out = []
        while left:
            pending = sorted(left)
            c = pending[int(rng.integers(len(pending)))]
            out.append(c)
            left[c] -= 1
            if left[c] == 0:
                del left[c]
        return out
    if policy in CYCLIC:
        if dominant is None or labels is None:
            raise ValueError(f"order {policy!r} needs the clients' dominant labels and a label order")
        if phi < 1:
            raise ValueError(f"phi must be >= 1, got {phi}")
        ring = [c for c in cycle_clients(clients, dominant, labels) if steps[c] > 0]
        left = {c: steps[c] for c in ring}
        out, forward = [], True
        while ring:
            for c in (ring if forward else ring[::-1]):
                take = min(phi, left[c])
                out.extend([c] * take)
                left[c] -= take
            ring = [c for c in ring if left[c] > 0]
            if policy == "cyclic_reverse":
                forward = not forward
        return out
    raise ValueError(f"unknown processing order {policy!r}")
