"""A client host's split-learning steps: a forward whose graph waits on the host for its gradient, the backward,
the client's update (:class:`SplitSteps`); the same for several clients in one call, a pooled step's clients on
this host, packed into one computation where ``runtime.pack_clients`` is on, is
:class:`~raysplit.runtime.client.pooled.PooledSteps`."""

from __future__ import annotations

import zlib

import torch

from raysplit.runtime import transport
from raysplit.runtime.client.executor import Forward
from raysplit.runtime.screening import bad_input
from raysplit.runtime.messages import Activation, Gradient, Tag
from raysplit.runtime.screening import (GRADIENT, defer_nonfinite, gradient_form_fault, nonfinite_fault,
                                        screens_nonfinite, where_of)


class SplitSteps:
    """The split-learning steps of a client host (a component of it): its hooks called on the host's client rule
    (``rule()``) in the order :mod:`raysplit.runtime.rules` gives. ``pending``: forwards awaiting their gradient;
    ``packed``: packed forwards awaiting theirs; ``replay``: under the event driver, what rebuilds a pending
    forward from a checkpoint."""

    def __init__(self, plan, rule, slots, data, meter, states, executor, cut, tail, worker_index: int):
        self.rule_of, self.slots, self.data, self.meter = rule, slots, data, meter
        self.states, self.executor, self.cut, self.tail = states, executor, cut, tail
        self.asynchronous = plan.method.asynchronous
        self.screens_nonfinite = screens_nonfinite(plan)
        self.on_bad_client = plan.sections.runtime.faults.on_bad_client
        self.worker_index = worker_index
        self.pending: dict[Tag, torch.Tensor] = {}
        self.packed: dict[Tag, tuple] = {}  # (Packed, index in it)
        self.replay: dict[Tag, tuple] = {}  # (batch indices, module buffers before the forward)

    @property
    def rule(self):
        return self.rule_of()

    def stream(self, tag: Tag):
        """The random stream of a forward: per (client, round, step, stream), wherever the client is hosted."""
        return self.executor.seeded(tag.client, 0, tag.round, tag.step, zlib.crc32(tag.stream.encode()))

    def cut_of(self, cid: int) -> tuple:
        """``(cut,)`` of a client with its own cut (its FLOPs are counted per cut, its packs hold clients of one
        cut); ``()`` where every client holds the same blocks."""
        return (self.states.cut_of(cid),) if self.states.tiered else ()

    def key(self, kind: str, x: torch.Tensor, cid: int) -> tuple:
        """The FLOP key of a client computation: its kind, its input's shape and the client's cut (if its own)."""
        return (kind, tuple(x.shape)) + self.cut_of(cid)

    def forward(self, tag: Tag, batch_size: int | None = None) -> Activation:
        """Client ``tag.client`` forwards its next batch; the graph waits here for the gradient for ``tag``."""
        cid, rule = tag.client, self.rule
        t_start = self.meter.now(cid)
        slot = self.slots.activate(cid)
        idx = rule.batch_indices(tag, batch_size)
        if self.asynchronous:  # what a checkpoint needs to rebuild this forward's graph (load_state_dict)
            self.replay[tag] = (idx, {k: b.detach().clone() for k, b in slot.module.named_buffers()})
        with self.stream(tag):
            x, y = rule.inputs(tag, idx)  # x to the host's device: a rule's own inputs (views) may not be there
            x = x.to(self.executor.device)
            [(out, fl)] = self.executor.forward([Forward(self.key("fwd", x, cid), rule.encoder(tag, slot), x)])
        return self.send(tag, t_start, x, y, out, fl)

    def send(self, tag: Tag, t_start: float, x: torch.Tensor, y, out: torch.Tensor, fl: int) -> Activation:
        """A computed forward leaves: the U-shape keeps its labels, the defence releases what is sent, the graph
        waits for its gradient, compute and upload are charged, the rule's ``after_forward``."""
        cid = tag.client
        y = self.tail.keep(tag, y) if self.tail is not None else y  # U-shaped: an empty array leaves
        nbytes = None
        if self.cut.defence is not None:
            out, nbytes = self.defend(tag, x, out)
        self.pending[tag] = out
        self.meter.charge_compute(cid, fl)
        msg = Activation(tag, out.detach(), y, 0.0, float(self.data.size(cid)))  # staged only if it leaves
        msg.t_sent = self.meter.charge_upload(cid, msg.nbytes if nbytes is None else
                                              nbytes + transport.nbytes(msg.y), "activations")
        self.rule.after_forward(tag, t_start, msg)
        return msg

    def defend(self, tag: Tag, x: torch.Tensor, out: torch.Tensor,
               count: bool = True, rate: float | None = None) -> tuple[torch.Tensor, int | None]:
        """``privacy.defence`` at the cut (:meth:`ClientCut.release`): what leaves instead of ``out``, drawn from its
        own per-step stream, and its bytes (None: the tensor's own). Counted against the client's budget at rate
        batch / its samples (``count``: not when a checkpoint rebuilds it; ``rate``: another rate)."""
        cid = tag.client
        rate = None if not count else rate if rate is not None else round(len(x) / self.data.size(cid), 12)
        with self.executor.seeded(cid, 2, tag.round, tag.step, zlib.crc32(tag.stream.encode())):
            return self.cut.release(tag, x, out, rate)

    def forward_many(self, tags: list[Tag], batch_size: int | None = None) -> list[Activation]:
        """Several forwards in one call, in order (one per stream of a client step)."""
        return [self.forward(tag, batch_size) for tag in tags]

    def backward(self, grad: Gradient) -> float:
        """Apply the gradient for the activation of its tag; the client's clock (or the rule's ``after_backward``'s)."""
        tag, cid = grad.tag, grad.tag.client
        if grad.rejected and tag not in self.pending:  # withheld for a tag that was not ours (a forged round)
            self.slots.drop(cid, grad.rejected)
            return self.meter.now(cid)
        t_start = self.meter.now(cid)
        return self.settle(grad, t_start, self._apply(grad))

    def settle(self, grad: Gradient, t_start: float, t_end: float) -> float:
        t = self.rule.after_backward(grad, t_start, t_end)
        return t_end if t == t_end else self.meter.set_clock(grad.tag.client, t)

    def receive(self, grad: Gradient, fault_flops=None) -> tuple | None:
        """A gradient arrives for a pending forward: download and step counted, screened (a faulty one drops the
        client, charged as the backward it stands for: ``fault_flops()``, else a backward of zeros). Returns the
        client's (slot, pending activation, gradient on the device), or None where nothing is to descend."""
        tag, cid = grad.tag, grad.tag.client
        try:
            out = self.pending.pop(tag)
        except KeyError:
            raise KeyError(f"gradient for {tag} has no pending activation on worker {self.worker_index}; "
                           f"pending: {sorted(self.pending)[:5]}") from None
        self.replay.pop(tag, None)
        slot = self.states.slots[cid]
        self.meter.charge_download(cid, grad.nbytes, grad.t_sent, "gradients")
        self.meter.count(cid, steps=1)
        why = grad.rejected
        if not why and grad.g is not None:
            why = self.screen(tag, grad.g, out)
        if why and not grad.rejected:
            if self.on_bad_client == "fail":
                raise bad_input(where_of(tag), f"rejected by the client: {why}")
            # the backward pass is charged as if it had run (the event loop predicts the client's clock so)
            self.meter.charge_compute(cid, fault_flops() if fault_flops is not None else
                                      self.rule.backward_pass(tag, out, torch.zeros_like(out)))
        if why:
            self.slots.drop(cid, why)
        if grad.g is None or cid in self.slots.dropped:
            return None
        return slot, out, transport.unpack(grad.g, self.executor.device)

    def screen(self, tag: Tag, g, out: torch.Tensor) -> str:
        """What is wrong with the gradient ``g`` for the activation ``out`` ('' if nothing): its form now; its
        values (NaN or inf) now where the client must decide (``on_bad_client: drop``) or where they are host
        memory (a gradient that travelled), else counted on the device and judged with the executor's deferred
        checks (at the round's end; under the event driver, at the end of the client's job), failing the run
        naming the same client, round and step."""
        why = gradient_form_fault(g, out)
        if why or not self.screens_nonfinite:
            return why
        if isinstance(g, torch.Tensor) and self.on_bad_client == "fail":
            defer_nonfinite(self.executor.deferred, g, "gradient",
                            lambda w: bad_input(where_of(tag), f"rejected by the client: {w}"),
                            (tag.round, tag.step, GRADIENT))
            return ""
        return nonfinite_fault(g, "gradient")

    def _apply(self, grad: Gradient) -> float:
        tag, cid = grad.tag, grad.tag.client
        leak = self.cut.take_leak(tag)
        got = self.receive(grad)
        if got is None:
            return self.meter.now(cid)
        slot, out, g = got
        if self.tail is None:  # U-shaped: zeroed before the tail's gradients (ClientTail.step), stepped with them
            slot.optimizer.zero_grad(set_to_none=True)
        if leak is not None:  # NoPeek's term first (its graph is the activation's), then the server's gradient
            self.cut.nopeek_loss(leak).backward(retain_graph=True)
        fl = self.rule.backward_pass(tag, out, g)
        self.slots.update(cid, slot)
        return self.meter.charge_compute(cid, fl)
