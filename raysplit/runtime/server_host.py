"""The server host: the server model, FedAvg sums and evaluation (its per-client copies in
:mod:`raysplit.runtime.server_copies`; see :mod:`raysplit.runtime.hosts`). A method's own server behaviour is its
server rule (:class:`~raysplit.runtime.rules.ServerRule`), whose hooks the host calls."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from raysplit.clock import FlopCache
from raysplit.errors import BadClientInput
from raysplit.runtime import transport
from raysplit.runtime.aggregation import finish_average
from raysplit.runtime.messages import Activation, Batch, Gradient, StateMsg, Tag, batch_step
from raysplit.runtime.server_copies import ServerCopies
from raysplit.runtime.optim import make_optimizer, round_lr, set_lr

from raysplit.runtime.hostspec import (Checkpointed, HostSpec, ModelSlot, NonFiniteLossError,
                                       build_parts, check_finite, limit_threads, method_of)
from raysplit.runtime.rules import ServerRule
from raysplit.runtime.screening import Screen
from raysplit.runtime.evaluation import EvalTally, predict_batches


class ServerHost(ServerCopies, Checkpointed):
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
        want = spec.device
        self.device = torch.device("cuda" if want in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
        client, server = build_parts(spec)
        server.load_state_dict(transport.unpack_state(init_state))
        server.to(self.device).train()
        self.models: dict = {"main": ModelSlot(server, make_optimizer(server.parameters(), spec.server_optimizer))}
        self.eval_client = client.to(self.device)
        self.client_init = StateMsg(client_init_state)  # the client part as the run started (a message)
        self.test_x, self.test_y = test["x"], test["y"]
        self.labeled = labeled or {}  # the server's own labelled set (data.n_labeled; semi-supervised methods)
        self.flops = FlopCache()
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

    def charge(self, flops: float, ready_at: float = 0.0) -> float:
        """Advance the server clock by a computation that can start once ``ready_at`` has passed (instantly with
        ``charge_server`` off, as in GAS's code)."""
        cost = flops / self.spec.server_flops if self.spec.charge_server else 0.0
        self.clock = max(self.clock, ready_at) + cost
        self.round_flops += flops
        return self.clock

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

    # ---- the one training step ---------------------------------------------------------------------------------
    def step_through(self, x: torch.Tensor, y: torch.Tensor, module, optimizers: list, *, tag: Tag, flop_key: tuple,
                     ready_at: float = 0.0, loss_fn: Callable | None = None, record: bool = True,
                     varying_batch: bool = False, where: str | None = None) -> float:
        """Forward ``x`` through ``module``, ``loss_fn(logits, y)`` (default: mean cross-entropy), backward, then
        step ``optimizers`` (none: a gradient pass, e.g. through a frozen server); the FLOPs (counted once per
        ``flop_key``) are charged to the server clock from ``ready_at`` on and the wall time to ``busy_wall``.
        ``record``: the loss counts as a training loss (checked for finiteness, logged). Returns the loss; the
        caller reads ``x.grad`` when it needs the gradient for the client. ``varying_batch``: FLOPs counted once
        per sample for a computation whose batch size changes every call (``FlopCache.run``). ``where``: how a
        non-finite loss names the step (default: round, client and step of ``tag``)."""
        t_wall = time.perf_counter()
        loss_fn = loss_fn or F.cross_entropy

        def step():
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss = loss_fn(module(x), y)
            loss.backward()
            return loss

        loss, fl = self.flops.run(flop_key, step, batch=len(y) if varying_batch else None)
        lv = self.settle_step(float(loss.item()), fl, module, optimizers, tag=tag, ready_at=ready_at, record=record,
                              where=where)
        self.busy_wall += time.perf_counter() - t_wall
        return lv

    def settle_step(self, lv: float, flops: int, module, optimizers: list, *, tag: Tag, ready_at: float = 0.0,
                    record: bool = True, where: str | None = None) -> float:
        """The rest of a training step once its gradients are in ``module``'s parameters: the finite check,
        clipping (``train.clip_grad_norm``), the optimizer steps, ``flops`` on the server clock, the loss logged."""
        if record:
            self._check(lv, tag, where)
        self.rule.before_step(module, optimizers, tag)
        if optimizers and self.spec.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.spec.clip_grad_norm)
        for opt in optimizers:
            opt.step()
        self.charge(flops, ready_at)
        if record:
            self.losses.append(lv)
        return lv

    def step_batch(self, b: Batch, module, optimizers: list, flop_key="main", loss_fn=None) -> Gradient:
        """One SGD step of ``module`` (and its ``optimizers``) on a batch, from its arrival on, with ``loss_fn``
        (:meth:`step_through`); returns the client's gradient."""
        x = b.x.requires_grad_(True)
        lv = self.step_through(x, b.y, module, optimizers, tag=b.tag, flop_key=("train", flop_key, tuple(x.shape)),
                               ready_at=b.t_sent, loss_fn=loss_fn)
        return self.answer(b, x.grad, lv)

    def answer(self, b: Batch | Tag, g: torch.Tensor | None, lv: float) -> Gradient:
        """The client's gradient for ``b`` (a batch or its tag), sent at the server's clock, its norm logged;
        ``g`` None: nothing goes back for this batch (e.g. a teacher stream)."""
        tag = b if isinstance(b, Tag) else b.tag
        if g is None:
            return Gradient(tag, None, self.clock, lv)
        self.grad_norms.append(float(g.norm()))
        return Gradient(tag, transport.pack(g), self.clock, lv)

    def revise(self, grads: list[Gradient], values: list) -> list[Gradient]:
        """A rule applied on top of the gradients just answered (SGLR's sharing): the first ``len(values)`` of
        ``grads`` carry ``values`` instead (same tags, times and losses), the rest are kept; the logged gradient
        norms follow."""
        new = [Gradient(g.tag, transport.pack(v) if isinstance(v, torch.Tensor) else v, g.t_sent, g.loss)
               for g, v in zip(grads, values)]
        out = new + list(grads[len(values):])
        self.grad_norms[-len(grads):] = [float(np.linalg.norm(g.g)) for g in out]
        return out

    def decode(self, act: Activation) -> Batch:
        """An arrived activation as a :class:`Batch` on the server's device (an owned, writable copy)."""
        return Batch(transport.unpack(act.x, self.device, writable=True),
                     torch.as_tensor(np.array(act.y), device=self.device), act.tag, act.t_sent, act.weight)

    @staticmethod
    @contextmanager
    def frozen(model: torch.nn.Module):
        """Within the block, ``model``'s parameters take no gradient (a pass through it yields only the input's
        gradient: CycleSL's and MiniBatch's frozen-server gradients, GAS's client gradients); each parameter's
        ``requires_grad`` is restored afterwards, also when the block raises."""
        before = [(prm, prm.requires_grad) for prm in model.parameters()]
        for prm, _ in before:
            prm.requires_grad_(False)
        try:
            yield model
        finally:
            for prm, flag in before:
                prm.requires_grad_(flag)

    def wait_until(self, t: float) -> float:
        """The server cannot go on before ``t``."""
        self.clock = max(self.clock, t)
        return self.clock

    def state_message(self, state: dict[str, torch.Tensor], **kw) -> StateMsg:
        """``state`` as a message sent now (at the server's clock)."""
        return StateMsg.packed(state, t_sent=self.clock, **kw)

    @batch_step(stamp=False)
    def train_step(self, b: Batch, key="main") -> Gradient:
        """Forward the batch through ``models[key]``, step it, return dL/d(features) to the client."""
        slot = self.models[key]
        return self.step_batch(b, slot.module, [slot.optimizer], "main" if key == "main" else "copy")

    def _check(self, loss: float, tag: Tag, where: str | None = None) -> None:
        if not math.isfinite(loss) and self.nonfinite is None:
            self.nonfinite = tag
        where = where or (f"round {tag.round}, client {tag.client} (step {tag.step})" if tag.client >= 0 else
                          f"round {tag.round}, server update {tag.step}")  # a server-only step (Tag client -1)
        check_finite(loss, self.spec.stop_on_nonfinite, where)

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
        out = self.predict(lambda x: server(encoder(x)))
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
