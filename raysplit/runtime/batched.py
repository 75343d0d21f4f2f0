"""Several server copies trained in one batched computation (``algorithm.batched_copies``). No Ray here.

The copies' parameters and buffers are stacked (``torch.func.stack_module_state``) and one vmapped
``functional_call`` computes every copy's forward and loss on its own activation. One backward of the summed losses
gives each copy exactly its own loss's gradient (the copies share nothing), which is handed to the copy's
parameters as ``.grad``; the updated buffers (BatchNorm running statistics, batch counters) are written back to
each copy. Each copy's own optimizer then steps as after its own backward (``ServerHost.train_copies``). Copies of a
language model with LoRA stack only their own weights (the adapters): the frozen base they share is passed once,
unbatched (:func:`stack_own`).

What vmap cannot batch raises here before any copy is touched (random operations such as dropout in training
mode: their per-copy draws would not follow the server's random stream; data-dependent Python control flow such
as BatchNorm with ``momentum=None``); the server host then falls back to one copy after another.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state

from raysplit.models.adapters import frozen_tensors


def stack_own(modules: list[torch.nn.Module]) -> tuple[dict, dict]:
    """``torch.func.stack_module_state(modules)`` without the frozen tensors of adapter-only blocks
    (:func:`~raysplit.models.adapters.frozen_tensors`, the base the modules share): ``functional_call`` on
    ``modules[0]`` takes those from it, once for every row, so only the adapters (and any other own weight) are
    stacked, each row its own. Modules without adapter-only blocks: exactly ``stack_module_state``."""
    frozen = {id(t) for t in frozen_tensors(modules[0])}
    if not frozen:
        return stack_module_state(modules)
    named = [dict(m.named_parameters()) for m in modules]
    params = {n: torch.stack([d[n].detach() for d in named]).requires_grad_(p.requires_grad)
              for n, p in named[0].items() if id(p) not in frozen}
    bufs = [dict(m.named_buffers()) for m in modules]
    buffers = {n: torch.stack([d[n] for d in bufs]) for n, b in bufs[0].items() if id(b) not in frozen}
    return params, buffers


def copies_backward(modules: list[torch.nn.Module], x: torch.Tensor, y: torch.Tensor,
                    loss_fn: Callable = F.cross_entropy) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward, ``loss_fn`` and backward of ``modules[i]`` on ``x[i]``, ``y[i]`` for every ``i`` at once (same
    architecture, equal batch shapes). Each module's parameters receive their gradients (``.grad``, as after
    ``loss.backward()``) and its buffers their updated values. Returns the losses ``(n,)`` and ``dL_i/dx_i``."""
    params, buffers = stack_own(modules)
    base = modules[0]  # functional_call swaps the stacked tensors in for the call and restores base's own

    def loss_of(p, b, xi, yi):
        return loss_fn(functional_call(base, (p, b), (xi,)), yi)

    x = x.detach().requires_grad_(True)
    losses = torch.vmap(loss_of, randomness="error")(params, buffers, x, y)
    losses.sum().backward()
    with torch.no_grad():
        for i, m in enumerate(modules):
            for name, prm in m.named_parameters():
                g = params[name].grad if name in params else None  # a shared frozen weight has none
                prm.grad = None if g is None else g[i]
            for name, buf in m.named_buffers():
                if name in buffers:
                    buf.copy_(buffers[name][i])
    return losses.detach(), x.grad


def vmap_refused(e: RuntimeError) -> bool:
    """Whether ``e`` is vmap refusing a model (a random operation under ``randomness="error"``, data-dependent
    control flow, an in-place update it cannot batch): the caller then computes one at a time. Any other error (CUDA
    out of memory, a driver, cuDNN or cuBLAS failure) is not a refusal and must surface, not turn packing off."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    text = str(e)
    return "vmap" in text or "Batching rule" in text or "functorch" in text
