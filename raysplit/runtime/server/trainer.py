"""The server's step arithmetic (issue 69): every server-side training computation of every family goes through a
:class:`Trainer`, a component of the server host that a server rule reaches as ``ctx.trainer``.

One step is the forward, the loss, the backward, the finite check, clipping (``train.clip_grad_norm``), the rule's
``before_step`` hook, the optimizers' steps and its FLOPs on the server's clock (:class:`ServerClock`), its wall
time on the round's busy time and its loss in the round's tally. The trainer also makes the frozen pass (the
gradient of the loss at the input, the server's parameters taking none), the answer sent back to a client, the
optimizers of the server's own modules at the round's learning rate (from the typed optimizer section), and the
FLOP key of each computation: the server call it runs in (the step the runtime dispatched), whether parameters
step or only the input's gradient is taken, the module's class and the input's shape. A rule never names a FLOP
key nor recomputes a schedule."""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from raysplit.clock import FlopCache
from raysplit.models.tiers import entered
from raysplit.runtime import transport
from raysplit.runtime.state import ModelSlot
from raysplit.runtime.screening import LOSS, Deferred, check_loss
from raysplit.runtime.messages import Batch, Gradient, StateMsg, Tag
from raysplit.runtime.optim import make_optimizer, round_lr, set_lr


class ServerClock:
    """The server's simulated clock: a computation of ``flops`` takes ``flops / clock.server_flops`` seconds from
    when it may start (instantly with ``clock.charge_server`` off, as in GAS's code)."""

    def __init__(self, clock_section):
        self.server_flops, self.charged = clock_section.server_flops, clock_section.charge_server
        self.now = 0.0

    def charge(self, flops: float, ready_at: float = 0.0) -> float:
        cost = flops / self.server_flops if self.charged else 0.0
        self.now = max(self.now, ready_at) + cost
        return self.now

    def wait_until(self, t: float) -> float:
        """The server cannot go on before ``t``."""
        self.now = max(self.now, t)
        return self.now


class Tally:
    """A round's numbers of the server's steps: the training losses, the norms of the gradients sent to clients
    (0-d tensors on the server's device while the round runs, read once at its end: :meth:`read`), the FLOPs, the
    wall time busy and the first step whose loss was not finite."""

    def __init__(self):
        self.losses: list = []
        self.grad_norms: list = []
        self.flops = 0.0
        self.busy_wall = 0.0
        self.nonfinite: Tag | None = None

    def read(self) -> tuple[list[float], list[float]]:
        """The losses and norms as floats, in one read of the device."""
        both = transport.read_floats(self.losses + self.grad_norms)
        return both[:len(self.losses)], both[len(self.losses):]


class Trainer:
    """The server's step arithmetic (module docstring). ``train``/``clock``: the typed sections; ``optimizer``: the
    server's optimizer section; ``cut_of(cid)``: a client's own cut where clients have their own (the server's
    model is entered there for its batches, and its FLOPs are counted per cut); ``before_step(module, optimizers,
    tag)``: the server rule's hook; ``deferred``: the
    host's checks read at the round's end (:class:`~raysplit.runtime.screening.Deferred`), where a step's finite
    check goes (None: each loss is read as it is made); ``loss(out, y)``: the model's training loss
    (:attr:`~raysplit.runtime.plan.ModelFacts.loss`), what a step computes unless the caller gives its own;
    ``sample_losses(out, y)``: the same per sample, ``(B,)`` (:attr:`~raysplit.runtime.plan.ModelFacts.sample_losses`),
    for steps that weigh samples (the pool's).

    Nothing here reads the device per step: a loss stays a 0-d tensor (returned, tallied, sent with the gradient,
    checked at the round's end), a gradient is the tensor itself, its norm a tensor in the tally."""

    def __init__(self, train, clock_section, optimizer, rounds: int, device: torch.device,
                 before_step: Callable | None = None, deferred: Deferred | None = None,
                 cut_of: Callable[[int], int | None] = lambda cid: None, loss: Callable = F.cross_entropy,
                 sample_losses: Callable | None = None):
        self.loss = loss
        self.sample_losses = sample_losses or (lambda out, y: F.cross_entropy(out, y, reduction="none"))
        self.train_section, self.optimizer_section, self.rounds = train, optimizer, rounds
        self.cut_of = cut_of  # tiered: a client's cut, where the server's model is entered for its batches
        self.device = device
        self.deferred = deferred
        self.clock = ServerClock(clock_section)
        self.flops = FlopCache()
        self.before_step = before_step or (lambda module, optimizers, tag: None)
        self.round = -1
        self.call = ""  # the server call running now (ServerHost.serve sets it): the first part of every FLOP key
        self.tally = Tally()
        self._kept: weakref.WeakSet = weakref.WeakSet()  # optimizers kept at the round's learning rate

    # ---- the round ------------------------------------------------------------------------------------------------
    def begin_round(self, rnd: int, t0: float) -> None:
        """A round begins at ``t0``: the tally is new, every optimizer made by :meth:`optimizer` (and the models'
        ones given to :meth:`keep_lr`) takes the round's learning rate."""
        self.round = rnd
        self.clock.wait_until(t0)
        self.tally = Tally()
        for opt in list(self._kept):
            set_lr(opt, self.lr())

    def lr(self) -> float:
        """The round's learning rate of the server's optimizer section (its schedule: exponential or cosine)."""
        return round_lr(self.optimizer_section, self.round, self.rounds)

    def optimizer(self, params) -> torch.optim.Optimizer:
        """A fresh optimizer over ``params`` from the server's optimizer section, at the round's learning rate now
        and at each later round's from its start."""
        opt = make_optimizer(params, self.optimizer_section)
        set_lr(opt, self.lr())
        self._kept.add(opt)
        return opt

    def keep_lr(self, opt: torch.optim.Optimizer) -> None:
        """``opt`` takes each round's learning rate at the round's start (the server models' optimizers)."""
        self._kept.add(opt)

    def scale_lr(self, opt: torch.optim.Optimizer, factor: float) -> None:
        """``opt``'s learning rate is the round's times ``factor`` until the next round starts (SGLR's ``lr_pow``)."""
        set_lr(opt, self.lr() * factor)

    @contextlib.contextmanager
    def serving(self, call: str):
        """Within the block, computations are counted under the server call ``call`` (the host's dispatch)."""
        outer, self.call = self.call, self.call or call
        try:
            yield
        finally:
            self.call = outer

    # ---- one step -------------------------------------------------------------------------------------------------
    def flop_key(self, kind: str, module, x: torch.Tensor) -> tuple:
        """The key a computation's FLOPs are counted under once: the server call, its kind (``step``: parameters
        step; ``grad``: the input's gradient only), the module's class and the input's shape."""
        return (self.call, kind, type(module).__name__, tuple(x.shape))

    def step(self, x: torch.Tensor, y: torch.Tensor, model, *more_optimizers, loss: Callable | None = None,
             ready_at: float = 0.0, step: int | None = None, tag: Tag | None = None, where: str | None = None) -> float:
        """One training step of ``model`` (a :class:`ModelSlot`, or a module whose ``more_optimizers`` step) on
        ``x`` and ``y``: forward, ``loss(out, y)`` (default the model's), backward, the finite check,
        :meth:`settle` (clipping, the rule's ``before_step``, the optimizer steps, the FLOPs on the clock from
        ``ready_at`` on). ``tag``: the client's step it serves, or ``step``: the number of a server-only step of the
        round (a step with neither is the round's step 0 of the server); ``where``: how a non-finite loss names it.
        Returns the loss, a 0-d tensor (the caller reads ``x.grad`` where it asked for one)."""
        module, optimizers = self._unpack(model, more_optimizers)
        tag = tag if tag is not None else Tag(-1, self.round, step or 0)
        return self._run(x, y, module, optimizers, loss, ready_at, tag, record=True, where=where, kind="step")

    def pool(self, batches: list[Batch]):
        """The batches' samples pooled for steps on them (:class:`~raysplit.runtime.server.pool.Pool`)."""
        from raysplit.runtime.server.pool import Pool

        return Pool(self, batches)

    def train(self, b: Batch, model, *more_optimizers, loss: Callable | None = None) -> Gradient:
        """One training step on a client's batch from its arrival on (:meth:`step`); the client's gradient."""
        x = b.x.requires_grad_(True)
        lv = self.step(x, b.y, model, *more_optimizers, loss=loss, ready_at=b.t_sent, tag=b.tag)
        return self.answer(b, x.grad, lv)

    def gradient(self, b: Batch, module: torch.nn.Module, loss: Callable | None = None) -> Gradient:
        """The frozen pass: the client's gradient of ``loss`` (default the model's) at its batch through
        ``module``, whose parameters take no gradient and do not step, charged from the batch's arrival on; the
        loss is not a training loss (not logged, not checked)."""
        x = b.x.detach().clone().requires_grad_(True)
        with frozen(module):
            lv = self._run(x, b.y, module, [], loss, b.t_sent, b.tag, record=False, where=None, kind="grad")
        return self.answer(b, x.grad, lv)

    def _unpack(self, model, more: tuple) -> tuple[torch.nn.Module, list]:
        if isinstance(model, ModelSlot):
            return model.module, [model.optimizer, *more]
        return model, list(more)

    def _run(self, x, y, module, optimizers, loss, ready_at, tag, *, record, where, kind) -> torch.Tensor:
        t_wall = time.perf_counter()
        loss_fn = loss or self.loss

        def step():
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            out = loss_fn(module(x), y)
            out.backward()
            return out

        cut = self.cut_of(tag.client) if tag.client >= 0 else None
        with entered(module, cut):
            out, fl = self.flops.run(self.flop_key(kind, module, x) + (() if cut is None else (cut,)), step)
        lv = self.settle(out.detach(), fl, module, optimizers, tag=tag, ready_at=ready_at, record=record,
                         where=where)
        self.tally.busy_wall += time.perf_counter() - t_wall
        return lv

    def settle(self, lv, flops: int, module, optimizers: list, *, tag: Tag, ready_at: float = 0.0,
               record: bool = True, where: str | None = None):
        """The rest of a step once its gradients are in ``module``'s parameters (a step computed elsewhere: batched
        copies, the U-shape's middle): the finite check, clipping, the rule's ``before_step``, the optimizer steps,
        ``flops`` on the clock from ``ready_at`` on, the loss ``lv`` (a 0-d tensor or a float) tallied
        (``record``)."""
        if record:
            self._check(lv, tag, where)
        self.before_step(module, optimizers, tag)
        if optimizers and self.train_section.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.train_section.clip_grad_norm)
        for opt in optimizers:
            opt.step()
        self.charge(flops, ready_at)
        if record:
            self.tally.losses.append(lv)
        return lv

    def charge(self, flops: float, ready_at: float = 0.0) -> float:
        """``flops`` of server work from ``ready_at`` on, on the clock and in the round's tally."""
        self.tally.flops += flops
        return self.clock.charge(flops, ready_at)

    def wait_until(self, t: float) -> float:
        return self.clock.wait_until(t)

    def _check(self, loss, tag: Tag, where: str | None = None) -> None:
        """The finite check of a step's loss, deferred to the round's end where the host keeps deferred checks; the
        round's first non-finite step is the tally's ``nonfinite``."""
        tally = self.tally

        def first() -> None:
            if tally.nonfinite is None:
                tally.nonfinite = tag

        where = where or (f"round {tag.round}, client {tag.client} (step {tag.step})" if tag.client >= 0 else
                          f"round {tag.round}, server update {tag.step}")  # a server-only step (Tag client -1)
        check_loss(self.deferred, loss, self.train_section.stop_on_nonfinite, where, first,
                   (tag.round, tag.step, LOSS))

    # ---- answers --------------------------------------------------------------------------------------------------
    def answer(self, b: Batch | Tag, g: torch.Tensor | None, loss) -> Gradient:
        """The client's gradient for ``b`` (a batch or its tag), sent at the server's clock, its norm tallied;
        ``g`` None: nothing goes back for this batch (a teacher stream). The gradient is the tensor itself (a
        message stages it only if it leaves the process)."""
        tag = b if isinstance(b, Tag) else b.tag
        if g is None:
            return Gradient(tag, None, self.clock.now, loss)
        g = g.detach()
        self.tally.grad_norms.append(g.norm())
        return Gradient(tag, g, self.clock.now, loss)

    def message(self, state: dict[str, torch.Tensor], **kw) -> StateMsg:
        """``state`` (tensors) as a message the server sends now, at its clock (a model for the clients)."""
        return StateMsg.packed(state, t_sent=self.clock.now, **kw)

    def revise(self, grads: list[Gradient], values: list) -> list[Gradient]:
        """Gradients just answered, revised (SGLR's sharing): the first ``len(values)`` of ``grads`` carry
        ``values`` instead (same tags, times and losses), the rest are kept; the tallied norms follow."""
        new = [Gradient(g.tag, v.detach() if isinstance(v, torch.Tensor) else v, g.t_sent, g.loss)
               for g, v in zip(grads, values)]
        out = new + list(grads[len(values):])
        # SGLR's sharing is done in host memory: the norms are taken there too, of every gradient of the call
        self.tally.grad_norms[-len(grads):] = [float(np.linalg.norm(transport.pack(g.g) if isinstance(g.g, torch.Tensor)
                                                                    else g.g)) for g in out]
        return out


@contextlib.contextmanager
def frozen(model: torch.nn.Module):
    """Within the block, ``model``'s parameters take no gradient (a pass through it yields only the input's
    gradient); each parameter's ``requires_grad`` is restored afterwards, also when the block raises."""
    before = [(prm, prm.requires_grad) for prm in model.parameters()]
    for prm, _ in before:
        prm.requires_grad_(False)
    try:
        yield model
    finally:
        for prm, flag in before:
            prm.requires_grad_(flag)
