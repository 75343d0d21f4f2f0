"""The server's evaluation: the global test set through the one evaluation loop."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from raysplit.data import DataSpec, to_tensor
from raysplit.models import end_to_end
from raysplit.runtime.evaluation import EvalTally, predict_batches


class ServerEvaluation:
    """The server's evaluation (a component of the server host; a server rule's ``ctx.evaluation``): the global
    test set (``test``: ``{"x", "y"}`` as stored), the module a client's model is loaded into to encode it
    (``client``, a fresh client part; a rule whose clients hold more than the client part installs its own with
    :meth:`replace_client`) and the one evaluation loop over it (:meth:`predict`). ``encoder()``: the module whose
    output a client sends (the server rule's ``client_encoder``); ``language_model``: the loop tallies next
    tokens (:func:`~raysplit.runtime.evaluation.predict_batches`)."""

    def __init__(self, test: dict, data_spec: DataSpec, batch_size: int, device, client: torch.nn.Module,
                 encoder: Callable[[], torch.nn.Module] | None = None, language_model: bool = False):
        self.x, self.y = test["x"], test["y"]
        self.language_model = language_model
        self.data_spec, self.batch_size, self.device = data_spec, batch_size, device
        self.client = client
        self.encoder = encoder or (lambda: self.client)

    def replace_client(self, module: torch.nn.Module) -> None:
        """Clients' models are ``module``'s kind (Ampere's device block with its auxiliary net): evaluation and
        aggregation load them into it."""
        self.client = module

    def predict(self, logits: Callable[[torch.Tensor], torch.Tensor]) -> tuple[np.ndarray, np.ndarray, float]:
        """The global test set through ``logits``: labels, predictions and the summed cross-entropy (a language
        model's: its next tokens)."""
        tally = predict_batches(self.x, self.y, self.data_spec, self.batch_size, logits, EvalTally(), self.device,
                                self.language_model)
        ys, preds, loss = tally.result()
        return (ys if self.language_model else np.asarray(self.y)), preds, loss

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
