"""SplitFed variants, Ampere's baselines (../shared/papers/ampere.txt §5.1): PiPar, SplitGP and SplitFed + SCAFFOLD.
Each trains like SplitFed V1 (per-client server copies averaged every round, FedAvg of the client parts); they
differ where their papers do.

- **PiPar** (Zhang, Varghese et al. 2023, "PiPar: Pipeline parallelism for collaborative machine learning"): each
  batch is cut into ``micro_batches`` m that flow through device compute, uplink, server and downlink as a
  pipeline, and the gradients are accumulated before one step, so the updates are SplitFed's while the step takes
  less time. Simulated here with SplitFed's updates and a pipelined clock: for a step with stage times f (forward),
  u (upload), s (server, including its queue), d (download) and b (backward), the step takes
  ``(f + u + s + d + b + (m - 1) max(f + b, u, s, d)) / m`` instead of their sum (m = 1 is SplitFed exactly).
- **SplitGP** (Han et al., INFOCOM 2023, "SplitGP: achieving both generalization and personalization in federated
  learning"): every client also trains a local head on its activations (here: the auxiliary network Ampere's
  generator builds, at ``ratio``) and its device block follows ``lambda_local * L_local + (1 - lambda_local) *
  L_global``; the server trains on the global loss; device blocks and heads are averaged. Evaluated by the global
  path (device block + server block).
- **SplitFed + SCAFFOLD** (Karimireddy et al., ICML 2020, extended to SFL by Ampere's authors): SCAFFOLD's control
  variates on the device block. A client steps with ``g - c_i + c``; after its ``K`` steps of the round
  ``c_i <- c_i - c + (x_start - x_end) / (K lr)`` (option II), and the server adds ``sum(delta c_i) / N`` to ``c``;
  controls travel like models (counted as model bytes). The server blocks follow SplitFed V1. SCAFFOLD's paper
  averages models and controls uniformly; here the device blocks are averaged with ``train.aggregation.weights``
  (default: by client size) and ``c`` uniformly. With unequal client sizes the correction then turns a round's
  size-weighted mean gradient into the uniform mean (``c - sum_i p_i c_i`` is added to it), so the device block
  follows the clients' uniform objective; ``train.aggregation.weights=uniform`` is the paper's SCAFFOLD exactly,
  and with equal sizes (Ampere's ``device_dirichlet``) the two agree. Tested: each ``c_i`` is the mean of the
  client's raw gradients of its round, and the correction lowers the drift between clients
  (tests/test_ampere.py). ``server_controls: true`` extends the control variates to the per-client server copies
  (the same option II rule on each copy's steps, ``c`` and the ``c_i`` of the server block kept at the server, so
  nothing more travels): SCAFFOLD of the whole model, as SCAFFOLD's paper runs it on an unsplit model. Ampere's
  paper does not say whether its extension corrects the server part; the default (off) corrects the device block
  only, which its words name ("correction terms that reduce the divergence between each device's model").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from .ampere import AuxRule, AuxServer, with_auxiliary
from .base import Algorithm, AlgorithmParams, CopiesParams, register
from .baselines import SFLV1
from ..runtime import ClientRule, ServerRule
from ..runtime.messages import Activation, Gradient, StateMsg, Tag


# ---- PiPar ----------------------------------------------------------------------------------------------------------
class PiParRule(ClientRule):
    """SplitFed's computation with a pipelined clock (module docstring)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self._stages: dict[Tag, tuple] = {}  # per step: start, forward time, upload time, arrival at the server

    def after_forward(self, tag: Tag, t_start: float, msg: Activation) -> None:
        upload = self.ctx.meter.upload_seconds(tag.client, msg.nbytes)
        self._stages[tag] = (t_start, msg.t_sent - t_start - upload, upload, msg.t_sent)

    def after_backward(self, grad: Gradient, t_start: float, t_end: float) -> float:
        t0, f, u, arrival = self._stages.pop(grad.tag)
        d = self.ctx.meter.download_seconds(grad.tag.client, grad.nbytes)
        s = max(grad.t_sent - arrival, 0.0)
        t_back = max(t_start, grad.t_sent) + d
        b = t_end - t_back
        m = self.ctx.params.micro_batches
        return t0 + (f + u + s + d + b + (m - 1) * max(f + b, u, s, d)) / m


class PiParParams(CopiesParams):
    micro_batches: int = Field(default=4, ge=1, description="m: micro-batches a batch is pipelined in (1: SplitFed)")


@register
class PiPar(SFLV1):
    """PiPar: SplitFed V1's updates with a pipelined clock (module docstring)."""

    name = "pipar"
    tiers = ""  # SplitFed V1's updates by block; its pipelined clock from each client's own stage times
    u_shape = "{name}'s pipelined clock models one exchange per step, not the U-shape's two"
    description = "PiPar: SplitFed with micro-batch pipelining (same updates, pipelined simulated time)"
    Params = PiParParams
    client_rule = PiParRule


# ---- SplitGP --------------------------------------------------------------------------------------------------------
class SplitGPRule(AuxRule):
    """The device block gets the server's gradient scaled by 1 - lambda plus lambda times the local head's."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self._labels: dict[Tag, torch.Tensor] = {}  # the batch of each activation awaiting its gradient

    def inputs(self, tag: Tag, idx):
        x, y = self.ctx.data.batch(idx)
        self._labels[tag] = y
        return x, self.ctx.data.labels(idx)

    def backward_pass(self, tag: Tag, out: torch.Tensor, g: torch.Tensor) -> int:
        lam = self.ctx.params.lambda_local
        head = self.ctx.states.slots[tag.client].module[1]
        y = self._labels.pop(tag)

        def surrogate():
            local = F.cross_entropy(head(out), y)
            ((1 - lam) * (out * g).sum() + lam * local).backward()

        return self.ctx.executor.run(("bwd_gp", tuple(out.shape)), surrogate)[1]


class SplitGPParams(CopiesParams):
    lambda_local: float = Field(default=0.2, ge=0, le=1, description="weight of the local loss in the device "
                                "block's objective")
    ratio: float = Field(default=0.5, gt=0, le=1, description="local head: the auxiliary net at this dimension ratio")


@register
class SplitGP(SFLV1):
    """SplitGP: SplitFed V1 with a local head and a local loss on every device (module docstring)."""

    name = "splitgp"
    tiers = ("its clients' module is the client part with a local head built at the one cut (Ampere's auxiliary "
             "network); not built for other cuts")
    u_shape = "{name}'s clients train their own classifier on their labels beside the server's"
    language_model = ("{name}'s local head is a classifier over class logits (Ampere's auxiliary network), "
                      "not built for a language model's next-token head")
    description = "SplitGP: SplitFed with a local head and lambda * local + (1 - lambda) * global device loss"
    Params = SplitGPParams
    client_rule = SplitGPRule
    server_rule = AuxServer

    def split_model(self, model, cut):
        index, device, server = super().split_model(model, cut)
        return index, with_auxiliary(model, device, server, cut, self.params.ratio), server


# ---- SplitFed + SCAFFOLD ---------------------------------------------------------------------------------------------
class ScaffoldRule(ClientRule):
    """Control variates of the device block: the global ``c`` and every client's own ``c_i``."""

    client_fields = ("c_own",)  # a client's c_i moves with it
    checkpointed = ("c_global",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.c_global: list[torch.Tensor] | None = None
        self.c_own: dict[int, list[torch.Tensor]] = {}
        self.x_start: dict[int, list[torch.Tensor]] = {}

    def on_activate(self, cid: int, slot) -> None:
        self.x_start[cid] = [p.detach().clone() for p in slot.module.parameters()]

    def before_step(self, cid: int, slot) -> None:
        params = list(slot.module.parameters())
        if self.c_global is not None:
            own = self.c_own.get(cid) or [torch.zeros_like(p) for p in params]
            for p, c, ci in zip(params, self.c_global, own):
                if p.grad is not None:
                    p.grad.add_(c - ci)

    def set_control(self, msg: StateMsg, receivers: list[int]) -> None:
        """The server's control variate for the round (download charged to the round's clients)."""
        state = msg.tensors(self.ctx.device)
        self.c_global = [state[str(i)] for i in range(len(state))] if state else None
        for c in receivers:
            if int(c) in self.ctx.data:
                self.ctx.meter.charge_download(int(c), msg.nbytes, msg.t_sent, "model")

    def control_deltas(self, clients: list[int]) -> StateMsg | None:
        """Option II update of each hosted round client's ``c_i``; the sum of the changes goes to the server."""
        total, t = None, 0.0
        slots, meter = self.ctx.states.slots, self.ctx.meter
        for c in (int(c) for c in clients):
            if c not in slots:
                continue
            slot = slots[c]
            params = [p.detach() for p in slot.module.parameters()]
            steps = max(meter.counted(c, "steps"), 1)
            lr = slot.optimizer.param_groups[0]["lr"]
            own = self.c_own.get(c) or [torch.zeros_like(p) for p in params]
            glob = self.c_global or [torch.zeros_like(p) for p in params]
            new = [ci - cg + (x0 - x) / (steps * lr) for ci, cg, x0, x in zip(own, glob, self.x_start[c], params)]
            delta = {str(i): (n - o) for i, (n, o) in enumerate(zip(new, own))}
            self.c_own[c] = new
            t = max(t, meter.charge_upload(c, sum(v.nbytes for v in delta.values()), "model"))
            total = delta if total is None else {k: total[k] + delta[k] for k in total}
        if total is None:
            return None
        return StateMsg.packed(total, t_sent=t)


class ScaffoldParams(AlgorithmParams):
    server_controls: bool = Field(
        default=False, description="control variates on the per-client server copies too (SCAFFOLD of the whole "
        "model; kept at the server, no traffic); off: the device block only, as Ampere's extension describes it")


class ScaffoldServer(ServerRule):
    """The device block's ``c`` (``control``, updated from the clients' deltas), and with ``server_controls`` the
    server block's own ``c`` and ``c_i`` (``server_control``, ``server_own``), which correct each client's server
    copy as its device block is corrected."""

    checkpointed = ("control", "server_control", "server_own")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.control: dict[str, torch.Tensor] = {}  # empty until the first round's updates: c = 0
        self.server_control: list[torch.Tensor] | None = None
        self.server_own: dict[int, list[torch.Tensor]] = {}
        self._at_fork: list[torch.Tensor] = []  # the main server block at the round's fork
        self._steps: dict[int, int] = {}  # steps each copy took this round
        self._server_deltas: list[list[torch.Tensor]] = []

    def control_msg(self) -> StateMsg:
        return self.ctx.trainer.message(self.control)

    def on_fork(self, keys: list) -> None:
        if self.ctx.params.server_controls:
            self._at_fork = [p.detach().clone() for p in self.ctx.models.main.module.parameters()]
            self._steps = {int(k): 0 for k in keys}

    def before_step(self, module, optimizers: list, tag) -> None:
        """A client's server copy steps with ``g - c_i + c`` (``server_controls``), as its device block does."""
        cid = tag.client
        if (self.ctx.params.server_controls and optimizers and cid in self._steps
                and module is self.ctx.models[cid].module):
            self._steps[cid] += 1
            if self.server_control is not None:
                own = self.server_own.get(cid)
                for i, p in enumerate(module.parameters()):
                    if p.grad is not None:
                        p.grad.add_(self.server_control[i] - own[i] if own else self.server_control[i])

    def before_merge(self, weights: dict) -> None:
        """Before the copies are averaged and dropped: option II on each copy (``server_controls``)."""
        self._server_deltas = []
        for k in (weights if self.ctx.params.server_controls else ()):
            slot = self.ctx.models[k]
            steps, lr = max(self._steps.get(int(k), 0), 1), slot.optimizer.param_groups[0]["lr"]
            params = [p.detach() for p in slot.module.parameters()]
            own = self.server_own.get(int(k)) or [torch.zeros_like(p) for p in params]
            glob = self.server_control or [torch.zeros_like(p) for p in params]
            new = [ci - cg + (x0 - x) / (steps * lr) for ci, cg, x0, x in zip(own, glob, self._at_fork, params)]
            self._server_deltas.append([n - o for n, o in zip(new, own)])
            self.server_own[int(k)] = new
        self._steps = {}

    def update_control(self, num_clients: int, *partials: StateMsg | None) -> None:
        """c <- c + sum(delta c_i) / N, for the device block and (``server_controls``) the server block."""
        parts = [p.tensors() for p in partials if p is not None]
        step = {k: sum(p[k] for p in parts) / num_clients for k in parts[0]}
        self.control = {k: self.control.get(k, 0) + step[k] for k in step}
        if self._server_deltas:
            glob = self.server_control or [torch.zeros_like(d) for d in self._server_deltas[0]]
            self.server_control = [c + sum(d) / num_clients for c, *d in zip(glob, *self._server_deltas)]
            self._server_deltas = []


@register
class SplitFedScaffold(SFLV1):
    """SplitFed V1 + SCAFFOLD's control variates on the device block (module docstring)."""

    name = "sflv1_scaffold"
    tiers = ("its control variates are one device block's, averaged over every client; controls by block for "
             "clients of other depths are not built")
    u_shape = Algorithm.u_shape  # not built for it yet
    description = "SplitFed + SCAFFOLD: control variates correct the device blocks' drift"
    Params = ScaffoldParams  # its own loop, one client after another: no batched copies
    client_rule = ScaffoldRule
    server_rule = ScaffoldServer

    def run_round(self, rt, rnd, clients, rng):
        rt.workers.set_control(rt.server.control_msg(), clients)
        rt.server.fork(clients)
        self.each_client_in_turn(rt, clients, own_server_copy=True)
        rt.server.merge(rt.weights(clients, self.agg.weights))
        deltas = rt.workers.control_deltas(clients)  # before aggregation replaces the device blocks
        agg = rt.aggregate_clients(rt.weights(clients, self.agg.weights), self.agg.write_to)
        rt.server.update_control(rt.num_clients, *deltas)
        return agg
