"""Parity runner: Hydra's own code (jtirana98/Hydra_tackling-CF-in-SFL) on raysplit's Fashion-MNIST setting.

Runs THEIR ``run_sfl.py`` (SplitFedV2 with processing orders) or ``run_hydra.py`` (Hydra) from a temporary copy of
their checkout (``git archive HEAD``), with the listed edits (edits.diff, README.md) applied to the copy, the missing
``models/mobilenet.py`` supplied by shim/models/mobilenet.py (raysplit's block lists), and raysplit's client index
lists and cycle order passed in. Their checkout stays pristine; nothing of theirs is copied into this repository.

    .venv/bin/python benchmarks/peers/hydra/run.py --hydra /work/peers/hydra --script hydra --policy cyclic \
        --rounds 30 --seed 0

Writes ``benchmarks/peers/hydra/.runs/<name>.json`` (per-round accuracy, per-label accuracy, their PG, BW computed
from the per-label history, wall time per round, the commands, their commit) and their log next to it.
See README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]  # the raysplit checkout
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))
from peer_data import fmnist_raw  # noqa: E402

# raysplit's defaults for the comparison (configs/hydra/fmnist_gap.yaml: model cnn_gap, cut conv1, cut_b conv3)
ARCH_CUTS = {"cnn_gap": ("conv1", "conv3"), "mobilenet_v1": (4, 23)}  # mobilenet_v1: the paper's scripts' 4 / 23
RATIO_TO_ALPHA = {0.0: 0, 0.2: 1, 0.4: 2, 0.6: 3, 0.8: 4, 0.9: 5}  # their get_data.partition_data(data_pattern)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hydra", required=True, help="a checkout of jtirana98/Hydra_tackling-CF-in-SFL (outside the "
                   "project); its HEAD commit is what runs")
    p.add_argument("--script", choices=["sfl", "hydra"], required=True,
                   help="sfl: their run_sfl.py (SplitFedV2 + order); hydra: their run_hydra.py")
    p.add_argument("--policy", choices=["cyclic", "random", "reverse"], default="cyclic",
                   help="their --policy (reverse = raysplit's cyclic_reverse)")
    p.add_argument("--rounds", type=int, default=30, help="their --epoch (global rounds); fmnist_gap: 30")
    p.add_argument("--seed", type=int, default=0, help="raysplit seed: partition, cycle order; also seeds their "
                   "random/numpy/torch global RNGs")
    p.add_argument("--config", default=str(ROOT / "configs/hydra/fmnist_gap.yaml"),
                   help="raysplit config the setting is read from (clients, partition, samples, batch, optimiser, "
                   "phi)")
    p.add_argument("--arch", choices=sorted(ARCH_CUTS), default="cnn_gap",
                   help="raysplit model behind their MobileNetV1(...) call (shim/models/mobilenet.py)")
    p.add_argument("--cut-a", default=None, help="client cut (their --cut / --cut_a), a raysplit cut index or "
                   "block name; default: conv1 (cnn_gap), 4 (mobilenet_v1)")
    p.add_argument("--cut-b", default=None, help="Hydra's head cut (their --cut_b); default conv3 (cnn_gap: heads "
                   "conv4+fc, 62 %%), 23 (mobilenet_v1); conv4 = raysplit's 'head=fc'")
    p.add_argument("--max-train-samples", type=int, default=None,
                   help="override the config's data.max_train_samples (fewer batches per client per round)")
    p.add_argument("--partition", choices=["raysplit", "theirs"], default="raysplit",
                   help="raysplit: raysplit's client index lists for this seed (edit E5); theirs: their MergeSFL "
                   "LabelwisePartitioner on the full 60,000 images")
    p.add_argument("--order", choices=["raysplit", "theirs"], default="raysplit",
                   help="cyclic/reverse: raysplit's label order for this seed (edit E10) or their own draw")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=str(HERE / ".runs"), help="result folder")
    p.add_argument("--tag", default="", help="appended to the result's file name")
    p.add_argument("--keep-last", action="store_true",
                   help="optional edit E11: their train loaders keep the last short batch (drop_last=False at "
                   "get_data.py:512), so a client runs ceil(n/64) batches a round as in raysplit (README.md)")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary copy of their repository")
    p.add_argument("--_setting-json", dest="setting_json", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def resolve_cut(arch: str, cut, in_shape=(1, 28, 28)) -> int:
    from raysplit.models import build_model

    model = build_model(arch, 10, in_shape)
    return model.resolve_cut(int(cut) if str(cut).lstrip("-").isdigit() else cut)


def param_share(arch: str, cut_a: int, cut_b: int) -> float:
    from raysplit.models import build_model

    m = build_model(arch, 10, (1, 28, 28))
    n = [sum(p.numel() for p in b.parameters()) for b in m.blocks]
    return sum(n[cut_b:]) / max(1, sum(n[cut_a:]))


def raysplit_setting(config: str, seed: int, max_train: int | None):
    """raysplit's own data path for this config and seed: the client index lists (mapped back to indices of the
    full Fashion-MNIST training file, which is what their FashionMNIST dataset indexes), the cycle order and the
    files read."""
    from raysplit.algorithms import orders
    from raysplit.config import load_config
    from raysplit.data import load_dataset, partition_counts
    from raysplit.data import load_partitioned

    overrides = [f"seed={seed}"] + ([f"data.max_train_samples={max_train}"] if max_train else [])
    cfg = load_config(config, overrides)
    d = cfg.data
    if d.dataset != "fashion_mnist" or d.partition.name != "dominant_label" or d.n_labeled:
        raise SystemExit(f"{config}: the runner supports fashion_mnist, dominant_label, n_labeled 0 only")
    spec, (x_tr, y_tr, _, _), train_idx, _, _, prov = load_partitioned(cfg.data, cfg.seed)
    full = load_dataset(d.dataset, d.root, **d.options)
    n = len(full.y_train)
    if d.max_train_samples and d.max_train_samples < n:  # experiment.py: the same draw, before the partition
        keep = np.sort(np.random.default_rng([cfg.seed, 1]).choice(n, d.max_train_samples, replace=False))
    else:
        keep = np.arange(n)
    if not (np.array_equal(full.y_train[keep], y_tr) and np.array_equal(full.x_train[keep], x_tr)):
        raise SystemExit("could not map raysplit's subsample back to the training file (experiment.py changed?)")
    parts = [[int(i) for i in keep[np.asarray(p)]] for p in train_idx]
    counts = partition_counts(train_idx, np.asarray(y_tr), spec.num_classes)
    labels = orders.label_order(cfg.seed, spec.num_classes)
    order = orders.cycle_clients(range(len(parts)), orders.dominant_labels(counts), labels)
    return cfg, parts, counts, labels, order, prov


def setting(a) -> dict:
    """Everything taken from raysplit (run in a child process, see main): the config's values, the client index
    lists, the cycle order, the cut indices and the head's share of the server's parameters."""
    cfg, parts, counts, labels, order, prov = raysplit_setting(a.config, a.seed, a.max_train_samples)
    d, t, alg = cfg.data, cfg.train, cfg.algorithm
    ratio = float(d.partition.params().get("ratio", 0.8))
    if ratio not in RATIO_TO_ALPHA:
        raise SystemExit(f"dominant_label ratio {ratio}: their --alpha supports {sorted(RATIO_TO_ALPHA)} only")
    opt = t.optimizer
    if opt.name != "sgd" or opt.schedule != "exponential" or t.local_epochs != 1:
        raise SystemExit("the runner maps train.optimizer sgd (exponential decay) and local_epochs 1 only")
    if opt.momentum > 0 and not opt.nesterov:
        print("warning: their code uses Nesterov momentum whenever momentum >= 0; raysplit's config has "
              "nesterov false", file=sys.stderr)
    n_labels = int(np.asarray(counts).shape[1])
    if a.policy != "random" and d.num_clients > n_labels:
        raise SystemExit(f"their cyclic/reverse logging indexes the per-label vector by client id: num_clients "
                         f"{d.num_clients} > {n_labels} labels crashes it (run_sfl.py:360, run_hydra.py:401)")
    dflt_a, dflt_b = ARCH_CUTS[a.arch]
    cut_a = resolve_cut(a.arch, a.cut_a if a.cut_a is not None else dflt_a)
    cut_b = resolve_cut(a.arch, a.cut_b if a.cut_b is not None else dflt_b)
    if a.script == "hydra" and not cut_a < cut_b:
        raise SystemExit(f"cut_b ({cut_b}) must lie after cut_a ({cut_a})")
    return {"parts": parts, "labels": labels, "order": [int(c) for c in order], "files": prov["files"],
            "num_clients": d.num_clients, "ratio": ratio, "max_train_samples": d.max_train_samples,
            "batch_size": t.batch_size, "lr": opt.lr, "decay": opt.decay, "min_lr": opt.min_lr,
            "momentum": opt.momentum if opt.momentum > 0 else -1,  # their -1 = plain SGD
            "weight_decay": opt.weight_decay, "phi": alg.phi, "cut_a": cut_a, "cut_b": cut_b,
            "head_share": param_share(a.arch, cut_a, cut_b)}


KEEP_LAST = ("pin_memory=False, drop_last=True))", "pin_memory=False, drop_last=False))")  # E11, get_data.py:512


def prepare_copy(hydra: Path, data_root: Path, keep_last: bool = False) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="hydra_parity_"))
    archive = subprocess.run(["git", "-C", str(hydra), "archive", "--format=tar", "HEAD"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    r = subprocess.run(["patch", "-p1", "--batch", "--forward", "-d", str(tmp), "-i", str(HERE / "edits.diff")],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"edits.diff does not apply to {hydra} HEAD:\n{r.stdout}{r.stderr}")
    if keep_last:
        src = (tmp / "get_data.py").read_text()
        if src.count(KEEP_LAST[0]) != 1:
            raise SystemExit(f"--keep-last: get_data.py has {src.count(KEEP_LAST[0])} train loaders with "
                             f"{KEEP_LAST[0]!r}, expected 1")
        (tmp / "get_data.py").write_text(src.replace(*KEEP_LAST))
    (tmp / "models").mkdir(exist_ok=True)
    for f in (HERE / "shim" / "models").glob("*.py"):
        shutil.copy(f, tmp / "models" / f.name)
    (tmp / "data").symlink_to(data_root)
    (tmp / "logs_training").mkdir()  # their scripts log there and do not create it
    return tmp


EPOCH = re.compile(r"Epoch \[(\d+)\]: Global model loss: (\S+) acc: (\S+)")
PG = re.compile(r">>>>> Perf\w* Gap: (\S+)")  # run_sfl: 'Performance', run_hydra: 'Perforamnce'
BWL = re.compile(r">>>>> Backward Tranfer: (\S+)")
ITEM = re.compile(r"(position|label) (\d+) >> (\S+)")
ORDER = re.compile(r"artificial_order: \[([\d, ]*)\]")


def _watch(proc, logdir, t0):
    rounds, order, seen, buf, logs = [], None, 0, "", []
    while True:
        done = proc.poll() is not None
        logs = sorted(logdir.glob("experiment_log-*.log"))
        if logs:
            with open(logs[-1]) as f:
                f.seek(seen)
                chunk = f.read()
            seen += len(chunk)
            buf += chunk
            *lines, buf = buf.split("\n")
            now = time.time() - t0
            for line in lines:
                if (m := ORDER.search(line)):
                    order = [int(v) for v in m.group(1).split(",") if v.strip()]
                elif (m := EPOCH.search(line)):
                    rounds.append({"round": int(m.group(1)), "loss": float(m.group(2)),
                                   "accuracy": float(m.group(3)), "t_logged_s": round(now, 2),
                                   "items": {}})
                    print(f"round {m.group(1)}: acc {float(m.group(3)):.4f}  ({now:.1f} s)", flush=True)
                elif rounds and (m := PG.search(line)):
                    rounds[-1]["their_pg"] = float(m.group(1))
                elif rounds and (m := BWL.search(line)):
                    rounds[-1]["their_bw"] = m.group(1)
                elif rounds and (m := ITEM.search(line)):
                    rounds[-1]["items"].setdefault(m.group(1), {})[int(m.group(2))] = float(m.group(3))
        if done:
            break
        time.sleep(0.5)
    return rounds, order, (logs[-1] if logs else None)


def run_and_watch(cmd, cwd, env, stdout_path):
    """Start their script; poll its log file and note when each round's line appears (their log has minute
    timestamps only)."""
    t0 = time.time()
    with open(stdout_path, "w") as so:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=so, stderr=subprocess.STDOUT)
        try:
            rounds, order, logs = _watch(proc, Path(cwd) / "logs_training", t0)
        finally:
            if proc.poll() is None:  # interrupted: do not leave their script running
                proc.kill()
                proc.wait()
    return proc.returncode, rounds, order, time.time() - t0, logs


def main(argv=None):
    from raysplit.metrics import backward_transfer, performance_gap  # light: no torch, no data

    a = parse_args(argv)
    if a.setting_json:
        Path(a.setting_json).write_text(json.dumps(setting(a)))
        return 0

    hydra = Path(a.hydra).resolve()
    if str(hydra).startswith(str(ROOT) + os.sep):
        raise SystemExit("--hydra must be a checkout outside the project (their code is not copied into it)")
    commit = git(hydra, "rev-parse", "HEAD")
    dirty = git(hydra, "status", "--porcelain")

    # raysplit's side (config, partition, cycle order, cuts) in a child process: importing raysplit and loading the
    # data costs ~750 MB, which this process would otherwise hold for the whole run
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        setting_path = f.name
    argv_now = sys.argv[1:] if argv is None else list(argv)
    if subprocess.run([sys.executable, __file__, *argv_now, "--_setting-json", setting_path], check=False).returncode:
        raise SystemExit("could not read raysplit's setting (above)")
    st = json.loads(Path(setting_path).read_text())
    os.unlink(setting_path)
    parts, labels, rs_order, files = st["parts"], st["labels"], st["order"], st["files"]
    N, ratio, cut_a, cut_b = st["num_clients"], st["ratio"], st["cut_a"], st["cut_b"]
    batch, lr, decay, min_lr, wd, phi = (st[k] for k in ("batch_size", "lr", "decay", "min_lr", "weight_decay", "phi"))
    momentum = st["momentum"]

    data_root = fmnist_raw(files, "hydra_parity_data")
    tmp = prepare_copy(hydra, data_root, a.keep_last)
    script = {"sfl": "run_sfl.py", "hydra": "run_hydra.py"}[a.script]
    their = ["--dataset_type", "fmnist", "--model_name", "mobilenet", "--num_clients", str(N),
             "--batch_size", str(batch), "--training_lr", str(lr), "--decay_rate", str(decay),
             "--min_lr", str(min_lr), "--epoch", str(a.rounds), "--local_epoch", "1",
             "--momentum", str(momentum), "--weight_decay", str(wd), "--device", "cpu",
             "--partition_method", "dl", "--alpha", str(RATIO_TO_ALPHA[ratio]), "--num_shards_per_partition", "1",
             "--policy", a.policy, "--phi", str(phi)]
    their += ["--cut", str(cut_a)] if a.script == "sfl" else ["--cut_a", str(cut_a), "--cut_b", str(cut_b)]
    env = dict(os.environ, HYDRA_PARITY_ARCH=a.arch, HYDRA_PARITY_HW="28", PYTHONHASHSEED=str(a.seed),
               PYTHONPATH=os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                          else [])))
    if a.threads > 0:
        env["OMP_NUM_THREADS"] = str(a.threads)
    if a.partition == "raysplit":
        (tmp / "parity_partition.json").write_text(json.dumps(parts))
        env["HYDRA_PARITY_PARTITION"] = str(tmp / "parity_partition.json")
    if a.order == "raysplit" and a.policy != "random":
        env["HYDRA_PARITY_ORDER"] = json.dumps(rs_order)
    cmd = [sys.executable, str(HERE / "_driver.py"), str(a.seed), str(a.threads), script, *their]

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = (f"{a.script}_{a.policy}_{a.arch}_a{cut_a}" + (f"b{cut_b}" if a.script == "hydra" else "")
            + f"_s{a.seed}_r{a.rounds}"
            + (f"_n{st['max_train_samples']}" if st["max_train_samples"] and a.partition == "raysplit" else "")
            + ("_theirpart" if a.partition == "theirs" else "") + ("_keeplast" if a.keep_last else "")
            + (f"_{a.tag}" if a.tag else "")
            + datetime.now().strftime("_%Y%m%d-%H%M%S"))
    print(f"their commit {commit[:10]}, copy {tmp}\n  {' '.join(cmd)}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed runner stops their script too (finally)
    try:
        rc, rounds, order, wall, log = run_and_watch(cmd, tmp, env, out / f"{name}.stdout")
        if log is not None:
            shutil.copy(log, out / f"{name}.log")
    finally:
        if not a.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    history = []
    for r in rounds:
        items = r.pop("items")
        if "label" in items:
            acc = [items["label"].get(k) for k in range(10)]
        elif "position" in items and order is not None:  # position i >> acc[artificial_order[i]]
            acc = [None] * 10
            for i, v in items["position"].items():
                acc[order[i]] = v
            r["position_acc"] = [items["position"][i] for i in sorted(items["position"])]
        else:
            acc = None
        r["label_acc"] = acc
        if acc is not None and None not in acc:
            r["pg"] = performance_gap(acc)  # raysplit's definition (= their my_utils.performance_gap)
            history.append(acc)
    for i, r in enumerate(rounds):
        r["wall_s"] = round(r["t_logged_s"] - (rounds[i - 1]["t_logged_s"] if i else 0.0), 2)
    steady = [r["wall_s"] for r in rounds[1:]]
    sizes = [len(p) for p in parts] if a.partition == "raysplit" else None
    result = {
        "runner_command": [sys.executable, *sys.argv] if argv is None else ["run.py", *argv],
        "their_repo": str(hydra), "their_commit": commit, "their_checkout_dirty": bool(dirty),
        "their_command": cmd[3:], "driver": "seeds random/numpy/torch with --seed, torch threads, runpy",
        "env": {k: env[k] for k in env if k.startswith("HYDRA_PARITY_") and k != "HYDRA_PARITY_PARTITION"},
        "edits_sha256": hashlib.sha256((HERE / "edits.diff").read_bytes()).hexdigest(),
        "script": a.script, "policy": a.policy, "seed": a.seed, "rounds_requested": a.rounds,
        "arch": a.arch, "cut_a": cut_a, "cut_b": cut_b if a.script == "hydra" else None,
        "head_share_of_server_params": st["head_share"] if a.script == "hydra" else None,
        "raysplit_config": a.config, "partition": a.partition, "order_source": a.order,
        "setting": {"num_clients": N, "ratio": ratio,
                    "max_train_samples": st["max_train_samples"] if a.partition == "raysplit" else None,
                    "batch_size": batch, "lr": lr, "decay": decay, "min_lr": min_lr,
                    "momentum": momentum, "weight_decay": wd, "phi": phi, "threads": a.threads},
        "keep_last": a.keep_last,
        "client_sizes": sizes,
        "batches_per_client": [-(-s // batch) if a.keep_last else s // batch for s in sizes] if sizes else None,
        "label_order_raysplit": labels, "artificial_order": order,
        "returncode": rc, "rounds_completed": len(rounds), "rounds": rounds,
        "final_accuracy": rounds[-1]["accuracy"] if rounds else None,
        "final_pg": rounds[-1].get("pg") if rounds else None,
        "bw": backward_transfer(np.asarray(history)) if history else None,  # their bw_score as intended
        "wall_time_s": round(wall, 1),
        "wall_s_per_round_median_after_first": float(np.median(steady)) if steady else None,
        "files": {"log": f"{name}.log", "stdout": f"{name}.stdout"},
    }
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"rc {rc}; {len(rounds)} rounds; final acc {result['final_accuracy']}; PG {result['final_pg']}; "
          f"wall {wall:.1f} s; per round (median after round 0) {result['wall_s_per_round_median_after_first']} s"
          f"\n-> {out / (name + '.json')}")
    if rc != 0:
        print((out / f"{name}.stdout").read_text()[-3000:], file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
