"""Aggregation by block for clients with their own cuts (issue 72): pure torch, no Ray; tested on hand-made weights
in tests/test_tiers.py.

Client ``i`` holds ``blocks[:cut_i]``, the server ``blocks[min cut:]``. A block is held by every client whose cut
lies after it and, from the shallowest cut on, by the server, whose copy of the block the clients that cut at or
before it trained through their activations. **The rule**: each block is the average of its holders' copies, each
holder weighted by the samples that trained its copy: a client by its own weight, the server by the weights of the
clients it trained the block for. Every client of the aggregation so counts once per block, and the denominator is
the same for every block (the round's total weight). This is the depth-heterogeneous rule of DepthFL (Kim et al.,
ICLR 2023) and HeteroFL (Diao et al., ICLR 2021): a parameter is averaged over the clients whose sub-model holds it;
what split learning adds is that the server's copy of a block in the overlap is one of its holders (SplitFT, arXiv
2604.26388, aggregates its clients' parts of different depths but its text gives no rule for the server's copy:
this is ours). The papers' texts are not in the project's library; the rule is taken from their published
descriptions.

A state's keys are those of :meth:`raysplit.models.SplitModel.segment` parts: the block's index in the full model
first (``"3.weight"``), on the clients' side and the server's alike."""

from __future__ import annotations

import copy
import time

import numpy as np
import torch
import torch.nn.functional as F

from raysplit.models.tiers import block_key


def partial_sum(states: list[dict], weights: list[float]) -> tuple[dict, dict]:
    """One worker's share of a tiered aggregation: per key, the weighted sum (float64) over the states that have it
    and the summed weight of those states. Clients of different LoRA ranks (``model.tiers[i].rank``) hold an entry
    at different shapes: the sum is then zero-padded to the largest and the weight is per element (a tensor of
    the sum's shape: the weight of the states holding that rank component; module docstring)."""
    sums: dict[str, torch.Tensor] = {}
    held: dict[str, float | torch.Tensor] = {}
    shape: dict[str, tuple] = {}
    for st in states:
        for k, v in st.items():
            shape[k] = tuple(max(a, b) for a, b in zip(shape[k], v.shape)) if k in shape else tuple(v.shape)
    for st, w in zip(states, weights):
        for k, v in st.items():
            if tuple(v.shape) == shape[k] and not isinstance(held.get(k), torch.Tensor):
                term = v.detach().double() * w
                sums[k] = term if k not in sums else sums[k] + term
                held[k] = held.get(k, 0.0) + float(w)
                continue
            if not isinstance(held.get(k), torch.Tensor):  # from here on per element: what the key had so far
                held[k] = torch.full(shape[k], held.get(k, 0.0), dtype=torch.float64)
                sums[k] = sums[k] if k in sums else torch.zeros(shape[k], dtype=torch.float64)
            sums[k] = sums[k] + _pad(v.detach().double() * w, shape[k])
            held[k] = held[k] + _pad(torch.full(tuple(v.shape), float(w), dtype=torch.float64), shape[k])
    return sums, held


def _pad(v: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``v`` zero-padded at the end of each dimension to ``shape`` (a lower-rank LoRA entry at a higher rank)."""
    if tuple(v.shape) == tuple(shape):
        return v
    return F.pad(v, [p for d in reversed(range(v.dim())) for p in (0, shape[d] - v.shape[d])])


def finish(partials: list[tuple[dict, dict]], total: float, server: dict, like: dict) -> tuple[dict, dict]:
    """The aggregate by block (module docstring) of the workers' ``partials`` (packed sums, weights per key),
    ``total`` their clients' weight, with the server's state ``server``: ``(client state, server update)``. The
    client state has every key of ``like`` (the deepest client's part), cast to its dtypes; the server update the
    server's keys that clients hold too (the overlap; a U-shaped client's ``head.<block>`` entry is the server's
    ``<block>``), to be loaded into the server's model. A key that no client
    holds and the server does not either is an error. Adapters of several LoRA ranks: ``like`` holds them at the
    largest rank and the update is cut to the server's (:func:`_finish_ranked`)."""

    out: dict[str, torch.Tensor] = {}
    update: dict[str, torch.Tensor] = {}
    for k, ref in like.items():
        at_server = block_key(k)[1]  # the server's name of the entry (a U-shaped head's ``head.`` dropped)
        if any(isinstance(p[1].get(k), torch.Tensor) or (k in p[0] and tuple(np.shape(p[0][k])) != tuple(ref.shape))
               for p in partials) or (at_server in server and tuple(server[at_server].shape) != tuple(ref.shape)):
            out[k] = _finish_ranked(k, partials, total, server.get(at_server), ref)
            if at_server in server:
                update[at_server] = out[k][tuple(slice(0, n) for n in server[at_server].shape)]
            continue
        s = sum((torch.as_tensor(np.asarray(p[0][k], dtype=np.float64)) for p in partials if k in p[0]),
                torch.zeros(()))
        w = sum(p[1].get(k, 0.0) for p in partials)
        if at_server in server:  # the server holds it for the clients that cut at or before its block
            s = s + server[at_server].detach().double().cpu() * (total - w)
            w = total
        if w == 0:
            raise ValueError(f"no holder of {k!r} took part in the aggregation")
        avg = s / w
        out[k] = (avg if ref.is_floating_point() else avg.round()).to(ref.dtype)
        if at_server in server:
            update[at_server] = out[k]
    return out, update


def _finish_ranked(k: str, partials, total: float, server_value, ref: torch.Tensor) -> torch.Tensor:
    """One entry held at several LoRA ranks, aggregated by **zero-padding, each rank component averaged over its
    holders**: every holder's ``lora_A`` (``r x in``) and ``lora_B`` (``out x r``) padded with zeros to the
    largest rank ``R``; element ``j`` of the aggregate is the sample-weighted mean over the holders whose rank
    exceeds ``j`` (HeteroFL's rule for nested sub-models, Diao et al., ICLR 2021, on LoRA's rank axis, as
    HetLoRA, Cho et al., 2024, pads and truncates client adapters of different ranks; the text of HSplitLoRA's
    "noise-free" aggregation is not in the project's library, so it is not followed here). The server, where it
    holds the block, weighs what the clients that cut at or before it gave (``total`` less the block's clients:
    the weight on the first component, which every rank holds). A component no holder has keeps ``ref``'s value.
    As with every LoRA average, ``mean(B) @ mean(A)`` is not ``mean(B @ A)``. Each client then keeps its first
    ``r`` components (:func:`raysplit.models.tiers.fit_state`); one scale ``alpha / rank`` for every rank
    (:func:`raysplit.models.tiers.ranked_lm`) makes the components commensurable."""
    shape = tuple(ref.shape)
    s = torch.zeros(shape, dtype=torch.float64)
    w = torch.zeros(shape, dtype=torch.float64)
    for sums, held in partials:
        if k not in sums:
            continue
        v = torch.as_tensor(np.asarray(sums[k], dtype=np.float64))
        h = held[k]
        h = torch.full(tuple(v.shape), float(h), dtype=torch.float64) if not isinstance(h, torch.Tensor) else h
        s, w = s + _pad(v, shape), w + _pad(h.double(), shape)
    if server_value is not None:
        share = total - float(w.max())  # the weight of the clients the server trained the block for
        sv = server_value.detach().double().cpu()
        s = s + _pad(sv * share, shape)
        w = w + _pad(torch.full(tuple(sv.shape), share, dtype=torch.float64), shape)
    if float(w.max()) == 0:
        raise ValueError(f"no holder of {k!r} took part in the aggregation")
    avg = torch.where(w > 0, s / torch.where(w > 0, w, torch.ones_like(w)), ref.detach().double().cpu())
    return (avg if ref.is_floating_point() else avg.round()).to(ref.dtype)


def merge_copies(main: torch.nn.Module, copies: dict, weights: dict, cuts) -> dict:
    """Per-client server copies (``copies[cid]``: modules of the main model's layout) merged by block: block ``b``
    is the weighted average of the copies of the clients that cut at or before it (the copies that trained it);
    a block none of them trained keeps the main model's value. The main model's state, merged."""
    out = {}
    for k, v in main.state_dict().items():
        b = block_key(k)[0]
        trained = [c for c in weights if cuts[int(c)] <= b]
        if not trained:
            out[k] = v
            continue
        total = float(sum(weights[c] for c in trained))
        acc = sum(copies[c].state_dict()[k].double() * (weights[c] / total) for c in trained)
        out[k] = acc.to(v.dtype) if v.is_floating_point() else acc.round().to(v.dtype)
    return out


def merge_optimizer_states(main: torch.nn.Module, main_state: dict, copy_states: dict, weights: dict,
                           cuts) -> dict | None:
    """The copies' optimizer states (momentum, Adam moments; ``copy_states[cid]``) merged by block as
    :func:`merge_copies` merges their weights: a parameter's state is the average over the copies that trained its
    block, the main optimizer's where none did. None where the optimizer keeps no state (plain SGD)."""
    first = next(iter(copy_states.values()))
    if not first["state"]:
        return None
    names = [n for n, _ in main.named_parameters()]
    merged = copy.deepcopy(first)
    for pid in merged["state"]:
        b = block_key(names[pid])[0]
        trained = [c for c in weights if cuts[int(c)] <= b]
        if not trained:
            merged["state"][pid] = copy.deepcopy(main_state["state"].get(pid, merged["state"][pid]))
            continue
        total = float(sum(weights[c] for c in trained))
        entry = {}
        for name, v in copy_states[trained[0]]["state"][pid].items():
            acc = sum(torch.as_tensor(copy_states[c]["state"][pid][name]).double() * (weights[c] / total)
                      for c in trained)
            ref = torch.as_tensor(v)
            entry[name] = acc.to(ref.dtype) if ref.is_floating_point() else acc.round().to(ref.dtype)
        merged["state"][pid] = entry
    return merged


def step_at_cuts(trainer, parts: list, model, tag, ready_at: float = 0.0) -> torch.Tensor:
    """One step of ``model`` (a :class:`~raysplit.runtime.state.ModelSlot`) on samples that enter it at several
    cuts (``parts``: ``(cut, features, labels, weights or None)``): each cut's samples run from there, the loss
    the weighted mean of the trainer's per-sample losses (``sample_losses``) over every sample (unweighted: the sum
    of the cuts' summed losses over all samples, the concatenated step's loss where there is one cut); then the
    trainer's :meth:`~raysplit.runtime.server.trainer.Trainer.settle` (clipping, the step, the FLOPs from
    ``ready_at`` on, counted once per composition of cuts and shapes)."""
    from raysplit.models.tiers import entered

    t_wall = time.perf_counter()
    module, optimizers = model.module, [model.optimizer]
    weights = [w if w is not None else torch.ones(len(y), device=y.device) for _, _, y, w in parts]
    total_weight = sum(w.sum() for w in weights)

    def step():
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        total = 0.0
        for (cut, x, y, _), w in zip(parts, weights):
            with entered(module, cut):
                total = total + (w * trainer.sample_losses(module(x), y)).sum()
        out = total / total_weight
        out.backward()
        return out

    key = (trainer.call, "step", type(module).__name__) + tuple((cut, tuple(x.shape)) for cut, x, _, _ in parts)
    out, fl = trainer.flops.run(key, step)
    lv = trainer.settle(out.detach(), fl, module, optimizers, tag=tag, ready_at=ready_at)
    trainer.tally.busy_wall += time.perf_counter() - t_wall
    return lv
