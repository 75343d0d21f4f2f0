"""Centralised training: the reference every distributed method is measured against (SplitLoRA's paper compares
split LoRA with centralised LoRA; raysplit's equivalence tests make SplitNN with one client equal to it).

One model, unsplit, with one optimizer, trained on the clients' batches as one machine holding all their data
would: each round the sampled clients (``algorithm.order``: shuffled or fixed) each contribute
``train.local_steps`` batches (or ``train.local_epochs`` passes) in turn, the one model and its optimizer state
going from one client's data to the next. Nothing is communicated: the model "moving" between clients is where
the simulator keeps the data, not traffic, so no model bytes are charged (``comm/*`` stays zero). The clock charges
only the clients' compute, one turn after another as the one machine would do it: a client's local steps cost
their FLOPs at that client's speed (``clock.profile``), and its turn starts when the previous client's turn ended
(the end time goes with the hand-out; no transfer time), so a round's ``time/sim_round`` is the sum of its
clients' compute times, not the longest of them. With one client it is plain single-process training on that
client's batches; with LoRA (``model.lm``) it is centralised LoRA. Evaluated as FedAvg's global model is (the
whole model on the global test set).

It differs from SplitNN with its model handed on (``splitnn``) in what it leaves out: no cut, no server, no
per-client optimizer state (a SplitNN client keeps its own moments; here there is one optimizer), no hand-over
traffic.
"""

from __future__ import annotations

import copy

import torch

from . import orders
from .base import Algorithm, register
from .baselines import SequentialParams
from ..runtime import ClientRule, StateMsg


def _on_cpu(value):
    """``value``'s tensors (an optimizer's state: nested dicts and lists) as CPU copies, for a message."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_on_cpu(v) for v in value]
    return copy.deepcopy(value)


class CentralRule(ClientRule):
    """The one model, its optimizer state and the moment its last turn ended: handed out by the client that trained
    last (``hand_out``), taken by every client host (``take``) and loaded into the next client's slot when it
    activates, whose clock then waits for that moment (its turn follows the previous one). No bytes are charged."""

    checkpointed = ("central",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.central: tuple[dict, dict, float] | None = None  # (weights, optimizer state on the CPU, turn's end)

    def on_activate(self, cid: int, slot) -> None:
        if self.central is None:
            return
        weights, opt_state = self.central[:2]
        # the previous turn's end (a checkpoint written before the turns were chained holds none: no wait)
        self.ctx.meter.wait_until(cid, self.central[2] if len(self.central) > 2 else 0.0)
        slot.module.load_state_dict(weights)
        lrs = [g["lr"] for g in slot.optimizer.param_groups]  # the round's, set at activation
        slot.optimizer.load_state_dict(opt_state)
        for g, lr in zip(slot.optimizer.param_groups, lrs):
            g["lr"] = lr

    def hand_out(self, cid: int) -> tuple[dict, dict, float]:
        """Client ``cid``'s model and optimizer state after its turn (CPU copies) and its clock then (the turn's
        end, where the next client's turn starts)."""
        slot = self.ctx.states.slots[cid]
        return (_on_cpu(slot.module.state_dict()), _on_cpu(slot.optimizer.state_dict()),
                float(self.ctx.meter.now(cid)))

    def weights(self, cid: int) -> StateMsg:
        """Client ``cid``'s model as the round's global model (for evaluation; not charged)."""
        return StateMsg.packed(self.ctx.states.state_of(cid))

    def take(self, central: tuple[dict, dict, float]) -> None:
        self.central = central


@register
class Centralised(Algorithm):
    """Centralised training on the clients' batches in turn, one model and one optimizer (module docstring)."""

    name = "centralised"
    description = "centralised training: one unsplit model and optimizer over the clients' batches in turn (reference)"
    tiers = "the whole model is on one party: it has no cut"
    client_rule = CentralRule
    Params = SequentialParams

    def split_model(self, model, cut):
        return None, model, torch.nn.Identity()

    def eval_modes(self) -> tuple[str, ...]:
        return ("global",)  # the one model; the clients hold no models of their own

    def run_round(self, rt, rnd, clients, rng):
        last = None
        for c in orders.client_order(self.params.order, clients, rng):
            rt.client(c).local_train(self.steps_for(rt, c))
            rt.workers.take(rt.client(c).hand_out())
            last = c
        return rt.client(last).weights()
