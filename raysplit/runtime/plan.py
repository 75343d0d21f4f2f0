"""What every host is built from (issue 69): the run's typed config sections as the config validated them
(:class:`Sections`), what the model is and where it is cut (:class:`ModelFacts`), the method (:class:`Method`) and
the privacy plug-ins, together a :class:`HostPlan`, prepared once on the driver (``experiment.prepare``) and
shipped to every actor. Nothing here restates a config default: a component reads the key it uses from its
section."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F


def per_sample_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each sample's cross-entropy ``(B,)`` (a class label per sample)."""
    return F.cross_entropy(logits, y, reduction="none")


@dataclass(frozen=True)
class ModelFacts:
    """What a rule may know of the model: its name and builder options, what goes in (``inputs``: the dataset's
    :class:`~raysplit.data.DataSpec`), where it is cut (``cut``: the index of the first server block, None: the
    whole model on the clients; ``tail_cut``: a U-shaped split's tail) and the per-sample shape of what crosses the
    cut (``cut_shape``; None without a cut). Clients with their own cuts (``cuts``): client ``i`` holds
    ``blocks[:cuts[i]]``, the server ``blocks[cut:]`` with ``cut`` the shallowest, entered at each client's cut
    (:class:`~raysplit.models.tiers.AtCuts`); ``cut_shape`` is then the shallowest cut's. ``lm``: a language
    model's ``model.lm`` section (:class:`~raysplit.models.causal_lm.LMConfig`; None: a model of the zoo), built on
    every side from it and the tokenizer's vocabulary (``inputs.num_classes``) as a fixed-length model (what crosses
    the cut is the hidden states tensor). With LoRA (``lm.adapter.kind: lora``) every side builds the frozen base
    once per process from that source and ``base_seed`` (the driver's: the run's seed) and checks it against
    ``base_digest`` (the driver's); the parts it builds share that base and hold their own adapters, which are
    what their states carry (:mod:`raysplit.models.adapters`)."""

    name: str
    options: dict
    inputs: Any  # raysplit.data.DataSpec
    cut: int | None
    tail_cut: int | None = None
    cut_shape: tuple | None = None
    cuts: tuple | None = None  # tiered (model.tiers, model.cut_budget): each client's cut; ``cut`` is the shallowest
    lm: Any = None  # raysplit.models.causal_lm.LMConfig
    base_seed: int | None = None  # a LoRA language model: the seed its frozen base is built with on every side
    base_digest: str | None = None  # ... and the driver's fingerprint of it (raysplit.models.adapters.base_digest)
    ranks: tuple | None = None  # tiered language model (model.tiers[i].rank): each client's LoRA rank, one per cut

    def cut_of(self, cid: int) -> int | None:
        """Client ``cid``'s cut where clients have their own (None: every client holds ``cut``)."""
        return None if self.cuts is None else self.cuts[int(cid)]

    @property
    def deepest(self) -> int | None:
        """The deepest client cut of a tiered split (None: not tiered)."""
        return None if self.cuts is None else max(self.cuts)


    @property
    def widest_rank(self) -> int | None:
        """The largest LoRA rank of a tiered language model's clients and server (None: no tier sets a rank): the
        rank the aggregate of the clients' blocks is held at (:mod:`raysplit.runtime.tiered`)."""
        return None if self.ranks is None else max(max(self.ranks), self.lm.adapter.rank)

    @property
    def language_model(self) -> bool:
        return self.lm is not None

    @property
    def label_shape(self) -> tuple:
        """A sample's labels: one class (``()``), or a language model's token block (its input shape)."""
        return self.input_shape if self.lm is not None else ()

    @property
    def loss(self):
        """The training loss ``loss(logits, y)``: mean cross-entropy over the labels (image and character
        models), a language model's mean next-token cross-entropy over its token blocks
        (:func:`raysplit.lm_metrics.lm_loss`)."""
        if self.lm is None:
            return F.cross_entropy
        from raysplit.lm_metrics import lm_loss

        return lm_loss

    @property
    def sample_losses(self):
        """Per-sample training losses ``sample_losses(logits, y) -> (B,)``, for a loss that weighs samples
        (CycleSL's pooled steps): the cross-entropy of each sample's class (image and character models), a
        language model's mean next-token cross-entropy of each token block
        (:func:`raysplit.lm_metrics.lm_sample_losses`)."""
        if self.lm is None:
            return per_sample_cross_entropy
        from raysplit.lm_metrics import lm_sample_losses

        return lm_sample_losses

    @property
    def num_classes(self) -> int:
        return self.inputs.num_classes

    @property
    def input_shape(self) -> tuple:
        return tuple(self.inputs.input_shape)

    def client_part(self, cid: int, device=None) -> torch.nn.Module:
        """A fresh client part of client ``cid`` (tiered: ``blocks[:cut_of(cid)]``; else :meth:`parts`' client)."""
        return self.parts(device)[0] if self.cuts is None else self.part_at(self.cut_of(cid), device)

    def part_at(self, cut: int, device=None) -> torch.nn.Module:
        """A fresh client part holding ``blocks[:cut]`` (U-shaped: with the tail), its adapters at the cut's LoRA
        rank where tiers set ranks."""
        from raysplit.models.tiers import client_part

        return client_part(self.build(device, rank=self.rank_at(cut)), cut, self.tail_cut)

    def rank_of(self, cid: int) -> int | None:
        """Client ``cid``'s LoRA rank where tiers set ranks (None: every client at ``model.lm.adapter.rank``)."""
        return None if self.ranks is None else self.ranks[int(cid)]

    def rank_at(self, cut: int) -> int | None:
        """The LoRA rank of the clients at ``cut`` (None: ``model.lm.adapter.rank``, no tier sets one)."""
        return None if self.ranks is None else self.ranks[self.cuts.index(cut)]

    @property
    def shares_base(self) -> bool:
        """A LoRA language model: its parts share this process's one frozen base and carry only adapters."""
        return self.lm is not None and self.lm.adapter.kind == "lora" and self.base_seed is not None

    def build(self, device=None, rank: int | None = None):
        """A fresh model of the zoo (random initial weights; callers load states): the whole
        :class:`~raysplit.models.SplitModel`, for a rule that splits it its own way (Ampere's auxiliary net).
        A LoRA language model: its own adapters (at ``rank``, :func:`~raysplit.models.tiers.ranked_lm`; None: its
        own) over this process's frozen base on ``device`` (:func:`~raysplit.models.causal_lm.shared_base_model`;
        None: the CPU; one template per rank, each from the same seed and checked against the same digest), which
        the caller must not move elsewhere (a ``.to`` to another device copies that part's base); otherwise
        ``device`` is not used."""
        if self.lm is not None:
            from raysplit.models.causal_lm import build_causal_lm, shared_base_model
            from raysplit.models.tiers import ranked_lm

            lm = ranked_lm(self.lm, rank)
            if self.shares_base:
                return shared_base_model(lm, vocab_size=self.num_classes, seed=self.base_seed,
                                         fixed_length=True, device=device, digest=self.base_digest)
            return build_causal_lm(lm, vocab_size=self.num_classes, fixed_length=True)
        from raysplit.models import build_model

        return build_model(self.name, self.num_classes, self.input_shape, **self.options)

    def parts(self, device=None) -> tuple[torch.nn.Module, torch.nn.Module]:
        """Fresh client and server parts at the configured cut (U-shaped: the client holds head and tail, a
        :class:`~raysplit.models.UClient`, the server the middle); with no cut the whole model and an identity.
        ``device``: see :meth:`build`."""
        model = self.build(device)
        if self.cut is None:
            return model, torch.nn.Identity()
        if self.cuts is not None:  # tiered: every block a client holds, the server's from the shallowest cut on
            from raysplit.models.tiers import tiered_parts

            if self.ranks is not None:  # the clients' blocks at the largest rank (the aggregate's shapes)
                return tiered_parts(self.build(device, rank=self.widest_rank), self.cuts, self.tail_cut)[0], \
                    tiered_parts(model, self.cuts, self.tail_cut)[1]
            return tiered_parts(model, self.cuts, self.tail_cut)
        if self.tail_cut is not None:
            return model.split_u(self.cut, self.tail_cut)
        return model.split(self.cut)


@dataclass(frozen=True)
class Sections:
    """The run's typed config sections as every host gets them (frozen pydantic models, shipped to each actor)."""

    train: Any  # raysplit.config.TrainConfig
    eval: Any  # EvalConfig
    clock: Any  # ClockConfig
    runtime: Any  # RuntimeConfig (runtime.torch_threads resolved by the backend)
    seed: int

    @property
    def server_optimizer(self):
        """The server's optimizer section: ``train.server_optimizer``, or the clients' where it is not given."""
        return self.train.server_optimizer or self.train.optimizer


@dataclass
class Progress:
    """The host's place in the run, which its context reads (``round``): set by the host, read by the rules."""

    round: int = -1


@dataclass(frozen=True)
class Method:
    """A method as its hosts get it: its validated ``Params``, what it derived at setup for them, and its rules."""

    params: Any
    setup: Any = None
    client_rule: Any = None  # raysplit.runtime.rules.ClientRule subclass (None: ClientRule)
    server_rule: Any = None  # ServerRule subclass (None: ServerRule)
    persist_client_models: bool = False  # no global client model: every client keeps its own
    asynchronous: bool = False  # run by the event driver: per-client RNG, forwards replayable from a checkpoint


@dataclass(frozen=True)
class HostPlan:
    """What a host is built from: the sections, the model, the method, the privacy plug-ins at the cut
    (``privacy``: a :class:`~raysplit.privacy.PrivacySpec`, None: off) and a U-shaped split (``ushape``: a
    :class:`~raysplit.label_privacy.UShapeSpec`, None: labels go to the server)."""

    sections: Sections
    model: ModelFacts
    method: Method
    privacy: Any = None
    ushape: Any = None
    events: Any = None  # the event loop's plan (raysplit.runtime.server.events.EventPlan) of an asynchronous method

    def parts(self, device=None) -> tuple[torch.nn.Module, torch.nn.Module]:
        """Fresh client and server parts (random init; callers load states): :meth:`ModelFacts.parts`."""
        return self.model.parts(device)

    def with_threads(self, threads: int) -> "HostPlan":
        """The plan with ``runtime.torch_threads: auto`` resolved to ``threads`` (a number or null stays)."""
        rt = self.sections.runtime
        if rt.torch_threads != "auto":
            return self
        return replace(self, sections=replace(self.sections, runtime=rt.model_copy(update={"torch_threads": threads})))
