"""MergeSFL (Liao et al., "MergeSFL: Split Federated Learning with Feature Merging and Batch Size Regulation",
ICDE 2024; a baseline of Hydra's Table 3, ../shared/papers/hydra.txt). Authors' code: ymliao98/MergeSFL
(``training_utils.merge_and_dispatch``, ``control``); Hydra's run of it: ``run_mergesfl.py`` (seed-code.md §2.7).

A round: the sampled clients receive the global client model; per step every client forwards a batch of its own
size ``d_i`` and the server *merges* the activations (and labels) into one mixed batch of ``D = sum d_i`` samples,
takes one forward/backward/step of the single server model on it (mean cross-entropy over the merged batch), and
*dispatches* each client its slice of the gradient; after the round the client models are averaged (FedAvg).

- **Gradient dispatch.** A client's slice is multiplied by ``D / d_i`` (the authors' and Hydra's code), so each
  client steps on the gradient of the mean loss over *its own* batch (the slice alone carries the factor
  ``d_i / D``). With FedAvg weights proportional to ``d_i`` (``client_weights: trained``, below) one merged step
  followed by aggregation is then exactly one SGD step of the whole model on the concatenated batch.
- **Batch-size regulation** (``batch_sizes: regulated``): the paper gives heterogeneous workers different batch
  sizes so that they finish an iteration at about the same time (no idle waiting at the merge). Here a client's
  time per sample is read from its virtual-clock profile, ``c_i = F / flops_i + (a + 8) / up_i + a / down_i``
  (``F``: FLOPs of the client part's forward and backward per sample, ``a``: activation bytes per sample, 8: the
  label; the download term only with ``clock.charge_server``), and ``d_i`` is proportional to ``1 / c_i``, at
  least 1 and at most the client's train-set size, summing to ``total_batch_size`` (default ``train.batch_size``
  per client). The paper estimates these states from measurements every round (and bounds ``D`` by the server's
  bandwidth); in the simulation the profiles are known exactly and fixed, so the estimate is the profile itself.
  ``batch_sizes: equal`` splits ``D`` evenly: the authors' public code (``control``) and Hydra's baseline give
  every client ``train.batch_size``, which is the default total.
- **Label mix.** The paper also picks the round's workers (a genetic algorithm) so that the merged batch's label
  distribution, the clients' label distributions weighted by their batch sizes, is close to IID (KL divergence).
  Not implemented: raysplit draws every algorithm's clients from one shared sampling stream, and the public code
  samples workers uniformly as well. The quantity is logged every round as ``method/label_kl`` (mean over the round's
  steps of KL(merged batch's expected label mix || training label distribution)), so the effect of the sampled
  set and of the batch sizes on the mix is visible.
- **Aggregation.** The paper aggregates the bottom models adaptively to the workers' batch sizes;
  ``client_weights: trained`` (default) weights each client by the samples it trained on this round (``d_i`` x its
  steps), the weighting that makes merged training equal large-batch SGD (above). The authors' code averages
  uniformly, which is the same when batch sizes are equal; ``config`` uses ``train.aggregation.weights``.
- **Round length.** ``train.local_steps`` merged steps per round (the paper's tau; 42 in the authors' code). With
  ``train.local_epochs`` every client runs that many passes over its data at its own batch size and leaves the
  merge once done (Hydra's ``run_mergesfl.py``, which runs one local epoch per round); the slowest client's pass
  then bounds the round whatever the batch sizes, so regulation pays off with ``local_steps``.
- Optimisers persist across rounds (the authors' code re-creates plain SGD each round: the same for plain SGD).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from .base import Algorithm, AlgorithmParams, SetupInfo, clients_per_round, register
from ..clock import FlopCache
from ..errors import ConfigError
from ..runtime import Batch, ServerRule, batch_step
from ..runtime.messages import Gradient

LABEL_BYTES = 8  # an int64 label travels with every sample


def regulated_batch_sizes(speeds, total: int, caps=None) -> np.ndarray:
    """Integer batch sizes proportional to ``speeds`` (samples per second), each at least 1 and at most its cap
    (the client's train-set size), summing to ``total`` (to the caps' sum when that is smaller). The shares
    ``clip(lam * speed, 1, cap)`` are found by bisection on ``lam`` (their sum grows with it); the rounding
    remainder goes to the largest fractional parts (ties: the earlier client)."""
    speeds = np.asarray(speeds, dtype=float)
    n = len(speeds)
    caps = np.full(n, total) if caps is None else np.minimum(np.asarray(caps, dtype=np.int64), total)
    if n == 0 or (speeds <= 0).any() or (caps < 1).any():
        raise ValueError(f"need positive speeds and caps for every client, got speeds {speeds}, caps {caps}")
    total = int(min(total, caps.sum()))
    if total < n:
        raise ValueError(f"a merged batch of {total} samples cannot give each of the {n} clients one")
    lo, hi = 0.0, float(np.max(caps / speeds))
    for _ in range(200):
        lam = (lo + hi) / 2
        lo, hi = (lam, hi) if np.clip(lam * speeds, 1, caps).sum() < total else (lo, lam)
    share = np.clip(hi * speeds, 1, caps)
    sizes = np.floor(share).astype(np.int64)
    rest = total - int(sizes.sum())
    for i in np.argsort(-(share - sizes), kind="stable"):
        if rest <= 0:
            break
        if sizes[i] < caps[i]:
            sizes[i] += 1
            rest -= 1
    return sizes


@dataclass(frozen=True)
class LabelMix:
    """The clients' label distributions and the training set's (for the ``label_kl`` metric)."""

    per_client: np.ndarray  # (clients, labels), rows sum to 1
    overall: np.ndarray  # (labels,)


class MergeServer(ServerRule):
    """Server rule with MergeSFL's merged step (``ctx.setup``: the :class:`LabelMix`)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.label_kls: list[float] = []

    def on_begin_round(self, rnd: int) -> None:
        self.label_kls = []

    @batch_step(starts="after_last_arrival")
    def merge_step(self, *acts: Batch) -> list[Gradient]:
        """Feature merging: one step of the server model on the concatenated activations (mean cross-entropy over
        the merged batch); each client gets its slice of the gradient times ``D / d_i`` (module docstring)."""
        trainer = self.ctx.trainer
        feats = [a.x for a in acts]
        x = torch.cat(feats).requires_grad_(True)
        y = torch.cat([a.y for a in acts])
        lv = trainer.step(x, y, self.ctx.models.main, tag=acts[0].tag)
        bounds = np.cumsum([0] + [len(f) for f in feats])
        out = []
        for a, lo, hi in zip(acts, bounds[:-1], bounds[1:]):
            g = x.grad[lo:hi] * (float(bounds[-1]) / float(hi - lo))
            out.append(trainer.answer(a, g, lv))
        mix: LabelMix = self.ctx.setup
        merged = sum(len(f) * mix.per_client[a.tag.client] for a, f in zip(acts, feats)) / bounds[-1]
        from scipy.stats import entropy  # here, not at import: scipy.stats costs every process ~0.6 s

        self.label_kls.append(float(entropy(merged, mix.overall)))
        return out

    def round_metrics(self) -> dict:
        return {"label_kl": float(np.mean(self.label_kls))} if self.label_kls else {}


class MergeSFLParams(AlgorithmParams):
    batch_sizes: Literal["regulated", "equal"] = Field(default="regulated", description="per-client batch sizes: "
                                                       "regulated (the paper: proportional to the client's speed "
                                                       "from its clock profile, so that every client's step takes "
                                                       "about as long) or equal (the authors' and Hydra's code)")
    total_batch_size: int | None = Field(default=None, ge=1, description="D: samples in the merged batch per step "
                                         "(default: train.batch_size x the round's clients)")
    client_weights: Literal["trained", "config"] = Field(default="trained", description="FedAvg weights of the "
                                                         "client models: the samples each trained on this round "
                                                         "(by batch size: merged training = large-batch SGD) or "
                                                         "train.aggregation.weights (the code: uniform)")


@register
class MergeSFL(Algorithm):
    """MergeSFL: per step the sampled clients' activations are merged into one server batch; per-client batch
    sizes regulated by the clients' speeds; FedAvg of the client models (module docstring)."""

    name = "mergesfl"
    tiers = ("it merges the clients' activations of a step into one batch and mixes them by label; not built for "
             "other cuts' shapes")
    language_model = "{name} needs a class label per sample: its server mixes the clients' labels"
    u_shape = "{name}'s server merges the clients' features, with their labels, into one batch"
    description = ("MergeSFL: clients' activations merged into one server batch per step, speed-regulated batch "
                   "sizes, FedAvg")
    Params = MergeSFLParams
    server_rule = MergeServer

    @classmethod
    def check_config(cls, params, cfg) -> None:
        super().check_config(params, cfg)
        m = clients_per_round(cfg)
        if params.total_batch_size is not None and params.total_batch_size < m:
            raise ConfigError(f"algorithm.total_batch_size={params.total_batch_size} cannot give each of the {m} "
                              "clients of a round (train.participation) one sample")

    def setup(self, info: SetupInfo) -> None:
        counts = np.asarray(info.counts, dtype=float)
        self.label_mix = LabelMix(counts / np.maximum(counts.sum(axis=1, keepdims=True), 1),
                                  counts.sum(axis=0) / counts.sum())
        self.flops_per_sample, self.bytes_per_sample = self.client_cost(info)
        down = self.bytes_per_sample if self.cfg.clock.charge_server else 0.0
        self.seconds_per_sample = np.array([p.seconds(self.flops_per_sample, self.bytes_per_sample + LABEL_BYTES, down)
                                            for p in info.profiles])
        self.default_total = self.cfg.train.batch_size * info.clients_per_round

    @staticmethod
    def client_cost(info: SetupInfo) -> tuple[float, float]:
        """FLOPs of the client part's forward + backward and bytes of its activation, per sample (a probe on a
        copy of the client part, so the model's buffers and gradients stay untouched)."""
        client = copy.deepcopy(info.model.segment(0, info.cut)).train()
        x = info.model.example_input(2, generator=torch.Generator().manual_seed(0))

        def forward_backward():
            out = client(x)
            out.float().sum().backward()
            return out

        out, flops = FlopCache().run(("probe",), forward_backward)
        return flops / len(x), float(out[0].nelement() * out.element_size())

    def host_setup(self) -> LabelMix:
        return self.label_mix

    def resolved(self) -> dict:
        return {"mergesfl.client_flops_per_sample": self.flops_per_sample,
                "mergesfl.activation_bytes_per_sample": self.bytes_per_sample,
                "mergesfl.total_batch_size": self.params.total_batch_size or self.default_total}

    def batch_sizes(self, rt, clients: list[int]) -> dict[int, int]:
        """Each client's batch this round (module docstring)."""
        clients = [int(c) for c in clients]
        total = self.params.total_batch_size or self.cfg.train.batch_size * len(clients)
        regulated = self.params.batch_sizes == "regulated"
        speeds = 1.0 / self.seconds_per_sample[clients] if regulated else np.ones(len(clients))
        sizes = regulated_batch_sizes(speeds, total, caps=rt.sizes[clients].astype(np.int64))
        return dict(zip(clients, (int(d) for d in sizes)))

    def steps(self, rt, sizes: dict[int, int]) -> dict[int, int]:
        """Each client's merged steps this round: ``local_steps``, or ``local_epochs`` passes at its batch size."""
        if self.local_epochs:
            return {c: self.local_epochs * self.batches_per_pass(rt.sizes[c], d) for c, d in sizes.items()}
        return {c: self.local_steps for c in sizes}

    def run_round(self, rt, rnd, clients, rng):
        sizes = self.batch_sizes(rt, clients)
        steps = self.steps(rt, sizes)
        done = 0
        for until in sorted(set(steps.values())):  # clients whose steps are done leave the merge
            active = [c for c in sizes if steps[c] >= until]
            rt.pooled_steps(active, until - done, MergeServer.merge_step, batch_sizes={c: sizes[c] for c in active})
            done = until
        weights = ({c: float(sizes[c] * steps[c]) for c in sizes} if self.params.client_weights == "trained"
                   else rt.weights(clients, self.agg.weights))
        return rt.aggregate_clients(weights, self.agg.write_to)
