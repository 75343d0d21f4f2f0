"""Rules: how a method changes what its clients (and its server) do, without subclassing the hosts.

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

The server side is the same idea: a method's server state, its server steps and its server calls are its
``Algorithm.server_rule`` (:class:`ServerRule`; :class:`AsyncRule` for asynchronous methods), whose hooks the server
host calls at fixed points (their list: :class:`ServerRule`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from raysplit.runtime.executor import Backward
from raysplit.runtime.hostspec import Checkpointed, ModelSlot, build_parts
from raysplit.runtime.messages import Activation, Gradient, StateMsg, Tag


class ClientRule(Checkpointed):
    """Plain split learning's client: every hook's default (the module docstring gives their order)."""

    client_fields: tuple[str, ...] = ()

    def __init__(self, host):
        self.host = host

    @classmethod
    def packable(cls) -> bool:
        """Whether this rule's clients can take their split steps packed (``runtime.pack_clients``): its backward
        is the plain one (a rule's own encoder only keeps that stream one at a time)."""
        return cls.backward_pass is ClientRule.backward_pass

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
        return x, y.cpu().numpy()

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


class ServerRule(Checkpointed):
    """What a method's server does beyond serving plain split steps, without subclassing the server host.

    A method gives its ``Algorithm.server_rule``, a subclass that keeps the method's own server state (made in
    ``__init__``, after the host's) and overrides the hooks it needs; the server host
    (:class:`~raysplit.runtime.server_host.ServerHost`) makes one rule when it is built and calls the hooks at
    fixed points, which the rule never has to reproduce (no ``super()`` chain):

    - :meth:`on_reset_round` when the host resets its per-round counters, :meth:`on_begin_round` once it has begun
      a round (its clock and learning rates set);
    - :meth:`on_fork` after the host forked per-client copies of its model, :meth:`before_merge` before it
      averages them back;
    - :meth:`before_step` when a server step's gradients are in a module, before clipping and the optimizer step;
    - :meth:`client_encoder` where the host needs the module a client encodes with (evaluation, screening);
    - :meth:`round_metrics` at the round's end (the method's numbers, logged under ``method/``);
    - :meth:`save` / :meth:`restore` with the server's checkpoint (default: the names in ``checkpointed``).

    The rule's other public methods are the method's server calls: its server steps, given to
    ``rt.split_steps`` / ``rt.pooled_steps`` by reference (``rt.pooled_steps(clients, steps, CycleServer.cycle_step)``;
    a step decorated with :func:`~raysplit.runtime.messages.batch_step` receives :class:`Batch` es), and what
    ``run_round`` calls as ``rt.server.<name>(...)``. ``self.host`` is the server host: ``models`` (``"main"`` and
    the copies), ``spec``, ``params``, ``device``, ``round``, ``clock``, the step helpers (``step_through``,
    ``step_batch``, ``answer``, ``revise``, ``frozen``, ``wait_until``) and ``fork``/``merge``."""

    def __init__(self, host):
        self.host = host

    def client_encoder(self) -> torch.nn.Module:
        """The module whose output a client sends (evaluation encodes the test set with it): the client part."""
        return self.host.eval_client

    def on_begin_round(self, rnd: int) -> None:
        """Round ``rnd`` began on the server."""

    def on_reset_round(self) -> None:
        """The host's per-round counters were reset (at each round's start, and once when the host is built)."""

    def on_fork(self, keys: list) -> None:
        """``models[k]`` were just forked from the main model for every ``k`` of ``keys``."""

    def before_merge(self, weights: dict) -> None:
        """The copies ``weights`` names are averaged into the main model (and dropped) next."""

    def before_step(self, module: torch.nn.Module, optimizers: list, tag: Tag) -> None:
        """A server step's gradients are in ``module``; clipping and ``optimizers``' steps follow."""

    def round_metrics(self) -> dict:
        """The round is over: the method's numbers of it, logged under ``method/``."""
        return {}

    def save(self, st: dict) -> None:
        """Add the rule's state to the server's checkpoint ``st`` (default: its ``checkpointed`` names under
        ``st["own"]``, beside the host's)."""
        st["own"].update(self.own_state())

    def restore(self, st: dict) -> None:
        """Take the rule's state back from a checkpoint :meth:`save` wrote."""
        self.load_own_state(st.get("own", {}))


class AsyncRule(ServerRule):
    """The server rule of an asynchronous method: the hooks the event loop calls in simulated-time order
    (:mod:`raysplit.runtime.events`), defaulting to plain asynchronous split learning: the server steps on every
    arrival, and the global model is the uniform average of every ``active`` uploads (a full model buffer).

    - :meth:`on_job_start`: a client took a slot;
    - :meth:`on_arrival`: a client's activation arrived (split methods); returns the client's gradient;
    - :meth:`should_flush` and :meth:`flush`: after each arrival (a full activation buffer trains the server);
    - :meth:`on_model_upload`: a client's model arrived; True when a new global model exists
      (``host.set_global``).

    The host (:class:`~raysplit.runtime.async_server.AsyncServer`) adds ``setup`` (the ``EventSetup``), ``events``,
    ``version``, ``uploads``, ``global_model()``, ``set_global(msg)`` and ``average(msgs, weights)``."""

    def on_job_start(self, cid: int, job) -> None:
        """Client ``cid`` began ``job``."""

    def on_arrival(self, act: Activation) -> Gradient:
        return self.host.train_step(act)

    def should_flush(self) -> bool:
        return False

    def flush(self) -> None:
        """The server's work once :meth:`should_flush` says so."""

    def on_model_upload(self, cid: int, msg: StateMsg, job) -> bool:
        host = self.host
        host.uploads.append(msg)
        if len(host.uploads) < host.setup.active:
            return False
        host.set_global(host.average(host.uploads, [1.0] * len(host.uploads)))
        host.uploads = []
        return True
