"""The server's two halves of a U-shaped split step (``model.tail_cut``; runtime/client/tail.py says the whole
step): the middle's forward on an arrived activation, and its backward and step on the gradient the client's tail
returns."""

from __future__ import annotations

import time

from raysplit.models.tiers import entered
from raysplit.runtime import transport
from raysplit.runtime.messages import Activation, Batch, Gradient, MiddleOut, Tag, TailGradient


class Middle:
    """The server's two halves of a U-shaped step on ``models[key]`` (``"main"``, or a client's copy), the middle's
    graph kept per tag in between (a component of the server host, with its ``trainer`` and ``models``)."""

    def __init__(self, trainer, models, device):
        self.trainer, self.models, self.device = trainer, models, device
        self.kept: dict[Tag, tuple] = {}  # the middle's (input, output) awaiting the tail's gradient

    def forward(self, act: Activation, key="main") -> MiddleOut:
        """Run the middle on an arrived activation (from its arrival on, on the server's clock); its output goes to
        the client's tail."""
        t_wall = time.perf_counter()
        b = Batch.of(act, self.device)
        x = b.x.requires_grad_(True)
        kind = "main" if key == "main" else "copy"
        cut = self.trainer.cut_of(b.tag.client)  # tiered: the middle entered at the client's cut
        module = self.models[key].module
        with entered(module, cut):
            z, fl = self.trainer.flops.run(("middle_fwd", kind, tuple(x.shape)) + (() if cut is None else (cut,)),
                                           lambda: module(x))
        self.trainer.charge(fl, b.t_sent)
        self.kept[b.tag] = (x, z)
        self.trainer.tally.busy_wall += time.perf_counter() - t_wall
        return MiddleOut(b.tag, z.detach(), self.trainer.clock.now)  # staged only if it leaves the process

    def backward(self, back: TailGradient | Gradient, key="main") -> Gradient:
        """Back-propagate the client's gradient of its loss through the middle, step ``models[key]`` (clipping and
        the rule's ``before_step`` first: :meth:`Trainer.settle`) and answer the activation's gradient. A gradient
        withheld for a rejected activation passes through."""
        if not isinstance(back, TailGradient):
            return back
        t_wall = time.perf_counter()
        x, z = self.kept.pop(back.tag)
        slot = self.models[key]
        g = transport.unpack(back.g, self.device, writable=True)
        kind = "main" if key == "main" else "copy"

        def backward():
            slot.optimizer.zero_grad(set_to_none=True)
            z.backward(g)

        cut = self.trainer.cut_of(back.tag.client)
        _, fl = self.trainer.flops.run(("middle_bwd", kind, tuple(x.shape)) + (() if cut is None else (cut,)),
                                       backward)
        self.trainer.settle(back.loss, fl, slot.module, [slot.optimizer], tag=back.tag, ready_at=back.t_sent,
                            record=False)
        self.trainer.tally.busy_wall += time.perf_counter() - t_wall
        return self.trainer.answer(back.tag, x.grad, back.loss)
