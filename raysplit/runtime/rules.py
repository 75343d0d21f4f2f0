"""Client rules: how a method changes what its clients do around a step, without subclassing the client host.

A method whose clients do more than plain split learning (FedProx's proximal term, SCAFFOLD's correction,
Semi-SFL's two views, SplitGP's local loss, PiPar's pipelined clock, Ampere's auxiliary net) gives its
``Algorithm.client_rule``, a subclass of :class:`ClientRule` that overrides the hooks it needs. The client host
(:class:`~raysplit.runtime.client_host.ClientHost`) makes one rule when it is built and calls its hooks in this
order, which the rule never has to reproduce (no ``super()`` chain):

1. a client's first use in a round (or job): its slot is made (its model and optimizer loaded), then
   :meth:`~ClientRule.on_activate`;
2. a forward: :meth:`~ClientRule.batch_indices` (which samples), :meth:`~ClientRule.inputs` (model input and the
   labels sent) and :meth:`~ClientRule.encoder` (the module that encodes them), inside the client's random stream;
   the defence at the cut (``privacy``); the activation is charged and sent; :meth:`~ClientRule.after_forward`;
3. its gradient: NoPeek's term (``privacy``), :meth:`~ClientRule.backward_pass`, :meth:`~ClientRule.before_step`,
   clipping (``train.clip_grad_norm``: it sees the whole gradient), the optimizer's step, the compute charged,
   :meth:`~ClientRule.after_backward` (the client's clock after the step);
4. the round's (job's) end: the client's weights and optimizer state stored, then :meth:`~ClientRule.on_release`.

``self.host`` is the client host: its components (``data``: samples and cursors; ``meter``: the clients' clocks
and counters; ``states``: models, optimizer states and slots; ``executor``: runs computations and counts their
FLOPs), ``spec``, ``params`` (the method's validated ``Params``), ``round`` and ``seeded(cid, *salt)``. Other
public methods of a rule are what the method's ``run_round`` calls on the workers (``rt.workers.<name>(...)``,
``rt.client(cid).<name>(...)``). ``client_fields`` names the rule's per-client mappings that move with a client
to another host; ``checkpointed`` the state checkpoints carry (:class:`~raysplit.runtime.hostspec.Checkpointed`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from raysplit.runtime.executor import Backward
from raysplit.runtime.hostspec import Checkpointed, ModelSlot, build_parts
from raysplit.runtime.messages import Activation, Gradient, Tag


class ClientRule(Checkpointed):
    """Plain split learning's client: every hook's default (the module docstring gives their order)."""

    client_fields: tuple[str, ...] = ()

    def __init__(self, host):
        self.host = host

    def build_module(self) -> torch.nn.Module:
        """A fresh client model (its weights are loaded after): the client part."""
        return build_parts(self.host.spec)[0]

    def on_activate(self, cid: int, slot: ModelSlot) -> None:
        """Client ``cid`` got its slot for the round (weights and optimizer loaded)."""

    def batch_indices(self, tag: Tag, batch_size: int | None) -> np.ndarray:
        """The samples of this forward: the client's next batch."""
        return self.host.data.draw(tag.client, batch_size)

    def inputs(self, tag: Tag, idx: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Model input and the labels sent with the activation."""
        x, y = self.host.data.batch(idx)
        return x, y.numpy()

    def encoder(self, tag: Tag, slot: ModelSlot) -> Callable[[torch.Tensor], torch.Tensor]:
        """The module that encodes this forward: the client's model."""
        return slot.module

    def after_forward(self, tag: Tag, t_start: float, msg: Activation) -> None:
        """The activation left at ``msg.t_sent``; the client's clock was ``t_start`` before the forward."""

    def backward_pass(self, tag: Tag, out: torch.Tensor, g: torch.Tensor) -> int:
        """Back-propagate the server's gradient ``g`` of the activation ``out``; returns the FLOPs."""
        return self.host.executor.backward([Backward(("bwd", tuple(out.shape)), out, g)])[0]

    def before_step(self, cid: int, slot: ModelSlot) -> None:
        """The gradients are in ``slot.module``; the optimizer steps next (after clipping)."""

    def after_backward(self, grad: Gradient, t_start: float, t_end: float) -> float:
        """The client's clock after its update: ``t_end`` (a timing model may replace it); ``t_start`` was its
        clock when the gradient arrived."""
        return t_end

    def on_release(self, cid: int) -> None:
        """Client ``cid``'s round (job) is over; its weights and optimizer state are stored."""
