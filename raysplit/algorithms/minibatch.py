"""Synchronous SFL with centralised server updates: MiniBatch-SFL and S2FL, GAS's synchronous baselines.

- **MiniBatch-SFL** (Huang, Tian and Tang 2023, "Federated learning with non-IID data: a mini-batch SFL
  approach"): a round is ``train.local_steps`` iterations; in each, every sampled client forwards a batch, each
  client's gradient comes from the current server model, then the server takes one step on the concatenation of
  all the clients' activations; after the round the client models are averaged by sample count. As in GAS's code
  (baseline/Minibatch-SFL.py), a client's batch is proportional to its share of the round's data,
  ``max(int(n_c / sum n * batch_size * M), 1)`` (``client_batch: equal`` gives everyone ``train.batch_size``).
- **S2FL** (Yan et al. 2023, "Have your cake and eat it too: toward efficient and accurate split federated
  learning"): MiniBatch-SFL whose round's clients are split into ``groups`` label-balanced groups (GAS's code
  ``group_data``: start from consecutive halves of the sampled order, then swap clients between groups while a
  swap lowers the mean L2 distance of the groups' label distributions to uniform); per iteration each group's
  server copy, forked from the server model, steps on the group's concatenated activations, and the copies are
  averaged. S2FL's adaptive split points are not implemented: GAS's code applies them only to its time model
  (each client charged the time of the cut closest to the median), not to training; here every client trains and
  is charged at the configured cut.

Language models (``model.lm``): MiniBatch-SFL's concatenated step takes the model's loss (the batch's mean
next-token loss) and runs with ``model.lm.split: plain`` (the server steps on the concatenation with its targets);
S2FL refuses one (its groups are balanced by class-label counts).

Clients with their own cuts (``model.tiers``; MiniBatch-SFL, not S2FL): each cut's batches enter the server's
model at that cut and the step's loss is the mean over every sample (the concatenated step's where there is one
cut); client parts and the server's overlap are averaged by block (raysplit/runtime/tiered.py).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from .base import AlgorithmParams, SetupInfo, register
from .cyclesl import CycleServer, PooledRound
from ..runtime import Batch, batch_step
from ..runtime.messages import Gradient


def group_l2(counts: np.ndarray, group: list[int]) -> float:
    """L2 distance of a group's label distribution to uniform (GAS's ``calculate_l2_distance``)."""
    total = counts[group].sum(axis=0)
    frac = total / total.sum() if total.sum() > 0 else np.zeros_like(total, dtype=float)
    return float(np.sqrt(((frac - 1.0 / len(frac)) ** 2).sum()))


def balanced_groups(clients: list[int], counts: np.ndarray, num_groups: int, max_passes: int = 100) -> list[list[int]]:
    """Consecutive slices of ``clients`` (the code drops the remainder of an uneven split; here the last group
    takes it), improved by the best client swap between groups while it lowers the mean distance to uniform."""
    size = len(clients) // num_groups
    groups = [list(clients[i * size:(i + 1) * size]) for i in range(num_groups)]
    groups[-1] += list(clients[num_groups * size:])

    def score(gs):
        return float(np.mean([group_l2(counts, g) for g in gs]))

    best = score(groups)
    for _ in range(max_passes):
        move = None
        for gi in range(num_groups):
            for gj in range(gi + 1, num_groups):
                for a in groups[gi]:
                    for b in groups[gj]:
                        trial = [list(g) for g in groups]
                        trial[gi][trial[gi].index(a)] = b
                        trial[gj][trial[gj].index(b)] = a
                        s = score(trial)
                        if s < best - 1e-12:
                            best, move = s, trial
        if move is None:
            break
        groups = move
    return groups


class MiniBatchServer(CycleServer):
    def set_groups(self, keys: list, group_of: dict[int, object]) -> None:
        """This round's groups: client -> the server model (``keys``: ``main``, or one copy per group) it trains."""
        self.keys, self.group_of = list(keys), {int(c): k for c, k in group_of.items()}

    @batch_step(starts="on_arrival")  # each group's step starts after its own clients' last arrival (minibatch_step)
    def grouped_step(self, *acts: Batch) -> list[Gradient]:
        """One iteration of every group (``set_groups``): with several groups the copies are forked from the
        server model, each group steps its copy on its activations (its clients' gradients from the frozen server
        model) and the copies are averaged; one group steps the server model itself. Gradients in ``acts``'
        order."""
        models = self.ctx.models
        copies = self.keys != ["main"]
        if copies:
            models.fork(self.keys)
        grads = {}
        for key in self.keys:
            mine = [a for a in acts if self.group_of[a.tag.client] == key]
            if mine:  # a group whose every activation was withheld (on_bad_client: drop) does not step
                grads.update(zip((a.tag for a in mine), self.minibatch_step(key, *mine)))
        if copies:
            models.merge({k: 1.0 for k in self.keys})
        return [grads[a.tag] for a in acts]

    @batch_step(starts="after_last_arrival")
    def minibatch_step(self, key, *acts: Batch) -> list[Gradient]:
        """Each client's gradient from the current server model (frozen), then one step of ``models[key]`` on
        the concatenated activations."""
        ctx = self.ctx
        grads = [ctx.trainer.gradient(a, ctx.models.main.module) for a in acts]
        ctx.trainer.pool(list(acts)).step_all(ctx.models[key], tag=acts[0].tag)  # tiered: each cut from its own
        return grads


class MiniBatchParams(AlgorithmParams):
    client_batch: Literal["proportional", "equal"] = Field(default="proportional", description="a client's batch: "
                                                           "its share of batch_size x M (GAS's code) or batch_size")


class S2FLParams(MiniBatchParams):
    groups: int = Field(default=2, ge=1, description="label-balanced groups per round, each with a server copy")


@register
class MiniBatchSFL(PooledRound):
    """MiniBatch-SFL (module docstring): per iteration one server step on all the clients' activations."""

    name = "minibatch_sfl"
    description = "MiniBatch-SFL: server steps on the concatenated batches of all participants, FedAvg"
    tiers = ""  # each cut's batches enter the server there, their losses pooled by samples; blocks by block
    Params = MiniBatchParams
    server_rule = MiniBatchServer

    def batch_sizes(self, rt, clients) -> dict[int, int | None]:
        if self.params.client_batch == "equal":
            return {c: None for c in clients}
        share = rt.sizes[clients] / rt.sizes[clients].sum()
        return {c: max(int(f * self.cfg.train.batch_size * len(clients)), 1) for c, f in zip(clients, share)}

    def iterate(self, rt, groups: list[list[int]], keys: list) -> None:
        """``local_steps`` iterations; several groups train server copies (``keys``) that are averaged after
        every iteration, a single group trains the server model itself (key ``main``)."""
        order = [c for g in groups for c in g]
        rt.server.set_groups(keys, {c: k for g, k in zip(groups, keys) for c in g})
        rt.pooled_steps(order, self.local_steps, MiniBatchServer.grouped_step, batch_sizes=self.batch_sizes(rt, order))

    def run_round(self, rt, rnd, clients, rng):
        self.iterate(rt, [list(clients)], ["main"])
        return rt.aggregate_clients(rt.weights(clients, "samples"), self.agg.write_to)


@register
class S2FL(MiniBatchSFL):
    """S2FL as GAS's code trains it (module docstring): label-balanced groups with server copies averaged."""

    name = "s2fl"
    tiers = ("its server copies belong to label groups, not clients, so a copy's blocks have no one cut; not built")
    language_model = ("{name} needs a class label per sample: it balances its client groups by their label "
                      "counts")
    description = "S2FL: MiniBatch-SFL over label-balanced client groups, group server copies averaged"
    Params = S2FLParams

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        self.counts = np.asarray(info.counts)

    def run_round(self, rt, rnd, clients, rng):
        groups = [g for g in balanced_groups([int(c) for c in clients], self.counts, self.params.groups) if g]
        self.iterate(rt, groups, [f"group{i}" for i in range(len(groups))])
        return rt.aggregate_clients(rt.weights(clients, "samples"), self.agg.write_to)
