"""A client host's split-learning steps: a forward whose graph waits on the host for its gradient, the backward,
the client's update; and the same for several clients in one call (a pooled step's clients on this host), packed
into one computation where ``runtime.pack_clients`` is on (:meth:`ClientSteps.forward_clients`)."""

from __future__ import annotations

import zlib

import torch

from raysplit.runtime import transport
from raysplit.runtime.executor import Forward, ragged_ok
from raysplit.runtime.hostspec import _bad_input
from raysplit.runtime.messages import Activation, Gradient, Tag
from raysplit.runtime.screening import gradient_fault, screens_nonfinite, where_of


class ClientSteps:
    """Mixed into :class:`~raysplit.runtime.client_host.ClientHost`: the split-learning step, its hooks called on
    the host's client rule in the order :mod:`raysplit.runtime.rules` gives."""

    def _stream(self, tag: Tag):
        """The random stream of a forward: per (client, round, step, stream), wherever the client is hosted."""
        return self.executor.seeded(tag.client, 0, tag.round, tag.step, zlib.crc32(tag.stream.encode()))

    def forward(self, tag: Tag, batch_size: int | None = None) -> Activation:
        """Client ``tag.client`` forwards its next batch; the graph waits here for the gradient for ``tag``."""
        cid, rule = tag.client, self.rule
        t_start = self.meter.now(cid)
        slot = self.activate(cid)
        idx = rule.batch_indices(tag, batch_size)
        if self.spec.asynchronous:  # what a checkpoint needs to rebuild this forward's graph (load_state_dict)
            self._replay[tag] = (idx, {k: b.detach().clone() for k, b in slot.module.named_buffers()})
        with self._stream(tag):
            x, y = rule.inputs(tag, idx)  # x to the host's device: a rule's own inputs (views) may not be there
            x = x.to(self.executor.device)
            [(out, fl)] = self.executor.forward([Forward(("fwd", tuple(x.shape)), rule.encoder(tag, slot), x)])
        return self._sent(tag, t_start, x, y, out, fl)

    def _sent(self, tag: Tag, t_start: float, x: torch.Tensor, y, out: torch.Tensor, fl: int) -> Activation:
        """A computed forward leaves: the U-shape keeps its labels, the defence releases what is sent, the graph
        waits for its gradient, compute and upload are charged, the rule's ``after_forward``."""
        cid = tag.client
        y = self.tail.keep(tag, y) if self.tail is not None else y  # U-shaped: an empty array leaves
        nbytes = None
        if self.cut.defence is not None:
            out, nbytes = self.defend(tag, x, out)
        self.pending[tag] = out
        self.meter.charge_compute(cid, fl)
        msg = Activation(tag, transport.pack(out), y, 0.0, float(self.data.size(cid)))
        msg.t_sent = self.meter.charge_upload(cid, msg.nbytes if nbytes is None else nbytes + msg.y.nbytes,
                                              "activations")
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

    def packs(self, items: list) -> bool:
        """Whether a call's forwards may run packed: packing on and not refused by vmap, and nothing around the
        plain forward and backward of the client part (the rule's own backward, a defence at the cut, the U-shape's
        tail, an asynchronous replay). Of these, the streams whose encoder is the client's own module pack; others
        (Semi-SFL's teacher stream) run one at a time."""
        return (self.executor.pack and self.executor.unpackable is None and len(items) > 1 and self.tail is None
                and self.cut.defence is None and not self.spec.asynchronous
                and self.rule.packable())

    def forward_clients(self, items: list[tuple[list[Tag], int | None]]) -> list[list[Activation]]:
        """:meth:`forward_many` for several clients of this host (``items``: each client's tags and batch size), in
        order: a pooled step's forwards here in one message. Packed (:meth:`packs`), the streams encoded by the
        client's own module whose inputs have equal shapes (or one sample shape, batches padded, where the model mixes
        no samples: :func:`ragged_ok`) forward as one vmapped computation (:meth:`Executor.forward_together`) whose
        graph waits for all their gradients (:meth:`backward_clients`); the other streams forward one at a time in
        order. Each tag's inputs are drawn in its own stream as unpacked, and each client's streams are sent in
        order, so a packed client's activations and clock equal its one-at-a-time ones within float rounding."""
        if not self.packs(items):
            return [self.forward_many(tags, bs) for tags, bs in items]
        flat = [(tag, bs) for tags, bs in items for tag in tags]  # client by client, each client's streams in order
        first = {tag.client: self.meter.now(tag.client) for tag, _ in flat}  # as forward() reads it, before activate
        slots = {c: self.activate(c) for c in first}
        encs = [self.rule.encoder(tag, slots[tag.client]) for tag, _ in flat]
        own = [enc is slots[tag.client].module for (tag, _), enc in zip(flat, encs)]
        if not any(own):
            return [self.forward_many(tags, bs) for tags, bs in items]
        idx, xs, ys = [], [], []
        done: list[tuple] = [None] * len(flat)  # each tag's (activation, FLOPs)
        for i, (tag, bs) in enumerate(flat):
            idx.append(self.rule.batch_indices(tag, bs))
            with self._stream(tag):
                x, y = self.rule.inputs(tag, idx[i])
                x = x.to(self.executor.device)
                if not own[i]:  # one at a time, as forward() runs it
                    [done[i]] = self.executor.forward([Forward(("fwd", tuple(x.shape)), encs[i], x)])
            xs.append(x)
            ys.append(y)
        ragged = ragged_ok(slots[flat[0][0].client].module)  # batches of different sizes padded into one pack
        shapes: dict[tuple, list[int]] = {}
        for i, x in enumerate(xs):
            if own[i]:
                shapes.setdefault(tuple(x.shape[1:] if ragged else x.shape), []).append(i)
        for ii in shapes.values():
            packed = None if len(ii) < 2 else self.executor.forward_together([encs[i] for i in ii], [xs[i] for i in ii])
            for k, i in enumerate(ii):
                if packed is not None:
                    done[i] = packed[0][k]
                    self.packed[flat[i][0]] = (packed[1], k)
                    continue
                with self._stream(flat[i][0]):  # one at a time, as forward() runs it (its inputs drawn again)
                    x = self.rule.inputs(flat[i][0], idx[i])[0].to(self.executor.device)
                    [done[i]] = self.executor.forward([Forward(("fwd", tuple(x.shape)), encs[i], x)])
        sent = iter([self._sent(tag, first.pop(tag.client) if tag.client in first else self.meter.now(tag.client),
                                x, y, *out)
                     for (tag, _), x, y, out in zip(flat, xs, ys, done)])
        return [[next(sent) for _ in tags] for tags, _ in items]

    def backward(self, grad: Gradient) -> float:
        """Apply the gradient for the activation of its tag; the client's clock (or the rule's ``after_backward``'s)."""
        tag, cid = grad.tag, grad.tag.client
        if grad.rejected and tag not in self.pending:  # withheld for a tag that was not ours (a forged round)
            self.drop(cid, grad.rejected)
            return self.meter.now(cid)
        t_start = self.meter.now(cid)
        return self._after(grad, t_start, self._apply(grad))

    def _after(self, grad: Gradient, t_start: float, t_end: float) -> float:
        t = self.rule.after_backward(grad, t_start, t_end)
        return t_end if t == t_end else self.meter.set_clock(grad.tag.client, t)

    def backward_clients(self, grads: list[Gradient]) -> list[float]:
        """:meth:`backward` for each gradient, in order; the gradients of a packed forward's clients go back through
        its graph in one backward (:meth:`Packed.backward`), each client's own optimizer then stepping."""
        if not any(g.tag in self.packed for g in grads):
            return [self.backward(g) for g in grads]
        out: dict[int, float] = {}
        waiting: dict[int, tuple] = {}  # by id: the pack, its clients (index in grads, t_start, slot, k, g)
        for i, grad in enumerate(grads):
            tag, cid = grad.tag, grad.tag.client
            if tag not in self.packed:
                out[i] = self.backward(grad)
                continue
            pack, k = self.packed.pop(tag)
            t_start = self.meter.now(cid)
            got = self._receive(grad, lambda: pack.backward_flops[k])
            if got is None:
                out[i] = self._after(grad, t_start, self.meter.now(cid))
                pack.settle(k)
                continue
            waiting.setdefault(id(pack), (pack, []))[1].append((i, t_start, got[0], k, got[2]))
        for pack, parts in waiting.values():
            pack.backward([(k, g) for _, _, _, k, g in parts])
            for i, t_start, slot, k, _ in parts:
                cid = grads[i].tag.client
                self._update(cid, slot)
                out[i] = self._after(grads[i], t_start, self.meter.charge_compute(cid, pack.backward_flops[k]))
        return [out[i] for i in range(len(grads))]

    def _receive(self, grad: Gradient, fault_flops=None) -> tuple | None:
        """A gradient arrives for a pending forward: download and step counted, screened (a faulty one drops the
        client, charged as the backward it stands for: ``fault_flops()``, else a backward of zeros). Returns the
        client's (slot, pending activation, gradient on the device), or None where nothing is to descend."""
        tag, cid = grad.tag, grad.tag.client
        try:
            out = self.pending.pop(tag)
        except KeyError:
            raise KeyError(f"gradient for {tag} has no pending activation on worker {self.worker_index}; "
                           f"pending: {sorted(self.pending)[:5]}") from None
        self._replay.pop(tag, None)
        slot = self.states.slots[cid]
        self.meter.charge_download(cid, grad.nbytes, grad.t_sent, "gradients")
        self.meter.count(cid, steps=1)
        why = grad.rejected
        if not why and grad.g is not None:
            why = gradient_fault(grad.g, out, screens_nonfinite(self.spec))
        if why and not grad.rejected:
            if self.spec.on_bad_client == "fail":
                raise _bad_input(where_of(tag), f"rejected by the client: {why}")
            # the backward pass is charged as if it had run (the event loop predicts the client's clock so)
            self.meter.charge_compute(cid, fault_flops() if fault_flops is not None else
                                      self.rule.backward_pass(tag, out, torch.zeros_like(out)))
        if why:
            self.drop(cid, why)
        if grad.g is None or cid in self.dropped:
            return None
        return slot, out, transport.unpack(grad.g, self.executor.device)

    def _apply(self, grad: Gradient) -> float:
        tag, cid = grad.tag, grad.tag.client
        leak = self.cut.take_leak(tag)
        got = self._receive(grad)
        if got is None:
            return self.meter.now(cid)
        slot, out, g = got
        if self.tail is None:  # U-shaped: zeroed before the tail's gradients (ClientTail.step), stepped with them
            slot.optimizer.zero_grad(set_to_none=True)
        if leak is not None:  # NoPeek's term first (its graph is the activation's), then the server's gradient
            self.cut.nopeek_loss(leak).backward(retain_graph=True)
        fl = self.rule.backward_pass(tag, out, g)
        self._update(cid, slot)
        return self.meter.charge_compute(cid, fl)
