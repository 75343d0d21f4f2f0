"""A client host's state store: the global client model, each client's own model and optimizer state (in a
:class:`~raysplit.runtime.spill.SpillStore`: beyond ``runtime.placement.client_state_mb`` the least recently used
go to disk), the slots of the clients being trained now, and a pool of modules to reuse."""

from __future__ import annotations

import copy
from typing import Callable

import torch

from raysplit.runtime.state import ModelSlot
from raysplit.runtime.optim import make_optimizer, set_lr
from raysplit.runtime.spill import SpillStore


def clone_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An owned copy of ``module``'s weights and buffers."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class ClientStates:
    """``global_state``: the client part every client starts from; ``own``: a client's own weights where it keeps
    them (``persist_client_models``, or set by the algorithm); ``opt_state``: its optimizer's state (kept across
    rounds, as in CycleSL's code); ``slots``: a module and optimizer per client being trained now, so a forward's
    graph stays alive until its gradient arrives. ``build`` makes a fresh client module (its weights are loaded
    after); released modules are pooled. Activating or releasing a client adds it to ``changed``."""

    client_fields = ("own", "opt_state")  # per-client state that moves with a client

    def __init__(self, build: Callable[[], torch.nn.Module], init_state: dict, optimizer: dict, *,
                 persist: bool, state_bytes: int | None, spill_dir: str | None, changed: set[int],
                 device: torch.device | None = None):
        self.build = build
        self.device = device  # where ``build``'s modules are (None: not said)
        self.global_state = init_state
        self.optimizer = optimizer
        self.persist = persist
        self.store = SpillStore(state_bytes, spill_dir)
        self.own = self.store.view("own")
        self.opt_state = self.store.view("opt")
        self.slots: dict[int, ModelSlot] = {}
        self._pool: list[torch.nn.Module] = []
        self.changed = changed

    def module(self) -> torch.nn.Module:
        """A client module to load weights into (a pooled one where there is one); :meth:`give_back` it after."""
        return self._pool.pop() if self._pool else self.build()

    def give_back(self, module: torch.nn.Module) -> None:
        """A module :meth:`module` lent, or one built alike, pooled for reuse (one on another device than the
        pool's, e.g. an attack's on the CPU beside a GPU host's, is not)."""
        p = next(module.parameters(), None)
        if p is None or self.device is None or p.device == self.device:
            self._pool.append(module)

    def state_of(self, cid: int) -> dict:
        """Client ``cid``'s current weights: its slot's, its own, or the global ones."""
        if cid in self.slots:
            return self.slots[cid].module.state_dict()
        return self.own.get(cid, self.global_state)

    def activate(self, cid: int, lr: float, state: dict | None = None) -> ModelSlot:
        """Client ``cid``'s slot: its own model (or the global one, or ``state``) in training mode, its optimizer
        with the client's saved state restored and learning rate ``lr``."""
        if cid in self.slots:
            return self.slots[cid]
        slot = self.restore_slot(cid, state if state is not None else self.own.get(cid, self.global_state),
                                 self.opt_state.get(cid))
        set_lr(slot.optimizer, lr)
        return slot

    def restore_slot(self, cid: int, weights: dict, optimizer_state: dict | None) -> ModelSlot:
        """Client ``cid``'s slot with these weights (in training mode) and optimizer state (None: a fresh
        optimizer); a checkpoint's active asynchronous jobs are restored so."""
        module = self.module()
        module.load_state_dict(weights)
        module.train()
        opt = make_optimizer(module.parameters(), self.optimizer)
        if optimizer_state is not None:
            opt.load_state_dict(optimizer_state)
        self.slots[cid] = ModelSlot(module, opt)
        return self.slots[cid]

    def release(self, cid: int, keep_weights: bool | None = None, keep_state: bool = True) -> None:
        """Client ``cid``'s round (job) is over: its weights are kept as its own (``keep_weights``, default
        ``persist_client_models``) and its optimizer state saved, unless ``keep_state`` is false (a dropped
        client keeps what it had before the round); the module goes back to the pool."""
        slot = self.slots.pop(cid, None)
        if slot is None:
            return
        self.changed.add(cid)
        if keep_state:
            if keep_weights if keep_weights is not None else self.persist:
                self.own[cid] = clone_state(slot.module)
            st = slot.optimizer.state_dict()
            if st["state"]:
                self.opt_state[cid] = copy.deepcopy(st)
        self._pool.append(slot.module)

    def install(self, state: dict, only: list[int] | None = None) -> None:
        """``state`` becomes the global client model (``only`` None; without ``persist_client_models`` the
        clients' own models are dropped) or the own model of the clients in ``only``."""
        if only is None:
            self.global_state = state
            if not self.persist:
                self.changed.update(self.own)
                self.own.clear()
        else:
            for c in only:
                self.own[c] = state
                self.changed.add(c)
