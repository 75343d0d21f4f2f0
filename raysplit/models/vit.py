"""A small Vision Transformer (torchvision's ``EncoderBlock``), split at block granularity, for Ampere's and GAS's
transformer experiments."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .core import SplitModel, register_model


class PatchEmbedding(nn.Module):
    """Patches -> tokens: ``Conv(C -> dim, patch, stride patch)``, a class token first, learned positions."""

    def __init__(self, channels: int, image: int, patch: int, dim: int, dropout: float = 0.0):
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.positions = nn.Parameter(torch.empty(1, tokens, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        t = self.proj(x).flatten(2).transpose(1, 2)  # (B, patches, dim)
        t = torch.cat([self.class_token.expand(len(t), -1, -1), t], dim=1)
        return self.dropout(t + self.positions)


class ClassTokenHead(nn.Module):
    """LayerNorm, the class token, a linear classifier."""

    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, t):
        return self.fc(self.norm(t)[:, 0])


@register_model(
    "vit_small", input_shape=(3, 32, 32), default_cut="layer1",
    description="A small ViT (patch 4, width 192, 6 encoder blocks of 3 heads, MLP 384): embed | layer1 .. layer6 | "
                "head; default cut layer1 (after the first transformer block).",
)
def vit_small(num_classes: int, input_shape: Sequence[int], patch: int = 4, dim: int = 192, depth: int = 6,
              heads: int = 3, mlp_dim: int = 384, dropout: float = 0.0) -> SplitModel:
    """Blocks: ``embed`` (:class:`PatchEmbedding`), ``layer1`` .. ``layer{depth}`` (torchvision ``EncoderBlock``:
    pre-norm self-attention and MLP with residuals), ``head`` (:class:`ClassTokenHead`). For 32x32 inputs: 64 patch
    tokens plus the class token, each ``dim`` wide. Sized for CPU experiments; no paper fixes this exact model."""
    from torchvision.models.vision_transformer import EncoderBlock  # here: torchvision costs ~2.7 s a process

    c, h = input_shape[0], input_shape[-1]
    blocks: list[tuple[str, nn.Module]] = [("embed", PatchEmbedding(c, h, patch, dim, dropout))]
    blocks += [(f"layer{i + 1}", EncoderBlock(heads, dim, mlp_dim, dropout, 0.0)) for i in range(depth)]
    blocks.append(("head", ClassTokenHead(dim, num_classes)))
    return SplitModel(blocks)
