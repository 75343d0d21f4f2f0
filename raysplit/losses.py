"""Losses of the semi-supervised family (building block: torch only, no Ray, no MLflow).

Semi-SFL's clustering regularisation (../shared/papers/semisfl.txt; seed-code.md §3.4, ``utils/losses.py:
FeatureCache``): a queue of recent teacher keys (L2-normalised projections) with their (pseudo-)labels and
confidence masks; a student query ``q_i`` is pulled towards every key with its label, in the batch and in the
queue, in the supervised-contrastive form

    logits_ij = q_i . k_j / kappa        over j in [batch keys ; queue]
    loss      = - mean_i ( sum_{j in P(i)} log softmax_j(logits_i) / max(|P(i)|, 1) )

where ``P(i)`` are the keys with the label of ``i`` whose mask is 1 (the anchor's own key included). The batch's
keys then enter the queue, FIFO with wrap. The same function serves the supervised phase (labels, masks all 1)
and the cross-entity phase (teacher pseudo-labels, masks from the confidence threshold).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class FeatureQueue:
    """FIFO of ``size`` keys (dim ``dim``) with labels (-1 when empty) and masks (0 when empty)."""

    def __init__(self, size: int, dim: int, generator: torch.Generator | None = None):
        self.size, self.dim = size, dim
        keys = torch.randn(size, dim, generator=generator)  # the code starts from random unit vectors
        self.keys = F.normalize(keys, dim=1)
        self.labels = torch.full((size,), -1, dtype=torch.long)
        self.masks = torch.zeros(size)
        self.ptr = 0

    def push(self, keys: torch.Tensor, labels: torch.Tensor, masks: torch.Tensor | None) -> None:
        """Enqueue a batch (detached), overwriting the oldest entries; wraps around. ``masks`` None leaves the
        overwritten entries' masks as they were (Semi-SFL's code in its supervised phase)."""
        n = len(keys)
        if n > self.size:
            raise ValueError(f"a batch of {n} keys does not fit a queue of {self.size}")
        idx = (self.ptr + torch.arange(n)) % self.size
        self.keys[idx] = keys.detach().to(self.keys.dtype).cpu()
        self.labels[idx] = labels.detach().cpu().long()
        if masks is not None:
            self.masks[idx] = masks.detach().cpu().float()
        self.ptr = int((self.ptr + n) % self.size)

    def clear(self) -> None:
        self.labels.fill_(-1)
        self.masks.zero_()


def queue_contrastive_loss(q: torch.Tensor, k: torch.Tensor, labels: torch.Tensor, masks: torch.Tensor | None,
                           queue: FeatureQueue, temperature: float, push: bool = True) -> torch.Tensor:
    """The supervised-contrastive / clustering loss of the module docstring; ``q`` and ``k`` are L2-normalised
    (n x dim), ``k`` carries no gradient. Pushes the batch into ``queue`` afterwards unless ``push`` is False.
    ``masks`` None: positives by label alone, and the queue's masks are left as they are (Semi-SFL's code in its
    supervised phase)."""
    dev = q.device
    keys = torch.cat([k.detach(), queue.keys.to(dev)])
    key_labels = torch.cat([labels, queue.labels.to(dev)])
    logits = q @ keys.T / temperature
    positive = labels[:, None] == key_labels[None, :]
    if masks is not None:
        key_masks = torch.cat([masks.float(), queue.masks.to(dev)])
        positive = positive & (key_masks[None, :] > 0)
    log_prob = F.log_softmax(logits, dim=1)
    per_anchor = (log_prob * positive).sum(dim=1) / positive.sum(dim=1).clamp(min=1)
    loss = -per_anchor.mean()
    if push:
        queue.push(k, labels, masks)
    return loss
