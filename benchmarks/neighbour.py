"""Does a busy neighbour slow a computing process on this machine? (issue 29 item 4: where cnn_small's rounds go)

Over compiled graphs an idle actor polls its channel, so while one actor computes a step another spins on the
other core. This times cnn_small's training step (forward, backward and SGD on a batch of 64 Fashion-MNIST-shaped
images, one torch thread, in one process, no Ray) alone and with a neighbour process that spins in a Python loop,
alternating the two within each repeat so that both see the same machine.

    .venv/bin/python benchmarks/neighbour.py [--repeats 5] [--steps 100]

Prints ms per step (min/median/max over repeats) and the ratio with the neighbour to without, per repeat.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch
import torch.nn.functional as F
from common import fmt, load, mmm

from raysplit.models import build_model


def spin(ready, stop) -> None:
    ready.set()
    while not stop.is_set():
        pass


def steps_ms(model, opt, x, y, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("cnn_small", 10, (1, 28, 28))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    steps_ms(model, opt, x, y, 20)  # warm-up
    ctx = mp.get_context("spawn")
    alone, beside = [], []
    load_at_start = load()
    for _ in range(a.repeats):
        alone.append(steps_ms(model, opt, x, y, a.steps))
        ready, stop = ctx.Event(), ctx.Event()
        p = ctx.Process(target=spin, args=(ready, stop))
        p.start()
        ready.wait(timeout=60)  # a spawned child imports this module (torch) first: time only once it spins
        beside.append(steps_ms(model, opt, x, y, a.steps))
        stop.set()
        p.join(timeout=10)
    ratio = [b / s for s, b in zip(alone, beside)]
    print(f"load average (1/5/15 min) {load_at_start} at the start; {os.cpu_count()} CPUs; "
          f"{a.repeats} repeats of {a.steps} steps")
    print("| cnn_small step, batch 64, 1 thread | ms/step alone | ms/step beside a spinning process | beside / alone |")
    print("|---|---|---|---|")
    print(f"| in process, no Ray | {fmt(mmm(alone))} | {fmt(mmm(beside))} | {fmt(mmm(ratio))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
