"""Semi-SFL: semi-supervised split federated learning with clustering regularisation (Sun et al.;
../shared/papers/semisfl.txt; what the authors' code does: ../shared/notes/seed-code.md §3), and FedSwitch-SL and
supervised-only, its baselines that share the machinery. Only the server holds labels: ``data.n_labeled``
class-balanced samples taken out of the training set; the clients' data is unlabelled (their labels are never
sent: an activation carries none).

Round r:

1. **Supervised phase** on the server, K_s steps of batch ``server_batch_size`` on two augmented views of the
   labelled set: ``CE(classifier(encoder(x1)), y) + L_cr(proj(encoder(x1)), teacher_proj(teacher_encoder(x2)), y)``
   (raysplit/losses.py, with the feature queue), then an EMA update of the teacher (encoder, classifier,
   projection head; BN buffers included) after every step: ``theta_t <- a theta_t + (1 - a) theta_s``,
   ``a = min(1 - 1/(step + 1), gamma)`` (``ema: warmup``) or the early code's ``gamma ** (K_s / K_s0)``
   (``ema: ks``).
2. The student and teacher encoders go to the round's clients (download counted for both).
3. **Cross-entity phase**, K_u = ``train.local_steps`` synchronous steps across the M active clients: each sends
   the student encoder's features of a strong view and the teacher encoder's features of a weak view of the same
   batch (two streams, paired by tag; no graph kept for the teacher). The server concatenates all of them:
   teacher pseudo-labels ``argmax softmax(teacher_classifier(e_t))`` with confidence >= ``tau``,
   ``L_u = mean_i(CE(classifier(e_i), y_i) mask_i) + L_cr(proj(e), teacher_proj(e_t), y, mask)``, steps the
   classifier and projection head, and returns each client its slice of dL_u/de times M (the code's rescale,
   which undoes the mean over the concatenated batch); the clients step their encoders.
4. The clients' encoders are averaged (BN buffers included) into the server's student encoder.
5. Evaluation with the teacher (encoder + classifier) on the global test set.
6. K_s for the next round from the schedule (``ks``): ``fixed``; ``milestones`` (the paper: at each milestone round
   compare the mean supervised loss of the last ``window`` rounds with the window before; halve K_s if the change
   is below ``rho1``, double it above ``rho2``); ``ratio`` (the authors' later code: every ``ratio_every`` rounds,
   over the last 11 windows (the whole windows there are before that, as the code), compare the normalised
   decrease rates of the unsupervised and supervised losses; if the unsupervised one leads in at least half,
   K_s <- round(max(K_s / alpha, beta K_u n_labeled / n_train)), never increasing).

Choices where the paper, the code and this implementation differ (seed-code.md §3.3-3.7):
- Fresh SGD optimisers every round on the server and the clients (the code's choice; momentum resets), lr from
  ``train.optimizer`` with its schedule (the configs use the code's cosine schedule).
- The queue is cleared after each cross-entity phase (the code); keys written in the supervised phase carry mask 1,
  so they count as positives in the cross-entity phase. ``stale_masks: true`` reproduces the code's quirk: the
  supervised phase writes no masks, its keys keep the stale (zero) masks and are never positives later.
- The CE mask is averaged over all samples, not only the confident ones (the code).
- The server runs its teacher in eval mode (no dropout, batch norm on its EMA'd running statistics) for the
  pseudo-labels and the keys, as the code runs its teacher classifier and head; the clients' copy of the teacher
  encoder runs in train mode, as in the code. Until 2026-11-26 the server's teacher ran in train mode: the same on
  models without dropout or batch norm (semisfl_cnn, cnn_small), noisier pseudo-labels with alexnet2's dropout.
- ``milestones`` implements the paper's rule on the supervised loss (the early code computed it on the
  unsupervised loss and never applied the new K_s to its loop, only to the EMA exponent).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from .base import Algorithm, AlgorithmParams, SetupInfo, clients_per_round, register
from ..data.augment import Augmenter
from ..errors import ConfigError
from ..losses import FeatureQueue, queue_contrastive_loss
from ..models.core import ProjectionHead
from ..runtime import Batch, ClientRule, ServerRule, batch_step, read_floats
from ..runtime.messages import Gradient, StateMsg, Tag


# ---- K_s schedules (pure functions) ---------------------------------------------------------------------------
def ks_milestones(ks: int, rnd: int, loss_x: list[float], milestones: list[int], window: int, rho1: float,
                  rho2: float) -> int:
    """The paper's rule, applied after round ``rnd``: at a milestone, |change of the windowed mean supervised
    loss| < rho1 halves K_s, > rho2 doubles it."""
    return ks_on_change(ks, milestone_change(rnd, loss_x, milestones, window), rho1, rho2)


def ks_on_change(ks: int, change: float | None, rho1: float, rho2: float) -> int:
    """The milestones rule's decision on what it read (``milestone_change``; None: no decision)."""
    if change is None:
        return ks
    change = abs(change)
    if change < rho1:
        return max(1, ks // 2)
    if change > rho2:
        return ks * 2
    return ks


def milestone_change(rnd: int, loss_x: list[float], milestones: list[int], window: int) -> float | None:
    """What the milestones rule reads after round ``rnd``: the mean supervised loss of the window before the last
    minus that of the last ``window`` rounds (positive: still falling); None off a milestone or before two
    windows of history."""
    if rnd + 1 not in milestones or len(loss_x) < 2 * window:
        return None
    return float(np.mean(loss_x[-2 * window:-window]) - np.mean(loss_x[-window:]))


def ratio_score(rnd: int, loss_x: list[float], loss_u: list[float], lrs: list[float], kss: list[int], ku: int,
                every: int, window: int) -> float | None:
    """What the authors' later rule (seed-code.md §3.5) reads after round ``rnd``: every ``every`` rounds, over the
    last 11 windows, ``dx_i = (x_i - x_(i+1)) / lr_i / Ks_i`` and ``du_i = (u_i - u_(i+1)) / lr_i / Ku``, the share
    R of the windows where ``du - dx >= 1e-5`` (the unsupervised loss falls faster per step); None off the schedule.

    Where fewer than 11 windows of history exist, the rule reads the whole windows there are (at least two), as the
    authors' code does: it slices the last ``11 w`` rounds, which at its first decision (round 100, w = 10) holds
    100 rounds, 10 windows. An earlier version here waited for 11 full windows and so skipped the first decision
    (found running their code beside ours, docs/results/peers.md)."""
    n = min(len(loss_x), 11 * window) // window
    if (rnd + 1) % every or n < 2:
        return None

    def windows(v):
        return np.asarray(v[-n * window:], dtype=float).reshape(n, window).mean(axis=1)

    x, u, lr, k = windows(loss_x), windows(loss_u), windows(lrs), windows(kss)
    dx = (x[:-1] - x[1:]) / lr[:-1] / k[:-1]
    du = (u[:-1] - u[1:]) / lr[:-1] / ku
    return float(np.mean(du - dx >= 1e-5))


def ks_ratio(ks: int, rnd: int, loss_x: list[float], loss_u: list[float], lrs: list[float], kss: list[int],
             ku: int, every: int, window: int, alpha: float, beta: float, labeled_share: float) -> int:
    """The authors' later rule applied after round ``rnd``: where ``ratio_score`` decides and R >= 0.5,
    K_s <- round(max(K_s / alpha, beta K_u labeled_share)), never upwards."""
    return ks_on_score(ks, ratio_score(rnd, loss_x, loss_u, lrs, kss, ku, every, window), ku, alpha, beta,
                       labeled_share)


def ks_on_score(ks: int, score: float | None, ku: int, alpha: float, beta: float, labeled_share: float) -> int:
    """The ratio rule's decision on what it read (``ratio_score``; None: no decision)."""
    if score is not None and score >= 0.5:
        return min(ks, int(round(max(ks / alpha, beta * ku * labeled_share))))
    return ks


def pseudo_label_ce(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float):
    """Teacher pseudo-labels, confidence mask and the masked CE averaged over *all* samples (the code)."""
    with torch.no_grad():
        conf, labels = F.softmax(teacher_logits, dim=1).max(dim=1)
        mask = (conf >= tau).float()
    ce = (F.cross_entropy(student_logits, labels, reduction="none") * mask).mean()
    return ce, labels, mask


@contextmanager
def teacher_mode(*modules: torch.nn.Module):
    """The teacher's forwards on the server in eval mode (no dropout; batch norm on its EMA'd running statistics),
    as the authors' code runs its teacher classifier and projection head (and, from the first test on, its
    encoder): a pseudo-label is the teacher's answer, not a dropout sample of it. Training flags are restored."""
    was = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, w in zip(modules, was):
            m.train(w)


def teacher_outputs(t_heads: torch.nn.Module, e_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's logits and L2-normalised key of the teacher features ``e_t`` (no graph, eval mode)."""
    with torch.no_grad(), teacher_mode(t_heads):
        logits, k = t_heads(e_t)
    return logits, k


def ema_update(teacher: torch.nn.Module, student: torch.nn.Module, a: float) -> None:
    """theta_t <- a theta_t + (1 - a) theta_s for every floating-point entry of the state (BN buffers
    included); integer buffers (num_batches_tracked) are copied."""
    with torch.no_grad():
        t_state, s_state = teacher.state_dict(), student.state_dict()
        for k, t in t_state.items():
            if t.is_floating_point():
                t.mul_(a).add_(s_state[k], alpha=1 - a)
            else:
                t.copy_(s_state[k])


# ---- hosts ----------------------------------------------------------------------------------------------------------
class SemiRule(ClientRule):
    """A client with unlabelled data: the student stream encodes a strong view of its next batch, the teacher
    stream a weak view of the same batch with the teacher encoder (no graph); no labels leave the client."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.augment = Augmenter(ctx.model.inputs)
        self.teacher = ctx.model.parts()[0].to(ctx.device)
        self._batch_of: dict[tuple, np.ndarray] = {}

    def set_teacher(self, msg: StateMsg, receivers: list[int]) -> None:
        """The round's teacher encoder (download charged to the round's clients this worker hosts)."""
        self.teacher.load_state_dict(msg.tensors())
        self.teacher.train()
        for c in receivers:
            if int(c) in self.ctx.data:
                self.ctx.meter.charge_download(int(c), msg.nbytes, msg.t_sent, "model")

    def batch_indices(self, tag: Tag, batch_size):
        key = (tag.client, tag.round, tag.step)
        if tag.stream == "teacher":
            return self._batch_of.pop(key)
        self._batch_of[key] = idx = self.ctx.data.draw(tag.client, batch_size)
        return idx

    def inputs(self, tag: Tag, idx):
        view = "weak" if tag.stream == "teacher" else "strong"
        return self.augment(self.ctx.data.x[idx], view), np.zeros(0, np.int64)  # the labels stay on the client

    def encoder(self, tag: Tag, slot):
        if tag.stream != "teacher":
            return slot.module

        def teacher(x):
            with torch.no_grad():
                return self.teacher(x)

        return teacher

    def on_release(self, cid: int) -> None:
        self.ctx.states.opt_state.pop(cid, None)  # a fresh optimiser every round (the code)


class _Heads(torch.nn.Module):
    """classifier(e) and the L2-normalised projection of e."""

    def __init__(self, classifier, proj):
        super().__init__()
        self.classifier, self.proj = classifier, proj

    def forward(self, e):
        return self.classifier(e), F.normalize(self.proj(e), dim=1)


class _Supervised(torch.nn.Module):
    """Input: the two views stacked; output: student logits and projection of view 1, teacher key of view 2."""

    def __init__(self, encoder, heads, t_encoder, t_proj):
        super().__init__()
        self.encoder, self.heads, self.t_encoder, self.t_proj = encoder, heads, t_encoder, t_proj

    def forward(self, views):
        logits, q = self.heads(self.encoder(views[0]))
        with torch.no_grad(), teacher_mode(self.t_encoder, self.t_proj):
            k = F.normalize(self.t_proj(self.t_encoder(views[1])), dim=1)
        return logits, q, k


@dataclass(frozen=True)
class SemiSetup:
    """What the Semi-SFL server needs beyond its Params (derived at setup)."""

    num_train: int  # labelled + unlabelled training samples (the ratio rule's floor)
    local_steps: int  # K_u
    cluster_reg: bool  # False: FedSwitch-SL


class SemiServer(ServerRule):
    """The server of Semi-SFL: student encoder (for the supervised phase), classifier (``models['main']``),
    projection head, their EMA teacher, the feature queue, the labelled set and the K_s schedule."""

    checkpointed = ("encoder", "heads", "t_encoder", "t_heads", "queue", "ks", "ema_steps", "history")

    def __init__(self, ctx):
        super().__init__(ctx)
        p = ctx.params
        self.cluster_reg = ctx.setup.cluster_reg
        client, _ = ctx.model.parts()
        client.load_state_dict(ctx.initial_client.tensors())
        self.encoder = client.to(ctx.device).train()
        self.classifier = ctx.models.main.module
        emb = int(np.prod(ctx.model.cut_shape))
        torch.manual_seed(ctx.seed * 1009 + 31)
        self.proj = ProjectionHead(emb, p.proj_dim).to(ctx.device)
        self.heads = _Heads(self.classifier, self.proj)
        self.t_encoder, self.t_heads = copy.deepcopy(self.encoder), copy.deepcopy(self.heads)
        self.queue = FeatureQueue(p.queue_size, p.proj_dim, torch.Generator().manual_seed(ctx.seed))
        self.augment = Augmenter(ctx.model.inputs)
        self.ks = p.ks_initial
        self.ema_steps = 0
        self.history: dict[str, list] = {"loss_x": [], "loss_u": [], "lr": [], "ks": []}
        self._opt_u = None

    def on_reset_round(self):
        self.round_loss = {"x": [], "u": [], "mask": []}
        self._opt_u = None

    # ---- 1. supervised phase --------------------------------------------------------------------------------------
    def supervised(self) -> int:
        """K_s steps on the labelled set with an EMA teacher update after each; returns K_s."""
        ctx = self.ctx
        p, rnd = ctx.params, ctx.round
        opt = ctx.trainer.optimizer(list(self.encoder.parameters()) + list(self.heads.parameters()))
        self.queue.clear()
        module = _Supervised(self.encoder, self.heads, self.t_encoder, self.t_heads.proj)
        x_all, y_all = ctx.labeled["x"], ctx.labeled["y"]
        rng = ctx.rng(0x5E1, rnd)
        need = p.server_batch_size * self.ks
        order = rng.permutation(np.tile(np.arange(len(y_all)), -(-need // len(y_all))))[:need]
        gamma = p.gamma if p.ema == "warmup" else p.gamma ** (self.ks / p.ks_initial)
        for step in range(self.ks):
            idx = order[step * p.server_batch_size:(step + 1) * p.server_batch_size]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(rng.integers(2**62)))
                views = torch.stack([self.augment(x_all[idx], v) for v in p.server_views]).to(ctx.device)
            y = torch.as_tensor(y_all[idx], device=ctx.device)

            def loss_fn(out, y):
                logits, q, k = out
                loss = F.cross_entropy(logits, y)
                if self.cluster_reg:  # the code's quirk: no masks at all here, and none written to the queue
                    masks = None if p.stale_masks else torch.ones(len(y), device=y.device)
                    loss = loss + queue_contrastive_loss(q, k, y, masks, self.queue, p.temperature)
                return loss

            lv = ctx.trainer.step(views, y, module, opt, step=step, loss=loss_fn,
                                  where=f"the supervised phase, round {rnd}, step {step}")
            a = min(1 - 1 / (self.ema_steps + 1), gamma) if p.ema == "warmup" else gamma
            ema_update(self.t_encoder, self.encoder, a)
            ema_update(self.t_heads, self.heads, a)
            self.ema_steps += 1
            self.round_loss["x"].append(lv)
        return self.ks

    def encoders(self) -> list[StateMsg]:
        """The student and the teacher encoder, sent to the round's clients."""
        return [self.ctx.trainer.message(m.state_dict()) for m in (self.encoder, self.t_encoder)]

    # ---- 3. cross-entity phase ---------------------------------------------------------------------------------
    @batch_step(starts="after_last_arrival")
    def semi_step(self, *acts: Batch) -> list[Gradient]:
        """One cross-entity step over every active client's (student, teacher) pair (module docstring)."""
        ctx = self.ctx
        p, rnd = ctx.params, ctx.round
        students, teachers = acts[0::2], acts[1::2]
        feats = [a.x for a in acts]
        e = torch.cat(feats[0::2]).requires_grad_(True)
        e_t = torch.cat(feats[1::2])
        t_logits, k = teacher_outputs(self.t_heads, e_t)
        if self._opt_u is None:  # a fresh optimiser for the phase (the code)
            self._opt_u = ctx.trainer.optimizer(self.heads.parameters())
        state = {}

        def loss_fn(out, _):
            logits, q = out
            ce, labels, mask = pseudo_label_ce(logits, t_logits, p.tau)
            state["mask"] = mask.mean().detach()
            if not self.cluster_reg:
                return ce
            return ce + queue_contrastive_loss(q, k, labels, mask, self.queue, p.temperature)

        step = len(self.round_loss["u"])
        lv = ctx.trainer.step(e, torch.zeros(len(e)), self.heads, self._opt_u, step=step, loss=loss_fn,
                              where=f"the cross-entity phase, round {rnd}, step {step}")
        self.round_loss["u"].append(lv)
        self.round_loss["mask"].append(state["mask"])
        grad = e.grad * len(students)  # the code's rescale by the number of active clients
        out, start = [], 0
        for s, t in zip(students, teachers):
            n = s.x.shape[0]
            g = grad[start:start + n]
            start += n
            out += [ctx.trainer.answer(s, g, lv), ctx.trainer.answer(t, None, lv)]
        return out

    # ---- 4-6 -------------------------------------------------------------------------------------------------------
    def set_encoder(self, msg: StateMsg) -> None:
        """The aggregate of the clients' encoders becomes the server's student encoder."""
        self.encoder.load_state_dict(msg.tensors())

    @torch.no_grad()
    def evaluate_teacher(self) -> tuple[np.ndarray, np.ndarray, float]:
        self.t_encoder.eval(), self.t_heads.eval()
        out = self.ctx.evaluation.predict(lambda x: self.t_heads.classifier(self.t_encoder(x)))
        self.t_encoder.train(), self.t_heads.train()
        return out

    def round_metrics(self) -> dict:
        """The round's K_s step (the schedule decides the next K_s here) and its losses."""
        ctx = self.ctx
        p, h = ctx.params, self.history
        rl = self.round_loss  # the steps' values, on the device until now: read in one go
        got = iter(read_floats(rl["x"] + rl["u"] + rl["mask"]))
        rl = {k: [next(got) for _ in rl[k]] for k in ("x", "u", "mask")}
        h["loss_x"].append(float(np.mean(rl["x"])) if rl["x"] else float("nan"))
        h["loss_u"].append(float(np.mean(rl["u"])) if rl["u"] else float("nan"))
        h["lr"].append(ctx.trainer.lr())
        h["ks"].append(self.ks)
        used, change, score = self.ks, None, None
        if p.ks == "milestones":
            change = milestone_change(ctx.round, h["loss_x"], p.milestones, p.window)
            self.ks = ks_on_change(self.ks, change, p.rho1, p.rho2)
        elif p.ks == "ratio":
            ku, share = ctx.setup.local_steps, len(ctx.labeled["y"]) / ctx.setup.num_train
            score = ratio_score(ctx.round, h["loss_x"], h["loss_u"], h["lr"], h["ks"], ku, p.ratio_every,
                                p.window)
            self.ks = ks_on_score(self.ks, score, ku, p.alpha, p.beta, share)
        out = {"ks": used, "ks_next": self.ks, "loss_x": h["loss_x"][-1], "loss_u": h["loss_u"][-1],
               "mask_rate": float(np.mean(rl["mask"])) if rl["mask"] else float("nan")}
        if change is not None:  # logged where the rule decides: the change it compared with rho1 and rho2
            out["ks_loss_change"] = change
        if score is not None:  # the ratio rule's R where it decides (K_s falls at R >= 0.5)
            out["ks_ratio_r"] = score
        return out


# ---- algorithms ----------------------------------------------------------------------------------------------------
def needs_labelled_set(name: str, cfg) -> None:
    if not cfg.data.n_labeled:
        raise ConfigError(f"{name} trains the server on a labelled set: set data.n_labeled > 0")


class SemiParams(AlgorithmParams):
    ks: Literal["fixed", "milestones", "ratio"] = Field(default="milestones", description="K_s schedule: fixed, "
                                                         "the paper's milestones rule, or the code's ratio rule")
    ks_initial: int = Field(default=100, ge=1, description="K_s: supervised server steps in the first round")
    milestones: list[int] = Field(default=[150, 250, 400, 600, 700], description="ks milestones: rounds at "
                                  "which K_s may change (increasing)")
    window: int = Field(default=10, ge=1, description="rounds averaged per window of the K_s rules")
    rho1: float = Field(default=0.01, ge=0, description="ks milestones: halve K_s below this change of the loss")
    rho2: float = Field(default=0.05, ge=0, description="ks milestones: double K_s above this change")
    ratio_every: int = Field(default=100, ge=1, description="ks ratio: rounds between decisions")
    alpha: float = Field(default=1.5, gt=1, description="ks ratio: K_s divisor")
    beta: float = Field(default=8.0, gt=0, description="ks ratio: floor beta * K_u * n_labeled / n_train")
    gamma: float = Field(default=0.99, gt=0, lt=1, description="EMA decay of the teacher")
    ema: Literal["warmup", "ks"] = Field(default="warmup", description="EMA weight min(1 - 1/(step+1), gamma) "
                                         "(the code at HEAD) or gamma**(K_s/K_s0) (the early code)")
    tau: float = Field(default=0.95, gt=0, le=1, description="confidence threshold of the teacher's pseudo-labels")
    queue_size: int = Field(default=1024, ge=1, description="feature queue entries (clustering regularisation)")
    temperature: float = Field(default=0.2, gt=0, description="temperature kappa of the clustering loss")
    proj_dim: int = Field(default=128, ge=1, description="projection head output (L2-normalised)")
    server_batch_size: int = Field(default=64, ge=1, description="labelled batch of the supervised phase")
    server_views: tuple[Literal["weak", "strong"], Literal["weak", "strong"]] = Field(
        default=("strong", "strong"), description="the supervised phase's two views: (strong, strong) is the code's "
        "strong_twice, (weak, weak) its twice")
    stale_masks: bool = Field(default=False, description="the code's quirk: supervised keys keep stale (zero) "
                              "masks in the queue")


class SemiSFLParams(SemiParams):
    cluster_reg: bool = Field(default=True, description="clustering regularisation (false: FedSwitch-SL)")


@register
class SemiSFL(Algorithm):
    """Semi-SFL (module docstring): labelled server, unlabelled clients, EMA teacher, clustering regularisation,
    adaptive K_s."""

    name = "semisfl"
    tiers = ("its teacher, projection head and feature queue are built on one cut's features; not built for other "
             "cuts")
    language_model = "{name} needs a class label per sample: its server pseudo-labels the clients' features"
    u_shape = "{name}'s server trains supervised steps on its labelled data and pseudo-labels the clients' features"
    description = "Semi-SFL: labelled server, unlabelled clients, teacher pseudo-labels, clustering regularisation"
    Params = SemiSFLParams
    client_rule = SemiRule
    server_rule = SemiServer

    @classmethod
    def check_config(cls, params, cfg) -> None:
        needs_labelled_set(cls.name, cfg)
        m = clients_per_round(cfg)
        if params.queue_size < m * cfg.train.batch_size or params.queue_size < params.server_batch_size:
            raise ConfigError(f"algorithm.queue_size={params.queue_size} is smaller than a concatenated batch "
                              f"({m} clients x train.batch_size {cfg.train.batch_size}, or server_batch_size "
                              f"{params.server_batch_size})")
        if list(params.milestones) != sorted(set(params.milestones)):
            raise ConfigError(f"algorithm.milestones must be strictly increasing, got {params.milestones}")
        if cfg.train.local_epochs:
            raise ConfigError(f"{cls.name} runs train.local_steps cross-entity steps (K_u); train.local_epochs is not "
                              "supported")

    def setup(self, info: SetupInfo) -> None:
        self.num_train = int(info.counts.sum()) + self.cfg.data.n_labeled

    def host_setup(self) -> SemiSetup:
        return SemiSetup(num_train=self.num_train, local_steps=self.local_steps,
                         cluster_reg=getattr(self.params, "cluster_reg", False))

    def eval_modes(self) -> tuple[str, ...]:
        return ("global",)  # the teacher on the global test set

    def evaluate(self, rt, mode, global_handle, clients):
        return rt.get(rt.server.evaluate_teacher())

    def run_round(self, rt, rnd, clients, rng):
        rt.server.supervised()
        student, teacher = rt.server.returning(2).encoders()
        rt.install(student, receivers=clients)
        rt.workers.set_teacher(teacher, clients)
        rt.pooled_steps(clients, self.local_steps, SemiServer.semi_step, streams=("student", "teacher"))
        agg = rt.aggregate_clients(rt.weights(clients, self.agg.weights), self.agg.write_to)
        rt.server.set_encoder(agg)
        return agg


@register
class FedSwitchSL(SemiSFL):
    """FedSwitch-SL: Semi-SFL without the clustering regularisation (teacher pseudo-labels with split training;
    the paper's ablation and baseline, after FedSwitch's alternating teacher/student training)."""

    name = "fedswitch_sl"
    tiers = "its teacher and feature streams are built on one cut's features; not built for other cuts"
    description = "FedSwitch-SL: Semi-SFL without clustering regularisation"
    Params = SemiParams  # no cluster_reg: the clustering regularisation is what it leaves out


@register
class SupervisedOnly(SemiSFL):
    """Supervised-only: the server's supervised phase alone (K_s steps per round on the labelled set with the same
    loss, views and EMA teacher), the clients' unlabelled data unused; evaluated with the teacher."""

    name = "supervised_only"
    tiers = "Semi-SFL's server steps and streams are built on one cut's features; not built for other cuts"
    description = "supervised-only: the server trains on its labelled set alone (Semi-SFL's phase 1)"
    Params = SemiSFLParams

    def run_round(self, rt, rnd, clients, rng):
        rt.server.supervised()
        return None


# ---- SemiFL ---------------------------------------------------------------------------------------------------------
class SemiFLRule(SemiRule):
    """SemiFL's client: the whole model; pseudo-labels from the round's global model on a weak view, training on a
    strong view with the masked CE plus mixup of the confident samples."""

    def semi_local(self, cid: int, steps: int, tau: float, mixup_alpha: float) -> float:
        ctx = self.ctx
        slot = ctx.activate(cid)
        teacher = copy.deepcopy(slot.module).eval()  # the global model of the round, frozen
        losses = []
        for step in range(steps):
            idx = ctx.data.draw(cid)
            with ctx.seeded(cid, 2, ctx.round, step):
                xw = self.augment(ctx.data.x[idx], "weak").to(ctx.device)
                xs = self.augment(ctx.data.x[idx], "strong").to(ctx.device)
                lam = float(ctx.rng(cid, ctx.round, step).beta(mixup_alpha, mixup_alpha))
                perm = torch.randperm(len(idx))

                def fwd_bwd():
                    slot.optimizer.zero_grad(set_to_none=True)
                    with torch.no_grad():
                        teacher_logits = teacher(xw)
                    loss, labels, mask = pseudo_label_ce(slot.module(xs), teacher_logits, tau)
                    keep = mask.bool()
                    if keep.sum() > 1:  # mixup of the confident samples with their pseudo-labels
                        xc, yc = xs[keep], labels[keep]
                        p = perm[perm < len(xc)]
                        out = slot.module(lam * xc + (1 - lam) * xc[p])
                        loss = loss + lam * F.cross_entropy(out, yc) + (1 - lam) * F.cross_entropy(out, yc[p])
                    loss.backward()
                    return loss

                loss, fl = ctx.executor.run(("semifl", len(idx)), fwd_bwd)
            ctx.update(cid, slot)
            ctx.meter.charge_compute(cid, fl)
            ctx.meter.count(cid, steps=1, loss_sum=loss.detach(), loss_n=1)
            losses.append(loss.detach())
        return float(np.mean(read_floats(losses)))


class SemiFLServer(ServerRule):
    """Holds the labelled set; fine-tunes the global (whole) model on it each round."""

    checkpointed = ("global_state",)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.augment = Augmenter(ctx.model.inputs)
        self.global_state = ctx.initial_client  # the clients' average after every round

    def keep_global(self, msg: StateMsg) -> None:
        self.global_state = msg

    def supervised_global(self) -> StateMsg:
        """The global model after ``ks_initial`` supervised steps on the labelled set (weak views)."""
        ctx = self.ctx
        p, rnd = ctx.params, ctx.round
        model = ctx.evaluation.client
        model.load_state_dict(self.global_state.tensors())
        model.train()
        opt = ctx.trainer.optimizer(model.parameters())
        x_all, y_all = ctx.labeled["x"], ctx.labeled["y"]
        rng = ctx.rng(0x5F1, rnd)
        for step in range(p.ks_initial):
            idx = rng.choice(len(y_all), p.server_batch_size, replace=False)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(rng.integers(2**62)))
                x = self.augment(x_all[idx], "weak").to(ctx.device)
            ctx.trainer.step(x, torch.as_tensor(y_all[idx], device=ctx.device), model, opt, step=step,
                             where=f"the supervised phase, round {rnd}, step {step}")
        return ctx.trainer.message(model.state_dict())


class SemiFLParams(AlgorithmParams):
    ks_initial: int = Field(default=100, ge=1, description="supervised server steps per round on the labelled set")
    server_batch_size: int = Field(default=64, ge=1, description="labelled batch of the server's steps")
    tau: float = Field(default=0.95, gt=0, le=1, description="confidence threshold of the pseudo-labels")
    mixup_alpha: float = Field(default=0.75, gt=0, description="Beta(a, a) of the mixup weight")


@register
class SemiFL(Algorithm):
    """SemiFL (Diao, Ding and Tarokh, NeurIPS 2022, "SemiFL: semi-supervised federated learning for unlabeled
    clients with alternate training"): the whole model on the clients; each round the server fine-tunes the global
    model on its labelled set, then the clients train on their unlabelled data with the global model's confident
    pseudo-labels (weak view -> label, strong view -> loss) plus mixup of the confident samples, and the models are
    averaged. Not implemented: SemiFL's static batch normalisation (the models here have no BN)."""

    name = "semifl"
    tiers = "the whole model is on the clients: it has no cut"
    language_model = "{name} needs a class label per sample: its server pseudo-labels the clients' data"
    u_shape = "{name}'s server trains on its labelled data"
    description = "SemiFL: FL with the global model's pseudo-labels and mixup, labelled fine-tuning on the server"
    Params = SemiFLParams
    client_rule = SemiFLRule
    server_rule = SemiFLServer

    @classmethod
    def check_config(cls, params, cfg) -> None:
        needs_labelled_set(cls.name, cfg)

    def split_model(self, model, cut):
        return None, model, torch.nn.Identity()

    def run_round(self, rt, rnd, clients, rng):
        p = self.params
        rt.install(rt.server.supervised_global(), receivers=clients)
        for c in clients:
            rt.client(c).semi_local(self.local_steps, p.tau, p.mixup_alpha)
        agg = rt.aggregate_clients(rt.weights(clients, self.agg.weights), self.agg.write_to)
        rt.server.keep_global(agg)
        return agg
