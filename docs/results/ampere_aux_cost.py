"""Ampere's on-device cost per batch: the device block alone (what SplitFed's devices run) against the device block
with Ampere's auxiliary net (what Ampere's devices run in the device phase), forward + backward FLOPs from
torch.utils.flop_counter, in the setting of configs/ampere/fmnist.yaml (cnn_small cut after conv1, batch 32,
28x28 Fashion-MNIST images) at each auxiliary ratio of the page's sweep, and in the CIFAR-10 settings of the
paper's models (configs/ampere/cifar10_mobilenet.yaml, cifar10_vit.yaml: 32x32 images, batch 64, ratio 0.5).
No data and no training; under a minute. Each case's counts are kept as a committed record
(docs/results/records/ampere_costs/, ``_runs.keep``, kind script), rewritten at every run.

    python docs/results/ampere_aux_cost.py            # prints the Markdown table in ampere.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import keep  # noqa: E402

from raysplit.algorithms.ampere import with_auxiliary  # noqa: E402
from raysplit.models import build_model  # noqa: E402

BATCH = 32
COSTS = Path(__file__).resolve().parent / ".ampere_costs"  # the counts' caches (ignored); records/ampere_costs/


def train_flops(forward) -> int:
    """Forward + backward FLOPs of one step of ``forward() -> loss``."""
    with FlopCounterMode(display=False) as fc:
        forward().backward()
    return fc.get_total_flops()


def _params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def measure(name: str, cut: str, shape: tuple, batch: int, ratio: float) -> tuple:
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, input_shape=shape)
    device, server = model.split(cut)
    both = with_auxiliary(model, device, server, cut, ratio)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    act = device(x).detach()
    device_only = train_flops(lambda: device(x).mul(torch.randn_like(act)).sum())  # SplitFed: a gradient arrives
    whole = train_flops(lambda: F.cross_entropy(both(x), y))
    return device_only, whole, _params(device), _params(both[1]), _params(server)


def main() -> None:
    cases = [("cnn_small", "conv1", (1, 28, 28), BATCH, r) for r in (0.25, 0.5, 0.75, 1.0)]
    cases += [("mobilenet_v3_large", "features.0", (3, 32, 32), 64, 0.5), ("vit_small", "layer1", (3, 32, 32), 64, 0.5)]
    print("forward + backward MFLOPs per batch on a device\n")
    print("| model, cut | batch | aux ratio | device block alone (SplitFed) | device block + aux net (Ampere) "
          "| Ampere / SplitFed per batch | device params | aux params | server params |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, cut, shape, batch, ratio in cases:
        d, w, dp, ap, sp = got = measure(name, cut, shape, batch, ratio)
        spec = {"model": name, "cut": cut, "input": list(shape), "batch": batch, "ratio": ratio}
        keep(COSTS / f"aux_{name}_{cut}_b{batch}_r{ratio}.json", "ampere-aux-cost", f"{name} {cut} ratio {ratio}",
             spec, dict(zip(("device_flops", "device_aux_flops", "device_params", "aux_params", "server_params"), got)))
        print(f"| {name}, {cut} | {batch} | {ratio} | {d / 1e6:.1f} | {w / 1e6:.1f} | {w / d:.2f}x | {dp:,} | {ap:,} "
              f"| {sp:,} |")


if __name__ == "__main__":
    main()
