"""Parity with the authors' code (issue 28, item 1): the tables and figures of docs/results/peers.md from runs of
the authors' code (benchmarks/peers/<peer>/run.py, cached in benchmarks/peers/<peer>/.runs/) and raysplit's runs of
the same setting (cached by the results scripts), no training. Each run of the authors' code read from its peer's
cache folder is kept as a committed record (records/peers_<peer>/, :func:`peer_file`) and restored from it on a
machine without the cache, as raysplit's runs are from theirs.

    .venv/bin/python docs/results/run_peers.py semisfl [--seeds 0 1 2] [--views twice]

Semi-SFL: Capsule HEAD (0c37252) against raysplit's Semi-SFL, both at 100 labels, K_s fixed at 20, K_u = 10, 60
rounds, IID, 30 clients (10 active), the same labelled set and client split per seed, the server's labelled views
``twice`` (weak, weak; the authors' SVHN setting) or ``strong_twice``; each with its supervised-only arm. Runs made by

    .venv/bin/python benchmarks/peers/capsule/run.py --capsule PATH --commit head --labels 100 --ks fixed \\
        --server-views twice --arm {semi,supervised} --rounds 60 --seed S
    .venv/bin/python docs/results/run_semisfl.py --rounds 60 --seeds 0 1 2 --jobs 2 --labels 100 \\
        --partitions IID --methods "Semi-SFL fixed K_s" "Supervised-only fixed K_s" --server-views weak

Prints the table (final teacher accuracy per arm: median [min, max] over the seeds both ran; the Semi-SFL minus
supervised-only gain paired by seed in each code base; raysplit minus the authors' code, paired by seed) and writes
docs/results/peers_semisfl.png (accuracy per evaluated round, each seed thin, the median thick). ``--commit early``
tabulates the early commit's runs (9bd1c6c, ``run.py --commit early``, the semi arm) instead, without the figure.
``--labels 1000`` tabulates the 1,000-label runs (figure peers_semisfl_l1000.png; ``--views strong_twice`` adds
``_strong_twice`` to a figure's name; with strong views the runs of Capsule with the runner's edit E12,
raysplit's strong view, ``run.py ... --strong-aug raysplit``, are a third code, "Capsule E12", where they exist:
Capsule and raysplit each against it, paired by seed). ``--ks adaptive`` tabulates the
semi arms with each code's K_s rule: Capsule HEAD's ratio rule against raysplit's ``Semi-SFL ratio K_s`` row, or
(with ``--commit early``) the early commit's milestones rule against raysplit's ``Semi-SFL`` row, the paper's
milestones rule; with K_s per round and what each rule read at its decisions where the run logged it. A figure is
written only when every arm has every seed.

    .venv/bin/python docs/results/run_peers.py hydra [--seeds 0 1 2] [--ours outputs/hydra_gap_r2] \
        [--theirs benchmarks/peers/hydra/.runs]

Hydra: the authors' run_sfl.py (SFLV2) and run_hydra.py (heads conv4+fc, 62 % of the server; with --cut-b conv4,
heads fc, 1.1 %) against raysplit's SFLV2, SFLV2+Hydra and SFLV2+Hydra head=fc on configs/hydra/fmnist_gap.yaml
(c = 1: 10 clients, dominant label 0.8, 12,800 images, the same client lists and cycle order per seed), cyclic and
random orders, 30 rounds. Runs made by

    .venv/bin/python benchmarks/peers/hydra/run.py --hydra PATH --script {sfl,hydra} --policy {cyclic,random} \
        --rounds 30 --seed S [--cut-b conv4]
    .venv/bin/python docs/results/run_hydra.py --study gap --jobs 1 --seeds 0 1 2 --only-c 1 \
        --methods SFLV2 SFLV2+Hydra "SFLV2+Hydra head=fc" --orders {cyclic,random} --out outputs/hydra_gap_r2

Prints the table (accuracy at round 30, mean of the last 5 rounds, PG and BW per code, method and order: median
[min, max] over the seeds both ran), the differences paired by seed in accuracy, PG and BW (Hydra minus SFLV2 in
each code; raysplit minus the authors' code per method) and writes docs/results/peers_hydra.png (global accuracy per
round, one panel per order).

    .venv/bin/python docs/results/run_peers.py cyclesl [--seeds 0 1 2] [--rounds 300] [--ours outputs/cyclesl_ladder]

CycleSL: the authors' SFLV2 and CycleSFL (E = 1) (AnonymWriter/CycleSL, main.py) against raysplit's on
configs/cyclesl/fmnist.yaml (100 clients, Dirichlet 0.1, 20 % client test splits, 10 clients a round, one batch of
32 per sampled client per round, Adam 1e-3, cnn_small cut conv1, 300 rounds; the same client partition, test splits
and sampled clients per seed), both measured as raysplit measures: every client's test split through its own
client model at the last round. Runs made by

    .venv/bin/python benchmarks/peers/cyclesl/run.py --cyclesl PATH --algo {SFLV2,CycleSFL} --seed S
    .venv/bin/python docs/results/run_cyclesl.py --ladder --jobs 1 --out outputs/cyclesl_ladder

(raysplit's: the ladder's first setting, "raysplit's setting", which is configs/cyclesl/fmnist.yaml unchanged; with
``--ours outputs/cyclesl_table`` the runs of ``run_cyclesl.py --seeds 0 1 2 --jobs 2 --backend local`` instead).
Prints the table (final accuracy per code and arm: median [min, max] over the seeds both ran, and per seed; the
authors' own evaluation at the last round, on that round's sampled clients' test splits, beside it), CycleSFL minus
SFLV2 paired by seed in each code, raysplit minus the authors' code per arm paired by seed, and the authors'
CycleSFL minus SFLV2 at every evaluated round.

    .venv/bin/python docs/results/run_peers.py gas [--seeds 0 1 2] [--rounds 12] [--theirs benchmarks/peers/gas/.runs]

GAS: the authors' GAS_main.py (eejiarong/GAS) against raysplit's GAS on benchmarks/peers/gas/raysplit.yaml
(configs/gas/fmnist.yaml reduced to 12 global rounds, evaluated every 2, the clock without server charges; Fashion-
MNIST, shards 2, 20 clients, 10 active, 20 local iterations of 32, AlexNet split at L2; raysplit's partition, client
profiles and initial weights per seed given to their code), both measured as raysplit measures: the global client
model and the server on the 10,000 test images. Both sides' runs are made by, and cached in --theirs by,

    .venv/bin/python benchmarks/peers/gas/run.py --side both --authors PATH --seeds 0 1 2

Prints the table (final accuracy per code: median [min, max] over the seeds and per seed; server updates, simulated
time and wall seconds per round beside it), raysplit minus the authors' code paired by seed, and both curves at
every evaluated round; "no cached runs" where there are none. With the page's runs (the default folder, the config's
rounds, seeds 0, 1 and 2 on both sides) it writes docs/results/peers_gas.png, both sides' curves.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np
from _runs import RECORDS, ROOT, median_range, recorded
from run_cyclesl import _cache as cyclesl_cache
from run_hydra import last5, run_file
from run_semisfl import SEMI, cached

HERE = Path(__file__).resolve().parent
CAPSULE = ROOT / "benchmarks" / "peers" / "capsule" / ".runs"
HYDRA = ROOT / "benchmarks" / "peers" / "hydra" / ".runs"
CYCLESL = ROOT / "benchmarks" / "peers" / "cyclesl" / ".runs"
GAS = ROOT / "benchmarks" / "peers" / "gas"
CYCLESL_ARMS = {"SFLV2": "sflv2", "CycleSFL (E=1)": "cyclesfl"}  # label -> run.py's and run_cyclesl.py's names
# raysplit's label -> their script and cuts in the run name: heads conv4+fc (62 % of the server), heads fc (1.1 %)
HYDRA_METHODS = {"SFLV2": ("sfl", "a1"), "SFLV2+Hydra": ("hydra", "a1b3"), "SFLV2+Hydra head=fc": ("hydra", "a1b4")}
RAYSPLIT_VIEWS = {"twice": "weak", "strong_twice": "strong"}
E12 = "Capsule E12"  # the authors' code with raysplit's strong view (the runner's optional edit E12)
MILESTONES, WINDOW = SEMI["milestones"], SEMI["window"]  # the milestones rule of run_semisfl.py's "Semi-SFL" row


PEERS = ROOT / "benchmarks" / "peers"


def peer_file(f: Path) -> Path:
    """``f``, a run of an author's code in its peer's own cache folder (benchmarks/peers/<peer>/.runs/ or below),
    kept as a committed record (records/peers_<peer>/, ``_runs.recorded``) as it is read, and restored from that
    record where this machine lacks the cache; a file elsewhere (a --theirs folder) is read as it is."""
    if not f.is_relative_to(PEERS):
        return f
    peer = f.relative_to(PEERS).parts[0]
    return recorded(f, f"peers-{peer}", f.stem, f"peers_{peer}")


def theirs(arm: str, seed: int, views: str, commit: str = "head", labels: int = 100, ks: str = "fixed",
           aug: str = "theirs") -> dict | None:
    """A cached run of the authors' code at ``commit`` (benchmarks/peers/capsule/run.py's ``run_name``); ``ks``
    fixed or adaptive (each commit's own rule), with K_s and the ratio rule's R per round where it decided;
    ``aug`` raysplit: the runs with the runner's edit E12 (raysplit's strong view, ``--strong-aug raysplit``)."""
    f = CAPSULE / (f"{commit}{'' if arm == 'semi' else '_sup'}_l{labels}_ks{ks}_{views}_k20u10_s{seed}_r60"
                   f"{'_rsaug' if aug == 'raysplit' else ''}.json")
    if not peer_file(f).is_file():
        return None
    d = json.loads(f.read_text())
    return {"curve": [(int(r), float(acc)) for r, acc in d["curve"]], "final": float(d["final_accuracy"]),
            "commit": d["commit"][:7], "ks": [int(r["ks"]) for r in d["rounds"] if "ks" in r],  # early: not logged
            "decisions": [(r["round"], r["ratio"]) for r in d["rounds"] if r.get("ratio") is not None]}


def ours(arm: str, seed: int, views: str, labels: int = 100, ks: str = "fixed", commit: str = "head") -> dict | None:
    """A cached run of docs/results/run_semisfl.py (its own cache names); ``ks`` adaptive is the rule of Capsule's
    ``commit``: the ratio rule (HEAD) or the paper's milestones rule (early)."""
    rule = "Semi-SFL ratio K_s" if commit == "head" else "Semi-SFL"
    method = ("Supervised-only fixed K_s" if arm != "semi" else rule if ks == "adaptive" else "Semi-SFL fixed K_s")
    f = cached(method, "IID", seed, 60, labels=labels, views=RAYSPLIT_VIEWS[views])
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    hist = d.get("history", [])
    decisions = [(h["round"], h["method/ks_ratio_r"]) for h in hist if "method/ks_ratio_r" in h]
    if method == "Semi-SFL":  # the milestones rule's loss change, recomputed from loss_x (semisfl_milestones.py)
        from raysplit.algorithms.semisfl import milestone_change

        loss_x = [h["method/loss_x"] for h in hist]
        decisions = [(r + 1, c) for r in range(len(loss_x))
                     if (c := milestone_change(r, loss_x[:r + 1], MILESTONES, WINDOW)) is not None]
    return {"curve": [(int(r), float(acc)) for r, _, acc in d["curve"]], "final": float(d["eval/accuracy"]),
            "ks": [int(h["method/ks"]) for h in hist if "method/ks" in h], "decisions": decisions}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("method", choices=["semisfl", "hydra", "cyclesl", "gas"])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--views", choices=sorted(RAYSPLIT_VIEWS), default="twice")
    ap.add_argument("--ours", default=None, help="hydra: run_hydra.py's --out (cached runs; default "
                    "outputs/hydra_gap_r2); cyclesl: run_cyclesl.py's --out (default outputs/cyclesl_ladder: its "
                    "--ladder runs at raysplit's setting; outputs/cyclesl_table: the table's runs)")
    ap.add_argument("--rounds", type=int, default=None, help="cyclesl: the rounds of the authors' runs (run.py's "
                    "name; default 300); gas: the rounds of both sides' runs (default benchmarks/peers/gas/"
                    "raysplit.yaml's train.rounds; 2: the runner's --smoke runs)")
    ap.add_argument("--theirs", default=None,
                    help="hydra: benchmarks/peers/hydra/run.py's --out (default benchmarks/peers/hydra/.runs; "
                    "benchmarks/peers/hydra/.runs_keeplast: the runs with --keep-last); the figure is drawn for the "
                    "defaults of --ours and --theirs only; gas: benchmarks/peers/gas/run.py's --out, both sides' "
                    "runs (default benchmarks/peers/gas/.runs); cyclesl: benchmarks/peers/cyclesl/run.py's --out "
                    "(default benchmarks/peers/cyclesl/.runs)")
    ap.add_argument("--commit", choices=["head", "early"], default="head",
                    help="semisfl: which commit of Capsule (early: the semi arm only, no figure)")
    ap.add_argument("--labels", type=int, choices=[100, 1000], default=100, help="semisfl: the labelled set's size")
    ap.add_argument("--ks", choices=["fixed", "adaptive"], default="fixed",
                    help="semisfl: K_s fixed at 20, or each code's rule (HEAD: the ratio rule; the semi arm only)")
    a = ap.parse_args()
    if a.method == "gas":
        return gas(a.seeds, ROOT / a.theirs if a.theirs else GAS / ".runs", a.rounds)
    if a.method == "cyclesl":
        return cyclesl(a.seeds, ROOT / (a.ours or "outputs/cyclesl_ladder"), ROOT / a.theirs if a.theirs else CYCLESL,
                       a.rounds or 300)
    if a.method == "hydra":
        return hydra(a.seeds, ROOT / (a.ours or "outputs/hydra_gap_r2"), ROOT / a.theirs if a.theirs else HYDRA)
    return semisfl(a)


def semisfl(a) -> int:
    kw = {"labels": a.labels, "ks": a.ks, "commit": a.commit}
    codes = [("Capsule", partial(theirs, **kw)), ("raysplit", partial(ours, **kw))]
    if a.views == "strong_twice" and a.ks == "fixed" and a.commit == "head":  # their runs with raysplit's strong view
        codes.append((E12, partial(theirs, **kw, aug="raysplit")))
    runs = {(code, arm): {s: r for s in a.seeds if (r := fn(arm, s, a.views)) is not None}
            for code, fn in codes for arm in ("semi", "supervised")}
    runs = {k: v for k, v in runs.items() if v or k[0] != E12}  # E12 only where it ran
    if a.ks == "adaptive":  # the rule's runs are the semi arm's; supervised-only has no K_s rule to compare
        runs = {k: v for k, v in runs.items() if k[1] == "semi"}
    commits = sorted({r["commit"] for r in runs[("Capsule", "semi")].values()})
    print(f"Capsule at {a.commit} ({', '.join(commits) or 'no runs'}), {a.labels} labels, K_s {a.ks}\n")
    print(f"| code | arm (server views {a.views}) | seeds | accuracy @60 | per seed |\n|---|---|---|---|---|")
    for (code, arm), by_seed in runs.items():
        v = [100 * r["final"] for r in by_seed.values()]
        print(f"| {code} | {arm} | {', '.join(map(str, by_seed))} | {median_range(v) if v else 'not run'} | "
              f"{', '.join(f'{x:.2f}' for x in v)} |")
    print("\n| difference | seeds | points, paired by seed | per seed |\n|---|---|---|---|")
    pairs = [(("Capsule", "semi"), ("Capsule", "supervised"), "Capsule: Semi-SFL minus supervised-only"),
             (("raysplit", "semi"), ("raysplit", "supervised"), "raysplit: Semi-SFL minus supervised-only"),
             (("raysplit", "semi"), ("Capsule", "semi"), "Semi-SFL: raysplit minus Capsule"),
             (("raysplit", "supervised"), ("Capsule", "supervised"), "supervised-only: raysplit minus Capsule"),
             ((E12, "semi"), (E12, "supervised"), f"{E12}: Semi-SFL minus supervised-only"),
             ((E12, "semi"), ("Capsule", "semi"), f"Semi-SFL: {E12} minus Capsule"),
             ((E12, "supervised"), ("Capsule", "supervised"), f"supervised-only: {E12} minus Capsule"),
             (("raysplit", "semi"), (E12, "semi"), f"Semi-SFL: raysplit minus {E12}"),
             (("raysplit", "supervised"), (E12, "supervised"), f"supervised-only: raysplit minus {E12}")]
    for x, y, label in pairs:
        seeds = sorted(set(runs.get(x, {})) & set(runs.get(y, {})))
        if not seeds:
            continue
        d = [100 * (runs[x][s]["final"] - runs[y][s]["final"]) for s in seeds]
        print(f"| {label} | {', '.join(map(str, seeds))} | {median_range(d, '+.2f')} | "
              f"{', '.join(f'{v:+.2f}' for v in d)} |")
    if a.ks == "fixed":  # where the levels part: each arm's median over the seeds at a few evaluations
        at = (5, 10, 20, 40, 60)
        print("\n| code | arm | median accuracy at rounds " + ", ".join(map(str, at)) + " |\n|---|---|---|")
        for (code, arm), by_seed in runs.items():
            med = [np.median([100 * dict(r["curve"])[rd] for r in by_seed.values()]) for rd in at
                   if all(rd in dict(r["curve"]) for r in by_seed.values())]
            print(f"| {code} | {arm} | {', '.join(f'{m:.2f}' for m in med)} |")
    if a.ks == "adaptive":
        print("\n| code | seed | K_s at rounds 1, 21, 41, 60 | the rule's reading at its decisions (round: value) |\n"
              "|---|---|---|---|")
        for code in ("Capsule", "raysplit"):
            for s, r in runs[(code, "semi")].items():
                path = ", ".join(str(r["ks"][i]) for i in (0, 20, 40, 59)) if len(r["ks"]) >= 60 else "-"
                dec = ", ".join(f"{rd}: {v:.3f}" for rd, v in r.get("decisions", [])) or "not logged"
                print(f"| {code} | {s} | {path} | {dec} |")
    complete = all(len(by_seed) == len(a.seeds) for by_seed in runs.values())
    if a.commit == "head" and a.ks == "fixed" and complete:  # a partial cache must not overwrite the figure
        figure(runs, a.views, a.labels)
    return 0


def hydra_theirs(method: str, order: str, seed: int, folder: Path = HYDRA) -> dict | None:
    """The newest complete 30-round run of the authors' script (benchmarks/peers/hydra/run.py's run name) in
    ``folder``."""
    script, cut = HYDRA_METHODS[method]
    done = []
    pattern = f"{script}_{order}_cnn_gap_{cut}_s{seed}_r30_n12800_*.json"
    kept = RECORDS / "peers_hydra"  # the committed records of the peer's own folder, restored where absent
    names = {f.name for f in folder.glob(pattern)} | ({f.name for f in kept.glob(pattern)} if folder == HYDRA else set())
    for f in sorted(peer_file(folder / n) for n in names):
        d = json.loads(f.read_text())
        if d["returncode"] == 0 and d["rounds_completed"] == 30:
            done.append(d)
    if not done:
        return None
    rounds = done[-1]["rounds"]
    return {"curve": [(r["round"] + 1, r["accuracy"]) for r in rounds],  # their Epoch [e] is logged after epoch e
            "final": rounds[-1]["accuracy"], "last5": float(np.mean([r["accuracy"] for r in rounds[-5:]])),
            "pg": rounds[-1]["pg"], "bw": done[-1]["bw"]}


def hydra_ours(out: Path, method: str, order: str, seed: int) -> dict | None:
    """A cached run of docs/results/run_hydra.py --study gap (its run_file names)."""
    f = out / run_file(1, order, method, None, seed)
    if not f.is_file():
        return None
    d = last5(json.loads(f.read_text()))  # curve: (round, accuracy), or (round, time/sim, accuracy) since the sweeps
    return {"curve": [(int(c[0]), float(c[-1])) for c in d.get("curve", [])], "final": d["eval/accuracy"],
            "last5": d["eval/accuracy_last5"], "pg": d["eval/performance_gap"], "bw": d["eval/backward_transfer"]}


def hydra(seeds: list[int], ours_dir: Path, theirs_dir: Path = HYDRA) -> int:
    runs = {(code, m, o): {s: r for s in seeds if (r := fn(m, o, s)) is not None}
            for o in ("cyclic", "random") for m in HYDRA_METHODS
            for code, fn in (("authors", partial(hydra_theirs, folder=theirs_dir)),
                             ("raysplit", lambda *k: hydra_ours(ours_dir, *k)))}
    print("| order | method | code | seeds | accuracy @30 (%) | last 5 rounds (%) | PG (pp) | BW (pp) |\n"
          + "|---" * 8 + "|")
    for (code, m, o), by_seed in runs.items():
        if by_seed:
            cells = [median_range([100 * r[k] for r in by_seed.values()]) for k in ("final", "last5", "pg", "bw")]
            print(f"| {o} | {m} | {code} | {', '.join(map(str, by_seed))} | {' | '.join(cells)} |")
    print("\n| order | difference | seeds | accuracy @30 (points), paired by seed | last 5 rounds | PG (pp) | BW (pp) |\n"
          + "|---" * 7 + "|")
    for o in ("cyclic", "random"):
        pairs = [((c, m, o), (c, "SFLV2", o), f"{c}: {m} minus SFLV2") for m in list(HYDRA_METHODS)[1:]
                 for c in ("authors", "raysplit")]
        pairs += [(("raysplit", m, o), ("authors", m, o), f"{m}: raysplit minus authors") for m in HYDRA_METHODS]
        for x, y, label in pairs:
            common = sorted(set(runs[x]) & set(runs[y]))
            if common:
                cells = [median_range([100 * (runs[x][s][k] - runs[y][s][k]) for s in common], "+.2f")
                         for k in ("final", "last5", "pg", "bw")]
                print(f"| {o} | {label} | {', '.join(map(str, common))} | {' | '.join(cells)} |")
    print("\n| order | method | code | BW per seed (pp) | accuracy @30 per seed (%) |\n" + "|---" * 5 + "|")
    for (code, m, o), by_seed in runs.items():
        if by_seed:
            bw, acc = (", ".join(f"{100 * r[k]:.2f}" for r in by_seed.values()) for k in ("bw", "final"))
            print(f"| {o} | {m} | {code} | {bw} | {acc} |")
    if theirs_dir == HYDRA and ours_dir == ROOT / "outputs/hydra_gap_r2":  # the page's figure: the page's runs only
        if all(runs[(c, "SFLV2", o)] for c in ("authors", "raysplit") for o in ("cyclic", "random")):
            hydra_figure(runs)
        else:  # a machine without the runs cached must not overwrite the page's figure with empty axes
            print("\npeers_hydra.png not written: the runs of the figure are not all cached here", file=sys.stderr)
    return 0


def completed(f: Path, rounds: int) -> dict | None:
    """A peer runner's result file (benchmarks/peers/*/run.py) if its run exited cleanly after ``rounds`` rounds
    with a final accuracy, else None."""
    if not peer_file(f).is_file():
        return None
    d = json.loads(f.read_text())
    if d.get("returncode") != 0 or d.get("final_accuracy") is None or d.get("rounds_completed") != rounds:
        return None
    return d


def cyclesl_theirs(folder: Path, arm: str, seed: int, rounds: int) -> dict | None:
    """A completed run of benchmarks/peers/cyclesl/run.py (its run_name, raysplit's sampling stream) in ``folder``:
    raysplit's measure from their models (``final``, ``curve``) and their own evaluation at the last round."""
    d = completed(folder / f"{CYCLESL_ARMS[arm]}_E1_s{seed}_r{rounds}.json", rounds)
    if d is None:
        return None
    return {"final": float(d["final_accuracy"]), "curve": [(int(r), float(v)) for r, v in d["curve"]],
            "own": float(d["their_eval_last_round"]["test/accu"]), "commit": d["their_commit"][:7]}


def cyclesl_ours(folder: Path, arm: str, seed: int) -> dict | None:
    """A cached raysplit run of run_cyclesl.py in ``folder``: its --ladder name at raysplit's setting, or else the
    table's name (both are configs/cyclesl/fmnist.yaml unchanged)."""
    method = CYCLESL_ARMS[arm]
    for f in (cyclesl_cache(f"{method} [raysplit's setting]", seed, folder), cyclesl_cache(method, seed, folder)):
        if f.is_file():
            return {"final": float(json.loads(f.read_text())["eval/accuracy"])}
    return None


def cyclesl(seeds: list[int], ours_dir: Path, theirs_dir: Path = CYCLESL, rounds: int = 300) -> int:
    codes = (("authors", lambda arm, s: cyclesl_theirs(theirs_dir, arm, s, rounds)),
             ("raysplit", lambda arm, s: cyclesl_ours(ours_dir, arm, s)))
    runs = {(code, arm): {s: r for s in seeds if (r := fn(arm, s)) is not None}
            for code, fn in codes for arm in CYCLESL_ARMS}
    commits = sorted({r["commit"] for arm in CYCLESL_ARMS for r in runs[("authors", arm)].values()})
    print(f"AnonymWriter/CycleSL at {', '.join(commits) or 'no runs'}; raysplit's runs from "
          f"{ours_dir.relative_to(ROOT) if ours_dir.is_relative_to(ROOT) else ours_dir}\n")
    print(f"| code | arm | seeds | accuracy @{rounds} (%), every client's test split | per seed | the authors' own "
          f"evaluation @{rounds}: that round's sampled clients (%) |\n" + "|---" * 6 + "|")
    for (code, arm), by_seed in runs.items():
        v = [100 * r["final"] for r in by_seed.values()]
        own = [100 * r["own"] for r in by_seed.values() if "own" in r]
        print(f"| {code} | {arm} | {', '.join(map(str, by_seed)) or '-'} | {median_range(v) if v else 'not run'} | "
              f"{', '.join(f'{x:.2f}' for x in v)} | {median_range(own) if own else '-'} |")
    print("\n| difference | seeds | points, paired by seed | per seed |\n|---|---|---|---|")
    cyc, v2 = list(CYCLESL_ARMS)[1], list(CYCLESL_ARMS)[0]
    pairs = [((c, cyc), (c, v2), f"{c}: {cyc} minus {v2}") for c in ("authors", "raysplit")]
    pairs += [(("raysplit", arm), ("authors", arm), f"{arm}: raysplit minus authors") for arm in CYCLESL_ARMS]
    pairs.insert(1, (("authors", cyc), ("authors", v2), f"authors, their own evaluation @{rounds} (the same "
                     f"sampled clients in both arms): {cyc} minus {v2}", "own"))
    for x, y, label, *key in pairs:
        key = key[0] if key else "final"
        common = sorted(set(runs[x]) & set(runs[y]))
        if common:
            d = [100 * (runs[x][s][key] - runs[y][s][key]) for s in common]
            print(f"| {label} | {', '.join(map(str, common))} | {median_range(d, '+.2f')} | "
                  f"{', '.join(f'{v:+.2f}' for v in d)} |")
    a, b = runs[("authors", cyc)], runs[("authors", v2)]
    common = sorted(set(a) & set(b))
    if common:
        at = sorted(set.intersection(*[{rd for rd, _ in r["curve"]} for s in common for r in (a[s], b[s])]))
        print(f"\n| the authors' code: {cyc} minus {v2} (points), every client's test split | "
              + " | ".join(f"@{rd}" for rd in at) + " |\n|---" + "|---" * len(at) + "|")
        for s in common:
            ca, cb = dict(a[s]["curve"]), dict(b[s]["curve"])
            print(f"| seed {s} | " + " | ".join(f"{100 * (ca[rd] - cb[rd]):+.2f}" for rd in at) + " |")
    return 0


def gas_run(folder: Path, side: str, seed: int, rounds: int) -> dict | None:
    """A completed run of benchmarks/peers/gas/run.py (its run_name: raysplit's profiles and initial weights given to
    the authors' code) in ``folder``; ``side`` authors or raysplit."""
    d = completed(folder / f"{side}_s{seed}_r{rounds}.json", rounds)
    if d is None:
        return None
    return {"final": float(d["final_accuracy"]), "curve": [(int(r), float(v)) for r, v in d["curve"]],
            "updates": int(sum(d["server_updates"])), "sim": float(d["sim_time"][-1][1]),
            "wall": d["wall_s_per_round_median"], "jitter": d.get("jitter_retries"),
            "commit": (d.get("their_commit") or d.get("raysplit_commit") or "")[:7]}


def gas(seeds: list[int], folder: Path, rounds: int | None = None) -> int:
    import yaml

    configured = yaml.safe_load((GAS / "raysplit.yaml").read_text())["train"]["rounds"]
    rounds = rounds or configured
    runs = {side: {s: r for s in seeds if (r := gas_run(folder, side, s, rounds)) is not None}
            for side in ("authors", "raysplit")}
    where = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
    if not any(runs.values()):
        print(f"no cached runs of {rounds} rounds for seeds {', '.join(map(str, seeds))} in {where} "
              "(benchmarks/peers/gas/run.py makes them)")
        return 0
    commits = {side: ", ".join(sorted({r["commit"] for r in by_seed.values()})) or "no runs"
               for side, by_seed in runs.items()}
    print(f"eejiarong/GAS at {commits['authors']}; raysplit at {commits['raysplit']}; runs from {where}\n")
    print(f"| code | seeds | accuracy @{rounds} (%), global test set | per seed | server updates in {rounds} rounds | "
          f"simulated time @{rounds} (s) | wall s a round |\n" + "|---" * 7 + "|")
    for side, by_seed in runs.items():
        if not by_seed:
            print(f"| {side} | - | not run | | | | |")
            continue
        v = [100 * r["final"] for r in by_seed.values()]
        cells = [median_range([r[k] for r in by_seed.values()], f) for k, f in (("updates", ".0f"), ("sim", ".0f"))]
        walls = [r["wall"] for r in by_seed.values() if r["wall"] is not None]
        print(f"| {side} | {', '.join(map(str, by_seed))} | {median_range(v)} | {', '.join(f'{x:.2f}' for x in v)} | "
              f"{' | '.join(cells)} | {median_range(walls, '.1f') if walls else '-'} |")
    common = sorted(set(runs["authors"]) & set(runs["raysplit"]))
    if not common:
        return 0
    a, b = runs["raysplit"], runs["authors"]
    d = [100 * (a[s]["final"] - b[s]["final"]) for s in common]
    print("\n| difference | seeds | points, paired by seed | per seed |\n|---|---|---|---|")
    print(f"| raysplit minus authors, accuracy @{rounds} | {', '.join(map(str, common))} | {median_range(d, '+.2f')} | "
          f"{', '.join(f'{x:+.2f}' for x in d)} |")
    at = sorted(set.intersection(*[{rd for rd, _ in r[s]["curve"]} for s in common for r in (a, b)]))
    print("\n| round | authors (%), median of the seeds | raysplit (%) | raysplit minus authors (points), paired by "
          "seed |\n|---|---|---|---|")
    for rd in at:
        ca, cb = ([100 * dict(r[s]["curve"])[rd] for s in common] for r in (b, a))
        print(f"| {rd} | {np.median(ca):.2f} | {np.median(cb):.2f} | "
              f"{median_range([y - x for x, y in zip(ca, cb)], '+.2f')} |")
    page = folder == GAS / ".runs" and rounds == configured and seeds == [0, 1, 2]
    if page and all(len(runs[side]) == 3 for side in runs):  # the page's figure: the page's runs only
        gas_figure(runs, rounds)
    elif page:  # a machine without the runs cached must not overwrite the page's figure with fewer curves
        print("\npeers_gas.png not written: the page's six runs are not all cached here", file=sys.stderr)
    return 0


def gas_figure(runs: dict, rounds: int) -> None:
    """docs/results/peers_gas.png: each side's test accuracy per evaluated round, each seed thin, the median thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for side, color, ls in (("authors", "C0", "--"), ("raysplit", "C1", "-")):
        seed_curves(ax, runs[side], f"GAS, {side}", color, ls, thin=(0.6, 0.4))
    ax.set_xlabel("global round"), ax.set_ylabel("global test accuracy (%)"), ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"GAS, Fashion-MNIST shards 2, AlexNet cut L2, {rounds} rounds: authors' code and raysplit",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(HERE / "peers_gas.png", dpi=110)
    plt.close(fig)


def seed_curves(ax, by_seed: dict, label: str, color: str, ls: str, thin: tuple[float, float]) -> None:
    """Each seed's accuracy curve thin (``thin``: line width, alpha), their median over the common rounds thick."""
    for r in by_seed.values():
        ax.plot(*zip(*[(rd, 100 * acc) for rd, acc in r["curve"]]), color=color, ls=ls, lw=thin[0], alpha=thin[1])
    common = sorted(set.intersection(*[{rd for rd, _ in r["curve"]} for r in by_seed.values()]))
    med = [np.median([100 * dict(r["curve"])[rd] for r in by_seed.values()]) for rd in common]
    ax.plot(common, med, color=color, ls=ls, lw=2, label=f"{label} (median of {len(by_seed)})")


def hydra_figure(runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, o in zip(axes, ("cyclic", "random")):
        for (code, m, oo), by_seed in runs.items():
            if oo != o or not by_seed:
                continue
            color, ls = {"SFLV2": "C0", "SFLV2+Hydra": "C3"}.get(m, "C2"), ("-" if code == "raysplit" else "--")
            seed_curves(ax, by_seed, f"{m}, {code}", color, ls, thin=(0.5, 0.35))
        ax.set_title(f"{o} order"), ax.set_xlabel("round"), ax.grid(alpha=0.3)
    axes[0].set_ylabel("global test accuracy (%)")
    for ax in axes:
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Hydra vs SFLV2, Fashion-MNIST, cnn_gap, dominant label 0.8, 10 clients: authors' code and raysplit")
    fig.tight_layout()
    fig.savefig(HERE / "peers_hydra.png", dpi=110)
    plt.close(fig)


def figure(runs: dict, views: str, labels: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {("Capsule", "semi"): ("C0", "-"), ("raysplit", "semi"): ("C1", "-"),
              ("Capsule", "supervised"): ("C0", ":"), ("raysplit", "supervised"): ("C1", ":"),
              (E12, "semi"): ("C2", "-"), (E12, "supervised"): ("C2", ":")}
    for key, by_seed in runs.items():
        if not by_seed:
            continue
        seed_curves(ax, by_seed, f"{key[0]} {key[1]}", *styles[key], thin=(0.6, 0.4))
    ax.set_xlabel("round"), ax.set_ylabel("teacher test accuracy (%)"), ax.grid(alpha=0.3), ax.legend(fontsize=8)
    ax.set_title(f"Semi-SFL, Fashion-MNIST, {labels} labels, K_s 20 fixed, server views {views}")
    fig.tight_layout()
    name = "peers_semisfl" + ("" if labels == 100 else f"_l{labels}") + ("" if views == "twice" else f"_{views}")
    fig.savefig(HERE / f"{name}.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
