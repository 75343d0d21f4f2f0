"""The server's one training step: every server-side training computation (split steps, CycleSL's pooled
resampling and frozen-server gradients, SGLR's concatenated step, Hydra's heads, the per-client copies) goes
through :meth:`ServerSteps.step_through` or, for batched copies, ends in :meth:`ServerSteps.settle_step`: one
forward, loss, backward, finite check, clipping, optimizer steps, FLOPs on the server's clock, wall time."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from raysplit.runtime import transport
from raysplit.runtime.hostspec import check_finite
from raysplit.runtime.messages import Activation, Batch, Gradient, Tag, batch_step


class ServerSteps:
    """Mixed into :class:`~raysplit.runtime.server_host.ServerHost`: its training steps, their tallies for the
    round (``losses``, ``grad_norms``, ``round_flops``, ``busy_wall``, the first ``nonfinite`` tag) and its clock."""

    def step_through(self, x: torch.Tensor, y: torch.Tensor, module, optimizers: list, *, tag: Tag, flop_key: tuple,
                     ready_at: float = 0.0, loss_fn: Callable | None = None, record: bool = True,
                     varying_batch: bool = False, where: str | None = None) -> float:
        """Forward ``x`` through ``module``, ``loss_fn(logits, y)`` (default: mean cross-entropy), backward, then
        step ``optimizers`` (none: a gradient pass, e.g. through a frozen server); the FLOPs (counted once per
        ``flop_key``) are charged to the server clock from ``ready_at`` on and the wall time to ``busy_wall``.
        ``record``: the loss counts as a training loss (checked for finiteness, logged). Returns the loss; the
        caller reads ``x.grad`` when it needs the gradient for the client. ``varying_batch``: FLOPs counted once
        per sample for a computation whose batch size changes every call (``FlopCache.run``). ``where``: how a
        non-finite loss names the step (default: round, client and step of ``tag``)."""
        t_wall = time.perf_counter()
        loss_fn = loss_fn or F.cross_entropy

        def step():
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss = loss_fn(module(x), y)
            loss.backward()
            return loss

        loss, fl = self.flops.run(flop_key, step, batch=len(y) if varying_batch else None)
        lv = self.settle_step(float(loss.item()), fl, module, optimizers, tag=tag, ready_at=ready_at, record=record,
                              where=where)
        self.busy_wall += time.perf_counter() - t_wall
        return lv

    def settle_step(self, lv: float, flops: int, module, optimizers: list, *, tag: Tag, ready_at: float = 0.0,
                    record: bool = True, where: str | None = None) -> float:
        """The rest of a training step once its gradients are in ``module``'s parameters: the finite check,
        clipping (``train.clip_grad_norm``), the optimizer steps, ``flops`` on the server clock, the loss logged."""
        if record:
            self._check(lv, tag, where)
        self.rule.before_step(module, optimizers, tag)
        if optimizers and self.spec.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.spec.clip_grad_norm)
        for opt in optimizers:
            opt.step()
        self.charge(flops, ready_at)
        if record:
            self.losses.append(lv)
        return lv

    def step_batch(self, b: Batch, module, optimizers: list, flop_key="main", loss_fn=None) -> Gradient:
        """One SGD step of ``module`` (and its ``optimizers``) on a batch, from its arrival on, with ``loss_fn``
        (:meth:`step_through`); returns the client's gradient."""
        x = b.x.requires_grad_(True)
        lv = self.step_through(x, b.y, module, optimizers, tag=b.tag, flop_key=("train", flop_key, tuple(x.shape)),
                               ready_at=b.t_sent, loss_fn=loss_fn)
        return self.answer(b, x.grad, lv)

    def answer(self, b: Batch | Tag, g: torch.Tensor | None, lv: float) -> Gradient:
        """The client's gradient for ``b`` (a batch or its tag), sent at the server's clock, its norm logged;
        ``g`` None: nothing goes back for this batch (e.g. a teacher stream)."""
        tag = b if isinstance(b, Tag) else b.tag
        if g is None:
            return Gradient(tag, None, self.clock, lv)
        self.grad_norms.append(float(g.norm()))
        return Gradient(tag, transport.pack(g), self.clock, lv)

    def revise(self, grads: list[Gradient], values: list) -> list[Gradient]:
        """A rule applied on top of the gradients just answered (SGLR's sharing): the first ``len(values)`` of
        ``grads`` carry ``values`` instead (same tags, times and losses), the rest are kept; the logged gradient
        norms follow."""
        new = [Gradient(g.tag, transport.pack(v) if isinstance(v, torch.Tensor) else v, g.t_sent, g.loss)
               for g, v in zip(grads, values)]
        out = new + list(grads[len(values):])
        self.grad_norms[-len(grads):] = [float(np.linalg.norm(g.g)) for g in out]
        return out

    def decode(self, act: Activation) -> Batch:
        """An arrived activation as a :class:`Batch` on the server's device (an owned, writable copy)."""
        return Batch(transport.unpack(act.x, self.device, writable=True),
                     torch.as_tensor(np.array(act.y), device=self.device), act.tag, act.t_sent, act.weight)

    @staticmethod
    @contextmanager
    def frozen(model: torch.nn.Module):
        """Within the block, ``model``'s parameters take no gradient (a pass through it yields only the input's
        gradient: CycleSL's and MiniBatch's frozen-server gradients, GAS's client gradients); each parameter's
        ``requires_grad`` is restored afterwards, also when the block raises."""
        before = [(prm, prm.requires_grad) for prm in model.parameters()]
        for prm, _ in before:
            prm.requires_grad_(False)
        try:
            yield model
        finally:
            for prm, flag in before:
                prm.requires_grad_(flag)

    @batch_step(stamp=False)
    def train_step(self, b: Batch, key="main") -> Gradient:
        """Forward the batch through ``models[key]``, step it, return dL/d(features) to the client."""
        slot = self.models[key]
        return self.step_batch(b, slot.module, [slot.optimizer], "main" if key == "main" else "copy")

    def _check(self, loss: float, tag: Tag, where: str | None = None) -> None:
        if not math.isfinite(loss) and self.nonfinite is None:
            self.nonfinite = tag
        where = where or (f"round {tag.round}, client {tag.client} (step {tag.step})" if tag.client >= 0 else
                          f"round {tag.round}, server update {tag.step}")  # a server-only step (Tag client -1)
        check_finite(loss, self.spec.stop_on_nonfinite, where)

    def charge(self, flops: float, ready_at: float = 0.0) -> float:
        """Advance the server clock by a computation that can start once ``ready_at`` has passed (instantly with
        ``charge_server`` off, as in GAS's code)."""
        cost = flops / self.spec.server_flops if self.spec.charge_server else 0.0
        self.clock = max(self.clock, ready_at) + cost
        self.round_flops += flops
        return self.clock

    def wait_until(self, t: float) -> float:
        """The server cannot go on before ``t``."""
        self.clock = max(self.clock, t)
        return self.clock
