"""Semi-SFL's premise, checked centrally (issue 28, item 2): on the same model, data and augmentations as
configs/semisfl/fmnist.yaml, does unlabelled data add accuracy at all when there is no split and no client?

    .venv/bin/python docs/results/semisfl_premise.py [--labels 40 100 250] [--seeds 0 1 2] [--steps 3000] [--jobs 2]

Two arms per (labels, seed), one process each, cached as JSON under docs/results/.semisfl_premise/:

- **supervised**: Semi-SFL's CNN (``semisfl_cnn``, 28x28 Fashion-MNIST) trained on the labelled set only, weak views
  (flip and crop) or with ``--lview strong`` the strong ones Semi-SFL's server trains on, batch ``--batch``;
- **fixmatch**: the same, plus each step an unlabelled batch of ``--mu`` x ``--batch`` images: an EMA teacher
  (decay ``--gamma``, eval mode) labels their weak views, and the student's cross-entropy on their strong views
  (RandAugment + cutout) counts where the teacher's confidence reaches ``--tau`` (FixMatch's loss, Sohn et al.
  2020, with Semi-SFL's teacher as its code builds it: ``pseudo_label_ce``, ``ema_update``, ``teacher_mode`` and
  ``Augmenter`` are raysplit's own, the ones the split method runs).

The labelled set is the one ``data.n_labeled`` draws for the seed (``labeled_split``, the same indices); every other
training image is unlabelled; the test set is Fashion-MNIST's 10,000 images. Optimizer as the config's: SGD lr 0.02,
Nesterov momentum 0.9, weight decay 5e-4, cosine to 0.005 over the steps. Prints per labels count the final test
accuracy of each arm (median [min, max] over seeds, the student; the teacher's is in the cache) and fixmatch minus
supervised paired by seed. One thread per run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from _runs import ROOT, keep, median_range, restore, spec_digest

HERE = Path(__file__).resolve().parent
OUT = HERE / ".semisfl_premise"


def labelled_indices(y: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The labelled set the split method draws for ``data.n_labeled: n`` and ``seed`` (raysplit's own
    ``labeled_split`` with the generator ``experiment`` seeds it with), so both arms and Semi-SFL share it."""
    from raysplit.data.partition import labeled_split

    return np.sort(labeled_split(y, n, np.random.default_rng([seed, 4]))[0])


def run(arm: str, labels: int, seed: int, steps: int, batch: int, mu: int, tau: float, gamma: float,
        lam: float, every: int, lview: str = "weak") -> dict:
    import copy

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from raysplit.algorithms.semisfl import ema_update, pseudo_label_ce, teacher_mode
    from raysplit.data.augment import Augmenter
    from raysplit.data.datasets import load_fashion_mnist, to_tensor
    from raysplit.models.core import build_model

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    data = load_fashion_mnist()
    spec = data.spec
    lab = labelled_indices(data.y_train, labels, seed)
    unl = np.setdiff1d(np.arange(len(data.y_train)), lab)
    aug = Augmenter(spec)
    student = build_model("semisfl_cnn", spec.num_classes, spec.input_shape)
    teacher = copy.deepcopy(student)
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.02, momentum=0.9, nesterov=True, weight_decay=5e-4)
    rng = np.random.default_rng(seed + 1000)
    x_test = to_tensor(data.x_test, spec)
    y_test = torch.as_tensor(data.y_test)

    def accuracy(model) -> float:
        with torch.no_grad(), teacher_mode(model):
            pred = torch.cat([model(x_test[i:i + 1000]).argmax(1) for i in range(0, len(x_test), 1000)])
        return float((pred == y_test).float().mean())

    curve, masks = [], []
    for step in range(steps):
        lr = 0.005 + 0.5 * (0.02 - 0.005) * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr
        i = rng.choice(lab, batch, replace=len(lab) < batch)
        xb = aug(data.x_train[i], lview)
        loss = F.cross_entropy(student(xb), torch.as_tensor(data.y_train[i]))
        if arm == "fixmatch":
            u = rng.choice(unl, mu * batch, replace=False)
            with torch.no_grad(), teacher_mode(teacher):
                t_logits = teacher(aug(data.x_train[u], "weak"))
            lu, _, mask = pseudo_label_ce(student(aug(data.x_train[u], "strong")), t_logits, tau)
            loss = loss + lam * lu
            masks.append(float(mask.mean()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema_update(teacher, student, min(1 - 1 / (step + 1), gamma))
        if (step + 1) % every == 0 or step + 1 == steps:
            curve.append((step + 1, accuracy(student), accuracy(teacher),
                          float(np.mean(masks[-every:])) if masks else 0.0))
    return {"arm": arm, "labels": labels, "seed": seed, "steps": steps, "accuracy": curve[-1][1],
            "teacher_accuracy": curve[-1][2], "curve": curve}


def cached(job: tuple, args) -> dict:
    arm, labels, seed = job
    view = "" if args.lview == "weak" else f"_lv{args.lview}"
    # _split: labeled_split's set
    out = OUT / f"{arm}_l{labels}_s{seed}_t{args.steps}_b{args.batch}_mu{args.mu}_split{view}.json"
    spec = {"arm": arm, "labels": labels, "seed": seed, **{k: getattr(args, k) for k in (
        "steps", "batch", "mu", "tau", "gamma", "lam", "every", "lview")}}
    if restore(out, digest=spec_digest(spec)):  # the cache, or the committed record of the same run
        return json.loads(out.read_text())
    res = run(arm, labels, seed, args.steps, args.batch, args.mu, args.tau, args.gamma, args.lam, args.every,
              args.lview)
    keep(out, "semisfl-premise", f"{arm} labels {labels} seed {seed}", spec, res)
    print(f"{arm:10s} labels {labels:4d} seed {seed}: student {100 * res['accuracy']:.2f} "
          f"teacher {100 * res['teacher_accuracy']:.2f}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--labels", type=int, nargs="*", default=[40, 100, 250])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--mu", type=int, default=7, help="unlabelled batch = mu x batch (FixMatch's mu)")
    ap.add_argument("--tau", type=float, default=0.95)
    ap.add_argument("--gamma", type=float, default=0.99, help="EMA decay of the teacher")
    ap.add_argument("--lam", type=float, default=1.0, help="weight of the unlabelled loss")
    ap.add_argument("--lview", choices=("weak", "strong"), default="weak",
                    help="view of the labelled batches: weak (FixMatch) or strong (what Semi-SFL's server trains on, "
                    "server_views [strong, strong])")
    ap.add_argument("--every", type=int, default=250, help="steps between test evaluations")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    jobs = [(arm, n, s) for s in args.seeds for n in args.labels for arm in ("supervised", "fixmatch")]
    with ProcessPoolExecutor(args.jobs) as pool:
        done = dict(zip(jobs, pool.map(cached, jobs, [args] * len(jobs))))
    print("\n| labels | supervised | FixMatch-style | teacher (FixMatch) | FixMatch minus supervised, paired by seed "
          "| per seed | mask rate at the end |\n|---|---|---|---|---|---|---|")
    for n in args.labels:
        sup = [100 * done[("supervised", n, s)]["accuracy"] for s in args.seeds]
        fm = [100 * done[("fixmatch", n, s)]["accuracy"] for s in args.seeds]
        te = [100 * done[("fixmatch", n, s)]["teacher_accuracy"] for s in args.seeds]
        d = [b - a for a, b in zip(sup, fm)]
        mask = [done[("fixmatch", n, s)]["curve"][-1][3] for s in args.seeds]
        print(f"| {n} | {median_range(sup)} | {median_range(fm)} | {median_range(te)} | {median_range(d, '+.2f')} | "
              f"{', '.join(f'{x:+.2f} (seed {s})' for s, x in zip(args.seeds, d))} | {median_range(mask)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
