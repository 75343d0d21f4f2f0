"""Asynchronous federated learning on the event driver: FedBuff, CA2FL and FedAsync, GAS's FL baselines.

Clients hold the whole model; a job is ``train.local_steps`` local SGD batches from the latest global model, then
the model goes up (runtime/server/events.py; the same clock, network model and client sampling as GAS). The server keeps
the global model each active job started from, so an upload is an update ``delta = x_client - x_start``.

- **FedBuff** (Nguyen et al., AISTATS 2022, "Federated learning with buffered asynchronous aggregation"): the
  server buffers ``buffer_size`` updates (default M) and then moves the global model by ``server_lr`` times their
  mean. GAS's code (baseline/FedBuff.py) instead averages the buffered *models*; ``aggregate: models`` does that.
- **CA2FL** (Wang et al., ICLR 2024, "Tackling the data heterogeneity in asynchronous federated learning with
  cached update calibration"): the server caches every client's latest update ``h_i`` (zero until it has one);
  when ``buffer_size`` updates from the set S are buffered it applies
  ``v = mean_all(h) + mean_{i in S}(delta_i - h_i)`` with ``server_lr``, then ``h_i <- delta_i`` for i in S.
  GAS's code (baseline/CA2FL.py) first refreshes the cache and then applies the sample-weighted mean of all cached
  updates; ``calibration: cache_mean`` does that.
- **FedAsync** (Xie, Koyejo and Gupta 2019, "Asynchronous federated optimization"): every upload is mixed in at
  once, ``x <- (1 - a_t) x + a_t x_client`` with ``a_t = alpha (staleness + 1)^-a`` (polynomial staleness
  function); every upload makes a global model, i.e. a global round.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from .base import AlgorithmParams, AsyncAlgorithm, register
from ..runtime import AsyncRule, Job
from ..runtime.messages import StateMsg


def _to_float(msg: StateMsg) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in msg.tensors().items()}


class UpdateServer(AsyncRule):
    """Asynchronous FL server: remembers the global model each job started from, turns uploads into updates."""

    checkpointed = ("start_of", "pending")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.start_of: dict[int, StateMsg] = {}
        self.pending: list[tuple[int, dict[str, torch.Tensor]]] = []  # (client, update) in the buffer
        self.buffer_size = getattr(ctx.params, "buffer_size", None) or ctx.events.active

    def on_job_start(self, cid: int, job: Job) -> None:
        self.start_of[cid] = self.ctx.global_model.current()

    def update_of(self, cid: int, msg: StateMsg) -> dict[str, torch.Tensor]:
        start = _to_float(self.start_of.pop(cid))
        return {k: v - start[k] for k, v in _to_float(msg).items()}

    def move_global(self, step: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        """x <- x + scale * step (integer buffers rounded back)."""
        current = self.ctx.global_model.current().tensors()
        new = {}
        for k, v in current.items():
            moved = v.double() + scale * step[k]
            new[k] = (moved if v.is_floating_point() else moved.round()).to(v.dtype)
        self.ctx.global_model.publish(StateMsg.packed(new, weight=1.0))


class FedBuffParams(AlgorithmParams):
    buffer_size: int | None = Field(default=None, ge=1, description="K: updates per server step (default: M)")
    server_lr: float = Field(default=1.0, gt=0, description="server learning rate on the mean update")
    aggregate: Literal["delta", "models"] = Field(default="delta", description="delta: x += server_lr * mean "
                                                  "update (the paper); models: x = mean of the buffered models "
                                                  "(GAS's code)")


class FedBuffServer(UpdateServer):
    def on_model_upload(self, cid: int, msg: StateMsg, job: Job) -> bool:
        p = self.ctx.params
        if p.aggregate == "models":
            self.start_of.pop(cid, None)
            self.pending.append((cid, _to_float(msg)))
        else:
            self.pending.append((cid, self.update_of(cid, msg)))
        if len(self.pending) < self.buffer_size:
            return False
        mean = {k: sum(u[k] for _, u in self.pending) / len(self.pending) for k in self.pending[0][1]}
        self.pending = []
        if p.aggregate == "models":
            ref = self.ctx.global_model.current().tensors()
            state = {k: (v if ref[k].is_floating_point() else v.round()).to(ref[k].dtype) for k, v in mean.items()}
            self.ctx.global_model.publish(StateMsg.packed(state, weight=1.0))
        else:
            self.move_global(mean, p.server_lr)
        return True


@register
class FedBuff(AsyncAlgorithm):
    """FedBuff: buffered asynchronous aggregation (module docstring)."""

    name = "fedbuff"
    tiers = "the whole model is on the clients: it has no cut"
    description = "FedBuff: async FL, K buffered client updates per server step"
    Params = FedBuffParams
    server_rule = FedBuffServer
    split = False


class CA2FLParams(FedBuffParams):
    calibration: Literal["paper", "cache_mean"] = Field(default="paper", description="paper: mean cached update "
                                                         "+ mean calibrated new updates; cache_mean: the "
                                                         "sample-weighted mean of all cached updates (GAS's code)")


class CA2FLServer(UpdateServer):
    checkpointed = ("cache",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.cache: dict[int, dict[str, torch.Tensor]] = {}

    def on_model_upload(self, cid: int, msg: StateMsg, job: Job) -> bool:
        self.pending.append((cid, self.update_of(cid, msg)))
        if len(self.pending) < self.buffer_size:
            return False
        n = len(self.ctx.events.client_sizes)
        keys = list(self.pending[0][1])
        zero = {k: torch.zeros_like(v) for k, v in self.pending[0][1].items()}
        if self.ctx.params.calibration == "paper":
            mean_cache = {k: sum(h[k] for h in self.cache.values()) / n if self.cache else zero[k] for k in keys}
            calib = {k: sum(u[k] - self.cache.get(c, zero)[k] for c, u in self.pending) / len(self.pending)
                     for k in keys}
            step = {k: mean_cache[k] + calib[k] for k in keys}
            for c, u in self.pending:
                self.cache[c] = u
        else:
            for c, u in self.pending:
                self.cache[c] = u
            sizes = self.ctx.events.client_sizes
            total = float(sum(sizes))
            step = {k: sum(h[k] * (sizes[c] / total) for c, h in self.cache.items()) for k in keys}
        self.pending = []
        self.move_global(step, self.ctx.params.server_lr)
        return True


@register
class CA2FL(AsyncAlgorithm):
    """CA2FL: FedBuff with cached-update calibration (module docstring)."""

    name = "ca2fl"
    tiers = "the whole model is on the clients: it has no cut"
    description = "CA2FL: FedBuff + calibration by every client's cached latest update"
    Params = CA2FLParams
    server_rule = CA2FLServer
    split = False


class FedAsyncParams(AlgorithmParams):
    alpha: float = Field(default=0.6, gt=0, le=1, description="mixing weight of a fresh upload")
    staleness_power: float = Field(default=0.5, ge=0, description="a in alpha * (staleness + 1)^-a")


class FedAsyncServer(UpdateServer):
    def on_job_start(self, cid: int, job: Job) -> None:
        pass

    def on_model_upload(self, cid: int, msg: StateMsg, job: Job) -> bool:
        p = self.ctx.params
        mix = p.alpha * (self.ctx.global_model.version - job.version + 1) ** (-p.staleness_power)
        current = _to_float(self.ctx.global_model.current())
        step = {k: v - current[k] for k, v in _to_float(msg).items()}
        self.move_global(step, mix)
        return True


@register
class FedAsync(AsyncAlgorithm):
    """FedAsync: every upload mixed into the global model with a staleness-decayed weight (module docstring)."""

    name = "fedasync"
    tiers = "the whole model is on the clients: it has no cut"
    description = "FedAsync: each upload mixed in with weight alpha * (staleness+1)^-a"
    Params = FedAsyncParams
    server_rule = FedAsyncServer
    split = False
