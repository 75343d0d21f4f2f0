"""Run the Semi-SFL authors' code (littlefishe/Capsule) on raysplit's Fashion-MNIST setting and record its curve.

    .venv/bin/python benchmarks/peers/capsule/run.py --capsule /work/peers/capsule \\
        [--commit head|early] [--labels 1000|100] [--ks fixed|adaptive] [--server-views twice|strong_twice] \\
        [--arm semi|supervised] [--rounds 60] [--seed 0] [--ks-initial 20] [--ku 10] [--eval-every 5]

Their code is never copied into this repository. The runner extracts the requested commit of the given checkout
(``git archive``, so the checkout's working tree is neither read nor changed) into a temporary folder, applies
``edits-<commit>.diff`` (the listed minimum of edits, see README.md), writes ``FLAGS/FMNIST.py`` from
``FLAGS_FMNIST_<commit>.py`` plus this run's keys, gunzips the Debian ``dataset-fashion-mnist`` files into
``<tmp>/data/FashionMNIST/raw``, and writes raysplit's labelled set and client split for (labels, seed) to a
``.npy`` the edited ``load_dataset`` reads. It then runs their ``main.py`` (their multiprocess layout: the server
process plus one process per client, synchronised by barriers) on the CPU with one torch thread per process,
streams its output to ``.runs/<name>.log`` and writes ``.runs/<name>.json``.

The setting is raysplit's ``configs/semisfl/fmnist.yaml``: 30 clients, 10 active per round, IID, K_s = 20 labelled
steps of 32, K_u = 10 unlabelled steps of 32 per active client, SGD 0.02 cosine to 0.005, Nesterov 0.9, wd 5e-4,
EMA 0.99, tau 0.95, queue 1024, temperature 0.2, teacher evaluated on the 10,000 test images every 5 rounds.

``--ks adaptive`` is each commit's own rule: at HEAD the ratio rule (``control=True``; it can only lower K_s) with
its period and window set by ``--ctrl-every``/``--ctrl-window`` (their code: 100 and 10, which never fire in 60
rounds); at the early commit the milestones rule (``iter_decay=True``, milestones 20/30/40/50, their hard-coded
10-round windows), which only changes the EMA exponent. ``--ks fixed`` turns the rule off.
``--arm supervised`` (HEAD only) sets their ``pre_round`` to the round count: every round is their server-only
supervised phase (``sup_train``), with no dispatch, cross-entity phase or aggregation.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
RUNS = HERE / ".runs"
COMMITS = {"head": "0c37252", "early": "9bd1c6c"}
FMNIST_DEBIAN = Path("/usr/share/datasets/fashion-mnist")
FMNIST_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                "t10k-labels-idx1-ubyte"]

# HEAD: "Round [i/R] train loss L | test loss l, acc a | lr x, xloss x, uloss u, xstep K_s, ustep K_u[ | R r]"
HEAD_LINE = re.compile(r"Round \[(\d+)/(\d+)\] train loss (\S+) \| test loss (\S+), acc (\S+) \| lr (\S+), "
                       r"xloss (\S+), uloss (\S+), xstep (\d+), ustep (\d+)(?: \| R (\S+))?")
# early: "Round [i/R] train loss L, acc: a"
EARLY_LINE = re.compile(r"Round \[(\d+)/(\d+)\] train loss (\S+), acc: (\S+)")


def sh(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def fmnist_dir() -> Path:
    """The Debian package's folder (dpkg -L dataset-fashion-mnist), else the usual path."""
    try:
        out = subprocess.run(["dpkg", "-L", "dataset-fashion-mnist"], check=False, capture_output=True,
                             text=True).stdout
        for line in out.splitlines():
            if line.endswith("train-images-idx3-ubyte.gz"):
                return Path(line).parent
    except FileNotFoundError:
        pass
    return FMNIST_DEBIAN


def prepare_data(work: Path) -> Path:
    """torchvision's FashionMNIST layout (root/FashionMNIST/raw/<uncompressed IDX files>)."""
    src = fmnist_dir()
    raw = work / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for name in FMNIST_FILES:
        with gzip.open(src / (name + ".gz")) as fin, open(raw / name, "wb") as fout:
            shutil.copyfileobj(fin, fout)
    return work / "data"


def raysplit_partition(labels: int, seed: int, num_clients: int, partition: str, alpha: float) -> list[np.ndarray]:
    """[labelled set, client 0, ..., client V-1]: what raysplit's own data path (data.load_partitioned)
    draws for configs/semisfl/fmnist.yaml with these overrides; the labelled set is every training index no client
    holds (the config has no subsample and no client test split)."""
    sys.path.insert(0, str(ROOT))
    from raysplit.config import load_config
    from raysplit.data import load_partitioned

    part = {"name": partition, **({"alpha": alpha} if partition == "dirichlet" else {})}
    cfg = load_config(ROOT / "configs" / "semisfl" / "fmnist.yaml", {
        "seed": seed, "data.n_labeled": labels, "data.num_clients": num_clients, "data.partition": part})
    assert not cfg.data.max_train_samples and not cfg.data.test_fraction, "the indices must be the file's"
    _, (_, y, _, _), train_idx, _, _, _ = load_partitioned(cfg.data, cfg.seed)
    clients = [np.asarray(p, dtype=np.int64) for p in train_idx]
    lab = np.setdiff1d(np.arange(len(y)), np.concatenate(clients)).astype(np.int64)
    assert len(lab) == labels
    return [lab] + clients


def prepare_code(capsule: Path, commit: str, work: Path, strong_aug: str = "theirs") -> tuple[Path, str]:
    sha = sh(["git", "-C", str(capsule), "rev-parse", "--verify", COMMITS[commit] + "^{commit}"],
             capture_output=True, text=True).stdout.strip()
    code = work / "capsule"
    code.mkdir()
    archive = subprocess.Popen(["git", "-C", str(capsule), "archive", sha], stdout=subprocess.PIPE)
    sh(["tar", "-x", "-C", str(code)], stdin=archive.stdout)
    if archive.wait():
        raise RuntimeError(f"git archive {sha} failed")
    diff = HERE / f"edits-{commit}.diff"
    sh(["git", "apply", "--check", str(diff)], cwd=code)
    sh(["git", "apply", str(diff)], cwd=code)
    if strong_aug == "raysplit":
        src = (code / "utils" / "datasets.py").read_text()
        for old in RAYSPLIT_STRONG:
            if src.count(old) != 1:
                raise SystemExit(f"--strong-aug raysplit: utils/datasets.py has {src.count(old)} of {old!r}, "
                                 f"expected 1")
            src = src.replace(old, RAYSPLIT_STRONG[old])
        (code / "utils" / "datasets.py").write_text(src)
    return code, sha


# optional edit E12 (--strong-aug raysplit): their strong view's RandAugmentMC(n=2, m=10) (FixMatch's: two operations
# of their pool, each applied with probability 0.5 at a magnitude drawn from 1..9, then a 16-pixel cutout) becomes
# raysplit's (raysplit/data/augment.py: torchvision's RandAugment(num_ops=2, magnitude=10), every operation applied,
# then a grey cutout of half the image side centred uniformly and clipped), after the same flip and crop
E12_CLASS = """
class RaysplitStrong:  # parity runner E12: raysplit's strong view (raysplit/data/augment.py), not theirs
    def __init__(self):
        self.rand_augment = transforms.RandAugment(num_ops=2, magnitude=10)

    def __call__(self, img):
        import torch
        from PIL import ImageDraw
        img = self.rand_augment(img).copy()
        w, h = img.size
        cut = max(1, h // 2)
        cy, cx = int(torch.randint(h, ())), int(torch.randint(w, ()))
        y0, y1 = max(0, cy - cut // 2), min(h, cy + cut // 2)
        x0, x1 = max(0, cx - cut // 2), min(w, cx + cut // 2)
        if y1 > y0 and x1 > x0:
            ImageDraw.Draw(img).rectangle((x0, y0, x1 - 1, y1 - 1), fill=127 if img.mode == 'L' else (127,) * 3)
        return img
"""
RAYSPLIT_STRONG = {"from utils.randaugments import RandAugmentMC\n":
                   "from utils.randaugments import RandAugmentMC\n" + E12_CLASS,
                   "RandAugmentMC(n=2, m=10)])": "RaysplitStrong()])  # parity runner E12"}


def flags_text(a, part_file: Path) -> str:
    text = (HERE / f"FLAGS_FMNIST_{a.commit}.py").read_text()
    keys = {"round": a.rounds, "labeled_num": a.labels, "stransform_type": a.server_views,
            "worker_num": a.clients, "active_worker_num": a.active, "seed": a.seed,
            "partition_file": str(part_file), "eval_every": a.eval_every}
    if a.commit == "head":
        keys.update({"global_steps": a.ks_initial, "local_steps": a.ku, "control": a.ks == "adaptive",
                     "ctrl_every": a.ctrl_every, "ctrl_window": a.ctrl_window,
                     "pre_round": a.rounds if a.arm == "supervised" else 0,
                     # the semi arm's queue is cleared after every cross-entity phase (server_utils.py:299), so
                     # each supervised phase starts from an empty queue; their clear_cache flag does the same here
                     "clear_cache": a.arm == "supervised"})
    else:
        keys.update({"sup_iters": a.ks_initial, "local_steps": a.ku, "iter_decay": a.ks == "adaptive"})
    lines = "".join(f"FLAGS.{k} = {v!r}\n" for k, v in keys.items())
    return text.rstrip("\n") + "\n\n# ---- this run (benchmarks/peers/capsule/run.py) ----\n" + lines


def run_name(a) -> str:
    arm = "" if a.arm == "semi" else "_sup"
    part = "" if a.partition == "iid" else f"_dir{a.alpha:g}"
    return (f"{a.commit}{arm}_l{a.labels}_ks{a.ks}_{a.server_views}{part}_k{a.ks_initial}u{a.ku}"
            f"_s{a.seed}_r{a.rounds}" + ("_rsaug" if a.strong_aug == "raysplit" else ""))


def parse(line: str, commit: str) -> dict | None:
    if commit == "head":
        m = HEAD_LINE.search(line)
        if not m:
            return None
        g = m.groups()
        return {"round": int(g[0]) + 1, "train_loss": float(g[2]), "test_loss": float(g[3]), "accuracy": float(g[4]),
                "lr": float(g[5]), "loss_x": float(g[6]), "loss_u": float(g[7]), "ks": int(g[8]), "ku": int(g[9]),
                "ratio": float(g[10]) if g[10] is not None else None}
    m = EARLY_LINE.search(line)
    if not m:
        return None
    g = m.groups()
    return {"round": int(g[0]) + 1, "train_loss": float(g[2]), "accuracy": float(g[3])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capsule", type=Path, required=True, help="a git checkout/clone of littlefishe/Capsule")
    p.add_argument("--commit", choices=sorted(COMMITS), default="head")
    p.add_argument("--labels", type=int, default=1000, help="server labelled samples (raysplit's labelled set)")
    p.add_argument("--ks", choices=["fixed", "adaptive"], default="fixed")
    p.add_argument("--server-views", choices=["twice", "strong_twice"], default="strong_twice",
                   help="server labelled views: raysplit fmnist.yaml uses strong/strong (= strong_twice); their "
                        "SVHN flags use twice (two weak views)")
    p.add_argument("--strong-aug", choices=["theirs", "raysplit"], default="theirs",
                   help="optional edit E12: raysplit's strong view (torchvision RandAugment(2, 10), every operation, "
                        "and a cutout of half the side) instead of their RandAugmentMC (README.md)")
    p.add_argument("--arm", choices=["semi", "supervised"], default="semi",
                   help="supervised: their pre_round = rounds (server-only supervised rounds; HEAD only)")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ks-initial", type=int, default=20, help="K_s (supervised steps per round at the start)")
    p.add_argument("--ku", type=int, default=10, help="K_u (cross-entity steps per round)")
    p.add_argument("--eval-every", type=int, default=5, help="evaluate the teacher every k rounds (and at the end)")
    p.add_argument("--ctrl-every", type=int, default=20, help="HEAD --ks adaptive: rule period in rounds (theirs 100)")
    p.add_argument("--ctrl-window", type=int, default=5, help="HEAD --ks adaptive: window in rounds (theirs 10)")
    p.add_argument("--clients", type=int, default=30)
    p.add_argument("--active", type=int, default=10)
    p.add_argument("--partition", choices=["iid", "dirichlet"], default="iid")
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet alpha (with --partition dirichlet)")
    p.add_argument("--start-method", choices=["fork", "forkserver"], default="fork",
                   help="their torch.multiprocessing context (theirs: forkserver, where every one of the ~66 "
                        "processes re-imports torch: minutes of start-up on 2 cores)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (OMP_NUM_THREADS)")
    p.add_argument("--stall", type=float, default=900, help="kill the run after this many seconds without output")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default .runs/<name>.json)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (edited code, data, logs)")
    a = p.parse_args(argv)
    if a.arm == "supervised" and a.commit != "head":
        p.error("--arm supervised needs --commit head (pre_round exists only there)")
    if a.commit == "head" and a.ks == "adaptive" and a.ctrl_every % a.ctrl_window:
        p.error("--ctrl-every must be a multiple of --ctrl-window (their rule reshapes the loss history into "
                "windows of --ctrl-window rounds)")
    if a.labels % 10:
        p.error("--labels must be a multiple of the 10 classes")

    name = run_name(a)
    RUNS.mkdir(exist_ok=True)
    out = a.out or RUNS / f"{name}.json"
    log_path = out.with_suffix(".log")
    work = Path(tempfile.mkdtemp(prefix=f"capsule-{name}-"))
    t_setup = time.time()
    proc = None
    try:
        code, sha = prepare_code(a.capsule.resolve(), a.commit, work, a.strong_aug)
        data_root = prepare_data(work)
        part_file = work / "partition.npy"
        parts = raysplit_partition(a.labels, a.seed, a.clients, a.partition, a.alpha)
        np.save(part_file, np.array(parts, dtype=object), allow_pickle=True)
        flags = flags_text(a, part_file)
        (code / "FLAGS" / "FMNIST.py").write_text(flags)

        inner = [sys.executable, "main.py", "--nworker", str(a.clients), "--aworker", str(a.active),
                 "--nlabeled", str(a.labels), "--expname", name]
        inner += ["--dataset", "fmnist", "--round", str(a.rounds)] if a.commit == "head" else ["--dataset", "FMNIST"]
        env = {**os.environ, "CAPSULE_DATA_ROOT": str(data_root), "OMP_NUM_THREADS": str(a.threads),
               "MKL_NUM_THREADS": str(a.threads), "PYTHONUNBUFFERED": "1",
               "CAPSULE_MP_START": a.start_method, "CUDA_VISIBLE_DEVICES": ""}
        print(f"[capsule] {name}: commit {sha[:7]}, work {work}", flush=True)
        print(f"[capsule] cd {code} && {shlex.join(inner)}", flush=True)

        rounds, lines = [], []
        t0 = time.time()
        proc = subprocess.Popen(inner, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True)
        last = [time.time()]
        failed = {"why": None, "at": 0.0}

        def watchdog():  # their processes block on barriers if one dies: kill the run's own process group
            while proc.poll() is None:
                time.sleep(2)
                if (failed["why"] and time.time() - failed["at"] > 20) or time.time() - last[0] > a.stall:
                    failed["why"] = failed["why"] or f"no output for {a.stall:.0f} s"
                    os.killpg(proc.pid, signal.SIGKILL)
                    return

        threading.Thread(target=watchdog, daemon=True).start()
        t_launched = None
        with open(log_path, "w") as log:
            for line in proc.stdout:
                now = time.time() - t0
                last[0] = time.time()
                log.write(f"{now:9.2f} {line}")
                log.flush()
                lines.append(line.rstrip("\n"))
                if "workers already launched" in line:
                    t_launched = now
                if line.startswith("Traceback") and not failed["why"]:
                    failed["why"], failed["at"] = "their code raised (see the log)", time.time()
                rec = parse(line, a.commit)
                if rec:
                    rec["t"] = now
                    rec["wall_round"] = now - (rounds[-1]["t"] if rounds else (t_launched or 0.0))
                    rounds.append(rec)
                    acc = rec["accuracy"]
                    print(f"[capsule] round {rec['round']:3d}  {rec['wall_round']:6.1f} s"
                          + ("" if math.isnan(acc) else f"  teacher acc {acc:.4f}")
                          + (f"  loss_x {rec['loss_x']:.3f} loss_u {rec['loss_u']:.3f} K_s {rec['ks']}"
                             if "loss_x" in rec else f"  loss {rec['train_loss']:.3f}"), flush=True)
        rc = proc.wait()
        wall = time.time() - t0
        if rc or failed["why"] or len(rounds) != a.rounds:
            tail = "\n".join(lines[-30:])
            print(f"[capsule] FAILED (rc {rc}, {failed['why'] or 'incomplete'}); last output:\n{tail}",
                  file=sys.stderr)
            return 1

        curve = [[r["round"], r["accuracy"]] for r in rounds if not math.isnan(r["accuracy"])]
        per_round = [r["wall_round"] for r in rounds]
        result = {
            "name": name, "peer": "littlefishe/Capsule", "commit": sha, "commit_label": a.commit,
            "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
            "inner_command": shlex.join(inner),
            "edits_sha256": hashlib.sha256((HERE / f"edits-{a.commit}.diff").read_bytes()).hexdigest(),
            "flags": flags,
            "setting": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "labelled_indices_sha256": hashlib.sha256(np.sort(parts[0]).tobytes()).hexdigest(),
            "client_sizes": [len(x) for x in parts[1:]],
            "curve": curve, "final_accuracy": rounds[-1]["accuracy"],
            "best_accuracy": max(acc for _, acc in curve),
            "mask_rate": None,  # their code computes p_num (mask.sum()) in semi_sfl_train but never logs it
            "wall_time": wall, "setup_time": t0 - t_setup,
            "startup_time": t_launched,
            "wall_time_round_median": float(np.median(per_round)),
            "rounds": [{k: v for k, v in r.items() if k != "t"} for r in rounds],
            "torch_threads_per_process": a.threads,
            "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
        }
        out.write_text(json.dumps(result, indent=1, allow_nan=True))
        print(f"[capsule] final teacher accuracy {result['final_accuracy']:.4f} (best {result['best_accuracy']:.4f}); "
              f"{wall:.0f} s, median {result['wall_time_round_median']:.1f} s/round, start-up "
              f"{t_launched or float('nan'):.1f} s -> {out}", flush=True)
        return 0
    finally:
        if proc is not None and proc.poll() is None:  # interrupted: end the run's own process group
            os.killpg(proc.pid, signal.SIGKILL)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
