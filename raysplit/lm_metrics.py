"""Language-model metrics (building block: no Ray, no MLflow): per-token loss and perplexity on held-out text.

The loss is the mean negative log-likelihood of every next token a block predicts (the logits at position ``t``
score token ``t + 1``; a padded target is not counted), so perplexity is ``exp`` of it over all tokens of the
evaluation set together, not the mean of per-batch perplexities. ``tokens`` is how many targets were counted.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

__all__ = ["token_nll", "lm_loss", "lm_sample_losses", "evaluate_lm", "lm_eval_metrics"]


def token_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of next-token NLL, number of targets)`` of a batch: logits ``(B, T, V)``, ids ``(B, T)``, mask
    ``(B, T)`` (1 = token; null: all). Both stay on the logits' device (nothing is read back here)."""
    targets = input_ids[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none")
    if attention_mask is None:
        return nll.sum(), torch.tensor(nll.numel(), device=nll.device)
    keep = attention_mask[:, 1:].flatten().to(nll.dtype)
    return (nll * keep).sum(), keep.sum().to(torch.long)


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
            ) -> torch.Tensor:
    """The causal-LM training loss: the mean next-token NLL over the batch's targets."""
    total, count = token_nll(logits, input_ids, attention_mask)
    return total / count.clamp(min=1)


def lm_sample_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-sample losses ``(B,)`` of a batch of fixed-length blocks: each block's mean next-token NLL over its
    ``T - 1`` targets. Blocks of one length count the same targets each, so the plain mean of these is
    :func:`lm_loss` (up to float rounding); a weighted mean weighs whole blocks (CycleSL's client-size weights)."""
    targets = input_ids[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none")
    return nll.view(targets.shape).mean(dim=1)


@torch.no_grad()
def evaluate_lm(forward: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[torch.Tensor]) -> dict:
    """``{"loss", "perplexity", "tokens"}`` of ``forward`` (token ids -> logits: a model, or a split model's
    parts composed, :func:`raysplit.models.causal_lm.compose`) over ``batches`` of fixed-length blocks; the
    sums stay on the device and are read once at the end."""
    total = count = None
    for ids in batches:
        s, n = token_nll(forward(ids), ids)
        total = s if total is None else total + s
        count = n if count is None else count + n
    if count is None or int(count) == 0:
        raise ValueError("evaluate_lm: no tokens to evaluate")
    loss = float(total) / int(count)
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(count)}


def lm_eval_metrics(targets, predictions, nll_sum: float) -> dict:
    """A run's evaluation of a language model from the runtime's evaluation loop (every next token of the test
    blocks: ``targets``, the most likely tokens ``predictions``, the summed NLL): ``loss`` (per token),
    ``perplexity`` (``exp`` of it), ``next_token_accuracy`` and ``tokens``. No per-label metrics: the labels are a
    vocabulary."""
    import numpy as np

    targets, predictions = np.asarray(targets), np.asarray(predictions)
    n = len(targets)
    if n == 0:
        raise ValueError("lm_eval_metrics: no tokens to evaluate")
    loss = float(nll_sum) / n
    return {"loss": loss, "perplexity": math.exp(loss),
            "next_token_accuracy": float((targets == predictions).mean()), "tokens": n}
