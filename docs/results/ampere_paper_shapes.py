"""Ampere's traffic and on-device compute at the paper's own shapes (issue 73, item 4): quantities that do not depend
on training, counted on inputs of the right shape, with no data and no training.

The paper's setting (../../../shared/papers/ampere.txt §5.1, Tables IV and V): CIFAR-10 (50,000 training images of
3x32x32) over 120 devices, the models split after their first layer (p = 1), the auxiliary net at ratio 0.5. Its
text gives no batch size; 64 is configs/ampere/cifar10_mobilenet.yaml's. 10 % of each device's images are held out
for validation, as the configs do (the paper names early stopping on validation accuracy, not the split). For each
of raysplit's two paper models (MobileNetV3-Large at features.0, ViT-S at layer1):

- bytes per device, counted as the runtime counts them (raysplit/runtime/transport.py: a message's arrays by their
  shapes and dtypes; a model as its packed state_dict): SplitFed (and PiPar, which moves the same data) per epoch,
  the activations and labels up and the gradients down for every training image plus the device block down and up;
  Ampere per device round the device block and the auxiliary net down and up, and once the activations and labels
  of every image (training and validation) up;
- forward + backward FLOPs per image on a device (torch.utils.flop_counter, docs/results/ampere_aux_cost.py's
  measure): the device block alone (SplitFed) and with the auxiliary net (Ampere's device phase);
- both to convergence at the paper's own epoch counts (Table IV, CIFAR-10: SplitFed 200 and Ampere's device phase
  55 for MobileNet-L; 131 and 81 for ViT-S), against the paper's Table V (SplitFed 61.03 and 245.06 GB per device).

    python docs/results/ampere_paper_shapes.py        # prints the tables in notes/ampere-cost.md; under a minute

Each model's counts are kept as a committed record (docs/results/records/ampere_costs/, kind script).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import keep  # noqa: E402
from ampere_aux_cost import COSTS, train_flops  # noqa: E402

from raysplit.algorithms.ampere import with_auxiliary  # noqa: E402
from raysplit.models import build_model  # noqa: E402
from raysplit.runtime import transport  # noqa: E402

SHAPE, IMAGES, DEVICES, BATCH, RATIO, VALIDATION = (3, 32, 32), 50_000, 120, 64, 0.5, 0.1
# (model, cut, the paper's name, Table IV's epochs to converge on CIFAR-10: SplitFed, Ampere's device phase,
#  Table V's SplitFed GB per device)
MODELS = [("mobilenet_v3_large", "features.0", "MobileNet-L", 200, 55, 61.03),
          ("vit_small", "layer1", "ViT-S", 131, 81, 245.06)]


def state_bytes(module: torch.nn.Module) -> int:
    return transport.state_nbytes(transport.pack_state(module.state_dict()))


def shapes(name: str, cut: str) -> dict:
    """Per-device bytes and per-image FLOPs of one model at the paper's shapes."""
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, input_shape=SHAPE)
    device, server = model.split(cut)
    both = with_auxiliary(model, device, server, cut, RATIO)
    x, y = torch.randn(BATCH, *SHAPE), torch.randint(0, 10, (BATCH,))
    act = device(x).detach()
    per_image_up = (transport.nbytes(transport.pack(act)) + transport.nbytes(transport.pack(y))) / BATCH
    per_image_down = transport.nbytes(transport.pack(act)) / BATCH  # the gradient has the activation's shape
    n = IMAGES / DEVICES
    train = n * (1 - VALIDATION)
    device_only = train_flops(lambda: device(x).mul(torch.randn_like(act)).sum()) / BATCH
    with_aux = train_flops(lambda: torch.nn.functional.cross_entropy(both(x), y)) / BATCH
    return {"splitfed_epoch": train * (per_image_up + per_image_down) + 2 * state_bytes(device),
            "ampere_round": 2 * state_bytes(both), "ampere_once": n * per_image_up,
            "flops_splitfed": device_only * train, "flops_ampere": with_aux * train}


def main() -> None:
    print(f"At the paper's shapes: CIFAR-10 {SHAPE}, {IMAGES:,} images over {DEVICES} devices "
          f"({IMAGES / DEVICES:.0f} each, {100 * VALIDATION:.0f} % for validation), batch {BATCH}, aux ratio {RATIO}\n")
    print("| model, cut | SplitFed MB per device an epoch | Ampere MB per device a device round | Ampere MB per device "
          "once (activations) | SplitFed GFLOP per device an epoch | Ampere GFLOP per device a device round |")
    print("|---|---|---|---|---|---|")
    got = {}
    for name, cut, paper, *_ in MODELS:
        s = got[name] = shapes(name, cut)
        spec = {"model": name, "cut": cut, "input": list(SHAPE), "images": IMAGES, "devices": DEVICES,
                "batch": BATCH, "ratio": RATIO, "validation": VALIDATION}
        keep(COSTS / f"paper_shapes_{name}_{cut}.json", "ampere-paper-shapes", f"{paper} at the paper's shapes", spec, s)
        print(f"| {paper} ({name}, {cut}) | {s['splitfed_epoch'] / 1e6:.2f} | {s['ampere_round'] / 1e6:.3f} | "
              f"{s['ampere_once'] / 1e6:.2f} | {s['flops_splitfed'] / 1e9:.3f} | {s['flops_ampere'] / 1e9:.3f} |")
    print("\nTo convergence at the paper's epoch counts (Table IV, CIFAR-10), against its Table V\n")
    print("| model | epochs: SplitFed, Ampere device phase | SplitFed GB per device (Table V) | Ampere GB per device "
          "| traffic saved (%) | on-device compute, Ampere / SplitFed |")
    print("|---|---|---|---|---|---|")
    for name, cut, paper, e_sfl, e_amp, table_v in MODELS:
        s = got[name]
        sfl, amp = e_sfl * s["splitfed_epoch"], e_amp * s["ampere_round"] + s["ampere_once"]
        ratio = e_amp * s["flops_ampere"] / (e_sfl * s["flops_splitfed"])
        print(f"| {paper} | {e_sfl}, {e_amp} | {sfl / 1e9:.2f} ({table_v}) | {amp / 1e9:.3f} | "
              f"{100 * (1 - amp / sfl):.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
