"""The baselines: SplitNN, PSL, SFLV1, SFLV2 and FedAvg.

Clients with their own cuts (``model.tiers``, ``model.cut_budget``; PSL, SFLV1, SFLV2): client ``i`` trains
``blocks[:cut_i]``, the server ``blocks[min cut:]``, entered at each client's cut. Where blocks are averaged (PSL's
server copies, SFLV1/SFLV2's FedAvg of client parts) they are averaged by block, every holder of a block weighted by
the samples that trained its copy, the server's copy of the overlap one of them: the depth-heterogeneous rule of
DepthFL/HeteroFL, with the server as a holder (raysplit/runtime/tiered.py states it). PSL never averages client
parts, so a client's blocks stay its own there too.

Semantics follow CycleSL's code (seed-code.md §4.3): a round is ``train.local_steps`` mini-batches per sampled
client (default 1); client aggregation is FedAvg weighted by client sample count (``train.aggregation.weights``)
and written to all clients or only the sampled ones (``train.aggregation.write_to``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from . import orders
from .base import Algorithm, AlgorithmParams, CopiesParams, SetupInfo, register
from ..runtime import ServerHost


class SequentialParams(AlgorithmParams):
    order: Literal["shuffled", "fixed"] = Field(default="shuffled", description="client order per round: a fresh "
                                                "permutation (shuffled) or ascending id (fixed)")


class OrderedParams(AlgorithmParams):
    order: orders.OrderName = Field(default="shuffled", description="server processing order: shuffled | fixed | "
                                    "random | cyclic | cyclic_reverse (algorithms/orders.py)")
    phi: int = Field(default=10, ge=1, description="cyclic orders: consecutive batches per client turn (Hydra: 10)")


@register
class SplitNN(Algorithm):
    """Vanilla split learning (Gupta & Raskar): one client at a time; each trains ``local_steps`` batches through
    the single server model, then hands its client model on to the next client (counted as upload + download).
    The last client's model starts the next round and is the one evaluated.

    Clients with their own cuts: the model handed on is the client's blocks and the server's blocks after its cut
    (the server's copy of the client's blocks takes the client's), aggregated by block over that one client
    (``rt.server.aggregate``), so the next client, shallower or deeper, takes its blocks from one model trained
    client after client: as one model trained on the clients' batches in turn."""

    name = "splitnn"
    description = "sequential split learning, client model handed on"
    u_shape = ""
    tiers = ""  # the model handed on goes through the server, whose blocks after the client's cut it completes
    Params = SequentialParams

    tiered = False

    def setup(self, info: SetupInfo) -> None:
        self.tiered = info.cuts is not None

    def run_round(self, rt, rnd, clients, rng):
        prev = None
        for c in orders.client_order(self.params.order, clients, rng):
            if prev is not None:
                rt.client(c).load_state(prev)
            rt.split_steps([c] * self.steps_for(rt, c))
            prev = rt.server.aggregate(*rt.workers.partial_sum({c: 1.0})) if self.tiered else rt.client(c).get_state()
        rt.install(prev)
        return prev


@register
class PSL(Algorithm):
    """Parallel split learning: each sampled client trains against its own copy of the server model; the copies
    are averaged (by sample count) into the server model at the end of the round. Client models are never
    aggregated: each client keeps its own."""

    name = "psl"
    description = "parallel SL: per-client server copies averaged, client models kept"
    u_shape = ""
    tiers = ""  # each copy enters at its client's cut; copies merge by block (runtime/tiered.py)
    Params = CopiesParams

    def keeps_global_client_model(self) -> bool:
        return False

    def run_round(self, rt, rnd, clients, rng):
        rt.server.fork(clients)
        self.train_copies(rt, clients)
        rt.server.merge(rt.weights(clients, self.agg.weights))
        return None

    def train_copies(self, rt, clients: list[int]) -> None:
        """Every client trains against its own server copy: one client's steps after another, or with
        ``algorithm.batched_copies`` interleaved (pooled steps: step 0 of every client, then step 1, ...; a client
        takes part in as many steps as ``steps_for`` gives it), so that the server gets every client's k-th
        activation at once and steps their copies in one batched computation (``ServerHost.train_copies``).

        The models come out the same either way: a client's steps touch only its own client model and its own
        server copy, so the order in which different clients are served does not matter (up to the rounding of
        vmap's batched kernels, tests/test_batched_copies.py), as long as the model draws no random numbers
        (dropout: the masks follow the order in which the host's generator is drawn). The simulated time does
        change: served interleaved, the server no longer waits for one client's gradient to travel back and its
        next batch to come up while the other clients' batches are waiting, so rounds of several steps per client
        end earlier; it is the clock the per-copy steps give in that order (the server charges each copy's
        FLOPs, one after another, from its activation's arrival on).

        Where the client hosts pack their clients' steps (``runtime.pack_clients``; auto: on an accelerator only),
        the steps are interleaved as well, batched copies or not, so that a host's clients of a step forward as one
        computation and take their gradients back through it together (:attr:`Runtime.packs_clients`): the same
        models within float rounding, and the interleaved clock; not where the method's client rule cannot pack
        (``ClientRule.packable``: SplitGP's backward). On a CPU (auto: off) nothing changes."""
        if getattr(self.params, "batched_copies", False) or (rt.packs_clients and self.client_rule.packable()):
            rt.pooled_steps(clients, {c: self.steps_for(rt, c) for c in clients}, ServerHost.train_copies)
        else:
            self.each_client_in_turn(rt, clients, own_server_copy=True)


@register
class SFLV1(PSL):
    """SplitFed V1 (Thapa et al.): PSL plus FedAvg of the sampled clients' models each round."""

    name = "sflv1"
    description = "SplitFed V1: per-client server copies averaged + FedAvg of client models"
    u_shape = ""
    tiers = ""  # copies merged by block, then client parts and the server's overlap aggregated by block

    def keeps_global_client_model(self) -> bool:
        return True

    def run_round(self, rt, rnd, clients, rng):
        super().run_round(rt, rnd, clients, rng)
        return rt.aggregate_clients(rt.weights(clients, self.agg.weights), self.agg.write_to)


@register
class SFLV2(Algorithm):
    """SplitFed V2: one server model that serves the sampled clients' batches one at a time in the configured
    processing order (``algorithm.order``: shuffled | fixed | random | cyclic | cyclic_reverse, see
    algorithms/orders.py; ``phi`` batches per turn in the cyclic orders), then FedAvg of the client models."""

    name = "sflv2"
    description = "SplitFed V2: one server model, sequential processing in a chosen order, FedAvg of clients"
    u_shape = ""
    tiers = ""  # the server enters at each client's cut; client parts and its overlap aggregated by block
    Params = OrderedParams

    def setup(self, info: SetupInfo) -> None:
        self.dominant = orders.dominant_labels(info.counts)
        self.labels = orders.label_order(info.seed, info.num_classes)

    def positions(self):
        return self.labels if self.params.order in orders.CYCLIC else None

    def resolved(self) -> dict:
        if self.params.order not in orders.CYCLIC:
            return {}
        per_label = np.bincount(self.dominant, minlength=len(self.labels))
        return {"order.labels": " ".join(map(str, self.labels)),
                "order.clients_per_label": " ".join(map(str, per_label[self.labels]))}

    def order_sequence(self, rt, clients, rng) -> list[int]:
        steps = {int(c): self.steps_for(rt, int(c)) for c in clients}
        return orders.sequence(self.params.order, clients, steps, rng, dominant=self.dominant, labels=self.labels,
                               phi=self.params.phi)

    def run_round(self, rt, rnd, clients, rng):
        rt.split_steps(self.order_sequence(rt, clients, rng))
        return rt.aggregate_clients(rt.weights(clients, self.agg.weights), self.agg.write_to)


@register
class FedAvg(Algorithm):
    """FedAvg (McMahan et al.): the whole model on the clients, ``local_steps`` local SGD batches each, then the
    weighted average. The FL baseline; no server model."""

    name = "fedavg"
    tiers = ("the whole model is on the clients: it has no cut")
    description = "federated averaging, whole model on clients"

    def split_model(self, model, cut):
        return None, model, torch.nn.Identity()

    def run_round(self, rt, rnd, clients, rng):
        rt.workers.local_train_many({int(c): self.steps_for(rt, c) for c in clients})  # packed where it pays
        return rt.aggregate_clients(rt.weights(clients, self.agg.weights), self.agg.write_to)
