"""The one evaluation loop (predictions and loss over a test set in batches). For a language model
(``language_model``) a sample is a token block, its labels the block itself: what is tallied is every next token
that is a target (the targets ``y[:, 1:]`` but those :data:`~raysplit.lm_metrics.IGNORE_INDEX`, E2E's masked
prompts; the predictions at the same positions of ``0 .. T-2``) and the summed next-token NLL over them, so the loss
divided by the number of labels is the per-token loss (:func:`raysplit.lm_metrics.lm_eval_metrics`)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from raysplit.data import DataSpec, to_tensor
from raysplit.lm_metrics import IGNORE_INDEX, token_nll
from raysplit.models import end_to_end
from raysplit.models.tiers import entered


class EvalTally:
    """Labels, predictions and summed loss of an evaluation, accumulated batch by batch."""

    def __init__(self):
        self.ys: list[np.ndarray] = []
        self.preds: list[np.ndarray] = []
        self.loss = 0.0

    def result(self) -> tuple[np.ndarray, np.ndarray, float]:
        if not self.ys:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), 0.0
        return np.concatenate(self.ys), np.concatenate(self.preds), self.loss


@torch.no_grad()
def predict_batches(x: np.ndarray, y: np.ndarray, data_spec: DataSpec, batch_size: int,
                    logits: Callable[[torch.Tensor], torch.Tensor], tally: EvalTally, device="cpu",
                    language_model: bool = False) -> EvalTally:
    """The one evaluation loop: ``logits`` of every batch of ``x``, cross-entropy summed into ``tally`` (a
    language model's: per next token, module docstring)."""
    for i in range(0, len(y), batch_size):
        xb = to_tensor(x[i:i + batch_size], data_spec).to(device)
        yb = torch.tensor(np.asarray(y[i:i + batch_size]), dtype=torch.long, device=device)  # a copy: y may be read-only
        out = logits(xb)
        if language_model:
            tally.loss += token_nll(out, yb)[0].item()
            targets = yb[:, 1:].reshape(-1).cpu().numpy()
            scored = targets != IGNORE_INDEX
            tally.ys.append(targets[scored])
            tally.preds.append(out[:, :-1].argmax(-1).reshape(-1).cpu().numpy()[scored])
            continue
        tally.loss += F.cross_entropy(out, yb, reduction="sum").item()
        tally.ys.append(yb.cpu().numpy())
        tally.preds.append(out.argmax(1).cpu().numpy())
    return tally


@torch.no_grad()
def evaluate_own(parts: tuple[torch.nn.Module, torch.nn.Module], data, state_of: Callable[[int], dict],
                 cids: list[int], server_state: dict, batch_size: int, device="cpu",
                 client_of: Callable[[int], torch.nn.Module] | None = None,
                 cut_of: Callable[[int], int | None] = lambda cid: None,
                 language_model: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """Each of ``cids`` that ``data`` (a :class:`~raysplit.runtime.client.data.ClientData`) holds test samples of:
    its own test split through its own client model (``state_of(cid)``) and the server model ``server_state``;
    ``parts``: fresh (client, server) modules to load them into, run on ``device``. Clients with their own cuts:
    ``client_of(cid)`` a fresh client part of client ``cid``, the server entered at ``cut_of(cid)``."""
    client, server = (m.to(device) for m in parts)
    server.load_state_dict(server_state)
    client.eval(), server.eval()
    tally = EvalTally()
    at_cut: dict = {}  # tiered: one fresh part per cut, loaded with each client's weights in turn
    for c in (int(c) for c in cids):
        idx = data.test_idx.get(c)
        if idx is None or len(idx) == 0:
            continue
        if client_of is not None and cut_of(c) not in at_cut:
            at_cut[cut_of(c)] = client_of(c).to(device).eval()
        own = client if client_of is None else at_cut[cut_of(c)]
        own.load_state_dict(state_of(c))
        with entered(server, cut_of(c)):
            predict_batches(data.x[idx], data.y[idx], data.spec, batch_size, end_to_end(own, server), tally, device,
                            language_model)
    return tally.result()


