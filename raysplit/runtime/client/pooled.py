"""A client host's pooled split steps: a pooled step's clients on this host in one message (``forward_clients``,
``backward_clients``), packed into one computation where ``runtime.pack_clients`` is on: the streams encoded by
the client's own module forward as one vmapped computation whose graph takes their gradients back in one backward
(the other streams, Semi-SFL's teacher, one at a time). Built on the host's :class:`SplitSteps`, whose forwards,
sends and receipts it uses, so a packed client's activations, clock and update equal its one-at-a-time ones
within float rounding."""

from __future__ import annotations

from raysplit.runtime.client.executor import Forward, ragged_ok
from raysplit.runtime.messages import Activation, Gradient, Tag


class PooledSteps:
    """Several of a host's clients' split steps per call (a component of the client host, over its ``steps``)."""

    def __init__(self, steps):
        self.steps = steps

    def packs(self, items: list) -> bool:
        """Whether a call's forwards may run packed: packing on and not refused by vmap, and nothing around the
        plain forward and backward of the client part (the rule's own backward, a defence at the cut, the U-shape's
        tail, an asynchronous replay). Of these, the streams whose encoder is the client's own module pack; others
        (Semi-SFL's teacher stream) run one at a time."""
        steps = self.steps
        return (steps.executor.pack and steps.executor.unpackable is None and len(items) > 1 and steps.tail is None
                and steps.cut.defence is None and not steps.asynchronous and steps.rule.packable())

    def forward_clients(self, items: list[tuple[list[Tag], int | None]]) -> list[list[Activation]]:
        """:meth:`SplitSteps.forward_many` for several clients of this host (``items``: each client's tags and batch
        size), in order: a pooled step's forwards here in one message. Packed (:meth:`packs`), the streams encoded by the
        client's own module whose inputs have equal shapes (or one sample shape, batches padded, where the model mixes
        no samples: :func:`ragged_ok`) forward as one vmapped computation (:meth:`Executor.forward_together`) whose
        graph waits for all their gradients (:meth:`backward_clients`); the other streams forward one at a time in
        order. Each tag's inputs are drawn in its own stream as unpacked, and each client's streams are sent in
        order, so a packed client's activations and clock equal its one-at-a-time ones within float rounding."""
        steps = self.steps
        if not self.packs(items):
            return [steps.forward_many(tags, bs) for tags, bs in items]
        flat = [(tag, bs) for tags, bs in items for tag in tags]  # client by client, each client's streams in order
        first = {tag.client: steps.meter.now(tag.client) for tag, _ in flat}  # as forward() reads it, first
        slots = {c: steps.slots.activate(c) for c in first}
        encs = [steps.rule.encoder(tag, slots[tag.client]) for tag, _ in flat]
        own = [enc is slots[tag.client].module for (tag, _), enc in zip(flat, encs)]
        if not any(own):
            return [steps.forward_many(tags, bs) for tags, bs in items]
        idx, xs, ys = [], [], []
        done: list[tuple] = [None] * len(flat)  # each tag's (activation, FLOPs)
        for i, (tag, bs) in enumerate(flat):
            idx.append(steps.rule.batch_indices(tag, bs))
            with steps.stream(tag):
                x, y = steps.rule.inputs(tag, idx[i])
                x = x.to(steps.executor.device)
                if not own[i]:  # one at a time, as forward() runs it
                    [done[i]] = steps.executor.forward([Forward(steps.key("fwd", x, tag.client), encs[i], x)])
            xs.append(x)
            ys.append(y)
        ragged = ragged_ok(slots[flat[0][0].client].module)  # batches of different sizes padded into one pack
        shapes: dict[tuple, list[int]] = {}
        for i, x in enumerate(xs):
            if own[i]:  # equal shapes of one cut pack (clients of other cuts hold other blocks)
                cut = steps.cut_of(flat[i][0].client)
                shapes.setdefault((tuple(x.shape[1:] if ragged else x.shape), cut), []).append(i)
        for (_, cut), ii in shapes.items():
            packed = None if len(ii) < 2 else steps.executor.forward_together([encs[i] for i in ii],
                                                                              [xs[i] for i in ii], cut)
            for k, i in enumerate(ii):
                if packed is not None:
                    done[i] = packed[0][k]
                    steps.packed[flat[i][0]] = (packed[1], k)
                    continue
                with steps.stream(flat[i][0]):  # one at a time, as forward() runs it (its inputs drawn again)
                    x = steps.rule.inputs(flat[i][0], idx[i])[0].to(steps.executor.device)
                    [done[i]] = steps.executor.forward([Forward(steps.key("fwd", x, tag.client), encs[i], x)])
        sent = iter([steps.send(tag, first.pop(tag.client) if tag.client in first else steps.meter.now(tag.client),
                                x, y, *out) for (tag, _), x, y, out in zip(flat, xs, ys, done)])
        return [[next(sent) for _ in tags] for tags, _ in items]

    def backward_clients(self, grads: list[Gradient]) -> list[float]:
        """:meth:`SplitSteps.backward` for each gradient, in order; the gradients of a packed forward's clients go
        back through its graph in one backward (:meth:`Packed.backward`), each client's own optimizer then stepping."""
        steps = self.steps
        if not any(g.tag in steps.packed for g in grads):
            return [steps.backward(g) for g in grads]
        out: dict[int, float] = {}
        waiting: dict[int, tuple] = {}  # by id: the pack, its clients (index in grads, t_start, slot, k, g)
        for i, grad in enumerate(grads):
            tag, cid = grad.tag, grad.tag.client
            if tag not in steps.packed:
                out[i] = steps.backward(grad)
                continue
            pack, k = steps.packed.pop(tag)
            t_start = steps.meter.now(cid)
            got = steps.receive(grad, lambda: pack.backward_flops[k])
            if got is None:
                out[i] = steps.settle(grad, t_start, steps.meter.now(cid))
                pack.settle(k)
                continue
            waiting.setdefault(id(pack), (pack, []))[1].append((i, t_start, got[0], k, got[2]))
        for pack, parts in waiting.values():
            pack.backward([(k, g) for _, _, _, k, g in parts])
            for i, t_start, slot, k, _ in parts:
                cid = grads[i].tag.client
                steps.slots.update(cid, slot)
                out[i] = steps.settle(grads[i], t_start, steps.meter.charge_compute(cid, pack.backward_flops[k]))
        return [out[i] for i in range(len(grads))]
