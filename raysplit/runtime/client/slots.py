"""A client host's round (a component of the client host): which clients are being trained now (their slots: model
and optimizer, made from the client-state store), their update once their gradients are in, and the round's
dropped clients. The client rule's ``on_activate``, ``before_step`` and ``on_release`` hooks run here, in the order
:mod:`raysplit.runtime.rules` gives."""

from __future__ import annotations

from typing import Callable

import torch

from raysplit.runtime.state import ModelSlot
from raysplit.runtime.optim import round_lr
from raysplit.runtime.plan import Progress


class ClientSlots:
    """The round's clients of one client host: ``progress.round`` (the host's round), ``dropped`` (clients dropped
    this round, or this job under events, and why). ``train``: the typed train section (the clients' optimizer,
    its schedule, clipping); ``rule()``: the host's client rule."""

    def __init__(self, data, states, meter, train, progress: Progress, rule: Callable, worker_index: int):
        self.data, self.states, self.meter, self.train = data, states, meter, train
        self.progress, self.rule, self.worker_index = progress, rule, worker_index
        self.dropped: dict[int, str] = {}

    def activate(self, cid: int, state: dict | None = None, rnd: int | None = None) -> ModelSlot:
        """The client's slot for this round: its own model (or the global one, or ``state``), its optimizer with
        the per-client state restored and the learning rate of round ``rnd`` (default: the host's round); the
        rule's ``on_activate`` the first time."""
        if cid in self.states.slots:
            return self.states.slots[cid]
        if cid not in self.data:
            raise KeyError(f"client {cid} is not hosted by worker {self.worker_index}")
        lr = round_lr(self.train.optimizer, self.progress.round if rnd is None else rnd, self.train.rounds)
        slot = self.states.activate(cid, lr, state)
        self.rule().on_activate(cid, slot)
        return slot

    def release(self, cid: int, keep_weights: bool | None = None) -> None:
        """The client's round is over: its weights and optimizer state kept (a dropped client keeps what it had
        before the round), then the rule's ``on_release``."""
        self.states.release(cid, keep_weights, keep_state=cid not in self.dropped)
        self.rule().on_release(cid)

    def clip(self, module: torch.nn.Module) -> None:
        """``train.clip_grad_norm`` on a client's gradients."""
        if self.train.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.train.clip_grad_norm)

    def update(self, cid: int, slot: ModelSlot) -> None:
        """The client's update once its gradients are in: the rule's ``before_step``, clipping (it sees the whole
        gradient), the optimizer's step."""
        self.rule().before_step(cid, slot)
        self.clip(slot.module)
        slot.optimizer.step()

    def drop(self, cid: int, why: str) -> None:
        """Client ``cid`` takes no further part in this round (job): no more updates, left out of aggregation, its
        own model and optimizer state stay as they were before the round (``runtime.faults.on_bad_client: drop``)."""
        if cid not in self.dropped:
            self.dropped[cid] = why
            self.meter.count(cid, dropped=1)
