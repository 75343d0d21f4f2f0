"""A step's batches pooled on the server (CycleSL's feature resampling): their features, labels and per-sample
weights (each sample its client's sample count), drawn from in resampled mini-batches, each one a training step of
the server's model. Where the clients have their own cuts (issue 72) the features of each cut stay apart and a
mini-batch's samples enter the server's model at their own cuts (:func:`raysplit.runtime.tiered.step_at_cuts`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raysplit.runtime import tiered


class Pool:
    """The pooled samples of ``batches`` in their order (``len``: how many), on the server's device; ``step(idx,
    model, tag)``: one step of ``model`` on the samples ``idx`` with the client-size-weighted cross-entropy;
    ``step_all(model, tag)``: one on all of them, unweighted."""

    def __init__(self, trainer, batches: list):
        self.trainer = trainer
        cuts = [trainer.cut_of(b.tag.client) for b in batches]
        self.y = torch.cat([b.y for b in batches])
        self.device = self.y.device
        self.w = torch.cat([torch.full((len(b.y),), float(b.weight), device=self.device) for b in batches])
        self.tiered = len(set(cuts)) > 1
        if not self.tiered:
            self.x = torch.cat([b.x for b in batches])
            return
        sample_cut = torch.cat([torch.full((len(b.y),), c, dtype=torch.long) for b, c in zip(batches, cuts)])
        self.cut_of_sample = sample_cut.to(self.device)
        self.local = torch.empty(len(self.y), dtype=torch.long, device=self.device)  # a sample's row in its cut's
        self.x_at: dict[int, torch.Tensor] = {}
        for cut in sorted(set(cuts)):
            rows = (self.cut_of_sample == cut).nonzero().flatten()
            self.local[rows] = torch.arange(len(rows), device=self.device)
            self.x_at[cut] = torch.cat([b.x for b, c in zip(batches, cuts) if c == cut])

    def __len__(self) -> int:
        return len(self.y)

    def step_all(self, model, tag) -> torch.Tensor:
        """One step of ``model`` on every pooled sample with the mean cross-entropy, as one step on the batches'
        concatenation (MiniBatch-SFL); tiered, each cut's samples run from there, their losses pooled by samples."""
        if not self.tiered:
            return self.trainer.step(self.x.detach(), self.y, model, tag=tag)
        return tiered.step_at_cuts(self.trainer, [(cut, x.detach(), self.y[self.cut_of_sample == cut], None)
                                                  for cut, x in self.x_at.items()], model, tag)

    def step(self, idx: torch.Tensor, model, tag) -> torch.Tensor:
        """One step of ``model`` on the samples ``idx``, each weighted by its client's sample count; the loss."""
        if not self.tiered:
            def weighted_ce(out, y, w=self.w[idx]):
                return (w * F.cross_entropy(out, y, reduction="none")).sum() / w.sum()

            return self.trainer.step(self.x[idx], self.y[idx], model, tag=tag, loss=weighted_ce)
        parts = []
        for cut, x in self.x_at.items():
            sel = idx[self.cut_of_sample[idx] == cut]
            if len(sel):
                parts.append((cut, x[self.local[sel]], self.y[sel], self.w[sel]))
        return tiered.step_at_cuts(self.trainer, parts, model, tag)
