"""Clients with their own cut points (issue 72): which cut each client holds, from ``model.tiers`` or the
``model.cut_budget`` rule, resolved once on the driver before any actor exists.

Client ``i`` holds ``blocks[:cuts[i]]``; the server holds ``blocks[min(cuts):]`` and enters its model at client
``i``'s cut for client ``i``'s activations (:class:`AtCuts`). One tier (every client at one cut) is not tiered at
all: the driver runs today's single-cut run at that cut (``experiment.prepare``).

This module knows nothing about Ray, MLflow or Tune; it reads plain values (the model, the clients' FLOP/s)."""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch
from torch import nn

from raysplit.clock import FlopCache
from raysplit.models.core import UClient

__all__ = ["AtCuts", "Entered", "block_key", "client_cuts", "client_part", "client_ranks", "cut_flops", "entered",
           "at_rank", "fit_state", "ranked_lm", "tier_of", "tiered_parts"]


def _resolve(model, cut, key: str) -> int:
    try:
        return model.resolve_cut(cut)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None


def cut_flops(model, cuts: Sequence[int], batch_size: int) -> dict[int, int]:
    """FLOPs of one batch's forward and backward through ``blocks[:cut]`` for each of ``cuts`` (counted with torch's
    flop counter on a random input through a copy of the model, the global random state kept: the model's weights,
    buffers (BatchNorm's statistics) and the run's random stream are as they were)."""
    flops = FlopCache()
    out = {}
    copied = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        for k in sorted(set(cuts)):
            part = copied.segment(0, k)
            x = copied.example_input(batch_size, generator=torch.Generator().manual_seed(0))

            def fb(part=part, x=x):
                y = part(x)
                if y.requires_grad:  # a frozen part (a language model's embeddings without adapters) only forwards
                    y.backward(torch.ones_like(y))

            out[k] = flops.run(("budget", k), fb)[1]
    return out


def client_cuts(model, model_cfg, num_clients: int, client_flops: Sequence[float], seed: int,
                batch_size: int, why_not=lambda cut: None) -> tuple[int, ...] | None:
    """Each client's cut (an index into the model's blocks), or None where neither ``tiers`` nor ``cut_budget`` is
    given (the run's single ``model.cut``). Where every client gets the same cut the caller runs today's single-cut
    run at it. Raises ``ValueError`` naming the key for a cut the model does not have or tiers that do not give
    every client exactly one cut, or a cut ``why_not`` refuses (``why_not(cut)``: why a client cannot cut there,
    None where it can; a language model's: :func:`lm_cut_refused`)."""
    if model_cfg.tiers is not None:
        for i, t in enumerate(model_cfg.tiers):
            why = why_not(_resolve(model, t.cut, f"model.tiers[{i}].cut"))
            if why:
                raise ValueError(f"model.tiers[{i}].cut={t.cut!r}: {why}")
        return tuple(_from_tiers(model, model_cfg, num_clients, client_flops, seed))
    if model_cfg.cut_budget is not None:
        cuts = _from_budget(model, model_cfg.cut_budget, num_clients, client_flops, batch_size, why_not)
        for c in model_cfg.cut_budget.cuts or ():
            if why_not(model.resolve_cut(c)):
                raise ValueError(f"model.cut_budget.cuts: {c!r} {why_not(model.resolve_cut(c))}")
        return tuple(cuts)
    return None


class AtCuts(nn.Sequential):
    """The server's part of a tiered split: ``blocks[start:]`` (children named by their index in the full model,
    as :meth:`SplitModel.segment` names them, so its ``state_dict`` keys are the untiered server part's), entered
    at ``entry``: the cut of the client whose activation it runs on (:meth:`entered`); ``entry`` is ``start``
    outside it."""

    def __init__(self, part: nn.Sequential, start: int):
        super().__init__(OrderedDict(part._modules))
        self.start = self.entry = int(start)

    def __getitem__(self, idx):
        """A block (an index), or the blocks of a slice as a plain Sequential named by full-model index (entered at
        its first block, as any part is)."""
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, block in self._modules.items():
            if int(name) >= self.entry:
                x = block(x)
        return x

    @contextlib.contextmanager
    def entered(self, cut: int):
        """Within the block, forwards enter at block ``cut`` (a client's cut, at or after ``start``)."""
        if not self.start <= cut < self.start + len(self):
            raise ValueError(f"cut {cut} is outside the server's blocks {self.start}..{self.start + len(self) - 1}")
        outer, self.entry = self.entry, int(cut)
        try:
            yield self
        finally:
            self.entry = outer


class Entered(nn.Module):
    """``server`` entered at ``cut`` for every forward (an evaluation pairing a tiered client's part with the
    server's model)."""

    def __init__(self, server: nn.Module, cut: int | None):
        super().__init__()
        self.server, self.cut = server, cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with entered(self.server, self.cut):
            return self.server(x)


def client_part(model, cut: int, tail_cut: int | None = None) -> nn.Module:
    """A client's part at ``cut``: ``blocks[:cut]``, with the tail ``blocks[tail_cut:]`` where the split is U-shaped
    (a :class:`~raysplit.models.UClient`, whose state keys are ``head.<block>...`` and ``tail.<block>...``)."""
    head = model.segment(0, cut)
    return head if tail_cut is None else UClient(head, model.segment(tail_cut, len(model)))


def tiered_parts(model, cuts: Sequence[int], tail_cut: int | None = None) -> tuple[nn.Module, AtCuts]:
    """The deepest client's part (every block a client holds) and the server's: ``blocks[min(cuts):]`` (U-shaped:
    up to the tail), entered at each client's cut."""
    end = len(model) if tail_cut is None else tail_cut
    return client_part(model, max(cuts), tail_cut), AtCuts(model.segment(min(cuts), end), min(cuts))


def block_key(key: str) -> tuple[int, str | None]:
    """A part's state key as ``(block index, the server's key for it)``: a client's head (``head.3.w``) and a plain
    part's keys (``3.w``) are the server's keys of that block (``3.w``); a U-shaped tail's (``tail.5.w``) only
    clients hold (None)."""
    side, _, rest = key.partition(".")
    if side == "tail":
        return int(rest.split(".", 1)[0]), None
    if side == "head":
        return int(rest.split(".", 1)[0]), rest
    return int(side), key


def entered(module, cut: int | None):
    """``module`` entered at ``cut`` where it is an :class:`AtCuts` and ``cut`` is given; else nothing changes."""
    if cut is None or not isinstance(module, AtCuts):
        return contextlib.nullcontext(module)
    return module.entered(cut)


def _from_tiers(model, model_cfg, n: int, client_flops, seed: int) -> list[int]:
    tiers = model_cfg.tiers
    tier_cuts = [_resolve(model, t.cut, f"model.tiers[{i}].cut") for i, t in enumerate(tiers)]
    cuts: list[int | None] = [None] * n
    if tiers[0].clients is not None:
        for i, t in enumerate(tiers):
            for c in t.clients:
                if not 0 <= c < n:
                    raise ValueError(f"model.tiers[{i}].clients: client {c} does not exist (data.num_clients={n})")
                if cuts[c] is not None:
                    raise ValueError(f"model.tiers[{i}].clients: client {c} is in two tiers")
                cuts[c] = tier_cuts[i]
        missing = [c for c in range(n) if cuts[c] is None]
        if missing:
            raise ValueError(f"model.tiers: clients {missing[:10]} are in no tier (every one of the "
                             f"data.num_clients={n} clients needs a cut)")
        return cuts
    counts = _apportion([t.share for t in tiers], n)
    if model_cfg.tier_order == "ids":
        order = list(range(n))
        slots = [i for i, k in enumerate(counts) for _ in range(k)]
    else:
        if model_cfg.tier_order == "seeded":
            order = [int(c) for c in np.random.default_rng([seed, 72]).permutation(n)]
        else:  # speed: the fastest clients to the deepest tiers (ties by id)
            order = sorted(range(n), key=lambda c: (-client_flops[c], c))
        by_depth = sorted(range(len(tiers)), key=lambda i: -tier_cuts[i]) if model_cfg.tier_order == "speed" \
            else range(len(tiers))
        slots = [i for i in by_depth for _ in range(counts[i])]
    for c, i in zip(order, slots):
        cuts[c] = tier_cuts[i]
    return cuts


def _apportion(shares: list[float], n: int) -> list[int]:
    """Client counts for the shares (largest remainder, ties to the earlier tier); each tier at least one client
    where there are enough."""
    raw = [s * n for s in shares]
    counts = [int(np.floor(r)) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))[:n - sum(counts)]:
        counts[i] += 1
    return counts


def _from_budget(model, budget, n: int, client_flops, batch_size: int, why_not) -> list[int]:
    cands = sorted({_resolve(model, c, "model.cut_budget.cuts") for c in budget.cuts} if budget.cuts
                   else {k for k in model.cut_points().values() if why_not(k) is None})
    flops = cut_flops(model, cands, batch_size)
    out = []
    for c in range(n):
        fits = [k for k in cands if flops[k] / client_flops[c] <= budget.seconds]
        out.append(max(fits) if fits else cands[0])
    return out


def describe(model, cuts: Sequence[int]) -> str:
    """The tiers in a line, shallowest first: each cut's name and how many clients hold it (``conv1:10,conv2:10``)."""
    names: dict[int, str] = {}
    for name, k in model.cut_points().items():
        names.setdefault(k, name)
    return ",".join(f"{names.get(k, k)}:{list(cuts).count(k)}" for k in sorted(set(cuts)))


def tier_of(cuts: Sequence[int] | None) -> dict[int, int]:
    """Each distinct cut's tier number, shallowest first (``eval/tier{k}/...``)."""
    return {cut: k for k, cut in enumerate(sorted(set(cuts or ())))}


# ----------------------------------------------------------------------------------------------------------------
# Per-client LoRA ranks (a language model's tiers)
# ----------------------------------------------------------------------------------------------------------------
def client_ranks(model_cfg, cuts: Sequence[int] | None, model=None) -> tuple[int, ...] | None:
    """Each client's LoRA rank from its tier's ``rank`` (``model.tiers[i].rank``; a tier without one:
    ``model.lm.adapter.rank``), or None where no tier sets one. A rank is a property of a cut here (the clients
    of one cut pack and pool one shape of part), so tiers at one cut with different ranks are an error; so is a
    rank on a model without LoRA adapters. Raises ``ValueError`` naming the key."""
    tiers = model_cfg.tiers or []
    given = [i for i, t in enumerate(tiers) if t.rank is not None]
    if not given:
        return None
    lm = model_cfg.lm
    if lm is None or lm.adapter.kind != "lora":
        what = "the model has no language-model section (model.lm)" if lm is None else \
            f"model.lm.adapter.kind={lm.adapter.kind} trains no adapters"
        raise ValueError(f"model.tiers[{given[0]}].rank: a rank is a LoRA adapter's, and {what}")
    if cuts is None or len(set(cuts)) == 1:
        if any(tiers[i].rank != lm.adapter.rank for i in given):
            raise ValueError(f"model.tiers[{given[0]}].rank: one tier is one cut for every client (today's "
                             f"single-cut run); set model.lm.adapter.rank instead")
        return None
    at_cut: dict[int, tuple[int, int]] = {}
    for i, t in enumerate(tiers):
        k = _resolve(model, t.cut, f"model.tiers[{i}].cut") if model is not None else t.cut
        r = t.rank if t.rank is not None else lm.adapter.rank
        if k in at_cut and at_cut[k][1] != r:
            raise ValueError(f"model.tiers[{i}].rank={r}: model.tiers[{at_cut[k][0]}] has the same cut with rank "
                             f"{at_cut[k][1]}; the clients of one cut share a rank")
        at_cut.setdefault(k, (i, r))
    return tuple(at_cut[c][1] for c in cuts)


def ranked_lm(lm, rank: int | None):
    """``lm`` (a ``model.lm`` section) with its adapters at ``rank`` and alpha scaled with it (``alpha * rank /
    adapter.rank``), so that every rank has the one scale ``alpha / rank`` of ``model.lm.adapter``: a rank-``r``
    adapter is then the first ``r`` components of a larger one, which zero-padding and truncation
    (:func:`fit_state`, :mod:`raysplit.runtime.tiered`) take it to be. ``lm`` itself where ``rank`` is None or
    the adapter's own."""
    if rank is None or rank == lm.adapter.rank:
        return lm
    a = lm.adapter
    return lm.model_copy(update={"adapter": a.model_copy(update={"rank": int(rank),
                                                                   "alpha": a.alpha * rank / a.rank})})


def fit_state(state: dict, like: dict) -> dict:
    """The entries of ``state`` that ``like`` (a part's state) has, each cut to ``like``'s shape where it is
    larger: a LoRA ``lora_A`` of rank ``R`` (``R x in``) keeps its first ``r`` rows, a ``lora_B`` (``out x R``)
    its first ``r`` columns (HetLoRA's truncation, Cho et al. 2024; the aggregate of adapters of several ranks is
    held at the largest). Entries already of ``like``'s shape are passed as they are (no copy)."""
    out = {}
    for k, ref in like.items():
        v = state[k]
        if tuple(v.shape) != tuple(ref.shape):
            if v.dim() != ref.dim() or any(a < b for a, b in zip(v.shape, ref.shape)):
                raise ValueError(f"state entry {k!r} has shape {tuple(v.shape)}, the part {tuple(ref.shape)}")
            v = v[tuple(slice(0, n) for n in ref.shape)]
        out[k] = v
    return out


def at_rank(state: dict, rank: int | None) -> dict:
    """``state`` with its LoRA entries cut to ``rank`` (as :func:`fit_state` cuts them, by name: peft's
    ``lora_A`` / ``lora_embedding_A`` keep their first ``rank`` rows, ``lora_B`` / ``lora_embedding_B`` their first
    ``rank`` columns); ``state`` itself where ``rank`` is None."""
    if rank is None:
        return state
    out = {}
    for k, v in state.items():
        if ("lora_A" in k or "lora_embedding_A" in k) and v.shape[0] > rank:
            v = v[:rank]
        elif ("lora_B" in k or "lora_embedding_B" in k) and v.shape[-1] > rank:
            v = v[..., :rank]
        out[k] = v
    return out


def lm_cut_refused(model, tail_cut: int | None):
    """Why a client of a language model (a :class:`~raysplit.models.causal_lm.CausalLM`) cannot cut at a block
    (None where it can), for :func:`client_cuts`: U-shaped (``tail_cut``, the head's index), a cut at the head or
    after the last decoder block leaves the server no block; a client part that trains nothing (the embeddings
    alone, which LoRA does not adapt by default) has no gradient to take."""
    def why_not(cut: int) -> str | None:
        if tail_cut is not None and cut >= tail_cut:
            return (f"leaves the server no decoder block before the head (U-shaped: the client keeps the head); "
                    f"cut at {model.block_names[tail_cut - 2]!r} or earlier")
        if not any(p.requires_grad for p in model.segment(0, cut).parameters()):
            return (f"the client's blocks ({', '.join(model.block_names[:cut])}) train nothing (no adapter in them: "
                    f"model.lm.adapter.target_modules); cut deeper")
        return None
    return why_not
