"""Hydra (Tirana et al., ../shared/papers/hydra.txt) and the multi-head baselines it compares against.

Hydra: the server part is split again at ``cut_b`` into part-2a (shared, trained sequentially in the processing
order, as SFLV2's server) and K heads (part-2b). Each client belongs to one group (head), fixed before training by
the paper's greedy Algorithm 2 (App. A.2) from the label-count vector every client sends once; a batch goes through
part-2a and its client's head, and both step. At the end of every round the heads are averaged into one head that is
copied back into every head, so the trained model has a single head. Client part-1: FedAvg as in SFLV2.

Choices where paper and code (seed-code.md §2) differ or are silent:
- Head averaging: the paper says FedAvg; the code takes the unweighted mean of all heads. ``head_weights: samples``
  (default) weights each head by the samples it trained on this round (a head that saw no client this round gets
  weight 0); ``uniform`` is the code's mean. The heads' optimizer states (momentum) are averaged the same way, so
  with K=1 Hydra is exactly SFLV2 (the second cut changes nothing). The code re-creates optimizers every epoch
  (plain SGD there, so nothing is lost); with momentum we keep the averaged state.
- K defaults to the number of labels, each label its own group; ``label_groups`` (superclasses) gives K < labels,
  e.g. Hydra's CIFAR-10 K=5 map ``[[0,2],[1,9],[8],[3,5,7],[4,6]]`` (the authors' code's; the paper states only the
  principle, semantic superclasses). Algorithm 2's score of a client for a group is
  its number of samples of the group's labels.
- ``cut_b`` defaults to the last two blocks as heads (the paper's "small heads": the last 2 layers).
- The label vector (labels x 8 bytes) is counted as upload of every client in round 0.

SplitFedV3 (Madaan et al.; Hydra's ``run_sflv3.py``): per-client part-1 models never averaged, per-client server
copies averaged every round (PSL's training); inference on the global test set runs every client's part-1 with the
server and takes, per sample, the prediction of the client whose logits have the highest maximum. On a language
model the rule is applied per next-token position (the client most confident at that position predicts it), the
natural reading of "per sample" when every position is a prediction; U-shaped, each client's tail follows the
server's part.

MultiHead (Chen et al.; Hydra's ``run_multihead.py``): part-1 FedAvg'd every round, one server part (head) per
client that is never averaged; inference runs the global part-1 with every head and takes the most confident head.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from .base import Algorithm, AlgorithmParams, SetupInfo, register
from .baselines import PSL, SFLV1, SFLV2, OrderedParams
from ..errors import ConfigError
from ..models.core import end_to_end, param_bytes
from ..models.tiers import Entered
from ..runtime import Batch, ClientRule, ModelSlot, ServerRule, batch_step
from ..runtime.aggregation import average_optimizer_states, average_states
from ..runtime.messages import Gradient, StateMsg


def greedy_groups(counts: np.ndarray, label_groups: list[list[int]]) -> list[int]:
    """Hydra's Algorithm 2: iterate over the groups; each takes the unassigned client with the most samples of the
    group's labels (ties: lowest client id); repeat until every client is assigned. Returns each client's group.
    Iterating over groups, not clients, keeps group sizes within one of each other."""
    counts = np.asarray(counts)
    score = np.stack([counts[:, g].sum(axis=1) for g in label_groups], axis=1)  # (clients, groups)
    group = np.full(len(counts), -1)
    left = len(counts)
    while left:
        for g in range(len(label_groups)):
            if not left:
                break
            free = np.flatnonzero(group < 0)
            c = free[np.argmax(score[free, g])]
            group[c] = g
            left -= 1
    return [int(g) for g in group]


class LabelRule(ClientRule):
    """Clients that can report their label counts and hand out their own models for evaluation."""

    def label_counts(self, num_classes: int, charge: bool) -> dict[int, np.ndarray]:
        data, out = self.ctx.data, {}
        for c, idx in data.train_idx.items():
            v = np.bincount(np.asarray(data.y[idx], dtype=np.int64), minlength=num_classes)
            if charge:
                self.ctx.meter.charge_upload(c, v.nbytes, "labels")
            out[c] = v
        return out

    def own_states(self) -> dict[int, StateMsg]:
        """The own model of every hosted client that has one (evaluation only: not charged)."""
        return {c: StateMsg.packed(st) for c, st in self.ctx.states.own.items()}


class ConfidentServer(ServerRule):
    """Server rule with the "most confident model" inference of SplitFedV3 and MultiHead."""

    @torch.no_grad()
    def _confident(self, pairs: list[tuple[torch.nn.Module, torch.nn.Module]]):
        """Per test sample, the logits of the (client part, server part) pair whose largest logit is largest; a
        language model's per next-token position (each position's logits over the vocabulary from the pair most
        confident there). A U-shaped client part runs its tail after the server's part (:func:`end_to_end`)."""
        for c, s in pairs:
            c.eval(), s.eval()
        runs = [end_to_end(c, s) for c, s in pairs]

        def most_confident(x):
            logits = torch.stack([run(x) for run in runs])  # (models, batch, [positions,] classes)
            best = logits.max(dim=-1).values.argmax(dim=0)  # (batch, [positions])
            return logits.gather(0, best[None, ..., None].expand(1, *logits.shape[1:]))[0]

        out = self.ctx.evaluation.predict(most_confident)
        for _, s in pairs:
            s.train()
        return out

    def evaluate_client_models(self, *parts: dict[int, StateMsg]) -> tuple[np.ndarray, np.ndarray, float]:
        """SplitFedV3: every client's own part-1 (from ``LabelClient.own_states``) with the server part."""
        states = {c: st for p in parts for c, st in p.items()}
        if not states:
            states = {-1: None}
        server, model = self.ctx.models.main.module, self.ctx.model
        pairs = []
        for c, st in sorted(states.items()):
            cut = model.cut_of(c) if c >= 0 else model.deepest  # tiered: each client's part at its own cut
            client = copy.deepcopy(self.ctx.evaluation.client) if cut is None or c < 0 else \
                model.client_part(c).to(self.ctx.device)
            if st is not None:
                client.load_state_dict(st.tensors())
            pairs.append((client, server if cut is None else Entered(server, cut)))
        return self._confident(pairs)

    def ensure_heads(self, keys: list) -> None:
        """MultiHead: a server head per client, forked from the initial server part the first time it is seen."""
        models = self.ctx.models
        models.fork([k for k in keys if k not in models])

    def evaluate_heads(self, client_state: StateMsg) -> tuple[np.ndarray, np.ndarray, float]:
        """MultiHead: the global part-1 with every client head (the initial part if no head exists yet)."""
        client, models = self.ctx.evaluation.client, self.ctx.models
        client.load_state_dict(client_state.tensors())
        heads = [s.module for k, s in sorted(models.items(), key=lambda kv: str(kv[0])) if k != "main"]
        return self._confident([(client, h) for h in heads or [models.main.module]])


class HydraServer(ServerRule):
    """``models['main']`` is the whole server part (part-2a then the averaged head) used for evaluation; its
    optimizer steps part-2a only. ``heads[g]`` are the K heads with their own optimizers (``ctx.setup`` is the
    algorithm's :class:`HydraLayout`)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        full = ctx.models.main.module
        layout: HydraLayout = ctx.setup
        self.body, self.head = full[:layout.head_at], full[layout.head_at:]
        ctx.models.replace("main", ModelSlot(full, ctx.trainer.optimizer(self.body.parameters())))
        self.heads = [self._new_head() for _ in range(layout.num_heads)]
        self.head_samples = np.zeros(len(self.heads))

    def _new_head(self) -> ModelSlot:
        m = copy.deepcopy(self.head)
        return ModelSlot(m, self.ctx.trainer.optimizer(m.parameters()))

    def on_begin_round(self, rnd: int) -> None:
        self.head_samples[:] = 0

    @batch_step(starts="on_arrival")
    def hydra_step(self, b: Batch, key: int) -> Gradient:
        """part-2a then head ``key`` (the client's group); both step; the gradient goes back to the client."""
        head = self.heads[int(key)]
        self.head_samples[int(key)] += len(b.y)
        return self.ctx.trainer.train(b, torch.nn.Sequential(self.body, head.module), self.ctx.models.main.optimizer,
                                      head.optimizer)

    def merge_heads(self, mode: str = "samples") -> None:
        """Average the heads (weights and optimizer states) into one head, copied back into every head."""
        w = self.head_samples.tolist() if mode == "samples" else [1.0] * len(self.heads)
        keep = [(h, wi) for h, wi in zip(self.heads, w) if wi > 0]
        if not keep:
            return
        wk = [wi for _, wi in keep]
        avg = average_states([h.module.state_dict() for h, _ in keep], wk)
        merged = average_optimizer_states([h.optimizer.state_dict() for h, _ in keep], wk)
        self.head.load_state_dict(avg)
        for h in self.heads:
            h.module.load_state_dict(avg)
            if merged is not None:
                h.optimizer.load_state_dict(merged)

    def save(self, st: dict) -> None:
        super().save(st)
        st["heads"] = [(h.module.state_dict(), h.optimizer.state_dict()) for h in self.heads]

    def restore(self, st: dict) -> None:
        super().restore(st)
        for h, (ms, os_) in zip(self.heads, st["heads"]):
            h.module.load_state_dict(ms)
            h.optimizer.load_state_dict(os_)


@dataclass(frozen=True)
class HydraLayout:
    """Where the heads start inside the server part, and how many there are (derived at setup)."""

    head_at: int
    num_heads: int


class HydraParams(OrderedParams):
    cut_b: int | str | None = Field(default=None, description="second cut (start of the heads); default: the "
                                    "last two blocks are the heads")
    heads: int | None = Field(default=None, ge=1, description="K; default: number of labels (or of label_groups)")
    label_groups: list[list[int]] | None = Field(default=None, description="superclasses: labels of each head")
    head_weights: Literal["samples", "uniform"] = Field(default="samples", description="head averaging: by the "
                                                        "samples each head trained on (the paper) or uniform (code)")


@register
class Hydra(SFLV2):
    """SFLV2 + Hydra: shared part-2a in the processing order, one head per client group, heads averaged each
    round (see the module docstring)."""

    name = "hydra"
    tiers = ("its server splits again at algorithm.cut_b into a shared part and per-group heads; a shared part "
             "entered at each client's cut is not built")
    language_model = "{name} needs a class label per sample: its server heads train on label groups"
    u_shape = "{name}'s server heads train on the labels of their label groups"
    description = "Hydra: SFLV2 with per-group server heads averaged every round (Algorithm 2 grouping)"
    Params = HydraParams
    client_rule = LabelRule
    server_rule = HydraServer
    checkpointed = ("groups",)  # a round 0 redone after a failure groups (and charges the labels) again

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        p, L = self.params, info.num_classes
        model = info.model
        if p.cut_b is None:
            at = len(model.blocks) - 2
        else:
            try:
                at = model.resolve_cut(p.cut_b)
            except ValueError as e:
                raise ConfigError(f"algorithm.cut_b: {e}") from None
        if not info.cut < at < len(model.blocks):
            raise ConfigError(f"algorithm.cut_b={p.cut_b!r} (block {at}) must lie after model.cut (block "
                              f"{info.cut}) and leave at least one block for the heads "
                              f"({len(model.blocks)} blocks)")
        if p.label_groups is not None:
            flat = sorted(lab for g in p.label_groups for lab in g)
            if flat != list(range(L)):
                raise ConfigError(f"algorithm.label_groups must cover every label 0..{L - 1} exactly once; got "
                                  f"{p.label_groups}")
            if p.heads is not None and p.heads != len(p.label_groups):
                raise ConfigError(f"algorithm.heads={p.heads} but label_groups has {len(p.label_groups)} groups")
            groups = [list(g) for g in p.label_groups]
        elif p.heads is None or p.heads == L:
            groups = [[lab] for lab in range(L)]
        elif p.heads == 1:
            groups = [list(range(L))]
        else:
            raise ConfigError(f"algorithm.heads={p.heads} < {L} labels needs algorithm.label_groups (the labels "
                              "of each head, e.g. superclasses)")
        self.label_groups = groups
        self.head_at = at - info.cut
        self.head_bytes = param_bytes(model.segment(at, len(model.blocks)), include_buffers=True)
        self.groups = None

    def host_setup(self) -> HydraLayout:
        return HydraLayout(self.head_at, len(self.label_groups))

    def resolved(self) -> dict:
        K = len(self.label_groups)
        return {**super().resolved(), "hydra.heads": K, "hydra.head_start_in_server": self.head_at,
                "hydra.head_bytes": self.head_bytes, "hydra.extra_head_bytes": (K - 1) * self.head_bytes}

    def run_round(self, rt, rnd, clients, rng):
        if self.groups is None:  # Algorithm 2 on the label vectors the clients send once (counted in round 0)
            L = sum(len(g) for g in self.label_groups)
            got = {}
            for part in rt.get(rt.workers.label_counts(L, rnd == 0)):
                got.update(part)
            counts = np.stack([got[c] for c in range(rt.num_clients)])
            self.groups = greedy_groups(counts, self.label_groups)
        rt.split_steps(self.order_sequence(rt, clients, rng), keys=dict(enumerate(self.groups)),
                       method=HydraServer.hydra_step)
        rt.server.merge_heads(self.params.head_weights)
        return rt.aggregate_clients(rt.weights(clients, self.agg.weights), self.agg.write_to)


@register
class SplitFedV3(PSL):
    """SplitFed V3: PSL's training (client models kept, per-client server copies averaged every round);
    global-test inference by the most confident client model (module docstring)."""

    name = "sflv3"
    u_shape = ""  # PSL's training; the confident inference runs each client's tail after the server's part
    tiers = ""  # PSL's training by block; each client's part paired with the server entered at its cut
    description = "SplitFed V3: per-client part-1 never averaged, server copies averaged, confident inference"
    client_rule = LabelRule
    server_rule = ConfidentServer

    def eval_modes(self) -> tuple[str, ...]:
        return ("global", "clients")

    def evaluate(self, rt, mode, global_handle, clients):
        if mode == "global":
            return rt.get(rt.server.evaluate_client_models(*rt.workers.own_states()))
        return super().evaluate(rt, mode, global_handle, clients)


@register
class MultiHead(SFLV1):
    """MultiHead: part-1 FedAvg'd every round; each client trains its own server head, never averaged;
    global-test inference by the most confident head (module docstring)."""

    name = "multihead"
    tiers = ("its per-client server heads start at the one cut; heads entered at each client's cut are not built")
    language_model = "{name} needs a class label per sample: its server heads train on label groups"
    u_shape = "{name}'s server heads train on the labels of their label groups"
    description = "MultiHead: FedAvg'd part-1, per-client server heads never averaged, confident inference"
    Params = AlgorithmParams  # its own loop, one client after another: no batched copies
    server_rule = ConfidentServer

    def eval_modes(self) -> tuple[str, ...]:
        return ("global",)  # the most-confident-head rule on the global test set

    def setup(self, info: SetupInfo) -> None:
        self.server_bytes = param_bytes(info.model.segment(info.cut, len(info.model.blocks)), include_buffers=True)

    def resolved(self) -> dict:
        return {"multihead.head_bytes": self.server_bytes,
                "multihead.all_heads_bytes": self.server_bytes * self.cfg.data.num_clients}

    def run_round(self, rt, rnd, clients, rng):
        rt.server.ensure_heads(clients)
        self.train_copies(rt, clients)  # one client after another; interleaved where the hosts pack clients
        return rt.aggregate_clients(rt.weights(clients, self.agg.weights), self.agg.write_to)

    def evaluate(self, rt, mode, global_handle, clients):
        return rt.get(rt.server.evaluate_heads(global_handle))
