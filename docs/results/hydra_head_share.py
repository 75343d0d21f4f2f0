"""Head share of raysplit's MobileNetV1 (CIFAR-sized inputs) at each candidate ``cut_b``: what fraction of the
server part (part-2 = blocks[cut_a:]) the heads (part-2b = blocks[cut_b:]) hold, in parameters and in forward
FLOPs per 32x32 image (torch.utils.flop_counter). No training; a few seconds.

    python docs/results/hydra_head_share.py          # prints the Markdown table in hydra.md
    python docs/results/hydra_head_share.py --width 0.25 --input 1 28 28   # configs/hydra/fmnist_mobilenet.yaml

The paper calls its small heads "the last 2 layers"; Hydra's scripts use cut_a = 4, cut_b = 23, and the authors'
model file, which fixes what their indices mean, was never committed (seed-code.md §2.2). The table is kept as a
committed record (docs/results/records/hydra_costs/, ``_runs.keep``, kind script), rewritten at every run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import keep  # noqa: E402

from raysplit.models import build_model  # noqa: E402

CUT_A = 4
COSTS = Path(__file__).resolve().parent / ".hydra_costs"  # the counts' caches (ignored); records/hydra_costs/


def flops(module: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    with FlopCounterMode(display=False) as fc:
        y = module(x)
    return fc.get_total_flops(), y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=float, default=1.0, help="MobileNetV1's width_mult")
    ap.add_argument("--input", type=int, nargs=3, default=[3, 32, 32], metavar=("C", "H", "W"))
    a = ap.parse_args()
    model = build_model("mobilenet_v1", num_classes=10, input_shape=tuple(a.input),
                        width_mult=a.width).eval()
    names = model.block_names
    per_block, x = [], torch.zeros(1, *a.input)
    with torch.no_grad():
        for block in model.blocks:
            f, x = flops(block, x)
            per_block.append((sum(p.numel() for p in block.parameters()), f))
    server_p = sum(p for p, _ in per_block[CUT_A:])
    server_f = sum(f for _, f in per_block[CUT_A:])
    print(f"cut_a = {CUT_A}: server part = blocks {CUT_A}..{len(names) - 1} ({names[CUT_A]} .. {names[-1]}), "
          f"{server_p / 1e6:.2f} M parameters, {server_f / 1e6:.1f} MFLOPs per image\n")
    print("| cut_b | heads (part-2b) | head parameters | share of server parameters | share of server FLOPs |")
    print("|---|---|---|---|---|")
    rows = []
    for cut_b in range(19, len(names)):
        hp = sum(p for p, _ in per_block[cut_b:])
        hf = sum(f for _, f in per_block[cut_b:])
        heads = ", ".join(n for n in names[cut_b:])
        rows.append({"cut_b": cut_b, "heads": heads, "head_params": hp, "head_flops": hf})
        print(f"| {cut_b} | {heads} | {hp / 1e6:.3f} M | {100 * hp / server_p:.1f} % | {100 * hf / server_f:.1f} % |")
    spec = {"width": a.width, "input": list(a.input), "cut_a": CUT_A}
    keep(COSTS / f"head_share_w{a.width}_{'x'.join(map(str, a.input))}.json", "hydra-head-share",
         f"MobileNetV1 x{a.width} at {'x'.join(map(str, a.input))}", spec,
         {"server_params": server_p, "server_flops": server_f, "rows": rows})


if __name__ == "__main__":
    main()
