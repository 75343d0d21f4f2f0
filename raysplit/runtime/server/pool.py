"""A step's batches pooled on the server (CycleSL's feature resampling): their features, labels and per-sample
weights (each sample its client's sample count), drawn from in resampled mini-batches, each one a training step of
the server's model. Where the clients have their own cuts (issue 72) the features of each cut stay apart and a
mini-batch's samples enter the server's model at their own cuts (:func:`raysplit.runtime.tiered.step_at_cuts`)."""

from __future__ import annotations

import torch

from raysplit.runtime import tiered


class Pool:
    """The pooled samples of ``batches`` in their order (``len``: how many), on the server's device; ``step(idx,
    model, tag)``: one step of ``model`` on the samples ``idx`` with the client-size-weighted per-sample loss (the
    trainer's ``sample_losses``: a class model's cross-entropy, a language model's mean next-token loss of each
    block); ``step_all(model, tag)``: one on all of them with the model's loss, unweighted."""

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
        # which cut each sample enters at and its row among its cut's samples: host memory, from the batches'
        # sizes, so that choosing a resampled batch's samples of each cut reads nothing back from the device
        self.cut_of_sample = torch.cat([torch.full((len(b.y),), c, dtype=torch.long) for b, c in zip(batches, cuts)])
        self.local = torch.empty(len(self.y), dtype=torch.long)
        self.x_at: dict[int, torch.Tensor] = {}
        for cut in sorted(set(cuts)):
            rows = (self.cut_of_sample == cut).nonzero().flatten()
            self.local[rows] = torch.arange(len(rows))
            self.x_at[cut] = torch.cat([b.x for b, c in zip(batches, cuts) if c == cut])

    def __len__(self) -> int:
        return len(self.y)

    def step_all(self, model, tag) -> torch.Tensor:
        """One step of ``model`` on every pooled sample with the mean cross-entropy, as one step on the batches'
        concatenation (MiniBatch-SFL); tiered, each cut's samples run from there, their losses pooled by samples."""
        if not self.tiered:
            return self.trainer.step(self.x.detach(), self.y, model, tag=tag)
        return tiered.step_at_cuts(self.trainer, [(cut, x.detach(), self.y[self.rows(cut)], None)
                                                  for cut, x in self.x_at.items()], model, tag)

    def rows(self, cut: int, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The pooled rows (of ``idx``, a host tensor, in its order; default all) whose samples enter at ``cut``, on
        the device."""
        idx = torch.arange(len(self.y)) if idx is None else idx
        return idx[self.cut_of_sample[idx] == cut].to(self.device)

    def step(self, idx: torch.Tensor, model, tag) -> torch.Tensor:
        """One step of ``model`` on the samples ``idx`` (host memory: CycleSL's resampled order), each weighted by
        its client's sample count; the loss."""
        if not self.tiered:
            idx = idx.to(self.device)
            def weighted(out, y, w=self.w[idx], per_sample=self.trainer.sample_losses):
                return (w * per_sample(out, y)).sum() / w.sum()

            return self.trainer.step(self.x[idx], self.y[idx], model, tag=tag, loss=weighted)
        parts = []
        for cut, x in self.x_at.items():
            sel = idx[self.cut_of_sample[idx] == cut]  # host memory: no read of the device
            if len(sel):
                on = sel.to(self.device)
                parts.append((cut, x[self.local[sel].to(self.device)], self.y[on], self.w[on]))
        return tiered.step_at_cuts(self.trainer, parts, model, tag)
