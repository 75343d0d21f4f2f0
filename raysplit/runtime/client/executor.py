"""A client host's executor: it runs the clients' computations (forward passes of the client part, backward passes
of the server's gradients, local training steps) and counts their FLOPs once per key
(``torch.utils.flop_counter`` through :class:`~raysplit.clock.FlopCache`), which the cost meter then charges.

It takes the work of several clients at once (:meth:`Executor.forward` and :meth:`Executor.backward` take lists),
so that an executor on an accelerator can pack many clients into one kernel; forwards and backwards run one client
at a time, in order, on the host's device (on the CPU, what every result of raysplit so far was computed with), and
clients' own training steps, and the forwards and backwards of a pooled step's clients, run packed where
``runtime.pack_clients`` is on (:meth:`Executor.train_together`, :meth:`Executor.forward_together`). A client's
computation runs inside its own random stream (:meth:`Executor.seeded`), so where it runs changes nothing."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from torch.func import functional_call

from raysplit.clock import FlopCache
from raysplit.models.adapters import copy_sharing_base
from raysplit.runtime.batched import copies_backward, stack_own, vmap_refused
from raysplit.runtime.devices import seed_generators
from raysplit.runtime.screening import Deferred


@dataclass
class Forward:
    """One client's forward: ``encode(x)``; its FLOPs counted under ``key``."""

    key: tuple
    encode: Callable[[torch.Tensor], torch.Tensor]
    x: torch.Tensor


@dataclass
class Backward:
    """One client's backward: ``out.backward(g)``; its FLOPs counted under ``key``."""

    key: tuple
    out: torch.Tensor
    g: torch.Tensor


class Packed:
    """Several clients' forwards computed as one (:meth:`Executor.forward_together`): their stacked parameters,
    whose gradients :meth:`backward` hands to each client's own module, the per-client activations (views of
    one output, one graph), and the FLOPs of each client's backward on its own batch."""

    def __init__(self, modules: list[torch.nn.Module], params: dict, outs: tuple, backward_flops: list[int]):
        self.modules, self.params, self.outs, self.backward_flops = modules, params, outs, backward_flops
        self.waiting = set(range(len(modules)))  # clients whose gradient has not come back yet

    def settle(self, k: int) -> None:
        """Client ``k``'s activation will get no backward (its gradient was withheld or rejected)."""
        self.waiting.discard(k)

    def backward(self, parts: list[tuple[int, torch.Tensor]]) -> None:
        """One backward through the shared graph for the clients ``k`` of ``parts`` with their gradients ``g``;
        each client's module's parameters receive their own gradient (``.grad``, as after its own backward from
        zeroed gradients). The graph is kept while other clients of the pack still wait for theirs."""
        for k, _ in parts:
            self.waiting.discard(k)
        for p in self.params.values():
            p.grad = None
        torch.autograd.backward([self.outs[k] for k, _ in parts], [g for _, g in parts],
                                retain_graph=bool(self.waiting))
        with torch.no_grad():
            for k, _ in parts:
                for name, prm in self.modules[k].named_parameters():
                    g = self.params[name].grad if name in self.params else None  # shared frozen: no gradient
                    prm.grad = None if g is None else g[k]


class Executor:
    """Runs client computations on ``device`` one client at a time and counts their FLOPs; ``seed``: the run's,
    from which each client's random streams are drawn; ``loss(out, y)``: the model's training loss
    (:attr:`~raysplit.runtime.plan.ModelFacts.loss`)."""

    def __init__(self, seed: int, device: torch.device = torch.device("cpu"), pack: bool | str = False,
                 loss: Callable = F.cross_entropy):
        self.loss = loss
        self.device = device
        self.flops = FlopCache()
        self.seed = seed
        # runtime.pack_clients: several clients' steps as one batched computation (auto: on an accelerator only,
        # where small per-client kernels leave it idle; on a CPU packing was measured 1.08-1.24x slower)
        self.pack = pack is True or (pack == "auto" and device.type != "cpu")
        self.unpackable: str | None = None  # why vmap refused the clients' model (then one client after another)
        self.packed_steps = 0  # client steps that ran packed
        self.unpacked_steps = 0  # client steps a pack was asked for that ran one at a time (vmap refused the model)
        # checks of values on the device (the losses' finite check, the gradients' NaN/inf screen), read at the
        # round's end (ClientHost.end_round): the host's step path never waits on the device
        self.deferred = Deferred()

    def pack_counts(self) -> dict:
        """How this executor's client steps ran: packed, or one at a time where a pack was asked for (and why)."""
        return {"packed_steps": self.packed_steps, "unpacked_steps": self.unpacked_steps,
                "unpackable": self.unpackable}

    @contextlib.contextmanager
    def seeded(self, cid: int, *salt: int):
        """Client computations draw from a generator seeded per (client, salt), so their randomness (dropout,
        augmentation) does not depend on which worker hosts the client or what ran before on it."""
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
            seed_generators(int(np.random.default_rng([self.seed, 0xC11, cid, *salt]).integers(2**62)), self.device)
            yield

    def forward(self, work: list[Forward]) -> list[tuple[torch.Tensor, int]]:
        """Each client's activation and the FLOPs of computing it, in the order of ``work``."""
        return [self.flops.run(w.key, lambda w=w: w.encode(w.x)) for w in work]

    def backward(self, work: list[Backward]) -> list[int]:
        """Back-propagate each client's gradient into its graph; the FLOPs of each."""
        return [self.flops.run(w.key, lambda w=w: w.out.backward(w.g))[1] for w in work]

    def run(self, key: tuple, fn: Callable[[], Any], batch: int | None = None) -> tuple[Any, int]:
        """A computation of its own (a local training step, SplitGP's surrogate backward): ``fn()`` and its FLOPs
        (:meth:`FlopCache.run`)."""
        return self.flops.run(key, fn, batch)

    def train_together(self, key: tuple, modules: list[torch.nn.Module], xs: list[torch.Tensor],
                       ys: list[torch.Tensor]) -> list[tuple[float, int]] | None:
        """One training step's forward, loss and backward of several clients at once (modules of one architecture,
        batches of equal shapes): their parameters and buffers stacked and the step vmapped
        (:func:`~raysplit.runtime.batched.copies_backward`); each module's parameters receive its own gradients
        and its buffers their new values, for its own optimizer to step. Returns each client's (loss, FLOPs of its
        step, counted once per ``key`` on a throwaway copy; the loss a 0-d tensor, not read), or None where vmap
        refuses the model (random operations such as dropout, data-dependent control flow): remembered, and the
        caller trains them one at a time (counted in ``unpacked_steps``)."""
        if self.unpackable is not None:
            self.unpacked_steps += len(modules)
            return None
        try:
            losses, _ = copies_backward(modules, torch.stack(xs), torch.stack(ys), self.loss)
        except RuntimeError as e:
            if not vmap_refused(e):
                raise
            self.unpackable = f"{type(e).__name__}: {e}"
            self.unpacked_steps += len(modules)
            return None

        def one():
            self.loss(copy_sharing_base(modules[0])(xs[0]), ys[0]).backward()

        fl = self.flops.count(key, one)
        self.packed_steps += len(modules)
        losses = losses.detach()
        return [(losses[i], fl) for i in range(len(modules))]

    def forward_together(self, modules: list[torch.nn.Module], xs: list[torch.Tensor],
                         key_suffix: tuple = ()) -> tuple[list[tuple[torch.Tensor, int]], Packed] | None:
        """Several clients' forwards at once (modules of one architecture, inputs of one sample shape): parameters
        and buffers stacked (a language model's adapters only, over the one frozen base its clients share:
        :func:`~raysplit.runtime.batched.stack_own`), the forward vmapped; each module's buffers receive their new values (BatchNorm's running
        statistics). Batches of different sizes (MergeSFL's per-client batches) are padded with zeros to the largest
        and each client's activation is its own rows of the output (FedJAX's pad-and-mask), which is exact where no
        layer mixes the samples of a batch (:func:`ragged_ok`; the caller packs only equal shapes otherwise): the
        padded rows get no gradient. Returns each client's (activation, FLOPs of its forward on its own batch,
        counted once per shape on a throwaway copy, as :meth:`forward` counts it) and the :class:`Packed` whose graph
        waits for their gradients; None where vmap refuses the model (remembered: the caller forwards them one at a
        time). ``key_suffix``: what the FLOP keys add (a tiered client's cut)."""
        if self.unpackable is not None:
            self.unpacked_steps += len(modules)
            return None
        params, buffers = stack_own(modules)  # a language model's adapters only, over its one frozen base
        base = modules[0]  # functional_call swaps the stacked tensors in for the call and restores base's own
        sizes = [len(x) for x in xs]
        top = max(sizes)
        if min(sizes) < top:
            xs_in = [x if len(x) == top else torch.cat([x, x.new_zeros((top - len(x), *x.shape[1:]))]) for x in xs]
        else:
            xs_in = xs

        def one(p, b, x):
            return functional_call(base, (p, b), (x,))

        try:
            out = torch.vmap(one, randomness="error")(params, buffers, torch.stack(xs_in))
        except RuntimeError as e:
            if not vmap_refused(e):
                raise
            self.unpackable = f"{type(e).__name__}: {e}"
            self.unpacked_steps += len(modules)
            return None
        with torch.no_grad():
            for i, m in enumerate(modules):
                for name, buf in m.named_buffers():
                    if name in buffers:
                        buf.copy_(buffers[name][i])
        outs = tuple(o if n == top else o[:n] for o, n in zip(out.unbind(0), sizes))
        fls, bfls = [], []
        for x, o in zip(xs, outs):
            fls.append(self.flops.count(("fwd", tuple(x.shape)) + key_suffix,
                                        lambda x=x: copy_sharing_base(base)(x)))
            bkey = ("bwd", tuple(o.shape)) + key_suffix
            if bkey not in self.flops:  # one client's backward alone, its forward run outside the count
                y = copy_sharing_base(base)(x)
                self.flops.count(bkey, lambda y=y: y.backward(torch.zeros_like(y)))
            bfls.append(self.flops.count(bkey, None))
        self.packed_steps += len(modules)
        return [(o, fl) for o, fl in zip(outs, fls)], Packed(modules, params, outs, bfls)


def ragged_ok(module: torch.nn.Module) -> bool:
    """Whether batches of different sizes may be padded into one packed forward of ``module``: no layer mixes the
    samples of a batch (BatchNorm in training mode does: padded rows would enter its statistics)."""
    return not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in module.modules())
