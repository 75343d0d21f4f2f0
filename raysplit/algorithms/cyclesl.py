"""The CycleSL family (Wang et al., ../shared/papers/cyclesl.txt, Algorithm 1) and SGLR (Pal et al. 2021).

CycleSL treats server training as a task of its own over the round's pooled smashed data: the server resamples
shuffled batches from the pooled features for ``server_epochs`` E, then, with the updated server frozen, computes
each client's gradient on that client's *original* features; the clients step. CyclePSL = that with no client
aggregation; CycleSFL = that + FedAvg of client models; CycleSGLR = that + SGLR's gradient averaging.

Choices where the paper and the authors' code (seed-code.md §4.3) differ or are silent:
- One server epoch is a full shuffled pass over the pooled features in batches of ``server_batch_size`` (the code;
  ``ceil(N * bs / server_bs)`` steps). Algorithm 1's text reads as one resampled batch per "epoch"; set
  ``server_steps: one`` for that reading.
- The resampled-batch loss weights every sample by its client's train-set size: sum_i w_i CE_i / sum_i w_i (code).
  A language model's sample is a token block: its loss ``CE_i`` is the block's mean next-token cross-entropy
  (:func:`raysplit.lm_metrics.lm_sample_losses`), so with equal weights the resampled step's loss is the
  next-token loss of the batch; the frozen pass's gradient is that of the batch's mean next-token loss. The
  server needs the tokens (its targets) for its epochs: a language model runs with ``model.lm.split: plain``
  (the U-shape keeps the head and the targets on the clients, so the server could not train on pooled batches).
- The gradient pass runs the frozen server in train mode (BatchNorm statistics update again), as the code does;
  the gradient is that of the mean CE over the client's batch.
- Client optimizer state persists across rounds (per client; Adam in the CycleSL configs).
- Clients with their own cuts (``model.tiers``; CyclePSL, CycleSFL): the pool keeps each cut's features apart, a
  resampled batch's samples enter the server's model at their own cuts with the same weighted loss, and CycleSFL
  averages client parts and the server's overlap by block (raysplit/runtime/tiered.py). CycleSGLR and SGLR share
  one gradient among clients, which clients of other cuts cannot take (other shapes): they refuse.

SGLR has two variants (``variant``):
- ``cyclesl`` (CycleSL's code, default): per-client server copies, each stepping once on its client's batch, then
  averaged; the first ``active_fraction`` of the round's clients (in sampled order) receive one gradient: the
  per-sample gradients of all their samples averaged with client-size weights, repeated over each batch; the other
  clients receive their own. No learning-rate scaling, no client aggregation.
- ``original`` (Pal et al.'s code): one server model takes one step on the concatenated batch with learning rate
  ``client lr * N ** lr_pow``; while ``round < comm_fraction * rounds`` every client receives the position-wise mean
  of the clients' gradient slices, afterwards its own slice. No client aggregation.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from .base import Algorithm, AlgorithmParams, CopiesParams, register
from ..errors import ConfigError
from ..runtime import Batch, ServerRule, batch_step
from ..runtime.messages import Gradient


def sglr_shared_gradient(grads: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """CycleSL's SGLR: mean of every per-sample gradient of the active clients, each client's samples weighted by
    the client's size: sum_c w_c sum_j g_cj / sum_c w_c n_c (one per-sample gradient)."""
    num = sum(w * g.sum(axis=0, dtype=np.float64) for g, w in zip(grads, weights))
    den = sum(w * len(g) for g, w in zip(grads, weights))
    return (num / den).astype(grads[0].dtype)


def host_array(g) -> np.ndarray:
    """A gradient as a numpy array in host memory (a tensor read from its device)."""
    return g.detach().cpu().numpy() if isinstance(g, torch.Tensor) else np.asarray(g)


def positionwise_mean(grads: list[np.ndarray]) -> np.ndarray:
    """Original SGLR: g_bar[j] = mean over clients of their j-th gradient row (clients with shorter batches only
    count for the rows they have)."""
    n = max(len(g) for g in grads)
    stack = np.full((len(grads), n, *grads[0].shape[1:]), np.nan, dtype=np.float64)
    for i, g in enumerate(grads):
        stack[i, :len(g)] = g
    return np.nanmean(stack, axis=0).astype(grads[0].dtype)


class CycleServer(ServerRule):
    """Server rule with the CycleSL step and SGLR's server-side rules (``self.ctx.params``: the algorithm's
    Params)."""

    @batch_step(starts="after_last_arrival")
    def cycle_step(self, *acts: Batch) -> list[Gradient]:
        """Algorithm 1: pool the round's features, train the server for E epochs on resampled batches with
        client-size-weighted loss, freeze it, return each client's gradient on its original features."""
        ctx = self.ctx
        p, main, trainer = ctx.params, ctx.models.main, ctx.trainer
        pool = trainer.pool(list(acts))  # the round's features, labels and client-size weights
        g = torch.Generator().manual_seed(ctx.seed * 100003 + ctx.round)
        bs = p.server_batch_size or ctx.train.batch_size
        n = len(pool)
        for _ in range(p.server_epochs):
            perm = torch.randperm(n, generator=g)  # the pool moves each batch's indices to its device
            starts = range(0, n, bs) if p.server_steps == "epoch" else [0]
            for i in starts:
                pool.step(perm[i:i + bs], main, tag=acts[0].tag)  # client-size-weighted cross-entropy
        return [trainer.gradient(a, main.module) for a in acts]

    def share_gradients(self, grads: list[Gradient], weights: list[float], active: int) -> list[Gradient]:
        """CycleSL's SGLR rule on already computed gradients: the first ``active`` get the shared one."""
        if active < 1:
            return grads
        # shared in host memory, in float64 as the authors' code does (a read of each active client's gradient)
        shared = sglr_shared_gradient([host_array(g.g) for g in grads[:active]], weights[:active])
        return self.ctx.trainer.revise(grads, [np.broadcast_to(shared, g.g.shape).copy() for g in grads[:active]])

    @batch_step(starts="after_last_arrival")
    def cycle_sglr_step(self, *acts: Batch) -> list[Gradient]:
        grads = self.cycle_step(*acts)
        active = int(self.ctx.params.active_fraction * len(acts))
        return self.share_gradients(grads, [a.weight for a in acts], active)

    @batch_step(starts="on_arrival")
    def sglr_copies_step(self, *acts: Batch) -> list[Gradient]:
        """SGLR, ``variant: cyclesl`` (module docstring): each client's server copy steps on its batch from its
        arrival on, then the first ``active_fraction`` share one gradient."""
        grads = self.ctx.models.train_copies(*acts)  # copies forked by the round; batched with batched_copies
        active = int(self.ctx.params.active_fraction * len(acts))
        return self.share_gradients(grads, [a.weight for a in acts], active)

    @batch_step(starts="after_last_arrival")
    def sglr_concat_step(self, *acts: Batch) -> list[Gradient]:
        """SGLR, ``variant: original`` (module docstring): one step of the server model on the concatenated
        batch at ``lr * N ** lr_pow``, once the last batch has arrived; the position-wise mean of the gradient
        slices while ``round < comm_fraction * rounds``."""
        ctx = self.ctx
        p, main = ctx.params, ctx.models.main
        x = torch.cat([a.x for a in acts]).requires_grad_(True)
        ys = [a.y for a in acts]
        ctx.trainer.scale_lr(main.optimizer, len(acts) ** p.lr_pow)
        lv = ctx.trainer.step(x, torch.cat(ys), main, tag=acts[0].tag)
        sizes = np.cumsum([0] + [len(t) for t in ys])
        slices = [x.grad[sizes[i]:sizes[i + 1]] for i in range(len(acts))]
        if ctx.round < p.comm_fraction * ctx.train.rounds:
            mean = torch.from_numpy(positionwise_mean([s.cpu().numpy() for s in slices]))
            slices = [mean[:len(s)].clone() for s in slices]
        return [ctx.trainer.answer(a, s, lv) for a, s in zip(acts, slices)]


class CycleParams(AlgorithmParams):
    server_epochs: int = Field(default=1, ge=1, description="E: passes over the pooled features per round")
    server_batch_size: int | None = Field(default=None, ge=1, description="resampling batch size (default: "
                                          "train.batch_size)")
    server_steps: Literal["epoch", "one"] = Field(default="epoch", description="epoch: a server epoch is a full "
                                                  "shuffled pass (the code); one: one resampled batch (the text)")


class SGLRParams(CopiesParams):
    variant: Literal["cyclesl", "original"] = Field(default="cyclesl", description="cyclesl: CycleSL's SGLR code; "
                                                    "original: Pal et al.'s code (module docstring)")
    active_fraction: float = Field(default=0.5, ge=0, le=1, description="variant cyclesl: the first fraction of "
                                   "the round's clients that receive the shared gradient")
    lr_pow: float = Field(default=1.0, description="variant original: server lr = client lr * N**lr_pow")
    comm_fraction: float = Field(default=0.6, ge=0, le=1, description="variant original: gradients are averaged "
                                 "while round < comm_fraction * train.rounds")


class CycleSGLRParams(CycleParams):
    active_fraction: float = Field(default=0.5, ge=0, le=1, description="the first fraction of the round's "
                                   "clients that receive the shared gradient")


class PooledRound(Algorithm):
    """Rounds of ``local_steps`` pooled steps: one forward per sampled client, one server call over all of them
    (``server_method``) returning one gradient per client, and the clients' backward passes."""

    server_rule = CycleServer
    server_method = CycleServer.cycle_step
    u_shape = "{name}'s server pools every client's features of a step, with their labels, into batches of its own"

    def setup(self, info) -> None:
        if self.local_epochs:
            raise ConfigError(f"{self.name} pools one batch per client per step (train.local_steps); "
                              "train.local_epochs is not supported")

    def pooled_steps(self, rt, clients) -> None:
        """The round's ``local_steps`` pooled steps through the runtime's one engine (server-driven, over the
        compiled transport where the backend offers it)."""
        rt.pooled_steps(clients, self.local_steps, type(self).server_method)


@register
class CyclePSL(PooledRound):
    """CycleSL on PSL: one server model trained on the pooled features; client models are not aggregated."""

    name = "cyclepsl"
    description = "CycleSL + PSL: pooled feature resampling, frozen-server gradients, no aggregation"
    tiers = ""  # each cut's features apart in the pool, every sample entering the server at its cut
    Params = CycleParams

    def keeps_global_client_model(self) -> bool:
        return False

    def run_round(self, rt, rnd, clients, rng):
        self.pooled_steps(rt, clients)
        return None


@register
class CycleSFL(PooledRound):
    """CycleSL on SFL: CyclePSL's round, then FedAvg of the client models (to all clients by default)."""

    name = "cyclesfl"
    description = "CycleSL + SFL: pooled feature resampling, frozen-server gradients, FedAvg of clients"
    tiers = ""  # CyclePSL's pool by cut, then client parts and the server's overlap by block
    Params = CycleParams

    def run_round(self, rt, rnd, clients, rng):
        self.pooled_steps(rt, clients)
        return rt.aggregate_clients(rt.weights(clients, self.agg.weights), self.agg.write_to)


@register
class CycleSGLR(CyclePSL):
    """CycleSL on SGLR: CyclePSL's round with SGLR's gradient sharing among the first ``active_fraction``."""

    name = "cyclesglr"
    description = "CycleSL + SGLR: pooled resampling, frozen-server gradients shared among active clients"
    tiers = "it shares one gradient among the active clients, and clients of other cuts get gradients of other shapes"
    Params = CycleSGLRParams
    server_method = CycleServer.cycle_sglr_step


@register
class SGLR(PooledRound):
    """Server-side local gradient averaging and learning-rate acceleration (Pal et al. 2021); both variants in
    the module docstring. Client models are never aggregated."""

    name = "sglr"
    description = "SGLR: server-side gradient averaging (variant cyclesl | original)"
    tiers = "it shares one gradient among clients, and clients of other cuts get gradients of other shapes"
    Params = SGLRParams

    def keeps_global_client_model(self) -> bool:
        return False

    def pooled_steps(self, rt, clients) -> None:
        step = CycleServer.sglr_copies_step if self.params.variant == "cyclesl" else CycleServer.sglr_concat_step
        rt.pooled_steps(clients, self.local_steps, step)

    def run_round(self, rt, rnd, clients, rng):
        cyclesl = self.params.variant == "cyclesl"
        if cyclesl:
            rt.server.fork(clients)
        self.pooled_steps(rt, clients)
        if cyclesl:
            rt.server.merge(rt.weights(clients, self.agg.weights))
        return None
