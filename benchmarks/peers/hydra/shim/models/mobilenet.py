"""Stand-in for Hydra's missing ``models/mobilenet.py`` (jtirana98/Hydra_tackling-CF-in-SFL never committed it).

Written for the raysplit parity runner (benchmarks/peers/hydra/run.py), which copies this file into a temporary copy
of their repository as ``models/mobilenet.py``. It implements the one call their ``get_models.py`` makes,
``MobileNetV1(in_channels, num_classes, start, end)``, with raysplit's block lists, so that THEIR cut integers are
raysplit's cut indices:

    MobileNetV1(C, L, -1, k)  = blocks[:k]      (the client part, = raysplit model.split(k)[0])
    MobileNetV1(C, L, k, -1)  = blocks[k:]      (the server part / the head)
    MobileNetV1(C, L, a, b)   = blocks[a:b]     (Hydra's part-2a)

``start = -1`` means "from the first block", ``end = -1`` "to the last block" (get_models.py passes -1 that way).

The architecture is raysplit's registered model named by the environment variable ``HYDRA_PARITY_ARCH``
(default ``cnn_gap``), built with ``raysplit.models.build_model(arch, num_classes, (C, H, W))``; ``H = W`` comes from
``HYDRA_PARITY_HW`` (default 28, Fashion-MNIST). Block indices:

* ``cnn_gap`` (configs/hydra/fmnist_gap.yaml): 0 conv1 | 1 conv2 | 2 conv3 | 3 conv4 (+GAP) | 4 fc.
  raysplit ``model.cut: conv1`` = cut 1; ``cut_b: conv3`` = 3 (heads conv4+fc, 62 % of the server);
  ``cut_b: conv4`` = 4 (heads fc, 1.1 %).
* ``mobilenet_v1`` (raysplit/models/mobilenets.py): 0 stem | 2i-1 dw_i | 2i pw_i (i = 1..13) | 27 pool | 28 fc.
  The paper's scripts' ``cut_a = 4, cut_b = 23`` then put stem, dw1, pw1, dw2 on the client and dw12..fc in the
  head. That indexing is raysplit's reading; the authors' own indexing is unknown (their file is missing).

Every call builds a whole model (fresh random weights) and keeps the requested slice, as a constructor that takes
``start``/``end`` would; get_models.py then copies the global parts' weights into the per-client copies itself.
"""

from __future__ import annotations

import os

from torch import nn


def MobileNetV1(in_channels, num_classes, start, end):  # their name
    from raysplit.models import build_model

    arch = os.environ.get("HYDRA_PARITY_ARCH", "cnn_gap")
    hw = int(os.environ.get("HYDRA_PARITY_HW", "28"))
    full = build_model(arch, int(num_classes), (int(in_channels), hw, hw))
    n = len(full.blocks)
    s = 0 if start == -1 else int(start)
    e = n if end == -1 else int(end)
    if not 0 <= s < e <= n:
        raise ValueError(f"MobileNetV1 shim: blocks [{start}, {end}) is empty or out of range for {arch} "
                         f"({n} blocks: {', '.join(full.block_names)})")
    return nn.Sequential(*list(full.blocks)[s:e])
