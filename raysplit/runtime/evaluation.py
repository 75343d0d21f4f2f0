"""The one evaluation loop (predictions and loss over a test set in batches)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from raysplit.data import DataSpec, to_tensor
from raysplit.models import end_to_end



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
                    logits: Callable[[torch.Tensor], torch.Tensor], tally: EvalTally, device="cpu") -> EvalTally:
    """The one evaluation loop: ``logits`` of every batch of ``x``, cross-entropy summed into ``tally``."""
    for i in range(0, len(y), batch_size):
        xb = to_tensor(x[i:i + batch_size], data_spec).to(device)
        yb = torch.tensor(np.asarray(y[i:i + batch_size]), dtype=torch.long, device=device)  # a copy: y may be read-only
        out = logits(xb)
        tally.loss += F.cross_entropy(out, yb, reduction="sum").item()
        tally.ys.append(yb.cpu().numpy())
        tally.preds.append(out.argmax(1).cpu().numpy())
    return tally



@torch.no_grad()
def evaluate_own(parts: tuple[torch.nn.Module, torch.nn.Module], data, state_of: Callable[[int], dict],
                 cids: list[int], server_state: dict, batch_size: int,
                 device="cpu") -> tuple[np.ndarray, np.ndarray, float]:
    """Each of ``cids`` that ``data`` (a :class:`~raysplit.runtime.client_data.ClientData`) holds test samples of:
    its own test split through its own client model (``state_of(cid)``) and the server model ``server_state``;
    ``parts``: fresh (client, server) modules to load them into, run on ``device``."""
    client, server = (m.to(device) for m in parts)
    server.load_state_dict(server_state)
    client.eval(), server.eval()
    tally = EvalTally()
    for c in (int(c) for c in cids):
        idx = data.test_idx.get(c)
        if idx is None or len(idx) == 0:
            continue
        client.load_state_dict(state_of(c))
        predict_batches(data.x[idx], data.y[idx], data.spec, batch_size, end_to_end(client, server), tally, device)
    return tally.result()


class ServerEvaluation:
    """The server's evaluation (a component of the server host; a server rule's ``ctx.evaluation``): the global
    test set (``test``: ``{"x", "y"}`` as stored), the module a client's model is loaded into to encode it
    (``client``, a fresh client part; a rule whose clients hold more than the client part installs its own with
    :meth:`replace_client`) and the one evaluation loop over it (:meth:`predict`). ``encoder()``: the module whose
    output a client sends (the server rule's ``client_encoder``)."""

    def __init__(self, test: dict, data_spec: DataSpec, batch_size: int, device, client: torch.nn.Module,
                 encoder: Callable[[], torch.nn.Module] | None = None):
        self.x, self.y = test["x"], test["y"]
        self.data_spec, self.batch_size, self.device = data_spec, batch_size, device
        self.client = client
        self.encoder = encoder or (lambda: self.client)

    def replace_client(self, module: torch.nn.Module) -> None:
        """Clients' models are ``module``'s kind (Ampere's device block with its auxiliary net): evaluation and
        aggregation load them into it."""
        self.client = module

    def predict(self, logits: Callable[[torch.Tensor], torch.Tensor]) -> tuple[np.ndarray, np.ndarray, float]:
        """The global test set through ``logits``: labels, predictions and the summed cross-entropy."""
        tally = predict_batches(self.x, self.y, self.data_spec, self.batch_size, logits, EvalTally(), self.device)
        return np.asarray(self.y), tally.result()[1], tally.loss

    @torch.no_grad()
    def evaluate(self, client_state: dict, server: torch.nn.Module) -> tuple[np.ndarray, np.ndarray, float]:
        """The client model ``client_state`` (tensors), encoded by :attr:`encoder`, with ``server`` on the global
        test set (a U-shaped client's tail after the server's middle)."""
        client, encoder = self.client, self.encoder()
        client.load_state_dict(client_state)
        client.eval(), server.eval()
        out = self.predict(end_to_end(client, server, encoder))
        server.train()
        return out

    def encoded(self, client_state, rng: np.random.Generator, batches: int):
        """``batches`` random test batches (``eval.batch_size`` samples each, fewer where the test set is smaller,
        drawn by ``rng`` without replacement, in index order) encoded by the client model ``client_state`` (a
        message) in evaluation mode: ``(features, labels)`` on the server's device, without a graph."""
        client = self.client
        client.load_state_dict(client_state.tensors())
        client.eval()
        n = len(self.y)
        for _ in range(batches):
            idx = np.sort(rng.choice(n, size=min(self.batch_size, n), replace=False))
            x = to_tensor(np.asarray(self.x[idx]), self.data_spec).to(self.device)
            with torch.no_grad():
                feats = client(x)
            yield feats, torch.as_tensor(np.asarray(self.y)[idx], dtype=torch.long, device=self.device)
