"""The server host: an assembly of components (:mod:`raysplit.runtime` says how the rooms fit), with a declared table of the
calls it accepts from other actors (:attr:`ServerHost.CALLS`, plus its rule's own calls).

- ``trainer`` (:class:`~raysplit.runtime.server.trainer.Trainer`): every server step's arithmetic, the server's clock and
  the round's tally;
- ``models`` (:class:`~raysplit.runtime.server.models.ServerModels`): the server model and its per-client copies;
- ``evaluation`` (:class:`~raysplit.runtime.evaluation.ServerEvaluation`): the global test set;
- ``middle`` (:class:`~raysplit.runtime.server.middle.Middle`, U-shaped splits only): the middle's two halves of a step;
- ``screen`` (:class:`~raysplit.runtime.screening.Screen`): what arrives from clients.

A method's own server behaviour is its server rule (:class:`~raysplit.runtime.rules.ServerRule`), built from a
:class:`~raysplit.runtime.contexts.ServerContext` over these components, whose hooks the host calls."""

from __future__ import annotations

import numpy as np
import torch

from raysplit.errors import BadClientInput
from raysplit.runtime import tiered, transport
from raysplit.runtime.aggregation import finish_average
from raysplit.runtime.contexts import server_context
from raysplit.runtime.server.evaluation import ServerEvaluation
from raysplit.runtime.state import ModelSlot, to_host
from raysplit.runtime.screening import Deferred, NonFiniteLossError
from raysplit.runtime.devices import (device_rng_state, host_device, limit_threads, set_determinism,
                                      set_device_rng_state)
from raysplit.runtime.messages import Activation, Batch, StateMsg, Tag, batch_step, step_timing
from raysplit.runtime.optim import make_optimizer, set_lr
from raysplit.runtime.plan import HostPlan, Progress
from raysplit.runtime.rules import ServerRule, call_table
from raysplit.models.tiers import entered
from raysplit.runtime.server.screen import Screen
from raysplit.runtime.server.models import ServerModels
from raysplit.runtime.server.trainer import Trainer
from raysplit.runtime.server.middle import Middle


class ServerHost:
    """Owns the server-side model(s) and optimizer(s) and the method's server rule (``self.rule``), built from a
    :class:`~raysplit.runtime.plan.HostPlan`. Methods do not subclass it: they give a server rule."""

    # what other actors may call (through serve): a name, or the component's call it is (a rule adds its own,
    # shadowing none)
    CALLS = {"begin_round": "begin_round", "end_round": "end_round", "aggregate": "aggregate",
             "get_state": "get_state", "evaluate": "evaluate", "state_dict": "state_dict",
             "load_state_dict": "load_state_dict", "train_step": "train_step", "train_copies": "train_copies",
             "fork": "models.fork", "merge": "models.merge", "middle_forward": "middle.forward",
             "middle_backward": "middle.backward", "activation_form": "screen.form",
             "client_encoder": "rule.client_encoder"}

    def __init__(self, plan: HostPlan, init_state: dict, client_init_state: dict, test: dict,
                 labeled: dict | None = None):
        s, rt = plan.sections, plan.sections.runtime
        if rt.torch_threads:
            limit_threads(rt.torch_threads)
        torch.manual_seed(s.seed * 1009 + 7919)
        self.plan = plan
        self.device = host_device(rt.server.device, "runtime.server.device")
        set_determinism(rt.deterministic, self.device)
        client, server = plan.parts(self.device)
        server.load_state_dict(transport.unpack_state(init_state))
        server.to(self.device).train()
        self.progress = Progress()
        optimizer = s.server_optimizer
        self.deferred = Deferred()  # the round's checks of values on the device, read at its end (end_round)
        self.trainer = Trainer(s.train, s.clock, optimizer, s.train.rounds, self.device,
                               before_step=lambda *a: self.rule.before_step(*a), deferred=self.deferred,
                               cut_of=plan.model.cut_of, loss=plan.model.loss, sample_losses=plan.model.sample_losses)
        self.models = ServerModels(ModelSlot(server, make_optimizer(server.parameters(), optimizer)), self.trainer,
                                   optimizer, batch_copies=getattr(plan.method.params, "batched_copies", False),
                                   cuts=plan.model.cuts,
                                   on_fork=lambda keys: self.rule.on_fork(keys),
                                   before_merge=lambda weights: self.rule.before_merge(weights))
        self.evaluation = ServerEvaluation(test, plan.model.inputs, s.eval.batch_size, self.device,
                                           client.to(self.device), encoder=lambda: self.rule.client_encoder(),
                                           language_model=plan.model.language_model)
        self.client_init = StateMsg(client_init_state)  # the client part as the run started (a message)
        self.labeled = labeled or {}  # the server's own labelled set (data.n_labeled; semi-supervised methods)
        self.middle = Middle(self.trainer, self.models, self.device) if plan.ushape is not None else None
        self.screen = Screen(plan, lambda: self.rule.client_encoder(), self.device,  # what arrives (on_bad_client)
                             self.deferred)
        self.build()
        ctx = server_context(sections=s, model=plan.model, method=plan.method, privacy=plan.privacy,
                             progress=self.progress, models=self.models, trainer=self.trainer,
                             evaluation=self.evaluation, labeled=self.labeled, device=self.device,
                             initial_client=self.client_init, **self.context_items())
        self.rule: ServerRule = (plan.method.server_rule or ServerRule)(ctx)
        self.calls = call_table(self, self.rule)
        self.reset_round()

    def build(self) -> None:
        """What a kind of server host adds before its rule is made (the asynchronous host: its event loop)."""

    def context_items(self) -> dict:
        """What a kind of server host adds to its rule's context (the asynchronous host: ``global_model``,
        ``events``)."""
        return {}

    @property
    def round(self) -> int:
        return self.progress.round

    @property
    def clock(self) -> float:
        """The server's simulated clock."""
        return self.trainer.clock.now

    def reset_round(self):
        self.deferred.clear()
        self.screen.new_round()
        self.rule.on_reset_round()

    def begin_round(self, rnd: int, t0: float) -> None:
        self.progress.round = rnd
        self.trainer.begin_round(rnd, t0)
        self.reset_round()
        for slot in self.models.values():
            set_lr(slot.optimizer, self.trainer.lr())
        self.rule.on_begin_round(rnd)

    # ---- what arrives from clients -------------------------------------------------------------------------------
    def serve(self, method: str, *args, **kwargs):
        """Every call from another actor (``Runtime.server``, the step loops, the event loop) enters here:
        ``method`` (a name in the host's call table: its own or its rule's) gets the arguments the screen lets
        through (:meth:`Screen.call <raysplit.runtime.screening.Screen.call>`); a step that takes batches
        (:func:`~raysplit.runtime.messages.batch_step`) gets them decoded to tensors on the server's device, the
        server's clock at the last arrival first where the step starts after it."""
        try:
            fn = self.calls[method]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} accepts no call {method!r} (its calls: "
                                 f"{', '.join(sorted(self.calls))})") from None
        return self.screened(method, fn, *args, **kwargs)

    def screened(self, name: str, fn, *args, batches: bool = False, **kwargs):
        """``fn`` (the server call ``name``) on the arguments the screen lets through (the event loop's way to its
        rule's hooks too); its activations decoded to batches where it is a step over batches (``batches``: a hook
        that takes them, ``AsyncRule.on_arrival``)."""
        if batches or step_timing(fn) is not None:
            inner = fn

            def fn(*a, **kw):
                return inner(*(self.decode(x) if isinstance(x, Activation) else x for x in a), **kw)

            fn.__name__ = inner.__name__
            fn.__wrapped__ = inner
        with self.trainer.serving(name):
            return self.screen.call(fn, args, kwargs, self.expected_round, self.clock)

    def expected_round(self, tag: Tag) -> int | None:
        """The round an arriving activation must carry."""
        return self.round

    def decode(self, act: Activation) -> Batch:
        """An arrived activation as a :class:`Batch` on the server's device (an owned, writable copy)."""
        return Batch.of(act, self.device)

    # ---- the plain split steps --------------------------------------------------------------------------------------
    @batch_step(starts="on_arrival")
    def train_step(self, b: Batch, key="main"):
        """One step of ``models[key]`` on the batch from its arrival on; the client's gradient."""
        return self.trainer.train(b, self.models[key])

    @batch_step(starts="on_arrival")
    def train_copies(self, *batches: Batch):
        """One step of each batch's client's copy (:meth:`ServerModels.train_copies`)."""
        return self.models.train_copies(*batches)

    # ---- client-model aggregation --------------------------------------------------------------------------
    def aggregate(self, *partials: StateMsg | None) -> StateMsg:
        """FedAvg: the workers' partial sums (``ClientHost.partial_sum``) summed and divided by the total weight."""
        parts = [p for p in partials if p is not None]
        if not parts:
            raise BadClientInput(f"round {self.round}: every client of the round was dropped "
                                 f"(runtime.faults.on_bad_client: drop), nothing to aggregate: {self.screen.drops}")
        total = sum(p.weight for p in parts)
        if self.plan.model.cuts is not None:  # by block: the server's copy of the overlap is one of its holders
            main = self.models.main.module
            state, update = tiered.finish([(p.state, p.held) for p in parts], total, main.state_dict(),
                                          self.evaluation.client.state_dict())
            main.load_state_dict({**main.state_dict(), **update})
        else:
            state = finish_average([p.state for p in parts], total, self.evaluation.client.state_dict())
        return StateMsg(transport.pack_state(state), t_sent=max(p.t_sent for p in parts), weight=total)

    def get_state(self, key="main") -> StateMsg:
        return StateMsg(transport.pack_state(self.models[key].module.state_dict()), t_sent=self.clock)

    # ---- evaluation ------------------------------------------------------------------------------------------
    def evaluate(self, client_state: StateMsg, key="main") -> tuple[np.ndarray, np.ndarray, float]:
        """The given client model's encoder (:meth:`client_encoder`) and ``models[key]`` on the global test set."""
        with entered(self.models[key].module, self.plan.model.deepest):  # tiered: the deepest client's blocks
            return self.evaluation.evaluate(client_state.tensors(), self.models[key].module)

    def end_round(self) -> dict:
        """The round's numbers; first its deferred checks (the activations' screen and the steps' finite checks, in
        the order they were made), the one read of the device a round."""
        self.deferred.settle()
        tally = self.trainer.tally
        if tally.nonfinite is not None and self.plan.sections.train.stop_on_nonfinite:
            t = tally.nonfinite
            raise NonFiniteLossError(f"non-finite loss at round {t.round}, client {t.client} (step {t.step})")
        losses, norms = tally.read()
        return {"losses": losses, "grad_norms": norms, "flops": tally.flops,
                "t_end": self.clock, "busy_wall": tally.busy_wall, "metrics": self.round_metrics(),
                "dropped": dict(self.screen.drops)}

    def round_metrics(self) -> dict:
        """Method-specific numbers of the round, logged under ``method/`` (the rule's; GAS's
        ``method/generated_activations``)."""
        return self.rule.round_metrics()

    # ---- checkpoint ---------------------------------------------------------------------------------------
    def own_state(self) -> dict:
        """What a kind of server host keeps across rounds beside its models (the asynchronous host's event loop)."""
        return {}

    def load_own_state(self, own: dict) -> None:
        pass

    def state_dict(self) -> dict:
        """Everything that persists across rounds, on the CPU (a snapshot's keeper holds no GPU; a checkpoint loads
        anywhere), with the random state of the host's device."""
        st = {"models": self.models.state_dict(), "clock": self.clock, "torch_rng": torch.get_rng_state(),
              "device_rng": device_rng_state(self.device), "dropped": dict(self.screen.dropped), "own": self.own_state()}
        self.rule.save(st)
        return to_host(st)

    def load_state_dict(self, st: dict) -> None:
        self.deferred.clear()
        self.models.load_state_dict(st["models"])
        self.trainer.clock.now = st["clock"]
        self.screen.dropped = dict(st.get("dropped", {}))
        self.load_own_state(st.get("own", {}))
        self.rule.restore(st)
        torch.set_rng_state(st["torch_rng"])
        set_device_rng_state(self.device, st.get("device_rng"))
