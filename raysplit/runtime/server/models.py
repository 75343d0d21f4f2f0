"""The server's models (a component of the server host; a server rule's ``ctx.models``): the main server model
and its per-client copies (SplitFed V1 and its kin): forked from the main model, stepped one activation each
(batched across copies where vmap allows, ``algorithm.batched_copies``), merged back by weighted average."""

from __future__ import annotations

import copy
import time
import warnings
from collections import Counter, defaultdict
from typing import Callable, Iterator

import torch

from raysplit.models.adapters import copy_sharing_base
from raysplit.runtime import batched, tiered
from raysplit.runtime.aggregation import average_optimizer_states, average_states
from raysplit.runtime.state import ModelSlot
from raysplit.runtime.messages import Batch, Gradient
from raysplit.runtime.optim import make_optimizer


class ServerModels:
    """``self[key]``: a :class:`ModelSlot` (``"main"``: the server model; a client id or a group's name: a copy or
    a head); :meth:`fork` and :meth:`merge` make and average copies, :meth:`train_copies` steps them. ``trainer``:
    the server's :class:`~raysplit.runtime.server.trainer.Trainer`; ``optimizer``: the server's optimizer section;
    ``batch_copies``: ``algorithm.batched_copies``; ``on_fork(keys)`` and ``before_merge(weights)``: the server
    rule's hooks."""

    def __init__(self, main: ModelSlot, trainer, optimizer, *, batch_copies: bool = False, cuts=None,
                 on_fork: Callable = lambda keys: None, before_merge: Callable = lambda weights: None):
        self._slots: dict = {"main": main}
        self.cuts = cuts  # tiered: each client's cut; copies merge by block (runtime/tiered.py)
        self.trainer, self.optimizer_section = trainer, optimizer
        self.batch_copies = batch_copies
        self.on_fork, self.before_merge = on_fork, before_merge
        self.unbatched: str | None = None  # why vmap refused the server model (batched copies fall back)

    # ---- a mapping of slots ---------------------------------------------------------------------------------------
    def __getitem__(self, key) -> ModelSlot:
        return self._slots[key]

    def __contains__(self, key) -> bool:
        return key in self._slots

    def __iter__(self) -> Iterator:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def items(self):
        return self._slots.items()

    def values(self):
        return self._slots.values()

    @property
    def main(self) -> ModelSlot:
        """The server model."""
        return self._slots["main"]

    def replace(self, key, slot: ModelSlot) -> None:
        """``self[key]`` becomes ``slot`` (Hydra's main model, whose optimizer steps its shared part only)."""
        self._slots[key] = slot

    # ---- per-client copies ----------------------------------------------------------------------------------------
    def fork(self, keys: list) -> None:
        """A copy of the main model and its optimizer per key, each with its own optimizer state (a copy:
        ``load_state_dict`` keeps the tensors it is given, which the copies would then update in place in turn);
        then the rule's ``on_fork``."""
        main = self._slots["main"]
        for k in keys:
            module = copy_sharing_base(main.module)  # a language model's copies share its frozen base
            opt = make_optimizer(module.parameters(), self.optimizer_section)
            opt.load_state_dict(copy.deepcopy(main.optimizer.state_dict()))  # carries the round's lr too
            self._slots[k] = ModelSlot(module, opt)
        self.on_fork(keys)

    def merge(self, weights: dict) -> None:
        """Replace the main server model by the weighted average of the copies (which are dropped). The copies'
        optimizer states (momentum, Adam moments) are averaged with the same weights, so one copy merges back
        exactly (SFLV1 with one client equals SFLV2). The rule's ``before_merge`` first. Clients with their own cuts:
        by block (:func:`~raysplit.runtime.tiered.merge_copies`)."""
        self.before_merge(weights)
        keys = list(weights)
        w = [weights[k] for k in keys]
        main = self._slots["main"]
        if self.cuts is not None:  # a copy trained the blocks from its client's cut on only
            copies = {k: self._slots[k].module for k in keys}
            main_opt = main.optimizer.state_dict()
            main.module.load_state_dict(tiered.merge_copies(main.module, copies, weights, self.cuts))
            merged = tiered.merge_optimizer_states(main.module, main_opt, {k: self._slots[k].optimizer.state_dict()
                                                                           for k in keys}, weights, self.cuts)
        else:
            main.module.load_state_dict(average_states([self._slots[k].module.state_dict() for k in keys], w))
            merged = average_optimizer_states([self._slots[k].optimizer.state_dict() for k in keys], w)
        if merged is not None:
            self._slots["main"].optimizer.load_state_dict(merged)
        for k in keys:
            del self._slots[k]

    def train_copies(self, *acts: Batch) -> list[Gradient]:
        """One step of each batch's client's copy (``self[client]``, forked by :meth:`fork`); one gradient per
        batch, as a step of each in the given order gives: same gradients, losses, gradient norms, finite checks
        and clock (each copy's FLOPs charged in that order from its batch's arrival on).

        With ``algorithm.batched_copies`` the copies whose batches have equal shapes run their forward and backward
        as one batched computation (:func:`batched.copies_backward`), and each copy's own optimizer steps on its own
        gradients (:meth:`Trainer.settle`). A shape only one client sent (a short last batch) takes the per-copy
        path, and so does everything once vmap has refused the model (dropout in training mode, ...), or a copy that
        more than one batch of the call steps (its steps depend on each other)."""
        groups: dict[tuple, list[int]] = defaultdict(list)
        if self.batch_copies and self.unbatched is None:
            uses = Counter(a.tag.client for a in acts)
            for i, a in enumerate(acts):
                if uses[a.tag.client] == 1:
                    groups[(tuple(a.x.shape), str(a.x.dtype), tuple(a.y.shape))].append(i)
        done: dict[int, tuple] = {}
        for idx in (g for g in groups.values() if len(g) > 1):
            steps = self._batched([acts[i] for i in idx])
            if steps is None:
                break
            done.update(zip(idx, steps))
        trainer, out = self.trainer, []
        for i, a in enumerate(acts):
            slot = self._slots[a.tag.client]
            if i not in done:
                out.append(trainer.train(a, slot))
                continue
            t_wall = time.perf_counter()
            lv, g, fl = done[i]
            trainer.settle(lv, fl, slot.module, [slot.optimizer], tag=a.tag, ready_at=a.t_sent)
            out.append(trainer.answer(a, g, lv))
            trainer.tally.busy_wall += time.perf_counter() - t_wall
        return out

    def _batched(self, acts: list[Batch]) -> list[tuple[float, torch.Tensor, int]] | None:
        """Forward and backward of the copies of ``acts`` (equal shapes) in one computation: per batch its loss, its
        gradient and the FLOPs its own step is charged (counted once per shape on a throwaway copy under the key a
        copy's own step has). None when vmap refuses the model: remembered, warned once."""
        t_wall = time.perf_counter()
        modules = [self._slots[a.tag.client].module for a in acts]
        x = torch.stack([a.x for a in acts])
        y = torch.stack([a.y for a in acts])
        try:
            losses, gx = batched.copies_backward(modules, x, y, self.trainer.loss)
        except RuntimeError as e:
            if not batched.vmap_refused(e):
                raise
            self.unbatched = f"{type(e).__name__}: {e}"
            warnings.warn(f"algorithm.batched_copies: the server model cannot be batched ({self.unbatched}); its "
                          f"copies step one after another")
            return None

        def per_copy():
            xi = x[0].detach().clone().requires_grad_(True)
            self.trainer.loss(copy_sharing_base(modules[0])(xi), y[0]).backward()

        fl = self.trainer.flops.count(self.trainer.flop_key("step", modules[0], x[0]), per_copy)
        self.trainer.tally.busy_wall += time.perf_counter() - t_wall
        losses = losses.detach()  # read with the round's other losses, at its end
        return [(losses[i], gx[i], fl) for i in range(len(acts))]

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {k: (s.module.state_dict(), s.optimizer.state_dict()) for k, s in self._slots.items()}

    def load_state_dict(self, st: dict) -> None:
        for k, (ms, os_) in st.items():
            if k not in self._slots:
                self.fork([k])
            self._slots[k].module.load_state_dict(ms)
            self._slots[k].optimizer.load_state_dict(os_)
