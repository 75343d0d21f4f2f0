"""The server's per-client copies of its model (SplitFed V1 and its kin): forked from the main model, stepped one
activation each (batched across copies where vmap allows), merged back by weighted average."""

from __future__ import annotations

import copy
import time
import warnings
from collections import Counter, defaultdict

import torch
import torch.nn.functional as F

from raysplit.runtime import batched
from raysplit.runtime.aggregation import average_optimizer_states, average_states
from raysplit.runtime.hostspec import ModelSlot
from raysplit.runtime.messages import Batch, Gradient, batch_step
from raysplit.runtime.optim import make_optimizer


class ServerCopies:
    """Mixed into :class:`~raysplit.runtime.server_host.ServerHost`: ``models[key]`` copies of the main model."""

    @batch_step(stamp=False)
    def train_copies(self, *acts: Batch) -> list[Gradient]:
        """One step of each activation's client's copy (``models[client]``, forked by ``fork``); one gradient per
        activation, as ``train_step`` on each in the given order gives: same gradients, losses, gradient norms,
        finite checks and clock (each copy's FLOPs charged in that order from its activation's arrival on).

        With ``algorithm.batched_copies`` the copies whose activations have equal shapes run their forward and
        backward as one batched computation (:func:`batched.copies_backward`), and each copy's own optimizer steps
        on its own gradients (:meth:`settle_step`). A shape only one client sent (a short last batch) takes the
        per-copy path, and so does everything once vmap has refused the model (dropout in training mode, ...), or
        a copy that more than one activation of the call steps (its steps depend on each other)."""
        groups: dict[tuple, list[int]] = defaultdict(list)
        if self.spec.batched_copies and self._unbatched is None:
            uses = Counter(a.tag.client for a in acts)
            for i, a in enumerate(acts):
                if uses[a.tag.client] == 1:
                    groups[(tuple(a.x.shape), str(a.x.dtype), tuple(a.y.shape))].append(i)
        done: dict[int, tuple] = {}
        for idx in (g for g in groups.values() if len(g) > 1):
            steps = self._batched_copies([acts[i] for i in idx])
            if steps is None:
                break
            done.update(zip(idx, steps))
        out = []
        for i, a in enumerate(acts):
            if i not in done:
                out.append(self.train_step(a, key=a.tag.client))
                continue
            t_wall = time.perf_counter()
            lv, g, fl = done[i]
            slot = self.models[a.tag.client]
            self.settle_step(lv, fl, slot.module, [slot.optimizer], tag=a.tag, ready_at=a.t_sent)
            out.append(self.answer(a, g, lv))
            self.busy_wall += time.perf_counter() - t_wall
        return out

    def _batched_copies(self, acts: list[Batch]) -> list[tuple[float, torch.Tensor, int]] | None:
        """Forward and backward of the copies of ``acts`` (equal shapes) in one computation: per activation its
        loss, its gradient and the FLOPs its own step is charged (counted once per shape on a throwaway copy, as
        ``train_step`` counts them). None when vmap refuses the model: remembered, warned once."""
        t_wall = time.perf_counter()
        modules = [self.models[a.tag.client].module for a in acts]
        x = torch.stack([a.x for a in acts])
        y = torch.stack([a.y for a in acts])
        try:
            losses, gx = batched.copies_backward(modules, x, y)
        except RuntimeError as e:
            self._unbatched = f"{type(e).__name__}: {e}"
            warnings.warn(f"algorithm.batched_copies: the server model cannot be batched ({self._unbatched}); its "
                          f"copies step one after another")
            return None

        def per_copy():
            xi = x[0].detach().clone().requires_grad_(True)
            F.cross_entropy(copy.deepcopy(modules[0])(xi), y[0]).backward()

        fl = self.flops.count(("train", "copy", tuple(x.shape[1:])), per_copy)
        self.busy_wall += time.perf_counter() - t_wall
        return [(float(lv), g, fl) for lv, g in zip(losses.tolist(), gx)]

    # ---- per-client copies ------------------------------------------------------------------------------------
    def fork(self, keys: list) -> None:
        """A copy of the main model and its optimizer per key, each with its own optimizer state (a copy:
        ``load_state_dict`` keeps the tensors it is given, which the copies would then update in place in turn)."""
        main = self.models["main"]
        for k in keys:
            module = copy.deepcopy(main.module)
            opt = make_optimizer(module.parameters(), self.spec.server_optimizer)
            opt.load_state_dict(copy.deepcopy(main.optimizer.state_dict()))  # carries the round's lr too
            self.models[k] = ModelSlot(module, opt)
        self.rule.on_fork(keys)

    def merge(self, weights: dict) -> None:
        """Replace the main server model by the weighted average of the copies (which are dropped). The copies'
        optimizer states (momentum, Adam moments) are averaged with the same weights, so one copy merges back
        exactly (SFLV1 with one client equals SFLV2). The rule's ``before_merge`` first."""
        self.rule.before_merge(weights)
        keys = list(weights)
        w = [weights[k] for k in keys]
        avg = average_states([self.models[k].module.state_dict() for k in keys], w)
        self.models["main"].module.load_state_dict(avg)
        merged = average_optimizer_states([self.models[k].optimizer.state_dict() for k in keys], w)
        if merged is not None:
            self.models["main"].optimizer.load_state_dict(merged)
        for k in keys:
            del self.models[k]
