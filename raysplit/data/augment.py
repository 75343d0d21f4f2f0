"""Weak and strong augmentation of image batches (FixMatch's views, as Semi-SFL's code uses them; seed-code.md
§3.6), with torchvision's transforms, applied per sample to the stored uint8 images before normalisation.

- ``weak``: random horizontal flip (not for SVHN's digits, as in FixMatch), then a random crop of the image size
  after reflect-padding by 12.5 %;
- ``strong``: ``weak``, then ``RandAugment(num_ops=2, magnitude=10)`` (torchvision's operation pool) and a
  cutout of half the image size filled with grey (FixMatch's ``CutoutAbs(16)`` for 32-pixel images);
- ``plain``: no augmentation.

Works for 1-channel and 3-channel images (``(N, C, H, W)`` uint8). Randomness comes from torch's global generator:
callers seed it (the Semi-SFL hosts do, per client and step).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from .datasets import DataSpec, to_tensor

View = Literal["plain", "weak", "strong"]
NO_FLIP = ("svhn",)  # digits: a mirrored 2 is no 2


class Augmenter:
    """Views of raw image batches for one dataset (``DataSpec`` of kind ``image``)."""

    def __init__(self, spec: DataSpec):
        if spec.kind != "image":
            raise ValueError(f"augmentation needs images; {spec.name} holds {spec.kind} data")
        from torchvision.transforms import v2  # here, not at import: torchvision costs ~2.7 s a process

        self.spec = spec
        c, h, w = spec.input_shape
        flip = [] if spec.name in NO_FLIP else [v2.RandomHorizontalFlip()]
        self.weak_t = v2.Compose(flip + [v2.RandomCrop((h, w), padding=int(0.125 * h), padding_mode="reflect")])
        self.rand_augment = v2.RandAugment(num_ops=2, magnitude=10)
        self.cut = max(1, h // 2)

    def _cutout(self, img: torch.Tensor) -> torch.Tensor:
        h, w = img.shape[-2:]
        cy, cx = int(torch.randint(h, ())), int(torch.randint(w, ()))
        y0, y1 = max(0, cy - self.cut // 2), min(h, cy + self.cut // 2)
        x0, x1 = max(0, cx - self.cut // 2), min(w, cx + self.cut // 2)
        img = img.clone()
        img[..., y0:y1, x0:x1] = 127
        return img

    def raw(self, x: np.ndarray, view: View) -> torch.Tensor:
        """Augmented uint8 batch (N, C, H, W)."""
        t = torch.as_tensor(np.array(x, copy=True)).reshape(len(x), *self.spec.input_shape)
        if view == "plain":
            return t
        out = []
        for img in t:
            img = self.weak_t(img)
            if view == "strong":
                img = self._cutout(self.rand_augment(img))
            out.append(img)
        return torch.stack(out)

    def __call__(self, x: np.ndarray, view: View) -> torch.Tensor:
        """Augmented and normalised model input."""
        return to_tensor(self.raw(x, view).numpy(), self.spec)
