"""A client host's state store: the global client model, each client's own model and optimizer state (in a
:class:`~raysplit.runtime.spill.SpillStore`: beyond ``runtime.placement.client_state_mb`` the least recently used
go to disk), the slots of the clients being trained now, and a pool of modules to reuse."""

from __future__ import annotations

import copy
from typing import Callable

import torch

from raysplit.models.tiers import at_rank, block_key, fit_state
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
                 device: torch.device | None = None, cut_of: Callable[[int], int | None] | None = None,
                 build_cut: Callable[[int], torch.nn.Module] | None = None,
                 rank_of: Callable[[int], int | None] | None = None):
        self.build = build
        self.rank_of = rank_of  # tiered LoRA ranks: the global state is at the largest, a client holds its own
        # tiered (clients with their own cuts): client cid's module is build_cut(cut_of(cid)), pooled by its cut; the
        # global state holds every block a client holds (the deepest cut's), each client loads its own blocks
        self.cut_of, self.build_cut = cut_of, build_cut
        self.device = device  # where ``build``'s modules are (None: not said)
        self.global_state = init_state
        self.optimizer = optimizer
        self.persist = persist
        self.store = SpillStore(state_bytes, spill_dir)
        self.own = self.store.view("own")
        self.opt_state = self.store.view("opt")
        self.slots: dict[int, ModelSlot] = {}
        self._pools: dict[int | None, list[torch.nn.Module]] = {}
        self.changed = changed

    @property
    def tiered(self) -> bool:
        return self.cut_of is not None

    def module(self, cid: int | None = None) -> torch.nn.Module:
        """A client module to load weights into (client ``cid``'s where clients have their own cuts; a pooled one
        where there is one); :meth:`give_back` it after."""
        key = self.cut_of(cid) if self.tiered and cid is not None else None
        pool = self._pools.get(key)
        if pool:
            return pool.pop()
        return self.build_cut(key) if key is not None else self.build()

    def give_back(self, module: torch.nn.Module) -> None:
        """A module :meth:`module` lent, or one built alike, pooled for reuse (one on another device than the
        pool's, e.g. an attack's on the CPU beside a GPU host's, is not)."""
        p = next(module.parameters(), None)
        if p is None or self.device is None or p.device == self.device:
            self._pools.setdefault(self._key(module), []).append(module)

    def _key(self, module: torch.nn.Module) -> int | None:
        if not self.tiered:
            return None
        return len(getattr(module, "head", module))  # a tiered client's head is blocks[:cut]: cut children

    def held(self, cid: int, state: dict) -> dict:
        """The part of ``state`` client ``cid`` holds: tiered, the entries of its blocks (a client part's key names
        its block's index in the full model; a U-shaped tail every client holds); else all of it."""
        if not self.tiered:
            return state
        cut = self.cut_of(cid)
        mine = {k: v for k, v in state.items() if k.startswith("tail.") or block_key(k)[0] < cut}
        return mine if self.rank_of is None else at_rank(mine, self.rank_of(cid))

    def load(self, module: torch.nn.Module, weights: dict) -> None:
        """``weights`` into ``module``: tiered, the blocks it holds of the global state's (every key it has)."""
        if self.tiered:
            keys = module.state_dict().keys()
            weights = {k: weights[k] for k in keys} if self.rank_of is None else \
                fit_state(weights, module.state_dict())  # LoRA ranks: its own of the aggregate's largest
        module.load_state_dict(weights)

    def state_of(self, cid: int) -> dict:
        """Client ``cid``'s current weights: its slot's, its own, or the global ones."""
        if cid in self.slots:
            return self.slots[cid].module.state_dict()
        return self.held(cid, self.own.get(cid, self.global_state))

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
        module = self.module(cid)
        self.load(module, weights)
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
        self._pools.setdefault(self._key(slot.module), []).append(slot.module)

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
