"""The server host: the server model, FedAvg sums and evaluation (its training step in
:mod:`raysplit.runtime.server_steps`, its per-client copies in :mod:`raysplit.runtime.server_copies`; see
:mod:`raysplit.runtime.hosts`). A method's own server behaviour is its
server rule (:class:`~raysplit.runtime.rules.ServerRule`), whose hooks the host calls."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from raysplit.clock import FlopCache
from raysplit.errors import BadClientInput
from raysplit.runtime import transport
from raysplit.runtime.aggregation import finish_average
from raysplit.runtime.messages import StateMsg, Tag
from raysplit.runtime.server_copies import ServerCopies
from raysplit.runtime.server_steps import ServerSteps
from raysplit.runtime.ushape import MiddleSteps
from raysplit.runtime.optim import make_optimizer, round_lr, set_lr

from raysplit.runtime.hostspec import (Checkpointed, HostSpec, ModelSlot, NonFiniteLossError,
                                       build_parts, host_device, limit_threads, method_of,
                                       set_determinism)
from raysplit.runtime.rules import ServerRule
from raysplit.runtime.screening import Screen
from raysplit.models import end_to_end
from raysplit.runtime.evaluation import EvalTally, predict_batches


class ServerHost(ServerSteps, MiddleSteps, ServerCopies, Checkpointed):
    """Owns the server-side model(s) and optimizer(s). ``models['main']`` is the server model; per-client copies
    (PSL, SFLV1) are forked from it and merged back by weighted averaging. Methods do not subclass it: they give a
    server rule (``spec.server_rule``), made here as ``self.rule`` once the host is built."""

    def __init__(self, spec: HostSpec, init_state: dict, client_init_state: dict, test: dict,
                 labeled: dict | None = None):
        if spec.torch_threads:
            limit_threads(spec.torch_threads)
        torch.manual_seed(spec.seed * 1009 + 7919)
        self.spec = spec
        self.params = spec.params
        self.device = host_device(spec.server_device, "runtime.server.device")
        set_determinism(spec.deterministic, self.device)
        client, server = build_parts(spec)
        server.load_state_dict(transport.unpack_state(init_state))
        server.to(self.device).train()
        self.models: dict = {"main": ModelSlot(server, make_optimizer(server.parameters(), spec.server_optimizer))}
        self.eval_client = client.to(self.device)
        self.client_init = StateMsg(client_init_state)  # the client part as the run started (a message)
        self.test_x, self.test_y = test["x"], test["y"]
        self.labeled = labeled or {}  # the server's own labelled set (data.n_labeled; semi-supervised methods)
        self.flops = FlopCache()
        self.middle: dict[Tag, tuple] = {}  # U-shaped steps: the middle's (input, output) awaiting the tail's gradient
        self.clock = 0.0
        self.round = -1
        self.screen = Screen(spec, lambda: self.client_encoder(), self.device)  # what arrives (on_bad_client)
        self._unbatched: str | None = None  # why vmap refused the server model (batched_copies falls back)
        self.build()
        self.rule: ServerRule = (spec.server_rule or ServerRule)(self)
        self.reset_round()

    def build(self) -> None:
        """What a kind of server host adds before the rule is made (the asynchronous host: its event loop)."""

    def reset_round(self):
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.round_flops = 0.0
        self.nonfinite: Tag | None = None
        self.busy_wall = 0.0
        self.screen.new_round()
        self.rule.on_reset_round()

    def begin_round(self, rnd: int, t0: float) -> None:
        self.round = rnd
        self.clock = max(self.clock, t0)
        self.reset_round()
        for slot in self.models.values():
            set_lr(slot.optimizer, round_lr(self.spec.server_optimizer, rnd, self.spec.rounds))
        self.rule.on_begin_round(rnd)

    # ---- what arrives from clients -------------------------------------------------------------------------------
    def serve(self, method: str, *args, **kwargs):
        """Every runtime call of a server method enters here (``Runtime.server``, the step loops, the event loop):
        ``method`` (the host's, or else its rule's) gets the arguments the screen lets through
        (:meth:`Screen.call <raysplit.runtime.screening.Screen.call>`)."""
        return self.screen.call(method_of(self, method), args, kwargs, self.expected_round, self.clock)

    def expected_round(self, tag: Tag) -> int | None:
        """The round an arriving activation must carry."""
        return self.round

    def activation_form(self) -> tuple[tuple, np.dtype]:
        """Per-sample shape and dtype of what the client part sends (probed once, :meth:`Screen.form`)."""
        return self.screen.form()

    def client_encoder(self) -> torch.nn.Module:
        """The module whose output a client sends (the rule's; the client part)."""
        return self.rule.client_encoder()

    def state_message(self, state: dict[str, torch.Tensor], **kw) -> StateMsg:
        """``state`` as a message sent now (at the server's clock)."""
        return StateMsg.packed(state, t_sent=self.clock, **kw)

    # ---- client-model aggregation --------------------------------------------------------------------------
    def aggregate(self, *partials: StateMsg | None) -> StateMsg:
        """FedAvg: the workers' partial sums (``ClientHost.partial_sum``) summed and divided by the total weight."""
        parts = [p for p in partials if p is not None]
        if not parts:
            raise BadClientInput(f"round {self.round}: every client of the round was dropped "
                                 f"(runtime.faults.on_bad_client: drop), nothing to aggregate: {self.screen.drops}")
        total = sum(p.weight for p in parts)
        state = finish_average([p.state for p in parts], total, self.eval_client.state_dict())
        return StateMsg(transport.pack_state(state), t_sent=max(p.t_sent for p in parts), weight=total)

    def get_state(self, key="main") -> StateMsg:
        return StateMsg(transport.pack_state(self.models[key].module.state_dict()), t_sent=self.clock)

    # ---- evaluation ------------------------------------------------------------------------------------------
    def predict(self, logits: Callable[[torch.Tensor], torch.Tensor]) -> tuple[np.ndarray, np.ndarray, float]:
        """The global test set through ``logits`` (the one evaluation loop, :func:`predict_batches`)."""
        tally = predict_batches(self.test_x, self.test_y, self.spec.data_spec, self.spec.eval_batch_size, logits,
                                EvalTally(), self.device)
        y, pred, loss = tally.result()
        return np.asarray(self.test_y), pred, loss

    @torch.no_grad()
    def evaluate(self, client_state: StateMsg, key="main") -> tuple[np.ndarray, np.ndarray, float]:
        """The given client model's encoder (:meth:`client_encoder`) and ``models[key]`` on the global test set."""
        client, server, encoder = self.eval_client, self.models[key].module, self.client_encoder()
        client.load_state_dict(client_state.tensors())
        client.eval(), server.eval()
        out = self.predict(end_to_end(client, server, encoder))  # U-shaped: through the client's tail too
        server.train()
        return out

    def end_round(self) -> dict:
        if self.nonfinite is not None and self.spec.stop_on_nonfinite:
            t = self.nonfinite
            raise NonFiniteLossError(f"non-finite loss at round {t.round}, client {t.client} (step {t.step})")
        return {"losses": self.losses, "grad_norms": self.grad_norms, "flops": self.round_flops,
                "t_end": self.clock, "busy_wall": self.busy_wall, "metrics": self.round_metrics(),
                "dropped": dict(self.screen.drops)}

    def round_metrics(self) -> dict:
        """Method-specific numbers of the round, logged under ``method/`` (the rule's; GAS's
        ``method/generated_activations``)."""
        return self.rule.round_metrics()

    # ---- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        st = {"models": {k: (s.module.state_dict(), s.optimizer.state_dict()) for k, s in self.models.items()},
              "clock": self.clock, "torch_rng": torch.get_rng_state(), "dropped": dict(self.screen.dropped),
              "own": self.own_state()}
        self.rule.save(st)
        return st

    def load_state_dict(self, st: dict) -> None:
        for k, (ms, os_) in st["models"].items():
            if k not in self.models:
                self.fork([k])
            self.models[k].module.load_state_dict(ms)
            self.models[k].optimizer.load_state_dict(os_)
        self.clock = st["clock"]
        self.screen.dropped = dict(st.get("dropped", {}))
        self.load_own_state(st.get("own", {}))
        self.rule.restore(st)
        torch.set_rng_state(st["torch_rng"])
