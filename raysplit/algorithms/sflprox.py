"""SplitFed V1 with FedProx's proximal term on the client part: the worked example of docs/extending.md.

FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous Networks", MLSys
2020) lets every client minimise its local loss plus ``mu / 2 * ||w - w_t||^2``, where ``w_t`` is the global model
the client started the round from, so that local updates on non-IID data drift less from the global model. Here the
term is applied where SplitFed has client-side weights: the client part. Its gradient ``mu * (w - w_t)`` is added to
the gradient the server sent back before each client step (the client rule's ``before_step``); the server copies, the
FedAvg of the client parts and everything else are SplitFed V1's. ``mu = 0`` is SplitFed V1 exactly
(tests/test_sflprox.py). The term's FLOPs (one multiply-add per weight) are not charged to the clock. Clients
with their own cuts: each pulls the blocks it holds (tests/test_tiers.py: ``mu = 0`` is tiered SplitFed V1).
"""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Algorithm, CopiesParams, register
from .baselines import SFLV1
from ..runtime import ClientRule


class ProxParams(CopiesParams):
    mu: float = Field(default=0.01, ge=0, description="FedProx's proximal weight: each client step adds mu * (w - "
                      "w_t) to the client part's gradient (w_t: the global client part at the start of the round; "
                      "0: SplitFed V1)")


class ProxRule(ClientRule):
    """Remembers each client's starting weights of the round and pulls its steps towards them."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.anchor: dict[int, list[torch.Tensor]] = {}

    def on_activate(self, cid: int, slot) -> None:  # the round's first use of this client: its weights now are w_t
        self.anchor[cid] = [p.detach().clone() for p in slot.module.parameters()]

    def before_step(self, cid: int, slot) -> None:  # the host clips after: clipping sees the whole gradient
        mu = self.ctx.params.mu
        for p, w_t in zip(slot.module.parameters(), self.anchor[cid]):
            if p.grad is not None and mu:
                p.grad.add_(p.detach() - w_t, alpha=mu)

    def on_release(self, cid: int) -> None:
        self.anchor.pop(cid, None)


@register
class SplitFedProx(SFLV1):
    """SplitFed V1 + FedProx's proximal term on the client part (module docstring)."""

    name = "sflv1_prox"
    u_shape = Algorithm.u_shape  # not built for it yet
    tiers = ""  # the term pulls whatever blocks a client holds towards where they started
    description = "SplitFed V1 + FedProx: a proximal term mu/2 ||w - w_t||^2 pulls each client part to the global"
    Params = ProxParams
    client_rule = ProxRule
