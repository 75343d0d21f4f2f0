"""raysplit's ``cnn_small`` in CycleSL's model format (a ``torch.nn.Module`` whose ``seq`` is the block list), for
the parity runner (benchmarks/peers/cyclesl/run.py copies this file into a temporary copy of their repository).

Their ``model_split(model, cut)`` is ``model.seq[:cut]`` / ``model.seq[cut:]``, so THEIR cut integer k is raysplit's
cut index k (``SplitModel.split(k)``). ``cnn_small`` (raysplit/models/small.py) for 1x28x28 and 10 classes has the
blocks 0 conv1 | 1 conv2 | 2 fc1 | 3 fc2; configs/cyclesl/fmnist.yaml's ``model.cut: conv1`` is cut 1 (conv1 on the
client; conv2, fc1, fc2 on the server).

The weights are drawn when their ``get_clients_and_server`` builds the model, after their ``seed(args.seed)``
(torch's global generator), with torch's default initialisation as in raysplit; every client starts from the same
client part (they deep-copy it), as in raysplit.
"""

from __future__ import annotations

import os

import torch


class CNN_small_raysplit(torch.nn.Module):
    def __init__(self, image_size: int = 28, num_class: int = 10) -> None:
        super().__init__()
        from raysplit.models import build_model

        arch = os.environ.get("CYCLESL_PARITY_ARCH", "cnn_small")
        full = build_model(arch, int(num_class), (1, int(image_size), int(image_size)))
        self.seq = torch.nn.Sequential(*list(full.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)
