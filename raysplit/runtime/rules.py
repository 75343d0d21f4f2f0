"""Rules: how a method changes what its clients (and its server) do, without subclassing the hosts.

A method whose clients do more than plain split learning (FedProx's proximal term, SCAFFOLD's correction,
Semi-SFL's two views, SplitGP's local loss, PiPar's pipelined clock, Ampere's auxiliary net) gives its
``Algorithm.client_rule``, a subclass of :class:`ClientRule` that overrides the hooks it needs. The client host
(:class:`~raysplit.runtime.client.host.ClientHost`) makes one rule when it is built, from a typed, read-only
:class:`~raysplit.runtime.contexts.ClientContext` (``self.ctx``: the config's sections, the method, the client
host's components), and calls its hooks in this order, which the rule never has to reproduce (no ``super()``
chain):

1. a client's first use in a round (or job): its slot is made (its model and optimizer loaded), then
   :meth:`~ClientRule.on_activate`;
2. a forward: :meth:`~ClientRule.batch_indices` (which samples), :meth:`~ClientRule.inputs` (model input and the
   labels sent) and :meth:`~ClientRule.encoder` (the module that encodes them), inside the client's random stream;
   the defence at the cut (``privacy``); the activation is charged and sent; :meth:`~ClientRule.after_forward`;
3. its gradient: NoPeek's term (``privacy``), :meth:`~ClientRule.backward_pass`, :meth:`~ClientRule.before_step`,
   clipping (``train.clip_grad_norm``: it sees the whole gradient), the optimizer's step, the compute charged,
   :meth:`~ClientRule.after_backward` (the client's clock after the step);
4. the round's (job's) end: the client's weights and optimizer state stored, then :meth:`~ClientRule.on_release`.

A rule's other public methods are its **calls**: what the method's ``run_round`` calls on the workers
(``rt.workers.<name>(...)``, ``rt.client(cid).<name>(...)``), added to the host's table of calls (a name the host
already takes is refused when the host is built: nothing shadows anything). ``client_fields`` names the rule's
per-client mappings that move with a client to another host; ``checkpointed`` the state checkpoints carry
(:class:`~raysplit.runtime.state.Checkpointed`).

The server side is the same idea: a method's server state, its server steps and its server calls are its
``Algorithm.server_rule`` (:class:`ServerRule`; :class:`AsyncRule` for asynchronous methods), built from a
:class:`~raysplit.runtime.contexts.ServerContext`, whose hooks the server host calls at fixed points (their list:
:class:`ServerRule`).
"""

from __future__ import annotations

import inspect
from typing import Callable

import numpy as np
import torch

from raysplit.runtime.client.executor import Backward
from raysplit.runtime.state import Checkpointed, ModelSlot, to_device
from raysplit.runtime.messages import Activation, Batch, Gradient, StateMsg, Tag, batch_step


class Rule(Checkpointed):
    """What both kinds of rule share: the context they are built from (``self.ctx``); restored state's tensors come
    back to the host's device (a checkpoint holds them on the CPU)."""

    def __init__(self, ctx):
        self.ctx = ctx

    def load_own_state(self, saved: dict) -> None:
        super().load_own_state(to_device(saved, self.ctx.device))


class ClientRule(Rule):
    """Plain split learning's client: every hook's default (the module docstring gives their order)."""

    client_fields: tuple[str, ...] = ()

    @classmethod
    def packable(cls) -> bool:
        """Whether this rule's clients can take their split steps packed (``runtime.pack_clients``): its backward
        is the plain one (a rule's own encoder only keeps that stream one at a time)."""
        return cls.backward_pass is ClientRule.backward_pass

    def build_module(self, device=None) -> torch.nn.Module:
        """A fresh client model (its weights are loaded after): the client part. ``device``: where the host keeps
        it (a language model's frozen base is shared there, :meth:`~raysplit.runtime.plan.ModelFacts.build`;
        None: the CPU); the caller moves it there."""
        return self.ctx.model.parts(device)[0]

    def on_activate(self, cid: int, slot: ModelSlot) -> None:
        """Client ``cid`` got its slot for the round (weights and optimizer loaded)."""

    def batch_indices(self, tag: Tag, batch_size: int | None) -> np.ndarray:
        """The samples of this forward: the client's next batch."""
        return self.ctx.data.draw(tag.client, batch_size)

    def inputs(self, tag: Tag, idx: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Model input and the labels sent with the activation (host memory: :meth:`ClientData.labels`)."""
        return self.ctx.data.features(idx), self.ctx.data.labels(idx)

    def encoder(self, tag: Tag, slot: ModelSlot) -> Callable[[torch.Tensor], torch.Tensor]:
        """The module that encodes this forward: the client's model."""
        return slot.module

    def after_forward(self, tag: Tag, t_start: float, msg: Activation) -> None:
        """The activation left at ``msg.t_sent``; the client's clock was ``t_start`` before the forward."""

    def backward_pass(self, tag: Tag, out: torch.Tensor, g: torch.Tensor) -> int:
        """Back-propagate the server's gradient ``g`` of the activation ``out``; returns the FLOPs."""
        cut = self.ctx.model.cut_of(tag.client)  # tiered: clients of other cuts hold other blocks
        key = ("bwd", tuple(out.shape)) + (() if cut is None else (cut,))
        return self.ctx.executor.backward([Backward(key, out, g)])[0]

    def before_step(self, cid: int, slot: ModelSlot) -> None:
        """The gradients are in ``slot.module``; the optimizer steps next (after clipping)."""

    def after_backward(self, grad: Gradient, t_start: float, t_end: float) -> float:
        """The client's clock after its update: ``t_end`` (a timing model may replace it); ``t_start`` was its
        clock when the gradient arrived."""
        return t_end

    def on_release(self, cid: int) -> None:
        """Client ``cid``'s round (job) is over; its weights and optimizer state are stored."""


class ServerRule(Rule):
    """What a method's server does beyond serving plain split steps, without subclassing the server host.

    A method gives its ``Algorithm.server_rule``, a subclass that keeps the method's own server state (made in
    ``__init__`` from ``self.ctx``) and overrides the hooks it needs; the server host
    (:class:`~raysplit.runtime.server.host.ServerHost`) makes one rule when it is built and calls the hooks at
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
    ``run_round`` calls as ``rt.server.<name>(...)``. ``self.ctx`` is a
    :class:`~raysplit.runtime.contexts.ServerContext`: ``models`` (``"main"`` and the copies), ``trainer`` (one
    step, the frozen pass, the answer, the round's learning rate), ``evaluation``, the sections and the method."""

    def client_encoder(self) -> torch.nn.Module:
        """The module whose output a client sends (evaluation encodes the test set with it): the client part."""
        return self.ctx.evaluation.client

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
    (:mod:`raysplit.runtime.server.events`), defaulting to plain asynchronous split learning: the server steps on every
    arrival, and the global model is the uniform average of every ``active`` uploads (a full model buffer).

    - :meth:`on_job_start`: a client took a slot;
    - :meth:`on_arrival`: a client's activation arrived (split methods); returns the client's gradient;
    - :meth:`should_flush` and :meth:`flush`: after each arrival (a full activation buffer trains the server);
    - :meth:`on_model_upload`: a client's model arrived; True when a new global model exists
      (``ctx.global_model.publish``).

    The context adds ``global_model`` (:class:`~raysplit.runtime.server.async_host.GlobalModel`: ``current()``,
    ``publish(msg)``, ``version``, ``average(msgs, weights)``) and ``events`` (the event loop's plan: ``active``,
    ``local_steps``, ``client_sizes``)."""

    checkpointed = ("uploads",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.uploads: list[StateMsg] = []

    def on_job_start(self, cid: int, job) -> None:
        """Client ``cid`` began ``job``."""

    def on_arrival(self, b: Batch) -> Gradient:
        """A client's batch has arrived (decoded for it by the host; its step starts at the arrival)."""
        return self.ctx.trainer.train(b, self.ctx.models.main)

    def should_flush(self) -> bool:
        return False

    def flush(self) -> None:
        """The server's work once :meth:`should_flush` says so."""

    def on_model_upload(self, cid: int, msg: StateMsg, job) -> bool:
        self.uploads.append(msg)
        if len(self.uploads) < self.ctx.events.active:
            return False
        model = self.ctx.global_model
        model.publish(model.average(self.uploads, [1.0] * len(self.uploads)))
        self.uploads = []
        return True


# the hooks a host calls on its rule: never calls from other actors
HOOKS = frozenset(n for cls in (ClientRule, ServerRule, AsyncRule) for n, v in vars(cls).items()
                  if callable(v) and not n.startswith("_")) | frozenset(dir(Checkpointed))


def rule_calls(rule_cls: type) -> list[str]:
    """A rule class's calls: its public methods that are not hooks (the module docstring)."""
    return sorted(n for n in dir(rule_cls) if not n.startswith("_") and n not in HOOKS
                  and inspect.isfunction(getattr(rule_cls, n, None)))


def host_calls(host_cls: type) -> list[str]:
    """The names of a host class's own calls (``CALLS``: names, or a mapping of names to the component's calls)."""
    return list(host_cls.CALLS)


class CallTable:
    """A host's table of the calls other actors may make, by name: ``table[name]`` is the callable (looked up at
    each call, so what a component holds now is what runs); ``in``, ``iter`` and ``len`` as a mapping's."""

    def __init__(self, paths: dict[str, tuple]):
        self.paths = paths  # name -> (object, attribute path)

    def __getitem__(self, name: str) -> Callable:
        target, path = self.paths[name]
        for part in path.split("."):
            target = getattr(target, part)
        return target

    def __contains__(self, name) -> bool:
        return name in self.paths

    def __iter__(self):
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)


def call_table(host, rule) -> CallTable:
    """A host's table of the calls other actors may make: the host's own (``type(host).CALLS``: a name is the
    host's method, ``"component.method"`` a component's) and its rule's (:func:`rule_calls`), by name. A rule's
    call named like one of the host's is refused (TypeError naming both): it would be shadowed."""
    calls = type(host).CALLS
    own = {name: (host, path) for name, path in (calls if isinstance(calls, dict) else
                                                 {n: n for n in calls}).items()}
    mine = rule_calls(type(rule))
    clash = sorted(set(own) & set(mine))
    if clash:
        raise TypeError(f"{type(rule).__name__} defines {clash}, which {type(host).__name__} already takes as its own "
                        f"calls; rename the rule's method")
    return CallTable({**own, **{name: (rule, name) for name in mine}})
