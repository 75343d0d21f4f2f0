"""Reproduce docs/results/ampere.md: Ampere against the SFL baselines on Fashion-MNIST (configs/ampere/fmnist.yaml).

    .venv/bin/python docs/results/run_ampere.py [--alphas 0.1 0.33 1.0] [--seeds 0 1 2] [--jobs 2] [--ablations]

For each non-IID degree alpha (Ampere's device_dirichlet scheme) and seed: Ampere, SplitFed (sflv1), PiPar, SplitGP
and SplitFed+SCAFFOLD, each a full raysplit run logged to MLflow (experiment ampere-fmnist in ./mlflow.db) on the
local backend with one torch thread, ``--jobs`` at a time. The SFL baselines run as many rounds as the config's
``train.rounds`` (60) with early stopping off; Ampere stops its phases on validation patience.
``--ablations`` adds Ampere without consolidation (alpha 0.33). ``--paired`` runs the consolidation ablation as
issue 26 asks for it: Ampere with and without consolidation at each alpha and seed, both phases to their caps
(patience = 30 = the caps, so both server blocks train exactly 30 epochs) and a loader cache (1,024 MB) that holds
every activation (exact shuffling of the consolidated set); prints median [min, max] per arm and the difference
paired by seed. ``--converge`` is issue 28's test where the paper says Ampere helps: both phases to convergence
(the paper's patience 15, caps of 100 device rounds and 100 server epochs), consolidation against none with a cache
holding every activation, beside SplitFed (the config's SGD with momentum) and SplitFed and SplitFed+SCAFFOLD with
plain SGD (momentum 0, the assumption of SCAFFOLD's option II control variates; the Ampere paper names SGD for its
updates and gives no optimizer for its baselines), and consolidation at a server batch of 320 (as many optimizer
steps per server epoch as the ablation's averaged blocks take); per alpha the jobs run in that order (or in the
order of ``--arms``, indices into CONVERGED), so a stopped study keeps the most telling runs.

Prints the markdown tables (final accuracy median [min, max] over seeds; bytes per device split into model and
activation/gradient traffic; on-device FLOPs per device; simulated time; rounds; then each method minus SplitFed,
paired by seed) and writes docs/results/ampere_alpha.png (accuracy against alpha, median with min-max bars). Cached
per run under docs/results/.ampere_runs/.

``--clock`` is issue 55's question of what SplitFed's simulated clock assumes. SplitFed's default step order
(``each_client_in_turn``) serves one device's steps after another's, so a device's first gradient waits for every
device served before it: on the virtual clock the devices train one after another. The paper's SplitFed trains
them in parallel, each against its own server copy. ``--clock`` runs Ampere and SplitFed as in the main table and
SplitFed with ``algorithm.batched_copies`` on: the same computation (the copies step together, equal within vmap's
rounding), served step by step across devices, so the devices train in parallel, in lockstep (every step waits for
the slowest device's activation); it prints each arm's simulated time and Ampere's saving against each, paired by
seed, and SplitFed's accuracy both ways.

``--to-target`` is issue 73's equal outcome for the time and traffic claims: Ampere (the main table's run) against
the two baselines with their devices in parallel, SplitFed and PiPar (``batched_copies``: the paper's assumption;
PiPar's pipelined clock is the paper's fastest baseline), both for ``TARGET_ROUNDS`` rounds (they pass Ampere's
accuracy within a few; ``--methods`` runs a part of the arms), on one simulated clock; it prints each arm's simulated time and device-server bytes to the
highest accuracy every run of the seed reaches (``_runs.to_target``) and Ampere's saving against the faster
baseline, paired by seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from _runs import ROOT, Run, common_target, early_stop, median_range, named, restored, run_all, to_target

METHODS = [("Ampere", None), ("SplitFed", {"name": "sflv1"}), ("PiPar", {"name": "pipar"}),
           ("SplitGP", {"name": "splitgp"}), ("SplitFed+SCAFFOLD", {"name": "sflv1_scaffold"})]
HERE = Path(__file__).resolve().parent
OUT = HERE / ".ampere_runs"
KEYS = ("comm/bytes_up", "comm/bytes_down", "comm/bytes_up_model", "comm/bytes_down_model",
        "comm/bytes_up_activations", "comm/bytes_down_gradients", "compute/client_flops", "method/server_epochs",
        "eval/validation_accuracy")  # the last: the arms run with eval.validation (--stopping)
DEVICES = 10
BYTES = ("comm/bytes_up", "comm/bytes_down")  # device-server traffic, models included


def one(method, alg, alpha, seed, extra=()):
    label = f"{method} alpha={alpha} seed {seed}"
    over = {"seed": seed, "data.partition.alpha": alpha, "runtime.backend": "local", "runtime.torch_threads": 1,
            "tracking.checkpoint_every": 0}
    if alg is not None:
        over["algorithm"] = alg
    over.update(dict(extra))
    out = OUT / (label.replace(" ", "_").replace("=", "") + ".json")
    return Run(ROOT / "configs/ampere/fmnist.yaml", over, label, out, keys=KEYS)


def per_device(res: dict, key: str) -> float:
    return sum(h.get(key, 0.0) for h in res["history"]) / DEVICES


def _acc(rs: list) -> str:
    """Final accuracy, median [min, max] over the seeds that finished, and the median best evaluated accuracy;
    diverged seeds are counted, never averaged."""
    ok = [100 * r["eval/accuracy"] for r in rs if "diverged" not in r]
    best = [100 * r["eval/best_accuracy"] for r in rs if "diverged" not in r]
    bad = len(rs) - len(ok)
    cell = f"{median_range(ok)} (best {np.median(best):.2f})" if ok else ""
    return cell + (f" (diverged: {bad}/{len(rs)} seeds)" if bad else "")


def versus(seeded: dict, alphas, reference: str = "SplitFed") -> str:
    """Each method's final accuracy minus ``reference``'s, paired by seed (the seeds both finished), per alpha:
    median [min, max] and each seed's. ``seeded[(method, alpha)]``: ``{seed: result}``."""
    lines = [f"| method minus {reference} | alpha | accuracy difference (points), paired by seed | per seed |",
             "|---|---|---|---|"]
    for method, _ in METHODS:
        for a in alphas:
            mine, ref = seeded.get((method, a), {}), seeded.get((reference, a), {})
            both = [s for s in sorted(mine) if s in ref and "diverged" not in mine[s] and "diverged" not in ref[s]]
            if method == reference or not both:
                continue
            d = [100 * (mine[s]["eval/accuracy"] - ref[s]["eval/accuracy"]) for s in both]
            lines.append(f"| {method} | {a} | {median_range(d, '+.2f')} | "
                         f"{', '.join(f'{x:+.2f} (seed {s})' for s, x in zip(both, d))} |")
    return "\n".join(lines)


ARMS = [("Ampere, equal epochs", True), ("Ampere without consolidation, equal epochs", False)]
PAIRED = (("algorithm.patience", 30), ("algorithm.cache_mb", 1024.0))
CONVERGE = (("algorithm.patience", 15), ("algorithm.device_rounds", 100), ("algorithm.server_epochs", 100),
            ("algorithm.cache_mb", 1024.0), ("train.rounds", 200))  # rounds: room for both phases' caps
SGD = (("train.optimizer.momentum", 0.0),)
# (arm, algorithm, overrides): the arms of --converge, in the order they run for each alpha
CONVERGED = [("Ampere, to convergence", None, (("algorithm.consolidate", True),) + CONVERGE),
             ("Ampere without consolidation, to convergence", None, (("algorithm.consolidate", False),) + CONVERGE),
             ("SplitFed", {"name": "sflv1"}, ()),
             ("SplitFed, plain SGD", {"name": "sflv1"}, SGD),
             ("SplitFed+SCAFFOLD, plain SGD", {"name": "sflv1_scaffold"}, SGD),
             # the consolidated block at 10x the batch: as many optimizer steps per epoch as the ablation's averaged
             # per-device blocks take (10 devices x ~1,080 rows / 32 each), against 10x as many at batch 32
             ("Ampere, to convergence, server batch 320", None,
              (("algorithm.consolidate", True), ("algorithm.server_batch_size", 320)) + CONVERGE),
             # no federation: one device holds all 12,000 images (alpha 1.0: is the gap to SplitFed the federated device
             # phase or the local loss? ampere.md, "Why Ampere is below SplitFed at alpha 1.0")
             ("Ampere, to convergence, server batch 320, one device", None,
              (("algorithm.consolidate", True), ("algorithm.server_batch_size", 320), ("data.num_clients", 1))
              + CONVERGE),
             ("SplitFed, one device", {"name": "sflv1"}, (("data.num_clients", 1),)),
             # SCAFFOLD corrects the device block only (here conv1: 160 of 206,922 parameters); cut after fc1 the
             # devices hold 99.4 % of the model (ampere.md, "SplitFed+SCAFFOLD with plain SGD at every alpha")
             ("SplitFed, plain SGD, cut fc1", {"name": "sflv1"}, SGD + (("model.cut", "fc1"),)),
             ("SplitFed+SCAFFOLD, plain SGD, cut fc1", {"name": "sflv1_scaffold"}, SGD + (("model.cut", "fc1"),)),
             # is the divergence of the arm above the learning rate? (0.05, SplitFed's; SCAFFOLD's paper tunes it)
             ("SplitFed+SCAFFOLD, plain SGD, cut fc1, lr 0.02", {"name": "sflv1_scaffold"},
              SGD + (("model.cut", "fc1"), ("train.optimizer.lr", 0.02))),
             ("SplitFed, plain SGD, cut fc1, lr 0.02", {"name": "sflv1"},
              SGD + (("model.cut", "fc1"), ("train.optimizer.lr", 0.02))),
             # why does SCAFFOLD's lower drift buy no accuracy? (ampere.md, "SplitFed+SCAFFOLD: its correction
             # works"). The server copies uncorrected: SCAFFOLD of the whole model (server_controls), at cut fc1
             # (fc2 corrected too) and at the page's cut conv1 (99.9 % of the model on the server) ...
             ("SplitFed+SCAFFOLD, plain SGD, cut fc1, lr 0.02, server controls",
              {"name": "sflv1_scaffold", "server_controls": True},
              SGD + (("model.cut", "fc1"), ("train.optimizer.lr", 0.02))),
             ("SplitFed+SCAFFOLD, plain SGD, server controls", {"name": "sflv1_scaffold", "server_controls": True},
              SGD),
             # ... and the 60-round budget: the cut-fc1, lr 0.02 pair run to 200 rounds (constant rate, so their
             # first 60 rounds are the 60-round runs')
             ("SplitFed, plain SGD, cut fc1, lr 0.02, 200 rounds", {"name": "sflv1"},
              SGD + (("model.cut", "fc1"), ("train.optimizer.lr", 0.02), ("train.rounds", 200))),
             ("SplitFed+SCAFFOLD, plain SGD, cut fc1, lr 0.02, 200 rounds", {"name": "sflv1_scaffold"},
              SGD + (("model.cut", "fc1"), ("train.optimizer.lr", 0.02), ("train.rounds", 200))),
             # ... and the local work: SCAFFOLD's analysis has its gain grow with the local steps a round, so the same
             # pair with 5 local epochs (about 170 steps a round, not 34), 30 rounds (150 epochs' worth of rounds)
             ("SplitFed, plain SGD, cut fc1, lr 0.02, 5 local epochs", {"name": "sflv1"},
              SGD + (("model.cut", "fc1"), ("train.optimizer.lr", 0.02), ("train.local_epochs", 5),
                     ("train.rounds", 30))),
             ("SplitFed+SCAFFOLD, plain SGD, cut fc1, lr 0.02, 5 local epochs", {"name": "sflv1_scaffold"},
              SGD + (("model.cut", "fc1"), ("train.optimizer.lr", 0.02), ("train.local_epochs", 5),
                     ("train.rounds", 30))),
             # issue 55 item 3, accuracy at a fair budget: the main table's SplitFed stops at 60 rounds while Ampere
             # runs its phases to convergence; SplitFed (the config's optimizer) given 200 rounds, its curve kept
             ("SplitFed, 200 rounds", {"name": "sflv1"}, (("train.rounds", 200),))]


# the differences converged() prints, paired by seed (x minus y), where both arms ran
CONVERGED_PAIRS = [("Ampere, to convergence", "Ampere without consolidation, to convergence"),
                   ("Ampere, to convergence, server batch 320", "SplitFed, 200 rounds"),
                   ("SplitFed, 200 rounds", "SplitFed"),
                   ("Ampere, to convergence", "SplitFed"),
                   ("SplitFed+SCAFFOLD, plain SGD", "SplitFed, plain SGD"),
                   ("Ampere, to convergence, server batch 320", "Ampere without consolidation, to convergence"),
                   ("Ampere, to convergence, server batch 320", "Ampere, to convergence"),
                   ("Ampere, to convergence, server batch 320", "SplitFed"),
                   ("Ampere, to convergence, server batch 320, one device", "SplitFed, one device"),
                   ("Ampere, to convergence, server batch 320, one device", "Ampere, to convergence, server batch 320"),
                   ("Ampere, to convergence, server batch 320, one device", "SplitFed"),
                   ("SplitFed, one device", "SplitFed"),
                   ("SplitFed+SCAFFOLD, plain SGD, cut fc1", "SplitFed, plain SGD, cut fc1"),
                   ("SplitFed, plain SGD, cut fc1", "SplitFed, plain SGD"),
                   ("SplitFed+SCAFFOLD, plain SGD, cut fc1, lr 0.02", "SplitFed, plain SGD, cut fc1, lr 0.02"),
                   ("SplitFed+SCAFFOLD, plain SGD, cut fc1, lr 0.02, server controls",
                    "SplitFed, plain SGD, cut fc1, lr 0.02"),
                   ("SplitFed+SCAFFOLD, plain SGD, cut fc1, lr 0.02, server controls",
                    "SplitFed+SCAFFOLD, plain SGD, cut fc1, lr 0.02"),
                   ("SplitFed+SCAFFOLD, plain SGD, server controls", "SplitFed, plain SGD"),
                   ("SplitFed+SCAFFOLD, plain SGD, server controls", "SplitFed+SCAFFOLD, plain SGD"),
                   ("SplitFed+SCAFFOLD, plain SGD, cut fc1, lr 0.02, 200 rounds",
                    "SplitFed, plain SGD, cut fc1, lr 0.02, 200 rounds"),
                   ("SplitFed+SCAFFOLD, plain SGD, cut fc1, lr 0.02, 5 local epochs",
                    "SplitFed, plain SGD, cut fc1, lr 0.02, 5 local epochs")]
assert {n for pair in CONVERGED_PAIRS for n in pair} <= {arm for arm, _, _ in CONVERGED}


def paired(res: dict, alphas, seeds) -> str:
    """Per alpha: each arm's final accuracy and server epochs, median [min, max] over seeds, and consolidation minus
    no consolidation paired by seed (positive: consolidation better, as the paper's section 5.2.4 finds)."""
    lines = ["| alpha | consolidation | no consolidation | difference, paired by seed | per seed | server epochs |",
             "|---|---|---|---|---|---|"]
    for a in alphas:
        c = [100 * res[(ARMS[0][0], a, s)]["eval/accuracy"] for s in seeds]
        n = [100 * res[(ARMS[1][0], a, s)]["eval/accuracy"] for s in seeds]
        d = [x - y for x, y in zip(c, n)]
        ep = sorted({int(max(h.get("method/server_epochs", 0) for h in res[(arm, a, s)]["history"]))
                     for arm, _ in ARMS for s in seeds})
        lines.append(f"| {a} | {median_range(c)} | {median_range(n)} | {median_range(d, '+.2f')} | "
                     f"{' '.join(f'{x:+.2f}' for x in d)} | {'/'.join(map(str, ep))} |")
    return "\n".join(lines)


def phases(res: dict) -> tuple[int, int]:
    """(device rounds, server epochs) an Ampere run used: the rounds before its first server epoch, and the most."""
    ep = [int(h.get("method/server_epochs", 0)) for h in res["history"]]
    return sum(1 for e in ep if e == 0), max(ep, default=0)


def converged(res: dict, alphas, seeds) -> str:
    """--converge: per alpha, each arm's final accuracy median [min, max] over the seeds that ran, Ampere's phase
    lengths, and the paired differences the claims rest on (consolidation minus none; Ampere minus SplitFed;
    SCAFFOLD minus SplitFed, both plain SGD)."""
    lines = ["| alpha | arm | final accuracy (%) | seeds | device rounds / server epochs per seed |", "|---" * 5 + "|"]
    for a in alphas:
        for arm, alg, _ in CONVERGED:
            got = [s for s in seeds if (arm, a, s) in res]
            if not got:
                continue
            acc = [100 * res[(arm, a, s)]["eval/accuracy"] for s in got]
            ph = " ".join("%d/%d" % phases(res[(arm, a, s)]) for s in got) if alg is None else "-"
            lines.append(f"| {a} | {arm} | {median_range(acc)} | {' '.join(map(str, got))} | {ph} |")
    lines += ["", "| alpha | difference | points, paired by seed | per seed |", "|---" * 4 + "|"]
    for a in alphas:
        for x, y in CONVERGED_PAIRS:
            both = [s for s in seeds if (x, a, s) in res and (y, a, s) in res]
            if both:
                d = [100 * (res[(x, a, s)]["eval/accuracy"] - res[(y, a, s)]["eval/accuracy"]) for s in both]
                lines.append(f"| {a} | {x} minus {y} | {median_range(d, '+.2f')} | "
                             f"{', '.join(f'{v:+.2f} (seed {s})' for s, v in zip(both, d))} |")
    return "\n".join(lines + long_runs(res, alphas, seeds))


def long_runs(res: dict, alphas, seeds, early: int = 60, last: int = 10, mark: float = 0.80) -> list[str]:
    """The arms run past ``early`` rounds (the budget check): per seed, the accuracy at round ``early`` (a
    constant-rate run's first rounds are the shorter run's), the mean of the ``last`` rounds' accuracies (less noisy
    than the final one), and the first round at or above ``mark``."""
    lines = ["", f"| alpha | arm | seed | accuracy at round {early} (%) | mean of the last {last} rounds (%) | "
             f"first round at {mark:.0%} or more |", "|---" * 6 + "|"]
    rows = 0
    for a in alphas:
        for arm, _, _ in CONVERGED:
            for s in seeds:
                curve = [acc for _, _, acc in res.get((arm, a, s), {}).get("curve", [])]
                if len(curve) <= early:
                    continue
                first = next((i + 1 for i, acc in enumerate(curve) if acc >= mark), None)
                lines.append(f"| {a} | {arm} | {s} | {100 * curve[early - 1]:.2f} | "
                             f"{100 * sum(curve[-last:]) / last:.2f} | {first or 'never'} |")
                rows += 1
    return lines if rows else []


def table(results, alphas) -> str:
    lines = ["| method | " + " | ".join(f"acc. alpha={a}" for a in alphas) +
             " | MB/device model | MB/device act.+grad. | on-device GFLOP | sim. time (s) | rounds |",
             "|---" * (6 + len(alphas)) + "|"]
    mid = 0.33 if 0.33 in alphas else alphas[0]
    for method, _ in METHODS:
        if (method, alphas[0]) not in results:  # not run (--methods)
            continue
        accs = []
        for a in alphas:
            accs.append(_acc(results[(method, a)]))
        rs = results[(method, mid)]
        model = np.median([per_device(r, "comm/bytes_up_model") + per_device(r, "comm/bytes_down_model")
                           for r in rs]) / 1e6
        data = np.median([per_device(r, "comm/bytes_up_activations") + per_device(r, "comm/bytes_down_gradients")
                          for r in rs]) / 1e6
        flops = np.median([per_device(r, "compute/client_flops") for r in rs]) / 1e9
        sim = np.median([r["time/sim"] for r in rs])
        rounds = np.median([len(r["history"]) for r in rs])
        lines.append(f"| {method} | {' | '.join(accs)} | {model:.1f} | {data:.1f} | {flops:.1f} | {sim:.1f} | "
                     f"{rounds:.0f} |")
    return "\n".join(lines)


def figure(results, alphas) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, _ in METHODS:  # median over seeds, bars from min to max; diverged seeds are left out
        acc = [np.array([r["eval/accuracy"] for r in results[(method, a)] if "diverged" not in r] or [np.nan]) * 100
               for a in alphas]
        med = np.array([np.median(a) for a in acc])
        ax.errorbar([str(a) for a in alphas], med, yerr=[med - [a.min() for a in acc], [a.max() for a in acc] - med],
                    marker="o", capsize=3, label=method)
    ax.set_xlabel("alpha (Ampere's Dirichlet scheme; 1 is about IID)"), ax.set_ylabel("test accuracy (%)")
    ax.set_title("Fashion-MNIST, 10 devices, small CNN split after its first layer")
    ax.grid(alpha=0.3), ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "ampere_alpha.png", dpi=120)
    plt.close(fig)


def clocks(res: dict, alphas, seeds) -> str:
    """--clock: per alpha, each arm's simulated time (median [min, max]), Ampere's saving against SplitFed served in
    turn and in parallel (per seed), and SplitFed's final accuracy both ways."""
    lines = ["| alpha | arm | simulated time (s) | Ampere's saving against it (%), per seed | accuracy (%) |",
             "|---|---|---|---|---|"]
    for a in alphas:
        amp = {s: res[("Ampere", a, s)]["time/sim"] for s in seeds if ("Ampere", a, s) in res}
        for arm in ("Ampere", "SplitFed", "SplitFed, devices in parallel"):
            got = {s: res[(arm, a, s)] for s in seeds if (arm, a, s) in res}
            if not got:
                continue
            t = [r["time/sim"] for r in got.values()]
            save = "" if arm == "Ampere" else ", ".join(
                f"{100 * (1 - amp[s] / r['time/sim']):.1f} (seed {s})" for s, r in got.items() if s in amp)
            acc = median_range([100 * r["eval/accuracy"] for r in got.values()])
            lines.append(f"| {a} | {arm} | {median_range(t, '.1f')} | {save or '-'} | {acc} |")
    return "\n".join(lines)


TARGET_ROUNDS = 15
TARGET_ARMS = [("Ampere", None, ()),
               (f"SplitFed, devices in parallel, {TARGET_ROUNDS} rounds", {"name": "sflv1", "batched_copies": True},
                (("train.rounds", TARGET_ROUNDS),)),
               (f"PiPar, devices in parallel, {TARGET_ROUNDS} rounds", {"name": "pipar", "batched_copies": True},
                (("train.rounds", TARGET_ROUNDS),))]


def targets(res: dict, alphas, seeds) -> str:
    """--to-target: per alpha and seed, the common target (the highest accuracy every arm of the seed reaches), each
    arm's simulated time and bytes per device to it, and Ampere's saving against the faster baseline (time) and
    against each (bytes)."""
    lines = ["| alpha | seed | target (%) | arm | time to target (s) | MB per device to target | "
             "Ampere's time saved (%) | Ampere's traffic saved (%) |", "|---" * 8 + "|"]
    for a in alphas:
        for s in seeds:
            got = {arm: res[(arm, a, s)] for arm, _, _ in TARGET_ARMS if (arm, a, s) in res}
            if len(got) < len(TARGET_ARMS):
                continue
            target = common_target(list(got.values()))
            hit = {arm: to_target(r, target, BYTES) for arm, r in got.items()}
            fastest = min((arm for arm in hit if arm != "Ampere"), key=lambda arm: hit[arm][1])
            for arm, (rnd, t, b) in hit.items():
                saved_t = "-" if arm == "Ampere" else f"{100 * (1 - hit['Ampere'][1] / t):.1f}"
                saved_b = "-" if arm == "Ampere" else f"{100 * (1 - hit['Ampere'][2] / b):.1f}"
                mark = " (faster)" if arm == fastest else ""
                lines.append(f"| {a} | {s} | {100 * target:.2f} | {arm}{mark} | {t:.2f} (round {rnd}) | "
                             f"{b / DEVICES / 1e6:.2f} | {saved_t} | {saved_b} |")
    return "\n".join(lines)


# issue 73 item 4, an accuracy claim with both arms stopped by one rule: the paper's early stopping (§5.2.1: patience
# 15 on validation accuracy, the best-validated model kept), Ampere's own for its phases (CONVERGED's server batch 320
# arm); SplitFed validated every round on the same held-out splits (eval.validation) for 200 rounds, its stop read
# from that curve (a run stopped at round r is the first r rounds of this one: a constant rate)
PATIENCE = 15
STOPPING = [("SplitFed, 200 rounds, validated", {"name": "sflv1"}, (("train.rounds", 200), ("eval.validation", True))),
            CONVERGED[5]]


def stopping(res: dict, alphas, seeds) -> str:
    """--stopping: per alpha and seed, Ampere's final accuracy (its server block of the best validation epoch,
    restored) and SplitFed's test accuracy at its best validation round under the same patience
    (:func:`_runs.early_stop`), its stop round, and its last round's; then Ampere minus SplitFed paired by seed, both
    ways. A second table: SplitFed's validated runs at round 60 and 200 (against the unvalidated runs': validation
    only reads) and at its best validation round of all its rounds (no stop), with Ampere minus that."""
    amp, sf = STOPPING[1][0], STOPPING[0][0]
    lines = ["| alpha | seed | Ampere (%) | SplitFed stopped (%) | SplitFed's best / stop round | SplitFed round 200 "
             "(%) | Ampere minus SplitFed stopped | Ampere minus SplitFed round 200 |", "|---" * 8 + "|"]
    more = ["| alpha | seed | SplitFed round 60 (%) | SplitFed round 200 (%) | SplitFed's best validation round of "
            "all, its test (%) | Ampere minus SplitFed there |", "|---" * 6 + "|"]
    diffs: dict = {}
    for a in alphas:
        for s in seeds:
            if (amp, a, s) not in res or (sf, a, s) not in res:
                continue
            r = res[(sf, a, s)]
            best, stop, acc = early_stop(r, PATIENCE)
            anywhere, _, acc_any = early_stop(r, len(r["history"]))  # a patience no run reaches: the best of all
            ampere, last = 100 * res[(amp, a, s)]["eval/accuracy"], 100 * r["eval/accuracy"]
            diffs.setdefault(a, []).append((ampere - 100 * acc, ampere - last, ampere - 100 * acc_any))
            lines.append(f"| {a} | {s} | {ampere:.2f} | {100 * acc:.2f} | {best} / {stop} | {last:.2f} | "
                         f"{ampere - 100 * acc:+.2f} | {ampere - last:+.2f} |")
            at = {int(pt[0]): pt[-1] for pt in r["curve"]}
            more.append(f"| {a} | {s} | {100 * at[60]:.2f} | {last:.2f} | {anywhere}: {100 * acc_any:.2f} | "
                        f"{ampere - 100 * acc_any:+.2f} |")
    for a, d in diffs.items():
        lines.append(f"| {a} | median [min, max] | | | | | {median_range([x[0] for x in d], '+.2f')} | "
                     f"{median_range([x[1] for x in d], '+.2f')} |")
        more.append(f"| {a} | median [min, max] | | | | {median_range([x[2] for x in d], '+.2f')} |")
    return "\n".join(lines + [""] + more)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alphas", type=float, nargs="*", default=[0.1, 0.33, 1.0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ablations", action="store_true")
    ap.add_argument("--paired", action="store_true", help="only the equal-epoch consolidation ablation")
    ap.add_argument("--converge", action="store_true", help="only issue 28's to-convergence study")
    ap.add_argument("--methods", nargs="*", default=None, help="only these methods (table rows), e.g. SplitFed PiPar")
    ap.add_argument("--clock", action="store_true", help="only SplitFed's clock served in turn and in parallel")
    ap.add_argument("--to-target", action="store_true",
                    help="only Ampere against SplitFed and PiPar in parallel, timed to a common accuracy")
    ap.add_argument("--report", action="store_true", help="--to-target: run nothing, the table from the runs cached "
                    "(or recorded)")
    ap.add_argument("--stopping", action="store_true", help="only Ampere against SplitFed, both stopped by the "
                    "paper's patience on validation accuracy")
    ap.add_argument("--arms", type=int, nargs="*", default=None,
                    help="--converge: only these arms (indices into CONVERGED), run in the order given")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    todo = [(m, alg, a, s) for s in args.seeds for a in args.alphas for m, alg in METHODS
            if args.methods is None or m in args.methods]
    if args.paired:
        todo = [(arm, None, a, s, (("algorithm.consolidate", cons),) + PAIRED) for s in args.seeds
                for a in args.alphas for arm, cons in ARMS]
        done = run_all("ampere-fmnist", todo, one, args.jobs)
        print(paired(dict(((job[0], job[2], job[3]), res) for job, res in done), args.alphas, args.seeds))
        return 0
    if args.converge:
        arms = CONVERGED if args.arms is None else [CONVERGED[i] for i in args.arms]
        todo = [(arm, alg, a, s, extra) for a in args.alphas for arm, alg, extra in arms for s in args.seeds]
        done = run_all("ampere-fmnist", todo, one, args.jobs)
        print(converged(dict(((job[0], job[2], job[3]), res) for job, res in done), args.alphas, args.seeds))
        return 0
    if args.stopping:
        todo = [(arm, alg, a, s, extra) for a in args.alphas for arm, alg, extra in STOPPING for s in args.seeds]
        done = run_all("ampere-fmnist", todo, one, args.jobs)
        print(stopping(dict(((job[0], job[2], job[3]), res) for job, res in done), args.alphas, args.seeds))
        return 0
    if args.clock:
        arms = [("Ampere", None, ()), ("SplitFed", {"name": "sflv1"}, ()),
                ("SplitFed, devices in parallel", {"name": "sflv1", "batched_copies": True}, ())]
        todo = [(arm, alg, a, s, extra) for a in args.alphas for s in args.seeds for arm, alg, extra in arms]
        done = run_all("ampere-fmnist", todo, one, args.jobs)
        print(clocks(dict(((job[0], job[2], job[3]), res) for job, res in done), args.alphas, args.seeds))
        return 0
    if args.to_target:
        todo = [(arm, alg, a, s, extra) for a in args.alphas for s in args.seeds for arm, alg, extra in TARGET_ARMS
                if args.methods is None or arm.split(",")[0] in args.methods]
        done = [] if args.report else run_all("ampere-fmnist", todo, one, args.jobs)
        if args.methods is not None or args.report:  # a part of the arms: the table from every arm cached
            done = [(job, named(json.loads(restored(one(*job).out).read_text()))) for job in
                    [(arm, alg, a, s, extra) for a in args.alphas for s in args.seeds for arm, alg, extra in TARGET_ARMS]
                    if restored(one(*job).out).is_file()]
        print(targets(dict(((job[0], job[2], job[3]), res) for job, res in done), args.alphas, args.seeds))
        return 0
    if args.ablations:
        todo += [("Ampere without consolidation", None, 0.33, s, (("algorithm.consolidate", False),))
                 for s in args.seeds]
    done = run_all("ampere-fmnist", todo, one, args.jobs)
    results: dict = {}
    seeded: dict = {}
    for job, res in done:
        results.setdefault((job[0], job[2]), []).append(res)
        seeded.setdefault((job[0], job[2]), {})[job[3]] = res
    print(table(results, args.alphas))
    print()
    print(versus(seeded, args.alphas))
    if args.ablations:
        print(f"\nAmpere without consolidation, alpha=0.33: {_acc(results[('Ampere without consolidation', 0.33)])}")
    if args.methods is None:
        figure(results, args.alphas)
    (OUT / "summary.json").write_text(json.dumps({f"{k[0]}|{k[1]}": v for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
