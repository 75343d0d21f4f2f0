"""GAS: generative activation-aided asynchronous split federated learning (Yang et al., AAAI 2025;
../shared/papers/gas.txt; what the authors' code does: ../shared/notes/seed-code.md §1).

M clients train at a time; each runs ``train.local_steps`` split iterations from the latest global client model,
then uploads its model and a newly sampled client takes its slot (the event driver, runtime/server/events.py). On the
server, in simulated-time order (the paper's Algorithm 1):

- **on activation arrival**: the activation joins the activation buffer with its client's recency weight; the
  client's gradient comes from the *current* server model with logit adjustment ``log(pi_c^tau + 1e-12)`` added to
  the logits (``pi_c``: the client's label frequencies over its local data); only the client part steps.
- **when the activation buffer is full** (``buffer_size`` batches, default M): the per-label activation statistics
  absorb the buffer (raysplit/gaussian.py); once every label has statistics, each label is topped up to
  ``min_per_label`` samples (default: the batch size) with activations drawn from its Gaussian; the server takes
  one step of plain cross-entropy over the real and generated activations; the buffer empties.
- **on model upload**: the model joins the model buffer; when it holds ``model_buffer_size`` models (default M)
  they are averaged (``model_weights``: uniform as in the code, or by samples) into the new global client model:
  one global round.

Recency weights (seed-code.md §1.4, the paper's "dynamic weighting"): an initial client's activations weigh 1, 2,
3, ... by its iteration; a client that joins later starts at ``total``, which grows by the cumulative number of
server updates at every aggregation. ``weighting: uniform`` weighs every activation 1.

Choices where the paper, the code and this implementation differ:
- The covariance is never re-factorised (raysplit/gaussian.py): ``covariance: full`` draws from exactly the
  code's N(mu, S) (the code rebuilds a Cholesky factor per label per server update); ``diagonal`` and ``lowrank``
  are cheaper approximations for large activations.
- The client's gradient pass runs through the server model with its parameters frozen (only the input gradient is
  computed; the code computes the parameter gradients too and discards them), and its FLOPs are charged to the
  server clock unless ``clock.charge_server: false`` (the code charges no server time at all).
- The code shares one client momentum buffer across all clients; here every client keeps its own optimizer state
  (as every raysplit algorithm does).
- The code's logit-adjustment vector has 10 entries whatever the dataset (a bug for CIFAR-100); here it has one
  per label.
- Generated activations are drawn by the server from a generator seeded per run, so a run is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from .base import AsyncAlgorithm, AlgorithmParams, SetupInfo, register
from ..gaussian import LabelGaussian
from ..runtime import AsyncRule, Batch


@dataclass(frozen=True)
class GASSetup:
    """What GAS's server needs beyond its Params, derived at setup: the (clients x labels) train-label counts (for
    logit adjustment), every client's train size, and the buffer sizes with their defaults resolved."""

    label_counts: tuple
    client_sizes: tuple
    buffer_size: int  # batches per server update
    model_buffer_size: int  # uploads per global model
    min_per_label: int  # samples per label in a server update after generation


class GASParams(AlgorithmParams):
    buffer_size: int | None = Field(default=None, ge=1, description="activation buffer: batches per server "
                                    "update (default: M = the active clients)")
    model_buffer_size: int | None = Field(default=None, ge=1, description="model buffer: uploads per global "
                                          "model (default: M)")
    model_weights: Literal["uniform", "samples"] = Field(default="uniform", description="averaging of the "
                                                         "buffered models: uniform (the code) or by samples")
    generate: bool = Field(default=True, description="top labels up with generated activations (false: the "
                           "paper's ablation)")
    min_per_label: int | None = Field(default=None, ge=0, description="samples per label in a server update "
                                      "after generation (default: train.batch_size)")
    covariance: Literal["full", "diagonal", "lowrank"] = Field(default="full", description="per-label activation "
                                                               "covariance (raysplit/gaussian.py)")
    rank: int = Field(default=32, ge=1, description="covariance: lowrank: columns kept")
    logit_adjustment: bool = Field(default=True, description="add log(pi_c^tau + 1e-12) to the logits in the "
                                   "client's gradient")
    tau: float = Field(default=1.0, ge=0, description="logit-adjustment temperature")
    weighting: Literal["recency", "uniform"] = Field(default="recency", description="activation weights in the "
                                                     "statistics: GAS's growing recency weights, or 1")
    dissimilarity_batches: int = Field(default=0, ge=0, description="gradient-dissimilarity diagnostic (the "
                                       "paper's Fig. 2a, the code's V_Test) on this many random test batches at "
                                       "every global round; 0: off")


class GASServer(AsyncRule):
    """The server of GAS: activation buffer, per-label Gaussians, model buffer (module docstring)."""

    checkpointed = ("stats", "buffer", "models_in", "weight_count", "total_weight", "server_updates", "gen_rng",
                    "last_update")

    def __init__(self, ctx):
        super().__init__(ctx)
        p, setup = ctx.params, ctx.setup
        counts = np.asarray(setup.label_counts, dtype=np.float64)
        self.num_labels = counts.shape[1]
        pi = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
        self.adjustment = torch.as_tensor(np.log(pi ** p.tau + 1e-12), dtype=torch.float32, device=ctx.device)
        self.act_shape = ctx.model.cut_shape
        dim = int(np.prod(self.act_shape))
        self.stats = [LabelGaussian(dim, p.covariance, p.rank) for _ in range(self.num_labels)]
        self.buffer: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        self.models_in: list = []  # uploaded client models (messages) in the model buffer
        self.weight_count: dict[int, float] = {}
        self.total_weight = 1.0
        self.server_updates = 0
        self.gen_rng = ctx.rng(0x6A5)
        self.last_update: tuple[torch.Tensor, torch.Tensor] | None = None  # (x, y) of the last server update
        self.generated, self.updates_this_round, self.dissimilarity = 0, 0, None  # this round's (round_metrics)

    # ---- hooks ------------------------------------------------------------------------------------------------
    def on_job_start(self, cid: int, job) -> None:
        self.weight_count[cid] = self.total_weight

    def on_arrival(self, b: Batch):
        c = b.tag.client
        w = self.weight_count[c] if self.ctx.params.weighting == "recency" else 1.0
        self.weight_count[c] += 1
        self.buffer.append((b.x.detach().clone(), b.y, w))
        adjust = self.adjustment[c] if self.ctx.params.logit_adjustment else None

        def adjusted_ce(out, y):
            return F.cross_entropy(out + adjust if adjust is not None else out, y)

        return self.ctx.trainer.gradient(b, self.ctx.models.main.module, adjusted_ce)

    def should_flush(self) -> bool:
        return len(self.buffer) >= self.ctx.setup.buffer_size

    def flush(self) -> None:
        p = self.ctx.params
        xs = torch.cat([b[0] for b in self.buffer])
        ys = torch.cat([b[1] for b in self.buffer])
        ws = np.concatenate([np.full(len(b[1]), b[2]) for b in self.buffer])
        flat = xs.reshape(len(xs), -1).cpu().numpy()
        labels = ys.cpu().numpy()
        for lab in np.unique(labels):
            mask = labels == lab
            st = self.stats[int(lab)]
            st.merge(flat[mask], ws[mask])
            if not st.finite():
                raise FloatingPointError(f"GAS: the activation statistics of label {int(lab)} became non-finite at "
                                         f"server update {self.server_updates}")
        if p.generate and all(st.merges for st in self.stats):
            gen_x, gen_y = [], []
            counts = np.bincount(labels, minlength=self.num_labels)
            for lab in range(self.num_labels):
                need = self.ctx.setup.min_per_label - int(counts[lab])
                if need > 0:
                    gen_x.append(self.stats[lab].sample(need, self.gen_rng))
                    gen_y.append(np.full(need, lab))
            if gen_x:
                g = torch.as_tensor(np.concatenate(gen_x), dtype=xs.dtype, device=xs.device)
                xs = torch.cat([xs, g.reshape(len(g), *self.act_shape)])
                ys = torch.cat([ys, torch.as_tensor(np.concatenate(gen_y), device=ys.device)])
                self.generated += len(g)
        self.ctx.trainer.step(xs, ys, self.ctx.models.main, step=self.server_updates)
        if p.dissimilarity_batches:
            self.last_update = (xs.detach(), ys)
        self.buffer = []
        self.server_updates += 1
        self.updates_this_round += 1

    def on_model_upload(self, cid: int, msg, job) -> bool:
        ctx = self.ctx
        self.weight_count.pop(cid, None)
        size = float(ctx.setup.client_sizes[cid]) if ctx.params.model_weights == "samples" else 1.0
        self.models_in.append(replace(msg, weight=size))
        if len(self.models_in) < ctx.setup.model_buffer_size:
            return False
        new = ctx.global_model.average(self.models_in, [m.weight for m in self.models_in])
        ctx.global_model.publish(new)
        self.models_in = []
        self.total_weight += self.server_updates
        if ctx.params.dissimilarity_batches and self.last_update is not None:
            self.dissimilarity = self.gradient_dissimilarity(new, *self.last_update)
        return True

    def gradient_dissimilarity(self, model, x: torch.Tensor, y: torch.Tensor) -> float:
        """The paper's gradient dissimilarity (Fig. 2a; the code's ``calculate_v_value``): the server model's
        gradient on the last server update's activations (generated ones included) against its gradient on
        ``dissimilarity_batches`` random test batches through the new global client model, as the code computes
        it: the squared distance summed per parameter tensor, divided by the number of tensors. (The code runs
        the test batches through whichever client's weights its shared client module last held; here it is the
        global model, the paper's intent.) A diagnostic: it changes no model and no clock."""
        ctx = self.ctx
        server = ctx.models.main.module
        params = [q for q in server.parameters() if q.requires_grad]
        real = [torch.zeros_like(q) for q in params]
        k = ctx.params.dissimilarity_batches
        for feats, yb in ctx.evaluation.encoded(model, ctx.rng(0xD15, ctx.global_model.version), k):
            for acc, g in zip(real, torch.autograd.grad(F.cross_entropy(server(feats), yb), params)):
                acc += g / k
        sampled = torch.autograd.grad(F.cross_entropy(server(x), y), params)
        return float(sum(((g - r) ** 2).sum() for g, r in zip(sampled, real)) / len(params))

    def round_metrics(self) -> dict:
        out = {"server_updates": self.updates_this_round, "generated_activations": self.generated}
        if self.dissimilarity is not None:
            out["grad_dissimilarity"] = self.dissimilarity
        self.generated, self.updates_this_round, self.dissimilarity = 0, 0, None  # the next round's, from zero
        return out


@register
class GAS(AsyncAlgorithm):
    """GAS (module docstring): asynchronous SFL with activation and model buffers, generative activations from
    per-label Gaussians, logit adjustment on the clients' gradients."""

    name = "gas"
    tiers = ("its server keeps one activation buffer and one set of per-label Gaussian statistics of the one "
             "cut's shape and steps on real and generated activations concatenated, and its model buffer averages "
             "the uploaded client parts by FedAvg of one shape in the event loop; a generator per cut needs a "
             "buffer and statistics per (cut, label), a server step entering at each cut, and the event loop's "
             "average by block with the server's copy as a holder (raysplit/runtime/tiered.py): not built")
    language_model = "{name} needs a class label per sample: its server generates activations from per-label statistics"
    u_shape = ("{name}'s server needs the labels: its per-label activation statistics generate activations of "
               "each label, and its logit adjustment reads the label distribution")
    description = "GAS: async SFL, activation/model buffers, generated activations, logit adjustment"
    Params = GASParams
    server_rule = GASServer

    def setup(self, info: SetupInfo) -> None:
        p, m = self.params, info.clients_per_round
        self.gas_setup = GASSetup(
            label_counts=tuple(map(tuple, info.counts.tolist())),
            client_sizes=tuple(int(n) for n in info.counts.sum(axis=1)),
            buffer_size=p.buffer_size or m, model_buffer_size=p.model_buffer_size or m,
            min_per_label=self.cfg.train.batch_size if p.min_per_label is None else p.min_per_label)

    def host_setup(self) -> GASSetup:
        return self.gas_setup

    def resolved(self) -> dict:
        s = self.gas_setup
        return {"gas.buffer_size": s.buffer_size, "gas.model_buffer_size": s.model_buffer_size,
                "gas.min_per_label": s.min_per_label}
