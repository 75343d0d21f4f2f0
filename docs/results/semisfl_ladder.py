"""Where Semi-SFL's unlabelled gain goes (issue 28, item 2): a ladder of central runs that turns FixMatch, step by
step, into the computation FedSwitch-SL (Semi-SFL without its clustering term) performs, at the budget of
configs/semisfl/fmnist.yaml, so the rung at which the gain over supervised-only disappears names the cause.

    .venv/bin/python docs/results/semisfl_ladder.py [--rungs sup joint alt ...] [--seeds 0 1 2] [--labels 100]

One process per (rung, seed), no Ray, no split: the same CNN (``semisfl_cnn``, its ``features`` cut separating the
encoder the clients train from the heads the server trains), the same labelled set (``labeled_split``, as
``data.n_labeled`` draws it), augmentations (raysplit's ``Augmenter``), pseudo-label loss (``pseudo_label_ce``), EMA
(``ema_update``), optimizer (SGD, Nesterov momentum 0.9, weight decay 5e-4, lr 0.02 cosine to 0.005 by round) and
budget per round (K_s = ``--ks`` labelled steps of ``--sbatch``; K_u = ``--ku`` unlabelled steps of M = ``--clients``
x ``--batch`` images) as the split runs. The rungs, each adding one of FedSwitch-SL's features to the one before:

- ``sup``: the K_s labelled steps only (supervised-only);
- ``joint``: FixMatch: every labelled step also takes K_u M B / K_s unlabelled images (the same number per round),
  one loss, one optimizer for the run, the EMA teacher after every step;
- ``alt``: the phases alternate as in Semi-SFL (K_s labelled steps, then K_u unlabelled steps of M B images, every
  layer updated by both), the EMA after every step of both;
- ``alt_ema``: the teacher moves only in the labelled phase (Semi-SFL's EMA placement);
- ``alt_fresh``: and a fresh optimizer for each phase of each round (the authors' code; momentum restarts);
- ``fed``: and the unlabelled phase as the split method runs it: M encoder copies (one per client, batch B, fresh
  optimizers, gradient times M as the code rescales it) under heads that step on the concatenated batch, the
  copies averaged into the encoder at the end of the phase (IID clients).

Prints the teacher's test accuracy per rung (median [min, max] over seeds; the split method evaluates its teacher),
the rung minus ``sup`` paired by seed, the mask rate and the purity of the confident pseudo-labels (their accuracy
against the true labels, which a central run may look at) in the last rounds. Cached as JSON under
docs/results/.semisfl_ladder/. One thread per run.
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
from semisfl_premise import labelled_indices

HERE = Path(__file__).resolve().parent
OUT = HERE / ".semisfl_ladder"
RUNGS = ("sup", "joint", "alt", "alt_ema", "alt_fresh", "fed")


def run(rung: str, labels: int, seed: int, a) -> dict:
    import copy

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from raysplit.algorithms.semisfl import ema_update, pseudo_label_ce, teacher_mode
    from raysplit.data.augment import Augmenter
    from raysplit.data.datasets import load_fashion_mnist, to_tensor
    from raysplit.models.core import build_model

    level = RUNGS.index(rung)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    data = load_fashion_mnist()
    spec = data.spec
    lab = labelled_indices(data.y_train, labels, seed)
    unl = np.setdiff1d(np.arange(len(data.y_train)), lab)
    aug = Augmenter(spec)
    enc, heads = build_model("semisfl_cnn", spec.num_classes, spec.input_shape).split("features")
    t_enc, t_heads = copy.deepcopy(enc), copy.deepcopy(heads)
    for p in [*t_enc.parameters(), *t_heads.parameters()]:
        p.requires_grad_(False)
    rng = np.random.default_rng(seed + 1000)
    x_test, y_test = to_tensor(data.x_test, spec), torch.as_tensor(data.y_test)
    ema_steps = 0

    def sgd(params, lr):
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)

    def ema():
        nonlocal ema_steps
        w = min(1 - 1 / (ema_steps + 1), a.gamma)
        ema_update(t_enc, enc, w)
        ema_update(t_heads, heads, w)
        ema_steps += 1

    def accuracy(e, h) -> float:
        with torch.no_grad(), teacher_mode(e, h):
            pred = torch.cat([h(e(x_test[i:i + 1000])).argmax(1) for i in range(0, len(x_test), 1000)])
        return float((pred == y_test).float().mean())

    def pseudo(u):
        """The teacher's logits on weak views of ``u`` and the student's strong views of them."""
        with torch.no_grad(), teacher_mode(t_enc, t_heads):
            t_logits = t_heads(t_enc(aug(data.x_train[u], "weak")))
        return t_logits, aug(data.x_train[u], "strong")

    def track(t_logits, u, stats):
        conf, lab_u = F.softmax(t_logits, 1).max(1)
        m = conf >= a.tau
        stats["mask"].append(float(m.float().mean()))
        if m.any():
            stats["pure"].append(float((lab_u[m] == torch.as_tensor(data.y_train[u])[m]).float().mean()))

    opt = None
    curve = []
    per_round = a.ku * a.clients * a.batch
    for rnd in range(a.rounds):
        lr = 0.005 + 0.5 * (0.02 - 0.005) * (1 + math.cos(math.pi * rnd / a.rounds))
        stats = {"mask": [], "pure": []}
        if opt is None or level >= RUNGS.index("alt_fresh"):
            opt = sgd([*enc.parameters(), *heads.parameters()], lr)
        for g in opt.param_groups:
            g["lr"] = lr
        for step in range(a.ks):
            i = rng.choice(lab, a.sbatch, replace=len(lab) < a.sbatch)
            loss = F.cross_entropy(heads(enc(aug(data.x_train[i], a.lview))), torch.as_tensor(data.y_train[i]))
            if rung == "joint":
                u = rng.choice(unl, per_round // a.ks, replace=False)
                t_logits, xs = pseudo(u)
                track(t_logits, u, stats)
                loss = loss + pseudo_label_ce(heads(enc(xs)), t_logits, a.tau)[0]
            opt.zero_grad()
            loss.backward()
            opt.step()
            ema()
        if level >= RUNGS.index("alt"):
            if level >= RUNGS.index("alt_fresh"):
                opt = sgd([*enc.parameters(), *heads.parameters()], lr)
            if rung == "fed":
                copies = [copy.deepcopy(enc) for _ in range(a.clients)]
                c_opts = [sgd(c.parameters(), lr) for c in copies]
                h_opt = sgd(heads.parameters(), lr)
            for step in range(a.ku):
                u = rng.choice(unl, a.clients * a.batch, replace=False)
                t_logits, xs = pseudo(u)
                track(t_logits, u, stats)
                if rung == "fed":
                    feats = [c(xs[k * a.batch:(k + 1) * a.batch]) for k, c in enumerate(copies)]
                    e = torch.cat([f.detach() for f in feats]).requires_grad_(True)
                    loss = pseudo_label_ce(heads(e), t_logits, a.tau)[0]
                    h_opt.zero_grad()
                    loss.backward()
                    h_opt.step()
                    for k, (f, o) in enumerate(zip(feats, c_opts)):
                        o.zero_grad()
                        f.backward(e.grad[k * a.batch:(k + 1) * a.batch] * a.clients)
                        o.step()
                else:
                    loss = pseudo_label_ce(heads(enc(xs)), t_logits, a.tau)[0]
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if rung == "alt":
                        ema()
            if rung == "fed":
                with torch.no_grad():
                    for name, p in enc.state_dict().items():
                        p.copy_(torch.stack([c.state_dict()[name] for c in copies]).mean(0))
        if (rnd + 1) % a.every == 0 or rnd + 1 == a.rounds:
            curve.append({"round": rnd + 1, "teacher": accuracy(t_enc, t_heads), "student": accuracy(enc, heads),
                          "mask": float(np.mean(stats["mask"])) if stats["mask"] else 0.0,
                          "purity": float(np.mean(stats["pure"])) if stats["pure"] else float("nan")})
    return {"rung": rung, "labels": labels, "seed": seed, "accuracy": curve[-1]["teacher"], "curve": curve}


def cached(job: tuple, a) -> dict:
    rung, labels, seed = job
    out = OUT / (f"{rung}_l{labels}_s{seed}_r{a.rounds}_ks{a.ks}_ku{a.ku}_m{a.clients}_b{a.batch}_sb{a.sbatch}"
                 f"_{a.lview}_g{a.gamma}.json")
    spec = {"rung": rung, "labels": labels, "seed": seed, **{k: v for k, v in sorted(vars(a).items())
                                                              if k not in ("rungs", "labels", "seeds", "jobs")}}
    if restore(out, digest=spec_digest(spec)):  # the cache, or the committed record of the same run
        return json.loads(out.read_text())
    res = run(rung, labels, seed, a)
    keep(out, "semisfl-ladder", f"{rung} labels {labels} seed {seed}", spec, res)
    print(f"{rung:10s} labels {labels:4d} seed {seed}: teacher {100 * res['accuracy']:.2f}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rungs", nargs="*", default=list(RUNGS), choices=RUNGS)
    ap.add_argument("--labels", type=int, nargs="*", default=[100])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--ks", type=int, default=20, help="labelled steps per round (K_s, fixed)")
    ap.add_argument("--ku", type=int, default=10, help="unlabelled steps per round (K_u)")
    ap.add_argument("--clients", type=int, default=10, help="active clients M")
    ap.add_argument("--batch", type=int, default=32, help="a client's unlabelled batch")
    ap.add_argument("--sbatch", type=int, default=32, help="the labelled batch (server_batch_size)")
    ap.add_argument("--lview", choices=("weak", "strong"), default="strong",
                    help="view of the labelled batches (Semi-SFL's server: strong)")
    ap.add_argument("--tau", type=float, default=0.95)
    ap.add_argument("--gamma", type=float, default=0.99, help="EMA decay of the teacher")
    ap.add_argument("--every", type=int, default=10, help="rounds between test evaluations")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    jobs = [(r, n, s) for s in a.seeds for n in a.labels for r in a.rungs]
    with ProcessPoolExecutor(a.jobs) as pool:
        done = dict(zip(jobs, pool.map(cached, jobs, [a] * len(jobs))))
    print("\n| labels | rung | teacher acc. | rung minus sup, paired by seed | per seed | mask rate (last round) "
          "| purity of confident pseudo-labels (last round) |\n|---|---|---|---|---|---|---|")
    for n in a.labels:
        for r in a.rungs:
            acc = [100 * done[(r, n, s)]["accuracy"] for s in a.seeds]
            d = ([acc_r - 100 * done[("sup", n, s)]["accuracy"] for s, acc_r in zip(a.seeds, acc)]
                 if "sup" in a.rungs else [])
            mask = [done[(r, n, s)]["curve"][-1]["mask"] for s in a.seeds]
            pure = [done[(r, n, s)]["curve"][-1]["purity"] for s in a.seeds]
            print(f"| {n} | {r} | {median_range(acc)} | {median_range(d, '+.2f') if d and r != 'sup' else ''} | "
                  f"{', '.join(f'{x:+.2f}' for x in d) if d and r != 'sup' else ''} | "
                  f"{median_range(mask) if r != 'sup' else ''} | {median_range(pure) if r != 'sup' else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
